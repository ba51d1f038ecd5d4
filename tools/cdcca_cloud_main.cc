// cdcca-cloud: the cloud service. Serves the wire contract over gRPC (TLS by default),
// stores what devices uplink durably, runs AKD jobs per device on a trainer pool, and
// serves the DWC updates and snapshots they produce.
//
//   cdcca-cloud --data_dir=/var/lib/cdcca --tokens=tokens.txt --checkpoint_dir=models/small \
//       --tls_cert=server.pem --tls_key=server.key [--client_ca=ca.pem]
//   cdcca-cloud --config=cloud.json                      # the same flags as a JSON object
//   cdcca-cloud --data_dir=/tmp/cdcca --tokens=tokens.txt --insecure   # loopback only
//
// Logs are JSON lines on stderr ({"event": ...}). Health: the Health RPC (no token needed)
// and, with --status_file, a JSON file rewritten every few seconds.
#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cli/flags_help.h"
#include "cli/print_config.h"
#include "cloud/open_cloud.h"
#include "cloud/trainer.h"
#include "cloud/update_guard.h"
#include "distill/job.h"
#include "model/runtime/threads.h"
#include "nlohmann/json.hpp"
#include "settings/defaults.h"
#include "storage/env.h"
#include "storage/exit_at_env.h"

ABSL_FLAG(std::string, config, "",
          "JSON file whose keys are these flags' names (e.g. {\"listen\": \"0.0.0.0:50051\", "
          "\"trigger_samples\": 64}); flags given on the command line win");
ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "host:port to serve on (port 0 picks one)");
ABSL_FLAG(std::string, data_dir, "",
          "directory of the sample log (samples/), update store (updates/), device registry "
          "(registry/) and per-device mirrors (trainer/); created if missing. One process per "
          "directory: it is locked (DIR/LOCK) while this one runs, and a second refuses to start");
ABSL_FLAG(std::string, store, "",
          "where the cloud's state lives: empty = files under --data_dir (one process); "
          "postgresql://user@host:port/db (or a libpq key=value string) = a PostgreSQL "
          "database that several cdcca-cloud processes share (fronts and trainers, --role). "
          "The schema is created and migrated by the program; --data_dir then holds only "
          "this process's lock and the trainer's quarantine records");
ABSL_FLAG(std::string, role, "all",
          "with --store: front (serves devices over gRPC, trains nothing, keeps no device "
          "state between calls), trainer (runs due jobs from the shared queue, serves "
          "nothing), or all (both in one process)");
ABSL_FLAG(std::string, trainer_id, "",
          "with --store: the name this trainer's job leases carry (empty = host:pid)");
ABSL_FLAG(double, lease_s, 30,
          "with --store: a job lease's length, s, renewed every third of it while the job runs; "
          "a trainer that dies loses its jobs to the other trainers after this long");
ABSL_FLAG(int, store_sessions, 16,
          "with --store: PostgreSQL sessions of a front (appends commit on them concurrently, "
          "sharing WAL flushes; as many service threads wait on them); a trainer alone opens "
          "--trainer_threads + 2");
ABSL_FLAG(std::string, tokens, "", "token file: one `<device_id> <token>` per line");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain");
ABSL_FLAG(std::string, tls_key, "", "PEM server private key");
ABSL_FLAG(std::string, client_ca, "",
          "PEM CA for client certificates: mutual TLS, every device must present a certificate "
          "signed by it (unless --allow_token_only_devices)");
ABSL_FLAG(bool, require_client_cert, false,
          "refuse devices without a client certificate (the default with --client_ca; kept for "
          "configs that say so)");
ABSL_FLAG(bool, allow_token_only_devices, false,
          "with --client_ca: also accept devices that present no client certificate, on their "
          "token alone (a certificate that is presented must still verify)");
ABSL_FLAG(std::string, client_cert_map, "",
          "mutual TLS: file of `<certificate name> <device_id>` lines. A client certificate "
          "must stand for the device of the call's token: its CN or a SAN equal to the "
          "device id, or mapped to it here; else PERMISSION_DENIED");
ABSL_FLAG(std::string, proxy_client_cert_header, "",
          "behind a proxy that ends mutual TLS (nginx): the request header in which it passes "
          "the client certificate it verified, percent-escaped PEM (nginx: grpc_set_header "
          "X-Client-Cert $ssl_client_escaped_cert; here x-client-cert). The certificate must "
          "stand for the token's device as with --client_ca; calls without it are refused "
          "unless --allow_token_only_devices. Only where nothing but the proxy reaches this "
          "process");
ABSL_FLAG(bool, insecure, false, "serve plaintext (loopback experiments only; prints a warning)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving");
ABSL_FLAG(std::string, expected_fingerprint, "",
          "hex fingerprint of the student base devices must run; empty = the checkpoint's "
          "(0 = accept any)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "a cdcca family (as written by `cdcca pretrain`), served as the pair it is: "
          "--teacher=DIR/teacher --student_base=DIR; empty (and no pair) = transport only, no "
          "training");
ABSL_FLAG(std::string, teacher, "",
          "a teacher-student pair instead of --checkpoint_dir: the teacher's folder (LLaVA, "
          "BLIP-2 or InstructBLIP), which must share its vision tower with --student_base");
ABSL_FLAG(std::string, student_base, "",
          "a Hugging Face pair: the student's folder, the model devices run before adaptation");
ABSL_FLAG(std::string, teacher_template, "auto",
          "a Hugging Face pair: the teacher's prompt (auto: the folder's chat template where it "
          "has one, else llava for LLaVA and none for BLIP-2; chat; none; llava; vicuna; "
          "chatml)");
ABSL_FLAG(std::string, student_template, "auto",
          "a Hugging Face pair: the student's prompt template, as the devices' --student_template");
ABSL_FLAG(std::string, teacher_precision, "",
          "a Hugging Face pair: the teacher's precision (fp32, bf16, fp16, int8, int4; empty = "
          "bf16 on cuda, fp32 on cpu)");
ABSL_FLAG(int64_t, lora_rank, cdcca::settings::kLoraRank,
          "a Hugging Face pair: LoRA rank on the LM's q and v (the devices' --lora_rank)");
ABSL_FLAG(double, lora_alpha, cdcca::settings::kLoraAlpha,
          "a Hugging Face pair: LoRA alpha (the devices' --lora_alpha)");
ABSL_FLAG(bool, lora_mlp, cdcca::settings::kLoraMlp,
          "a Hugging Face pair: LoRA on the LM's MLP too (the devices' --lora_mlp)");
ABSL_FLAG(bool, lora_qformer, cdcca::settings::kLoraQformer,
          "LoRA on the student's Q-Former attention query and value too (BLIP-2, "
          "InstructBLIP; the devices' --lora_qformer)");
ABSL_FLAG(bool, lora_projector, false,
          "LoRA on the student's projector into the LM too (LLaVA's multi_modal_projector, "
          "BLIP-2's language_projection; the devices' --lora_projector). "
          "Unset: --profile's (measured: on for LLaVA, off otherwise; paper: off)");
ABSL_FLAG(bool, lora_vision, cdcca::settings::kLoraVision,
          "the student's vision tower too: LoRA on its attention and its LayerNorms, trained "
          "from the uplinked frames (the devices' --lora_vision; they must uplink frames, "
          "--uplink_precision=jpeg: a sample of tokens cannot train the tower and is refused)");
ABSL_FLAG(std::string, profile, cdcca::settings::kProfile,
          "defaults of --lora_projector where it is unset: measured (the projector's LoRA on "
          "LLaVA: the best measured) or paper (LoRA on the LM alone); the devices' --profile, "
          "which also picks their uplink (measured: the frames; paper: the fp16 tokens)");
ABSL_FLAG(std::string, student_precision, cdcca::settings::kStudentPrecision,
          "precision of the devices' frozen student base (fp32, int8, int4): the mirrors "
          "compute with exactly that base");
ABSL_FLAG(std::string, learner, "",
          "cloud learner: akd, pl, pkd or cwd (empty = --distill_config's, else akd)");
ABSL_FLAG(std::string, distill_config, "",
          "distill settings JSON (configs/distill/akd.json layout); empty = the learner's "
          "preset. With --learner too, that learner trains with these settings and only its "
          "own feature term (baselines on equal terms)");
ABSL_FLAG(int, max_steps, 0, "training steps per job (0 = from --distill_config, default 200)");
ABSL_FLAG(double, time_budget_s, 0, "wall-clock bound of one job's training loop, s (0 = none)");
ABSL_FLAG(int, batch_size, 0, "samples per training step (0 = from --distill_config, default 16)");
ABSL_FLAG(double, lr, 0, "learning rate of a job (0 = from --distill_config, default 0.001)");
ABSL_FLAG(int, max_answer_tokens, 0,
          "longest answer the teacher generates as a label, in tokens (0 = from "
          "--distill_config, default 6, the devices' --max_answer_tokens)");
ABSL_FLAG(bool, print_config, false,
          "print the configuration this command line runs (every flag, and the job settings "
          "resolved from --distill_config and the presets) as JSON on stdout, and exit");
ABSL_FLAG(int, max_batches_per_job, 64, "most uplink batches one job trains on");
ABSL_FLAG(int64_t, max_job_samples, 8192,
          "most samples one job trains on (the rest wait for the next job)");
ABSL_FLAG(int64_t, max_job_decoded_mib, 512,
          "most decoded uplink bytes one job takes, MiB (the rest wait for the next job)");
ABSL_FLAG(int64_t, max_batch_samples, 1024,
          "uplink: most samples one batch may hold; a batch past it is refused at ingest");
ABSL_FLAG(int64_t, max_batch_decoded_mib, 16,
          "uplink: most bytes one batch may decompress to, MiB; a batch past it is refused at "
          "ingest, before anything is decompressed");
ABSL_FLAG(int64_t, device_quota_mib, 1024,
          "uplink: most MiB of one device's samples its jobs have not consumed yet that the "
          "sample log holds; past it Uplink answers RESOURCE_EXHAUSTED (0 = no quota). "
          "Consumed samples are released and their segment files deleted once all of a "
          "file's samples are");
ABSL_FLAG(int64_t, replay_capacity, cdcca::settings::kReplayCapacity,
          "replay buffer per device, samples (0 = none)");
ABSL_FLAG(int64_t, pool_samples, cdcca::settings::kPoolSamples,
          "durable pool per device, samples: the newest samples its jobs trained on, kept in "
          "the sample log and trained on again by every job (0 = none)");
ABSL_FLAG(int64_t, max_resident_mirrors, 64,
          "most devices whose mirror and replay buffer stay in memory between jobs (least "
          "recently used evicted first; an evicted device reloads both from its state file); "
          "0 = no bound");
ABSL_FLAG(int64_t, byte_budget, 0,
          "per-device byte budget of one update (0 = the device's Register capability, else "
          "--bits_per_param alone)");
ABSL_FLAG(double, bits_per_param, cdcca::settings::kBitsPerParam,
          "update size cap in bits per trainable parameter (0 = none)");
ABSL_FLAG(bool, guard, cdcca::settings::kGuard,
          "update guard: hold out --guard_holdout_fraction of each device's samples (never "
          "trained on) and publish an update only if it raises the student's score on them "
          "(--guard_measure) beyond --guard_z paired standard errors; else withhold it (the "
          "batches are consumed, the device stays where it is; event update_withheld)");
ABSL_FLAG(double, guard_holdout_fraction, cdcca::settings::kGuardHoldoutFraction,
          "update guard: share of each device's answers held out (picked before UTS stage 1 "
          "and uplinked whole), in [0, 1)");
ABSL_FLAG(int64_t, guard_pool, cdcca::settings::kGuardPool,
          "update guard: most held-out samples kept per device (the newest)");
ABSL_FLAG(int64_t, guard_min_pool, cdcca::settings::kGuardMinPool,
          "update guard: smallest pool the paired rule runs on; below it an update ships unless "
          "its agreement falls by more than --guard_z / sqrt(pool)");
ABSL_FLAG(double, guard_z, cdcca::settings::kGuardZ,
          "update guard: an update ships when its gain in agreement exceeds this many paired "
          "standard errors");
ABSL_FLAG(double, guard_confident_fraction, cdcca::settings::kGuardConfidentFraction,
          "update guard: share of the held-out pool compared, in (0, 1]: the samples the "
          "teacher answers most surely (lowest answer-token entropy)");
ABSL_FLAG(bool, guard_restore_base, cdcca::settings::kGuardRestoreBase,
          "update guard: when an update is withheld and the pretrained base agrees with the "
          "teacher on the held-out pool beyond --guard_z paired standard errors better than the "
          "device's current version, return the device to the base as a new version");
ABSL_FLAG(std::string, guard_measure, cdcca::settings::kGuardMeasure,
          "update guard: what a held-out answer is scored by: teacher_probability (the "
          "teacher's probability of the answer: with a calibrated teacher, the chance that it "
          "is right), teacher_and_base (the mean of the teacher's and the pretrained "
          "student's probability of it: an update must gain by both judges together) or "
          "agreement (with the teacher's answer)");
ABSL_FLAG(int, trigger_samples, cdcca::settings::kTriggerSamples,
          "run a device's job once it has this many new samples");
ABSL_FLAG(double, trigger_interval_s, cdcca::settings::kTriggerIntervalS,
          "... or once this many seconds passed since its last job with any new sample (0 = off)");
ABSL_FLAG(int, trainer_threads, 1, "jobs run at once (of different devices)");
ABSL_FLAG(int, max_jobs_together, cdcca::settings::kMaxJobsTogether,
          "most jobs of different devices that train together over the one student base when they "
          "run at once (--trainer_threads): each device's rows read its own adapters and it gets "
          "what its job alone gives; a step holds every job's batch (1 = one job at a time)");
ABSL_FLAG(
    std::string, fp8_base, "",
    "how the student's frozen base multiplies in a job's training steps: native (FP8, e4m3 "
    "scaled per row, where the GPU runs FP8 products natively, compute capability 8.9+; the "
    "plain products elsewhere), on (FP8 everywhere: emulated on the CPU; a GPU without native "
    "FP8 refuses the job) or off; where FP8 runs on a GPU the trainer holds the base in FP8 in "
    "place of bf16 (empty: the distill config's job key \"fp8_base\", default native)");
ABSL_FLAG(int, torch_threads, 0,
          "LibTorch intra-op threads of the trainer, process-wide (0 = automatic: 1, the BLAS "
          "threads matrix products)");
ABSL_FLAG(int, blas_threads, 0,
          "threads of the BLAS that multiplies matrices (OpenBLAS), process-wide (0 = its own "
          "default: one per core); 1 where the program shares its cores with a serving path, "
          "whose idle BLAS workers otherwise spin on them");
ABSL_FLAG(std::string, device, "cpu",
          "where jobs train: cpu, cuda, or cuda:N (the N-th GPU only: one trainer per GPU); "
          "falls back to cpu without CUDA");
ABSL_FLAG(double, uts_keep_fraction, cdcca::settings::kUtsKeepFraction,
          "UTS setting sent to devices: fraction of frames stage 1 keeps (0 = device default)");
ABSL_FLAG(
    double, uts_token_ratio, cdcca::settings::kUtsTokenRatio,
    "UTS setting sent to devices: fraction of visual tokens stage 2 keeps (0 = device default)");
ABSL_FLAG(int, uts_mc_passes, cdcca::settings::kUtsMcPasses,
          "UTS setting sent to devices: MC-dropout passes (0 = device default)");
ABSL_FLAG(double, uts_random_share, cdcca::settings::kUtsRandomShare,
          "UTS setting sent to devices: share of the frames stage 1 passes over that go up all "
          "the same (0 = device default)");
ABSL_FLAG(std::string, status_file, "",
          "write health and per-device training state as JSON here every --status_interval_s");
ABSL_FLAG(double, status_interval_s, 2, "how often --status_file is rewritten");

namespace {

using cdcca::cloud::CloudOptions;

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "{\"event\":\"fatal\",\"error\":%s}\n",
               nlohmann::json(s.ToString()).dump().c_str());
  return 1;
}

void Log(const nlohmann::json& event) {
  std::fprintf(stderr, "%s\n", event.dump().c_str());
  std::fflush(stderr);
}

// What the flags set: the cloud, and what the program does around it.
struct ProgramOptions {
  CloudOptions cloud;
  std::string port_file;
  int visible_gpu = -1;  // --device cuda:N: N, the one GPU this process sees; -1 = all
};

// The trainer's flags (the model, the job's settings and bounds, the guard).
absl::Status SetStrategyOptionsFromFlags(cdcca::cloud::PerDeviceStrategyOptions& so,
                                         int& visible_gpu) {
  so.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  so.teacher_dir = absl::GetFlag(FLAGS_teacher);
  so.student_base_dir = absl::GetFlag(FLAGS_student_base);
  so.teacher_template = absl::GetFlag(FLAGS_teacher_template);
  so.student_template = absl::GetFlag(FLAGS_student_template);
  so.teacher_precision = absl::GetFlag(FLAGS_teacher_precision);
  so.lora_rank = absl::GetFlag(FLAGS_lora_rank);
  so.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
  so.lora_mlp = absl::GetFlag(FLAGS_lora_mlp);
  so.lora_qformer = absl::GetFlag(FLAGS_lora_qformer);
  so.lora_projector = absl::GetFlag(FLAGS_lora_projector);
  so.lora_vision = absl::GetFlag(FLAGS_lora_vision);
  so.student_precision = absl::GetFlag(FLAGS_student_precision);
  so.learner = absl::GetFlag(FLAGS_learner);
  so.distill_config = absl::GetFlag(FLAGS_distill_config);
  so.max_steps = absl::GetFlag(FLAGS_max_steps);
  so.time_budget_s = absl::GetFlag(FLAGS_time_budget_s);
  so.batch_size = absl::GetFlag(FLAGS_batch_size);
  so.lr = absl::GetFlag(FLAGS_lr);
  so.max_answer_tokens = absl::GetFlag(FLAGS_max_answer_tokens);
  so.torch_threads = absl::GetFlag(FLAGS_torch_threads);
  so.fp8_base = absl::GetFlag(FLAGS_fp8_base);
  if (!so.fp8_base.empty()) {
    if (absl::Status s = cdcca::distill::CheckFp8BaseMode(so.fp8_base, "--fp8_base"); !s.ok()) {
      return s;
    }
  }
  so.train_device = absl::GetFlag(FLAGS_device);
  if (absl::StartsWith(so.train_device, "cuda:")) {
    if (!absl::SimpleAtoi(so.train_device.substr(5), &visible_gpu) || visible_gpu < 0) {
      return absl::InvalidArgumentError("--device must be cpu, cuda or cuda:N");
    }
    so.train_device = "cuda";
  }
  so.max_batches_per_job =
      static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_batches_per_job)));
  so.byte_budget = static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_byte_budget)));
  so.max_samples_per_job =
      static_cast<uint64_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_max_job_samples)));
  so.max_decoded_bytes_per_job =
      static_cast<uint64_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_max_job_decoded_mib))) << 20;
  // Per-batch bounds of the ingest check (the codec's own limits: 4096 samples, 64 MiB).
  so.max_samples_per_batch =
      static_cast<uint32_t>(std::clamp<int64_t>(absl::GetFlag(FLAGS_max_batch_samples), 1, 4096));
  so.max_decoded_bytes_per_batch =
      static_cast<uint64_t>(std::clamp<int64_t>(absl::GetFlag(FLAGS_max_batch_decoded_mib), 1, 64))
      << 20;
  so.bits_per_param = absl::GetFlag(FLAGS_bits_per_param);
  so.replay_capacity =
      static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_replay_capacity)));
  so.pool_samples = static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_pool_samples)));
  so.max_resident_mirrors =
      static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_max_resident_mirrors)));
  so.max_jobs_together = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_jobs_together)));
  so.guard.enabled = absl::GetFlag(FLAGS_guard);
  so.guard.holdout_fraction = absl::GetFlag(FLAGS_guard_holdout_fraction);
  so.guard.pool_capacity =
      static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_guard_pool)));
  so.guard.min_pool =
      static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_guard_min_pool)));
  so.guard.z = absl::GetFlag(FLAGS_guard_z);
  so.guard.confident_fraction = absl::GetFlag(FLAGS_guard_confident_fraction);
  so.guard.restore_base = absl::GetFlag(FLAGS_guard_restore_base);
  absl::StatusOr<cdcca::cloud::GuardMeasure> measure =
      cdcca::cloud::ParseGuardMeasure(absl::GetFlag(FLAGS_guard_measure));
  if (!measure.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--guard_measure: ", measure.status().message()));
  }
  so.guard.measure = *measure;
  return absl::OkStatus();
}

// The one mapping of the flags to options: what the program runs, and what --print_config
// reports.
absl::StatusOr<ProgramOptions> OptionsFromFlags() {
  ProgramOptions p;
  CloudOptions& o = p.cloud;
  o.data_dir = absl::GetFlag(FLAGS_data_dir);
  o.store = absl::GetFlag(FLAGS_store);
  o.role = absl::GetFlag(FLAGS_role);
  o.store_sessions = std::max(1, absl::GetFlag(FLAGS_store_sessions));
  o.device_quota_bytes =
      static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_device_quota_mib))) << 20;
  o.tokens_file = absl::GetFlag(FLAGS_tokens);
  o.client_cert_map_file = absl::GetFlag(FLAGS_client_cert_map);
  o.server.listen_address = absl::GetFlag(FLAGS_listen);
  o.server.insecure = absl::GetFlag(FLAGS_insecure);
  o.server.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                  absl::GetFlag(FLAGS_client_ca), absl::GetFlag(FLAGS_require_client_cert),
                  absl::GetFlag(FLAGS_allow_token_only_devices)};
  if (absl::Status s = SetStrategyOptionsFromFlags(o.strategy, p.visible_gpu); !s.ok()) return s;

  cdcca::cloud::CloudServiceOptions& svc = o.service;
  // Without a model, ingest checks any shape within the per-batch bounds.
  svc.sample_spec.max_samples_per_batch = o.strategy.max_samples_per_batch;
  svc.sample_spec.max_decoded_bytes_per_batch = o.strategy.max_decoded_bytes_per_batch;
  // On the shared store the service's threads wait on the database: one per session.
  if (!o.store.empty()) svc.io_threads = std::max(2, absl::GetFlag(FLAGS_store_sessions));
  svc.proxy_client_cert_header =
      absl::AsciiStrToLower(absl::GetFlag(FLAGS_proxy_client_cert_header));
  svc.allow_token_only_devices = absl::GetFlag(FLAGS_allow_token_only_devices);
  svc.uts.set_keep_fraction(static_cast<float>(absl::GetFlag(FLAGS_uts_keep_fraction)));
  svc.uts.set_token_ratio(static_cast<float>(absl::GetFlag(FLAGS_uts_token_ratio)));
  svc.uts.set_mc_passes(static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_uts_mc_passes))));
  const double random_share = absl::GetFlag(FLAGS_uts_random_share);
  if (!(random_share >= 0 && random_share < 1)) {
    // A device would refuse it at every Register: say so at the start instead.
    return absl::InvalidArgumentError("--uts_random_share must be in [0, 1)");
  }
  svc.uts.set_random_share(static_cast<float>(random_share));
  // The guard's flags are read on every role, so a front role tells devices the share the
  // trainer role holds out when both are started with the same --guard flags.
  svc.guard_holdout_fraction =
      absl::GetFlag(FLAGS_guard) ? absl::GetFlag(FLAGS_guard_holdout_fraction) : 0.0;
  const std::string fingerprint = absl::GetFlag(FLAGS_expected_fingerprint);
  if (!fingerprint.empty()) {
    uint64_t value = 0;
    if (!absl::SimpleHexAtoi(fingerprint, &value)) {
      return absl::InvalidArgumentError("--expected_fingerprint must be hex");
    }
    o.expected_fingerprint = value;
  }

  const double interval = absl::GetFlag(FLAGS_trigger_interval_s);
  o.scheduler.trigger_interval = interval > 0 ? absl::Seconds(interval) : absl::InfiniteDuration();
  o.scheduler.trigger_samples = std::max(1, absl::GetFlag(FLAGS_trigger_samples));
  o.scheduler.threads = std::max(1, absl::GetFlag(FLAGS_trainer_threads));
  o.trainer_id = absl::GetFlag(FLAGS_trainer_id);
  o.lease = absl::Seconds(std::max(1.0, absl::GetFlag(FLAGS_lease_s)));
  o.log = Log;
  o.env = cdcca::storage::ProgramEnv();
  o.status_file = absl::GetFlag(FLAGS_status_file);
  o.status_interval = absl::Seconds(absl::GetFlag(FLAGS_status_interval_s));
  p.port_file = absl::GetFlag(FLAGS_port_file);
  return p;
}

// --print_config: this program's flags and the job settings they resolve to, under the
// settings' names (settings/defaults.h).
int PrintConfig(const cdcca::cli::FlagFilter& own) {
  nlohmann::json config = cdcca::cli::FlagsJson(own);
  config.erase("print_config");
  absl::StatusOr<ProgramOptions> options = OptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  absl::StatusOr<std::string> job = cdcca::cloud::JobSettingsJson(options->cloud.strategy);
  if (!job.ok()) return Fail(job.status());
  config.update(nlohmann::json::parse(*job));
  std::printf("%s\n", config.dump(2).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the cdcca cloud service.\n"
      "  cdcca-cloud --data_dir=DIR --tokens=FILE --checkpoint_dir=DIR\n"
      "      (--tls_cert=F --tls_key=F [--client_ca=F [--allow_token_only_devices]] | --insecure)\n"
      "  cdcca-cloud --config=cloud.json\n"
      "Logs are JSON lines on stderr. See README (Deploying) for a worked example.");
  // --help lists this file's flags (absl matches the program name, spelt with '-').
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "cdcca_cloud_main");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  cdcca::cli::ParseFlagsOrHelp(argc, argv, [&usage](std::string_view file) {
    return usage.contains_help_flags(absl::string_view(file.data(), file.size()));
  });
  const cdcca::cli::FlagFilter own = [&usage](const absl::CommandLineFlag& flag) {
    return usage.contains_help_flags(flag.Filename());
  };
  if (absl::Status s = cdcca::cli::ApplyConfigFile(absl::GetFlag(FLAGS_config), argc, argv, own);
      !s.ok()) {
    return Fail(s);
  }
  {
    const std::string student = absl::GetFlag(FLAGS_student_base).empty()
                                    ? absl::GetFlag(FLAGS_checkpoint_dir)
                                    : absl::GetFlag(FLAGS_student_base);
    if (absl::Status s = cdcca::cli::ApplyProfile(
            absl::GetFlag(FLAGS_profile), cdcca::cli::FolderModelType(student),
            cdcca::cli::GivenFlags(argc, argv, absl::GetFlag(FLAGS_config)));
        !s.ok()) {
      return Fail(s);
    }
  }
  if (absl::GetFlag(FLAGS_print_config)) return PrintConfig(own);
  // Block SIGINT/SIGTERM in every thread (they inherit this mask) and wait for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<ProgramOptions> options = OptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  if (absl::Status s = cdcca::model::ApplyBlasThreadsFlag(absl::GetFlag(FLAGS_blas_threads));
      !s.ok()) {
    return Fail(s);
  }
  if (options->visible_gpu >= 0) {
    // One GPU for this process: the others are hidden before anything touches CUDA.
    ::setenv("CUDA_VISIBLE_DEVICES", std::to_string(options->visible_gpu).c_str(), 1);
  }
  absl::StatusOr<std::unique_ptr<cdcca::cloud::Cloud>> cloud =
      cdcca::cloud::OpenCloud(options->cloud);
  if (!cloud.ok()) return Fail(cloud.status());
  if (!options->port_file.empty() && (*cloud)->port() != 0) {
    if (absl::Status s =
            cdcca::storage::WriteFileAtomically(*cdcca::storage::Env::Default(), options->port_file,
                                                absl::StrCat((*cloud)->port(), "\n"));
        !s.ok()) {
      return Fail(s);
    }
  }

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  Log({{"event", "shutting_down"}, {"signal", signal_number}});
  (*cloud)->Shutdown(absl::Seconds(5));
  return 0;
}
