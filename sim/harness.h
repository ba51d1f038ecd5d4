// The round-trip harness: runs an Experiment through the real services on one machine.
//
// For each method, a fresh cloud (stores, PerDeviceStrategy, the programs' JobScheduler,
// CloudService on a loopback gRPC port) and N device agents (InferenceRuntime + CloudClient
// + DeviceAgent with its link thread running, as in `cdcca-device`), each device reaching
// the cloud through its own LinkEmulator. The scheduler and the agents' link loops run on one
// VirtualClock (proto/clock.h) that the harness moves; everything else is real. Every round
// (Algorithm 1 of the paper), the devices at once, each on its own thread:
//
//   1. each device answers stream_frames frames of its round's domain; UTS keeps samples and
//      tokens and queues them (DeviceAgent::Process, Flush);
//   2. its link thread uplinks the queue over its emulated link as batches fill; the
//      device's part of the round ends when every batch is acked durable;
//   3. then the clock moves by the scheduler's trigger interval: the scheduler triggers one
//      job per device with new samples (the sample-count trigger is off, so a job never
//      starts on part of a round) and runs them on its workers (Experiment job.workers);
//   4. the link loops' next poll (the clock moves by their poll interval) fetches and
//      applies each update in place and reports the digest;
//   5. every device is scored on eval_scenes held-out test scenes of its current domain.
//
// Device-side methods (tent, cotta) adapt a local copy of the student on the device's own
// stream and load the result into the runtime; source-only never adapts. Neither uses the
// cloud or the link.
//
// Determinism: stream, evaluation scenes, dropout and training are seeded from `seed`, and
// no job's input depends on timing: a round's job consumes exactly that round's batches,
// virtual time (sample ids, triggers) restarts at a fixed point each round, each kept
// sample's dropout passes draw from their own seed (AgentOptions::score_seed), and jobs and
// device-side adaptation, which draw from LibTorch's process-wide generator, never overlap
// one another (one scheduler worker) or a device's scoring. So the same seed gives the same
// accuracies, digests and byte counts; transfer, job and queueing times are measured
// wall-clock figures and vary. (A device that uplinks nothing in a round lets its trigger
// fire early in the next one; that round's job may then see part of the uplink.)
#ifndef CDCCA_SIM_HARNESS_H_
#define CDCCA_SIM_HARNESS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "sim/experiment.h"

namespace cdcca::sim {

// One device in one round.
struct DeviceRound {
  int device = 0;
  int round = 0;       // 1-based; 0 = before any adaptation
  std::string domain;  // e.g. "fog-4", "fog-4+text"
  double da = 0;       // VQA direct-answer accuracy, percent (official metric)
  double mc = 0;       // multiple-choice accuracy, percent
  int questions = 0;
  // Per evaluation question, in a fixed order (the same scenes and questions for every
  // method on the same domain): official VQA accuracy in [0, 1]. For paired comparisons.
  std::vector<float> question_da;
  // Caption experiments (Experiment::captioning()): BLEU-4 and CIDEr-D in percent per
  // category, in the order in-domain, near-domain, out-domain, all. The VQA fields then
  // carry the "all" figures so that every table, plot and paired comparison works on them:
  // da = CIDEr-D, mc = BLEU-4, questions = images, question_da = each image's CIDEr-D in
  // COCO units (their mean x 100 is da).
  struct CaptionScore {
    std::string category;
    double bleu4 = 0, cider = 0;
    int images = 0;
  };
  std::vector<CaptionScore> captions;
  int64_t frames = 0;
  int64_t kept_samples = 0;
  int64_t kept_tokens = 0;
  uint64_t uplink_payload_bytes = 0;    // UTS batches (what the codec produced)
  uint64_t uplink_wire_bytes = 0;       // every byte device -> cloud on the link
  uint64_t downlink_payload_bytes = 0;  // DWC update
  uint64_t downlink_wire_bytes = 0;
  double uplink_seconds = 0;    // measured: the round's Uplink calls
  double downlink_seconds = 0;  // measured: fetching, applying and reporting the update
  double job_seconds = 0;       // cloud training (or on-device adaptation) time
  double queue_seconds = 0;     // measured: the scheduler's trigger to the job's start
  // The cloud's update guard on the round's job (cloud/update_guard.h): whether it withheld
  // the update (the device then stays at its version), and the held-out pool it scored with
  // the agreement with the teacher before and after the update (pool 0: not scored).
  bool update_withheld = false;
  bool restored_base = false;  // withheld, and the device went back to the pretrained base
  int64_t guard_pool = 0;
  double guard_before = 0, guard_after = 0;
  // A withheld update measured all the same (cloud jobs with the guard): the device's score
  // on the round's evaluation questions with the update it did not get, and that minus its
  // score as it is (paired over the questions, with the difference's standard error).
  bool withheld_measured = false;
  double withheld_da = 0;
  double withheld_gain = 0;
  double withheld_gain_se = 0;
  uint64_t withheld_state_digest = 0;  // of the state the withheld update would have given
  uint64_t version = 0;                // model version the device runs after the round
  uint64_t state_digest = 0;           // of the device's trainable set after the round
  bool in_sync = true;                 // device digest == cloud mirror digest
  double answer_ms = 0;                // mean per-frame answer latency on the device
};

struct MethodResult {
  std::string method;
  std::vector<DeviceRound> rounds;  // devices x (rounds + 1), round-major
  uint64_t raw_frame_bytes = 0;     // one model-input frame, RGB
  int64_t trainable_parameters = 0;
  // Concurrency seen: devices streaming and uplinking at once, the scheduler's jobs
  // triggered and not finished at once (queued or running), and running at once.
  int peak_devices_streaming = 0;
  int peak_jobs_in_flight = 0;
  int peak_jobs_running = 0;
};

struct RunResult {
  Experiment experiment;
  uint64_t seed = 0;
  std::vector<MethodResult> methods;
  double seconds = 0;
};

struct HarnessOptions {
  std::string work_dir;  // per-method cloud and device state (created; left for inspection)
  uint64_t seed = 1;
  // Called with a one-line status and the fraction done [0, 1] (progress bars).
  std::function<void(const std::string&, double)> progress;
};

absl::StatusOr<RunResult> RunExperiment(const Experiment& experiment,
                                        const HarnessOptions& options);

// The settings of the round that `method` of `e` runs, as one JSON object keyed by the
// settings' names (settings/defaults.h), the way cdcca-cloud's and cdcca-device's
// --print_config print theirs: UTS (uts_*, uplink_precision), the student and its adapters
// (student_precision, lora_*), the job (learner, l_*, temperature, max_steps, batch_size, lr,
// replay_fraction, replay_capacity, max_answer_tokens), the downlink (bits_per_param) and the
// update guard (guard*). Built by the same functions that build the run's cloud and devices.
// What `cdcca-sim --print_config` prints. INVALID_ARGUMENT for an unknown method; the errors
// of reading the experiment's distill settings.
absl::StatusOr<std::string> RoundSettingsJson(const Experiment& e,
                                              const std::string& method = "cd-cca");

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_HARNESS_H_
