#include "cloud/cluster_roles.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

namespace cdcca::cloud {
namespace {

void Log(const nlohmann::json& event) {
  std::fprintf(stderr, "%s\n", event.dump().c_str());
  std::fflush(stderr);
}

}  // namespace

// ---- JobQueueTrigger --------------------------------------------------------------------------

JobQueueTrigger::JobQueueTrigger(JobQueueTriggerOptions options, pg::PgCloudStore* store,
                                 PerDeviceStrategy* strategy, pg::PgMirrorStates* states,
                                 std::string owner)
    : store_(store), strategy_(strategy), states_(states), owner_(std::move(owner)) {
  store_->TriggerJobsOnAppend(
      {static_cast<uint64_t>(std::max(1, options.trigger_samples)), options.trigger_interval});
}

absl::StatusOr<RollbackResult> JobQueueTrigger::OnRollback(const std::string& device_id,
                                                           uint64_t device_version,
                                                           uint64_t to_version) {
  if (strategy_ == nullptr || states_ == nullptr) {
    return absl::UnimplementedError(
        "this front has no model (--checkpoint_dir or a Hugging Face pair): it cannot roll a "
        "device back");
  }
  // The device's job lease, as a trainer's job holds it: no job of the device runs while the
  // rollback does, and the rollback publishes only while it holds the lease.
  const absl::Duration lease_length = absl::Seconds(30);
  std::optional<pg::JobLease> lease;
  const absl::Time give_up = absl::Now() + absl::Minutes(1);
  while (true) {
    absl::StatusOr<std::optional<pg::JobLease>> leased =
        store_->Borrow()->LeaseDeviceJob(device_id, owner_, lease_length);
    if (!leased.ok()) return leased.status();
    if (leased->has_value()) {
      lease = **leased;
      break;
    }
    if (absl::Now() > give_up) {
      return absl::UnavailableError(absl::StrCat(
          "a job of ", device_id, " has run for over a minute: roll back once it finished"));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  absl::StatusOr<pg::MirrorState> cursor = store_->Borrow()->MirrorCursor(device_id);
  if (cursor.ok()) {
    strategy_->DropUnless(device_id, cursor->version, cursor->consumed_sequence);
  } else if (absl::IsNotFound(cursor.status())) {
    strategy_->DropUnless(device_id, 0, 0);
  } else {
    (void)store_->Borrow()->ReleaseLease(*lease, absl::InfiniteFuture());
    return cursor.status();
  }
  states_->Hold(*lease);
  absl::StatusOr<RollbackResult> result =
      strategy_->Rollback(device_id, device_version, to_version);
  if (!states_->Forget(device_id)) {
    (void)store_->Borrow()->ReleaseLease(*lease, absl::InfiniteFuture());
  }
  // Publish and ReleaseLease leave the job due if samples arrived meanwhile.
  return result;
}

// ---- JobWorker --------------------------------------------------------------------------------

JobWorker::JobWorker(JobWorkerOptions options, pg::PgCloudStore* store, pg::PgMirrorStates* states,
                     PerDeviceStrategy* strategy)
    : options_(std::move(options)), store_(store), states_(states), strategy_(strategy) {
  for (int i = 0; i < std::max(1, options_.threads); ++i) threads_.emplace_back([this] { Loop(); });
}

JobWorker::~JobWorker() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void JobWorker::SetJobCallback(std::function<void(const absl::StatusOr<JobReport>&)> callback) {
  absl::MutexLock lock(&mu_);
  callback_ = std::move(callback);
}

void JobWorker::Loop() {
  const auto stopping = [this] {
    absl::MutexLock lock(&mu_);
    return stopping_;
  };
  while (!stopping()) {
    absl::StatusOr<std::optional<pg::JobLease>> lease =
        store_->Borrow()->LeaseJob(options_.owner, options_.lease);
    if (lease.ok() && lease->has_value()) {
      RunLeased(**lease);
      continue;
    }
    if (!lease.ok()) {
      Log({{"event", "job_lease_failed"}, {"error", lease.status().ToString()}});
    }
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.poll);
  }
}

void JobWorker::RunLeased(const pg::JobLease& leased) {
  const std::string& id = leased.device_id;
  // Another trainer may have run this device's jobs since this one held its state.
  absl::StatusOr<pg::MirrorState> cursor = store_->Borrow()->MirrorCursor(id);
  if (cursor.ok()) {
    strategy_->DropUnless(id, cursor->version, cursor->consumed_sequence);
  } else if (absl::IsNotFound(cursor.status())) {
    strategy_->DropUnless(id, 0, 0);
  }
  states_->Hold(leased);

  // Renews the lease every third of its length until the job ends.
  absl::Mutex beat_mu;
  bool job_done = false;
  bool lost = false;
  std::thread heartbeat([&] {
    pg::JobLease lease = leased;
    absl::MutexLock lock(&beat_mu);
    while (!beat_mu.AwaitWithTimeout(absl::Condition(&job_done), options_.lease / 3)) {
      beat_mu.Unlock();
      absl::Status s = store_->Borrow()->Heartbeat(&lease, options_.lease);
      beat_mu.Lock();
      if (absl::IsFailedPrecondition(s)) {
        lost = true;
        return;
      }
    }
  });
  absl::StatusOr<JobReport> report = strategy_->RunJob(id);
  // As the embedded scheduler measures it: from the moment the job was due to its start.
  if (report.ok()) report->queue_seconds = absl::ToDoubleSeconds(leased.waited);
  {
    absl::MutexLock lock(&beat_mu);
    job_done = true;
  }
  heartbeat.join();
  const bool published = states_->Forget(id);

  absl::Duration retry = absl::ZeroDuration();
  if (report.ok() || published) {
    ++jobs_done_;
    absl::MutexLock lock(&mu_);
    retry_delay_.erase(id);
  } else if (absl::IsNotFound(report.status())) {
    // Nothing new to train: the job is not due until a front schedules it again.
    if (absl::Status s = store_->Borrow()->ReleaseLease(leased, absl::InfiniteFuture());
        !s.ok() && !absl::IsFailedPrecondition(s)) {
      Log({{"event", "job_release_failed"}, {"device_id", id}, {"error", s.ToString()}});
    }
  } else {
    ++jobs_failed_;
    {
      absl::MutexLock lock(&mu_);
      absl::Duration& delay = retry_delay_[id];
      delay = delay == absl::ZeroDuration() ? options_.retry_after
                                            : std::min(delay * 2, options_.max_retry_after);
      retry = delay;
    }
    absl::Status s = store_->Borrow()->ReleaseLease(leased, absl::Now() + retry);
    if (absl::IsFailedPrecondition(s) || lost) {
      ++leases_lost_;
      Log({{"event", "job_lease_lost"},
           {"device_id", id},
           {"fencing_token", leased.fencing_token},
           {"action", "nothing of the job was published; the lease's new holder runs it"}});
    } else if (!s.ok()) {
      Log({{"event", "job_release_failed"}, {"device_id", id}, {"error", s.ToString()}});
    }
  }
  std::function<void(const absl::StatusOr<JobReport>&)> callback;
  {
    absl::MutexLock lock(&mu_);
    callback = callback_;
  }
  if (callback) callback(report);
}

}  // namespace cdcca::cloud
