// JobScheduler: when a device's job runs. A CloudObserver that triggers a job every N new
// samples or every T seconds (whichever first, if there are new samples) and runs it on its own
// worker pool, never on an RPC thread. Its time is a Clock (the real one in `cdcca-cloud`; the
// harness drives it on a VirtualClock). The job itself is PerDeviceStrategy::RunJob
// (cloud/trainer.h).
#ifndef CDCCA_CLOUD_JOB_SCHEDULER_H_
#define CDCCA_CLOUD_JOB_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cloud/cloud_service.h"
#include "cloud/internal/work_pool.h"
#include "cloud/job_report.h"
#include "cloud/sample_store.h"
#include "proto/clock.h"
#include "settings/defaults.h"

namespace cdcca::cloud {

class PerDeviceStrategy;

struct JobSchedulerOptions {
  // Run a job once a device has this many new samples. Default: the defaults table's.
  int trigger_samples = settings::kTriggerSamples;
  // ... or once this long has passed since its last job (or since start) while it has at
  // least one new sample. Default: the table's. absl::InfiniteDuration() = off.
  absl::Duration trigger_interval = absl::Seconds(settings::kTriggerIntervalS);
  // Jobs running at once (different devices). Default: 1.
  int threads = 1;
  // A failed job is retried after this long, doubled after each further failure of the
  // device's jobs up to max_retry_after. Defaults: 5 s, 5 min.
  absl::Duration retry_after = absl::Seconds(5);
  absl::Duration max_retry_after = absl::Minutes(5);
  // What the triggers' time is read from (not owned; must outlive the scheduler).
  // nullptr = Clock::Real(); the harness injects a VirtualClock.
  Clock* clock = nullptr;
};

// Runs strategy jobs when their trigger fires. OnSamplesStored/OnApplied only note the
// event and return; a scheduler thread decides, and a work pool runs the jobs.
// Thread-safe. `strategy` and `samples` must outlive it.
class JobScheduler final : public CloudObserver {
 public:
  JobScheduler(JobSchedulerOptions options, PerDeviceStrategy* strategy, SampleStore* samples);
  // Stops triggering, waits for running jobs.
  ~JobScheduler() override;

  void OnSamplesStored(const std::string& device_id, uint64_t highest_durable) override;
  void OnApplied(const std::string& device_id, uint64_t version, bool in_sync) override;
  // The strategy's Rollback (it waits for a job of the device that is running).
  absl::StatusOr<RollbackResult> OnRollback(const std::string& device_id, uint64_t device_version,
                                            uint64_t to_version) override;

  // Blocks until no job runs and no device has reached its trigger, or `timeout` passed.
  // Returns false on timeout. For tests and the harness.
  bool WaitIdle(absl::Duration timeout);
  uint64_t jobs_done() const;
  uint64_t jobs_failed() const;
  // The most jobs triggered and not yet finished (queued for a worker or running) at once,
  // and the most running at once, since the start.
  int peak_in_flight() const;
  int peak_running() const;
  // Optional callback after each job (successful or not); runs on a pool thread.
  void SetJobCallback(std::function<void(const absl::StatusOr<JobReport>&)> callback);

 private:
  struct DeviceSchedule {
    uint64_t highest_durable = 0;
    uint64_t counted_upto = 0;  // batches whose samples are in pending_samples
    int64_t pending_samples = 0;
    bool running = false;
    absl::Time last_job = absl::InfinitePast();  // set to now when first seen
    absl::Time retry_at = absl::InfinitePast();
    absl::Duration retry_delay = absl::ZeroDuration();  // after the last failure
    absl::Time triggered_at;                            // real time the running job was triggered
  };

  void Loop();
  // Whether `d` should run now; counts new samples from the store's index as needed.
  bool Due(const std::string& device_id, DeviceSchedule& d, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(const std::string& device_id);

  const JobSchedulerOptions options_;
  Clock* const clock_;
  PerDeviceStrategy* const strategy_;
  SampleStore* const samples_;

  mutable absl::Mutex mu_;
  std::map<std::string, DeviceSchedule> devices_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool dirty_ ABSL_GUARDED_BY(mu_) = false;
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // triggered, not finished
  int executing_ ABSL_GUARDED_BY(mu_) = 0;
  int peak_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int peak_running_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t jobs_done_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t jobs_failed_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void(const absl::StatusOr<JobReport>&)> callback_ ABSL_GUARDED_BY(mu_);

  std::unique_ptr<internal::WorkPool> pool_;
  std::thread thread_;
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_JOB_SCHEDULER_H_
