#include "cloud/job_scheduler.h"

#include <algorithm>
#include <utility>

#include "cloud/trainer.h"

namespace cdcca::cloud {

JobScheduler::JobScheduler(JobSchedulerOptions options, PerDeviceStrategy* strategy,
                           SampleStore* samples)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      strategy_(strategy),
      samples_(samples) {
  pool_ = std::make_unique<internal::WorkPool>(std::max(1, options_.threads));
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    for (const std::string& id : samples_->Devices()) {
      DeviceSchedule& d = devices_[id];
      d.highest_durable = samples_->HighestDurable(id);
      d.last_job = now;
    }
    dirty_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
}

JobScheduler::~JobScheduler() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  pool_.reset();  // runs queued jobs' remaining closures and joins
}

void JobScheduler::OnSamplesStored(const std::string& device_id, uint64_t highest_durable) {
  absl::MutexLock lock(&mu_);
  DeviceSchedule& d = devices_[device_id];
  if (d.last_job == absl::InfinitePast()) d.last_job = clock_->Now();
  d.highest_durable = std::max(d.highest_durable, highest_durable);
  dirty_ = true;
}

absl::StatusOr<RollbackResult> JobScheduler::OnRollback(const std::string& device_id,
                                                        uint64_t device_version,
                                                        uint64_t to_version) {
  return strategy_->Rollback(device_id, device_version, to_version);
}

void JobScheduler::OnApplied(const std::string& device_id, uint64_t version, bool in_sync) {
  // Nothing to change on the cloud side: a device out of sync is told to load the newest
  // snapshot, which is its mirror itself.
}

void JobScheduler::SetJobCallback(std::function<void(const absl::StatusOr<JobReport>&)> callback) {
  absl::MutexLock lock(&mu_);
  callback_ = std::move(callback);
}

uint64_t JobScheduler::jobs_done() const {
  absl::MutexLock lock(&mu_);
  return jobs_done_;
}

uint64_t JobScheduler::jobs_failed() const {
  absl::MutexLock lock(&mu_);
  return jobs_failed_;
}

int JobScheduler::peak_in_flight() const {
  absl::MutexLock lock(&mu_);
  return peak_in_flight_;
}

int JobScheduler::peak_running() const {
  absl::MutexLock lock(&mu_);
  return peak_running_;
}

bool JobScheduler::Due(const std::string& device_id, DeviceSchedule& d, absl::Time now) {
  if (d.running || now < d.retry_at) return false;
  const uint64_t consumed = strategy_->ConsumedSequence(device_id);
  if (d.highest_durable <= consumed) {
    d.pending_samples = 0;
    d.counted_upto = consumed;
    return false;
  }
  if (d.counted_upto < consumed) {
    d.counted_upto = consumed;
    d.pending_samples = 0;
  }
  if (d.counted_upto < d.highest_durable) {
    // From the store's index: scheduling never reads a payload.
    d.pending_samples += static_cast<int64_t>(
        samples_->SampleCount(device_id, d.counted_upto + 1, d.highest_durable));
    d.counted_upto = d.highest_durable;
  }
  if (d.pending_samples <= 0) return false;
  return d.pending_samples >= options_.trigger_samples ||
         now - d.last_job >= options_.trigger_interval;
}

void JobScheduler::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    const absl::Time now = clock_->Now();
    for (auto& [id, d] : devices_) {
      if (!Due(id, d, now)) continue;
      d.running = true;
      d.triggered_at = absl::Now();
      ++running_;
      peak_in_flight_ = std::max(peak_in_flight_, running_);
      const std::string device_id = id;
      pool_->Schedule([this, device_id] { Run(device_id); });
    }
    dirty_ = false;
    // Wake on new samples, a finished job, or every 200 ms for the time trigger.
    auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || dirty_; };
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&wake), absl::Milliseconds(200));
  }
}

void JobScheduler::Run(const std::string& device_id) {
  double queue_seconds = 0;
  {
    absl::MutexLock lock(&mu_);
    queue_seconds = absl::ToDoubleSeconds(absl::Now() - devices_[device_id].triggered_at);
    ++executing_;
    peak_running_ = std::max(peak_running_, executing_);
  }
  absl::StatusOr<JobReport> report = strategy_->RunJob(device_id);
  if (report.ok()) report->queue_seconds = queue_seconds;
  std::function<void(const absl::StatusOr<JobReport>&)> callback;
  {
    absl::MutexLock lock(&mu_);
    DeviceSchedule& d = devices_[device_id];
    d.running = false;
    --running_;
    --executing_;
    d.last_job = clock_->Now();
    if (report.ok() || absl::IsNotFound(report.status())) d.retry_delay = absl::ZeroDuration();
    if (report.ok()) {
      ++jobs_done_;
    } else if (!absl::IsNotFound(report.status())) {
      ++jobs_failed_;
      d.retry_delay = d.retry_delay == absl::ZeroDuration()
                          ? options_.retry_after
                          : std::min(d.retry_delay * 2, options_.max_retry_after);
      d.retry_at = clock_->Now() + d.retry_delay;
    }
    dirty_ = true;
    callback = callback_;
  }
  if (callback) callback(report);
}

bool JobScheduler::WaitIdle(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    {
      absl::MutexLock lock(&mu_);
      bool idle = running_ == 0;
      const absl::Time now = clock_->Now();
      for (auto& [id, d] : devices_) {
        if (!idle) break;
        if (Due(id, d, now)) idle = false;
      }
      if (idle) return true;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

}  // namespace cdcca::cloud
