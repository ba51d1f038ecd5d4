// The two roles of a cloud process on the shared store (cloud/pg/pg_cloud_store.h):
//
//   JobQueueTrigger  a front's CloudObserver: each stored batch makes the device's job
//                    due in the shared job queue (in the batch's own statement), now once
//                    the device has trigger_samples samples past its mirror's cursor, else
//                    after trigger_interval; and it serves Rollback under the device's job
//                    lease.
//                    A front holds no device state between calls.
//   JobWorker        a trainer's loop: leases the job due longest ago (no two trainers
//                    hold one job), renews the lease while the job runs, and runs it with
//                    PerDeviceStrategy, whose commit publishes the result under the lease
//                    (PgMirrorStates). A job that fails is given back, due again after a
//                    delay that grows with the device's failures; a trainer that dies loses
//                    only its lease, and the job runs elsewhere once the lease expires.
#ifndef CDCCA_CLOUD_CLUSTER_ROLES_H_
#define CDCCA_CLOUD_CLUSTER_ROLES_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cloud/cloud_service.h"
#include "cloud/pg/pg_cloud_store.h"
#include "cloud/trainer.h"

namespace cdcca::cloud {

struct JobQueueTriggerOptions {
  // As JobSchedulerOptions: a job is due once a device has this many new samples, or this
  // long after a batch arrived (InfiniteDuration = only the sample trigger).
  int trigger_samples = 32;
  absl::Duration trigger_interval = absl::Seconds(60);
};

class JobQueueTrigger final : public CloudObserver {
 public:
  // `store` must outlive the trigger. The trigger rides in the store's appends from here on
  // (PgCloudStore::TriggerJobsOnAppend): the statement that stores a batch makes its job
  // due, so a batch is acked only with its job scheduled. With `strategy` (committing through
  // `states`), the front also serves Rollback: it leases the device's job (waiting up to a
  // minute for a running one), and the strategy's rollback publishes under that lease.
  JobQueueTrigger(JobQueueTriggerOptions options, pg::PgCloudStore* store,
                  PerDeviceStrategy* strategy = nullptr, pg::PgMirrorStates* states = nullptr,
                  std::string owner = "front");
  absl::StatusOr<RollbackResult> OnRollback(const std::string& device_id, uint64_t device_version,
                                            uint64_t to_version) override;

 private:
  pg::PgCloudStore* const store_;
  PerDeviceStrategy* const strategy_;
  pg::PgMirrorStates* const states_;
  const std::string owner_;
};

struct JobWorkerOptions {
  // Who holds the leases (unique per process: host and pid by default).
  std::string owner;
  // Jobs run at once, each on its own thread. Default: 1.
  int threads = 1;
  // A lease's length, renewed every lease / 3 while the job runs. Default: 30 s.
  absl::Duration lease = absl::Seconds(30);
  // How often an idle thread looks for a due job. Default: 200 ms.
  absl::Duration poll = absl::Milliseconds(200);
  // A failed job is due again after retry_after, doubled per further failure of the
  // device up to max_retry_after.
  absl::Duration retry_after = absl::Seconds(5);
  absl::Duration max_retry_after = absl::Minutes(5);
};

class JobWorker {
 public:
  // Starts the threads. `strategy` must commit through `states`; all must outlive the
  // worker.
  JobWorker(JobWorkerOptions options, pg::PgCloudStore* store, pg::PgMirrorStates* states,
            PerDeviceStrategy* strategy);
  // Stops leasing, waits for the running jobs (their results publish or not as their
  // leases allow).
  ~JobWorker();

  // Runs after each job (successful or not) on the worker's thread.
  void SetJobCallback(std::function<void(const absl::StatusOr<JobReport>&)> callback);
  uint64_t jobs_done() const { return jobs_done_.load(); }
  uint64_t jobs_failed() const { return jobs_failed_.load(); }
  // Jobs whose lease was lost while they ran (nothing of them was published).
  uint64_t leases_lost() const { return leases_lost_.load(); }

 private:
  void Loop();
  void RunLeased(const pg::JobLease& lease);

  const JobWorkerOptions options_;
  pg::PgCloudStore* const store_;
  pg::PgMirrorStates* const states_;
  PerDeviceStrategy* const strategy_;
  std::atomic<uint64_t> jobs_done_{0};
  std::atomic<uint64_t> jobs_failed_{0};
  std::atomic<uint64_t> leases_lost_{0};

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, absl::Duration> retry_delay_ ABSL_GUARDED_BY(mu_);
  std::function<void(const absl::StatusOr<JobReport>&)> callback_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_CLUSTER_ROLES_H_
