#include "cloud/internal/mirror_cache.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace cdcca::cloud::internal {

void DeviceMirror::PublishInfo() {
  absl::MutexLock lock(&info_mu);
  info.version = version;
  info.state_digest = digest;
  info.consumed_sequence = consumed;
  info.jobs = jobs;
  info.updates_withheld = withheld;
  info.rollbacks = rollbacks;
  info.holdout_pool = holdout.size();
  info.quarantined_samples = quarantine.samples;
  info.last_quarantine_reason = quarantine.recent.empty() ? "" : quarantine.recent.back().reason;
  info_valid = true;
}

void DeviceMirror::Clear() {
  mirror = compress::NamedTensors();
  encoder = compress::DeltaEncoder();
  replay.reset();
  holdout.clear();
  holdout_built = false;
  pool.clear();
  pool_built = false;
  quarantine = QuarantineLog();
  loaded = false;
}

DeviceMirror* MirrorCache::Get(const std::string& id) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<DeviceMirror>& d = devices_[id];
  if (d == nullptr) d = std::make_unique<DeviceMirror>();
  return d.get();
}

void MirrorCache::MarkLoaded(const std::string& id, DeviceMirror& d) {
  d.loaded = true;
  d.PublishInfo();
  absl::MutexLock lock(&mu_);
  resident_.insert(id);
}

void MirrorCache::MarkUnloaded(const std::string& id, DeviceMirror& d) {
  d.loaded = false;
  absl::MutexLock lock(&mu_);
  resident_.erase(id);
  ++evictions_;
}

void MirrorCache::Touch(const std::string& id,
                        absl::FunctionRef<void(const std::string& id, DeviceMirror& d)> evict) {
  std::vector<std::pair<uint64_t, std::string>> idle;
  {
    absl::MutexLock lock(&mu_);
    last_used_[id] = ++tick_;
    if (max_resident_ == 0 || resident_.size() <= max_resident_) return;
    for (const std::string& r : resident_) idle.emplace_back(last_used_[r], r);
  }
  std::sort(idle.begin(), idle.end());
  size_t excess = idle.size() - max_resident_;
  for (const auto& [used, r] : idle) {
    if (excess == 0) break;
    DeviceMirror* d = Get(r);
    if (!d->mu.TryLock()) continue;
    if (d->loaded) {
      evict(r, *d);
      --excess;
    }
    d->mu.Unlock();
  }
}

size_t MirrorCache::resident() const {
  absl::MutexLock lock(&mu_);
  return resident_.size();
}

uint64_t MirrorCache::evictions() const {
  absl::MutexLock lock(&mu_);
  return evictions_;
}

}  // namespace cdcca::cloud::internal
