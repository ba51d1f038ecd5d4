// What a trainer job did and what the trainer knows of a device: the records that
// PerDeviceStrategy (cloud/trainer.h) returns, JobScheduler (cloud/job_scheduler.h) hands to its
// callback, and the programs log.
#ifndef CDCCA_CLOUD_JOB_REPORT_H_
#define CDCCA_CLOUD_JOB_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cloud/update_guard.h"

namespace cdcca::cloud {

// What one job did; returned by PerDeviceStrategy::RunJob and logged by the programs.
struct JobReport {
  std::string device_id;
  uint64_t base_version = 0;
  uint64_t new_version = 0;
  uint64_t state_digest = 0;    // of the mirror at new_version
  uint64_t first_sequence = 0;  // uplink batches consumed: [first_sequence, last_sequence]
  uint64_t last_sequence = 0;
  int64_t samples = 0;  // this round's samples trained on
  // This round's samples held out for the update guard (never trained on; not in `samples`).
  int64_t held_out_samples = 0;
  // Samples in [first_sequence, last_sequence] the job could not use (a batch that reads
  // back damaged or does not decode, a frame that does not decode): quarantined, consumed.
  uint64_t quarantined_samples = 0;
  int64_t replay_samples = 0;  // earlier rounds' samples drawn from the replay buffer
  // Earlier jobs' samples trained again from the device's durable pool
  // (PerDeviceStrategyOptions::pool_samples).
  int64_t pool_samples = 0;
  int steps = 0;
  bool stopped_by_budget = false;  // the job hit its time budget before max_steps
  double train_seconds = 0;
  double loss_first = 0;  // "total" loss at the first step and over the last steps
  double loss_last = 0;
  uint64_t payload_bytes = 0;  // DWC update size
  double bits_per_param = 0;
  double relative_error = 0;  // of the update against the trained delta
  // Non-zero when the configured budget could not hold even the smallest payload and the
  // job used this byte budget instead.
  uint64_t budget_raised_to = 0;
  std::string train_device;  // "cpu" or "cuda:0"
  // What the job log says beyond the numbers (e.g. a Hugging Face pair with different
  // tokenizers trains without the logit KL, and says so).
  std::vector<std::string> notes;
  // Set by JobScheduler: real time from the trigger firing to the job's start (waiting for
  // a free worker); on the shared store by JobWorker: from the moment the job was due to its
  // lease (pg::JobLease::waited).
  double queue_seconds = 0;
  // The update guard's finding (pool 0 and decision "" where it did not run: guard off, or
  // nothing was trained). With update_withheld the update did not ship: new_version equals
  // base_version, state_digest is the unchanged mirror's, payload_bytes is 0, and the
  // batches are consumed all the same.
  GuardVerdict guard;
  bool update_withheld = false;
  // With the update withheld and UpdateGuardOptions::restore_base: the pretrained base
  // scored against the device's current version on the job's newly held-out samples (at
  // least the newest min_pool of the pool; base as "after"), and
  // whether it won by the guard's rule, so that the device went back to the base as a new
  // version (new_version, state_digest are then the restored state's).
  GuardVerdict base_guard;
  // With update_withheld and PerDeviceStrategyOptions::report_withheld_state: the trainable
  // state the withheld update would have given the device (safetensors), for measuring what
  // the guard's decision cost or saved (the experiments' harness).
  std::string withheld_state;
  bool restored_base = false;
};

// What a strategy knows of one device, for health output and tests.
struct DeviceTrainingState {
  uint64_t version = 0;                // mirror version (0 = the pretrained base)
  uint64_t state_digest = 0;           // compress::StateDigest of the mirror
  uint64_t consumed_sequence = 0;      // highest uplink batch trained on
  uint64_t jobs = 0;                   // jobs run since the process started
  uint64_t quarantined_samples = 0;    // ever, persisted
  std::string last_quarantine_reason;  // "" if none
  // Updates the guard withheld since the process started, and the held-out pool's size (0
  // until the device's first job since the start rebuilds it).
  uint64_t updates_withheld = 0;
  uint64_t holdout_pool = 0;
  uint64_t rollbacks = 0;  // Rollback()s since the process started
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_JOB_REPORT_H_
