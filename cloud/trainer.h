// The cloud trainer: what turns a device's uplinked samples into DWC updates, job by job.
//
//   PerDeviceStrategy  one mirror per device (only that device's trainable set; the frozen
//                      student base and the teacher are loaded once and shared), a job =
//                      the round's cloud step (cloud/train_round.h: AKD or another cloud
//                      learner with a replay buffer, DeltaEncoder with the device's byte
//                      budget and error feedback), the update guard, then one commit.
//   JobScheduler       when a device's job runs (cloud/job_scheduler.h).
//
// Where it lives: the strategy's bookkeeping here (cloud/trainer.cc: load, job, commit,
// rollback), the held-out pool and its scoring in cloud/internal/holdout_pool.h, the
// quarantine file in cloud/internal/quarantine_log.h, the frozen models in
// cloud/internal/mirror_trainer.h. `cdcca-cloud` and the in-process harness (`sim/`) run the
// same code:
//   auto strategy = PerDeviceStrategy::Create(options, samples.get(), updates.get());
//   JobScheduler scheduler(scheduler_options, strategy->get(), samples.get());
//   CloudService service(..., &scheduler);   // or call scheduler.OnSamplesStored yourself
//   ... scheduler.WaitIdle();                // or (*strategy)->RunJob(id) synchronously
//
// Durability (PerDeviceStrategy): one state file per device,
// <state_dir>/<device_id>.mirror, written atomically (temp, fsync, rename, fsync dir): the
// mirror's trainable set, its version, the consumed-sample cursor, the encoder's residual,
// the newest update and snapshot payloads, and the replay buffer (its samples in full, with
// the trained samples of the job it commits). The file is the commit point of a job; the
// payloads are published to the UpdateStore after it, and Recover() republishes them if a
// crash came in between (or the store's copy is missing or damaged). So after a restart
// every device resumes with its mirror, version, cursor and residual intact, and no sample
// is trained twice or skipped, and the replay buffer goes on as it was (on the shared store:
// on whichever trainer runs the device's next job); the pool (pool_samples) is persisted as
// the sample log's batches it holds.
//
// Memory (PerDeviceStrategy): a device's state (mirror, residual, replay buffer, held-out
// pool) is loaded on demand, by its first job or call, and at most max_resident_mirrors idle
// devices keep it in memory between jobs; the least recently used leave first and come back
// from their state files as after a restart. Recover() reads every state file once (to
// republish what a crash left unpublished) and keeps only the bound.
//
// The update guard (PerDeviceStrategyOptions::guard, cloud/update_guard.h): a job's samples
// that compress::IsHeldOutSample picks never train; they join the device's held-out pool (the
// newest pool_capacity of them). After training, before anything is committed, the strategy scores
// the pool against the teacher with the mirror before the job and with the mirror the device
// would hold after applying the encoded update, and JudgeUpdate decides. A withheld update is
// never committed or published: the cursor moves past the job's batches (committed as for
// batches that give nothing to train), the trained samples join the replay buffer, the
// device's learner state (phi, psi) is dropped with the update it was trained with, and the
// mirror, version and residual stay. The pool is not persisted: after a restart a device's
// first job rebuilds it from the sample log (the held-out samples of the batches up to the
// cursor, newest first), which gives the same pool since the choice is a hash. The teacher's
// answer per pooled sample and the student's answer at the mirror's version are cached in
// memory (recomputed after a restart).
//
// Every unusable sample ends (PerDeviceStrategy): a stored batch that reads back damaged or
// does not decode, a sample the trainer cannot use (a frame that does not decode), and the
// batches of a job whose training goes non-finite or fails kMaxJobAttempts times at the same
// cursor are quarantined: written with their reason to <state_dir>/<device_id>.quarantine
// (before the cursor moves past them, so a restart does not retry them), counted in
// State(), and the job goes on with the rest. No cursor is retried forever because of its
// samples; a job that fails on I/O (a state file that cannot be written) is retried by the
// scheduler with a growing delay, its samples untouched.
#ifndef CDCCA_CLOUD_TRAINER_H_
#define CDCCA_CLOUD_TRAINER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cloud/cloud_service.h"
#include "cloud/device_registry.h"
#include "cloud/job_report.h"
#include "cloud/job_scheduler.h"
#include "cloud/sample_store.h"
#include "cloud/stores.h"
#include "cloud/update_guard.h"
#include "cloud/update_store.h"
#include "cloud/uplink_check.h"
#include "settings/defaults.h"
#include "storage/env.h"

namespace cdcca::cloud {

// Jobs of one device that fail while training at the same cursor before its batches are
// quarantined.
inline constexpr int kMaxJobAttempts = 3;

struct PerDeviceStrategyOptions {
  // A cdcca family (`cdcca pretrain --out DIR`), read as the pair it is: teacher_dir =
  // DIR/teacher, student_base_dir = DIR.
  std::string checkpoint_dir;
  // Or a teacher-student pair of model folders: the teacher's folder and the student's (the
  // devices' model before adaptation), LLaVA, BLIP-2 or InstructBLIP, sharing the vision tower. The
  // mirror loads the student at student_precision with the devices' adapters (LoRA on the LM's q/v;
  // lora_mlp adds the MLP; AdapterOptions seed 0). Prompts are put in each side's prompt format
  // (model::ResolvePromptFormat on that side's folder: "auto" is its chat template where it has
  // one, else llava's for LLaVA and none for the BLIP-2 family; "chat", "none" or a named
  // template). The teacher runs at teacher_precision ("" = bf16 on CUDA, fp32 on the CPU).
  std::string teacher_dir;
  std::string student_base_dir;
  std::string teacher_template = "auto";
  std::string student_template = "auto";
  std::string teacher_precision;
  // The devices' adapters; defaults: the defaults table's (settings/defaults.h).
  int64_t lora_rank = settings::kLoraRank;
  double lora_alpha = settings::kLoraAlpha;
  bool lora_mlp = settings::kLoraMlp;
  bool lora_qformer = settings::kLoraQformer;  // the Q-Former's query and value too
  bool lora_projector = false;  // the projector into the LM too (programs: --profile)
  // The student's vision tower too (its attention's LoRA and its LayerNorms), trained from
  // the uplinked frames; token samples cannot train it and are refused.
  bool lora_vision = settings::kLoraVision;
  // Precision of the devices' frozen student base: "fp32", "int8" or "int4". The mirror
  // computes with exactly that base, dequantized. Default: the defaults table's.
  std::string student_precision = settings::kStudentPrecision;
  // Where the per-device state files live; created if missing.
  std::string state_dir;
  // Every call on the state files goes through it (not owned; must outlive the strategy).
  storage::Env* env = storage::Env::Default();
  // Where each device's committed state lives (not owned; must outlive the strategy).
  // nullptr = a file per device in state_dir. A shared store (cloud/pg/pg_cloud_store.h)
  // commits and publishes a job's result in one transaction under the job's lease; then
  // Recover() has nothing to republish, and the quarantine files stay in state_dir.
  MirrorStates* mirror_states = nullptr;
  // Cloud learner: "akd", "pl", "pkd" or "cwd"; "" = distill_config's, else "akd".
  std::string learner;
  // Optional distill settings JSON (configs/distill/akd.json layout); "" = the learner's
  // preset. Its "job" section sets the job options below unless they are overridden. With
  // both, the learner trains with these settings and only its own feature term
  // (distill::WithFeatureTermOf): baselines on equal terms with AKD.
  std::string distill_config;
  // Job bounds; 0 keeps the value of distill_config (or distill::JobOptions' default).
  int max_steps = 0;
  double time_budget_s = 0;
  int batch_size = 0;
  double lr = 0;  // AdamW's learning rate; 0 keeps distill_config's
  // Longest answer the teacher generates as a label; 0 keeps distill_config's (default: the
  // defaults table's).
  // Captioning needs datasets::kMaxCaptionTokens.
  int max_answer_tokens = 0;
  // Most devices' jobs that train together over the one student base (jobs that wait for it
  // at the same time, as up to JobSchedulerOptions::threads do: each device's result is what
  // its job alone gives; a step's batch holds every job's rows, so activation memory grows
  // with it). 1 = one job at a time.
  size_t max_jobs_together = settings::kMaxJobsTogether;
  // Torch intra-op threads per job. 0 = automatic (1; model/runtime/threads.h).
  int torch_threads = 0;
  // How the job's frozen base multiplies in its steps (distill::JobOptions::fp8_base: native,
  // on or off; empty leaves the distill config's value).
  std::string fp8_base;
  // Train on "cpu" or "cuda" (falls back to CPU without CUDA). Default: "cpu".
  std::string train_device = "cpu";
  // Most uplink batches one job reads (the rest wait for the next job). Default: 64.
  size_t max_batches_per_job = 64;
  // Most samples and decoded bytes one job takes (what the decoded samples hold in memory:
  // features as floats, token ids, frames and the float tokens a frame becomes); the batch
  // that would pass either bound waits for the next job (a job always takes its first
  // batch). Defaults: 8192 samples, 512 MiB.
  uint64_t max_samples_per_job = 8192;
  uint64_t max_decoded_bytes_per_job = 512ull << 20;
  // Per-batch bounds of SampleSpec (cloud/uplink_check.h); Spec() hands them, with the
  // model's shape, to the service's ingest check. Defaults: 1024 samples, 16 MiB.
  uint32_t max_samples_per_batch = 1024;
  uint64_t max_decoded_bytes_per_batch = 16ull << 20;
  // DWC: per-device byte budget per update (0 = the device's Register capability, else
  // bits_per_param alone), and the bits-per-parameter cap. Defaults: 0 and the table's.
  uint64_t byte_budget = 0;
  double bits_per_param = settings::kBitsPerParam;
  // Replay buffer capacity per device, in samples (0 = no replay). Default: the table's.
  size_t replay_capacity = settings::kReplayCapacity;
  // The durable pool per device, in samples (0 = none): the newest pool_samples samples its
  // jobs trained on (withheld jobs' too), trained on again, all of them, by each next job
  // beside its new samples. The pool lives in the sample log: its batches are not released,
  // and a load (restart, eviction, another trainer on the shared store) reads it back from
  // the batches before the cursor, newest first. Default: the table's.
  size_t pool_samples = settings::kPoolSamples;
  // Most devices whose mirror, encoder residual, replay buffer and held-out pool stay in
  // memory between their jobs (least recently used evicted first; devices in a job at the
  // moment do not count as evictable). An evicted device loads again from its state file
  // on its next job, as after a restart: the learner's state between jobs restarts empty.
  // 0 = no bound. Default: 64.
  size_t max_resident_mirrors = 64;
  // The update guard (cloud/update_guard.h): held-out samples per device, and the rule that
  // withholds an update that does not raise their agreement with the teacher beyond noise.
  UpdateGuardOptions guard;
  // Each withheld job's report carries the state its update would have given the device
  // (JobReport::withheld_state): the harness measures what withholding it did. Off in the
  // programs.
  bool report_withheld_state = false;
  // Tests: runs before each job's training; an error fails that training as a learner's
  // error would. (Crashes at a chosen step are the Env's: storage/exit_at_env.h.)
  std::function<absl::Status(const std::string& device_id)> before_training;
};

// The job settings a strategy made from `options` trains with (its distill_config, else the
// learner's preset; the options' own bounds applied), as a JSON object keyed by the settings'
// names (settings/defaults.h): learner, l_ce, l_query, l_repr, l_kl, temperature, max_steps,
// batch_size, lr, replay_fraction, max_answer_tokens. What `--print_config` reports; reads
// only the distill settings file. Errors: those of reading it, or an unknown learner.
absl::StatusOr<std::string> JobSettingsJson(const PerDeviceStrategyOptions& options);

// One mirror per device, trained and shipped job by job. Thread-safe: the
// scheduler never runs two jobs for the same device at once (a device's calls wait for each
// other), but may run jobs of different devices concurrently.
class PerDeviceStrategy final {
 public:
  // Loads the family (teacher and student base once). `samples` and `updates` must outlive
  // the strategy; `registry` (optional) supplies devices' byte budgets.
  static absl::StatusOr<std::unique_ptr<PerDeviceStrategy>> Create(
      const PerDeviceStrategyOptions& options, SampleLog* samples, UpdateLog* updates,
      DeviceStore* registry = nullptr);
  ~PerDeviceStrategy();

  // Brings persisted state back after a restart and republishes committed updates the
  // update store lacks. Call once, before the first job.
  absl::Status Recover();
  // Trains `device_id` on its durable samples after its cursor and publishes one update
  // (the round's cloud step: cloud/train_round.h, then the guard and the commit).
  // NOT_FOUND if there are no new usable samples (the cursor moves past unusable ones). On
  // any other error the mirror and residual are unchanged; the cursor stays unless the
  // job's batches were quarantined (the error says so).
  absl::StatusOr<JobReport> RunJob(const std::string& device_id);
  // The highest uplink sequence the device's jobs have consumed (0 = none).
  uint64_t ConsumedSequence(const std::string& device_id) const;
  DeviceTrainingState State(const std::string& device_id) const;
  // Returns the device, which runs `device_version`, to its state at `to_version` (0 = the
  // version before its newest): committed and published as a new version (new_version =
  // device_version + 1) whose state is exactly that older state, its residual empty, the
  // cursor where it was (the rolled-back jobs' samples stay consumed). The device loads the
  // new version's snapshot; a device that fetches the update instead finds its digest
  // differs and resyncs to that snapshot. FAILED_PRECONDITION if the device does not run
  // the mirror's version (or runs the pretrained base), INVALID_ARGUMENT for a version not
  // before it, NOT_FOUND if the update store no longer keeps that version's snapshot.
  absl::StatusOr<RollbackResult> Rollback(const std::string& device_id, uint64_t device_version,
                                          uint64_t to_version);

  // The mirror's trainable set of `device_id` as a safetensors blob (what a snapshot holds).
  absl::StatusOr<std::string> MirrorState(const std::string& device_id) const;
  // Digest of the pretrained student's trainable set (every device's version-0 digest).
  uint64_t BaseDigest() const;
  // Fingerprint of the frozen student base devices must run (for CloudServiceOptions).
  uint64_t BaseFingerprint() const;
  // The teacher's vision tower (the family's encoder), which reads the devices' tokens.
  uint64_t VisionFingerprint() const;
  // What an uplinked batch must be for this model (for CloudServiceOptions::sample_spec).
  SampleSpec Spec() const;
  // Devices whose state is in memory now (at most max_resident_mirrors, plus devices in a
  // call at the moment), and how many were evicted since the start.
  size_t ResidentMirrors() const;
  uint64_t MirrorEvictions() const;
  // Drops the device's state from memory unless it is at `version` with cursor `consumed`
  // (what the shared store holds): another process trained it since, and its next call
  // loads the stored state. Waits for a call of the device that is running.
  void DropUnless(const std::string& device_id, uint64_t version, uint64_t consumed);

  struct Impl;

 private:
  explicit PerDeviceStrategy(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_TRAINER_H_
