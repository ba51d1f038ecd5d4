#include "cloud/pg/pg_cloud_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace cdcca::cloud::pg {
namespace {

StoredUpdate ToStoredUpdate(StoredPayload p) {
  StoredUpdate u;
  u.base_version = p.base_version;
  u.new_version = p.new_version;
  u.state_digest = p.state_digest;
  u.sha256 = std::move(p.sha256);
  u.payload = std::make_shared<const std::string>(std::move(p.payload));
  return u;
}

}  // namespace

// ---- the pool ---------------------------------------------------------------------------------

PgCloudStore::PgCloudStore() = default;

absl::StatusOr<std::unique_ptr<PgCloudStore>> PgCloudStore::Open(
    const PgCloudStoreOptions& options) {
  if (options.sessions < 1) return absl::InvalidArgumentError("a store needs at least 1 session");
  std::unique_ptr<PgCloudStore> store(new PgCloudStore());
  PgStoreOptions session_options;
  session_options.conninfo = options.conninfo;
  session_options.keep_per_device = options.keep_per_device;
  session_options.max_device_bytes = options.max_device_bytes;
  for (int i = 0; i < options.sessions; ++i) {
    absl::StatusOr<std::unique_ptr<PgStore>> session = PgStore::Open(session_options);
    if (!session.ok()) return session.status();
    store->sessions_.push_back(*std::move(session));
  }
  {
    absl::MutexLock lock(&store->mu_);
    for (const std::unique_ptr<PgStore>& s : store->sessions_) store->idle_.push_back(s.get());
  }
  store->appends_ = std::make_unique<internal::WorkPool>(options.sessions);
  return store;
}

PgCloudStore::~PgCloudStore() { appends_.reset(); }

PgCloudStore::Session::~Session() {
  if (owner_ != nullptr) owner_->GiveBack(store_);
}

PgCloudStore::Session PgCloudStore::Borrow() const {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](std::vector<PgStore*>* idle) { return !idle->empty(); }, &idle_));
  PgStore* store = idle_.back();
  idle_.pop_back();
  return Session(this, store);
}

void PgCloudStore::GiveBack(PgStore* store) const {
  absl::MutexLock lock(&mu_);
  idle_.push_back(store);
}

// ---- DeviceStore ------------------------------------------------------------------------------

absl::StatusOr<store::v1::DeviceRecord> PgCloudStore::Register(
    const std::string& device_id, uint64_t model_fingerprint,
    const v1::Capabilities& capabilities) {
  return Borrow()->Register(device_id, model_fingerprint, capabilities);
}

absl::Status PgCloudStore::SetApplied(const std::string& device_id, uint64_t version,
                                      uint64_t digest, bool in_sync) {
  return Borrow()->SetApplied(device_id, version, digest, in_sync);
}

absl::StatusOr<store::v1::DeviceRecord> PgCloudStore::Get(const std::string& device_id) const {
  return Borrow()->GetDevice(device_id);
}

size_t PgCloudStore::size() const {
  absl::StatusOr<uint64_t> n = Borrow()->DeviceCount();
  return n.ok() ? static_cast<size_t>(*n) : 0;
}

// ---- SampleLog --------------------------------------------------------------------------------

void PgCloudStore::Append(const std::string& device_id, v1::UplinkBatch batch,
                          AppendCallback done) {
  appends_->Schedule([this, device_id, batch = std::move(batch), done = std::move(done)] {
    std::optional<AppendTrigger> trigger;
    {
      absl::MutexLock lock(&mu_);
      trigger = trigger_;
    }
    absl::StatusOr<AppendOutcome> outcome = Borrow()->Append(device_id, batch, trigger);
    if (!outcome.ok()) {
      done(outcome.status());
      return;
    }
    if (!outcome->duplicate) {
      appended_records_.fetch_add(1, std::memory_order_relaxed);
      appended_bytes_.fetch_add(batch.ByteSizeLong(), std::memory_order_relaxed);
    }
    done(AppendResult{outcome->duplicate, outcome->highest_sequence});
  });
}

void PgCloudStore::TriggerJobsOnAppend(AppendTrigger trigger) {
  absl::MutexLock lock(&mu_);
  trigger_ = trigger;
}

absl::StatusOr<uint64_t> PgCloudStore::Durable(const std::string& device_id) const {
  return Borrow()->HighestSequence(device_id);
}

absl::StatusOr<uint64_t> PgCloudStore::CountSamples(const std::string& device_id,
                                                    uint64_t from_sequence,
                                                    uint64_t to_sequence) const {
  return Borrow()->SampleCount(device_id, from_sequence, to_sequence);
}

absl::StatusOr<StoredBatches> PgCloudStore::ReadEach(const std::string& device_id,
                                                     uint64_t from_sequence,
                                                     size_t max_records) const {
  const int max = static_cast<int>(std::min<size_t>(max_records, 1 << 20));
  absl::StatusOr<std::vector<store::v1::SampleRecord>> records =
      Borrow()->ReadBatches(device_id, from_sequence == 0 ? 0 : from_sequence - 1, max);
  if (!records.ok()) return records.status();
  StoredBatches out;
  out.records = *std::move(records);
  return out;
}

absl::Status PgCloudStore::Release(const std::string& device_id, uint64_t through_sequence) {
  absl::StatusOr<uint64_t> deleted = Borrow()->Release(device_id, through_sequence);
  if (!deleted.ok()) return deleted.status();
  released_records_.fetch_add(*deleted, std::memory_order_relaxed);
  return absl::OkStatus();
}

SampleStoreStats PgCloudStore::Stats() const {
  SampleStoreStats stats;
  stats.records = appended_records_.load(std::memory_order_relaxed);
  stats.bytes = appended_bytes_.load(std::memory_order_relaxed);
  stats.released_records = released_records_.load(std::memory_order_relaxed);
  return stats;
}

// ---- UpdateLog --------------------------------------------------------------------------------

absl::Status PgCloudStore::PutUpdate(const std::string& device_id, uint64_t base_version,
                                     uint64_t new_version, uint64_t /*state_digest*/,
                                     std::string /*payload*/) {
  absl::StatusOr<StoredPayload> stored = Borrow()->UpdateAfter(device_id, base_version);
  if (stored.ok() && stored->new_version == new_version) return absl::OkStatus();
  if (!stored.ok() && absl::IsUnavailable(stored.status())) return stored.status();
  return absl::FailedPreconditionError(
      absl::StrCat("the shared store does not hold the update ", base_version, " -> ", new_version,
                   " of ", device_id, ": updates are published by their job"));
}

absl::Status PgCloudStore::PutSnapshot(const std::string& device_id, uint64_t version,
                                       uint64_t /*state_digest*/, std::string /*payload*/) {
  absl::StatusOr<StoredPayload> stored = Borrow()->Snapshot(device_id, version);
  if (stored.ok()) return absl::OkStatus();
  if (absl::IsUnavailable(stored.status())) return stored.status();
  return absl::FailedPreconditionError(
      absl::StrCat("the shared store does not hold the snapshot of version ", version, " of ",
                   device_id, ": snapshots are published by their job"));
}

absl::StatusOr<StoredUpdate> PgCloudStore::UpdateAfter(const std::string& device_id,
                                                       uint64_t base_version) const {
  absl::StatusOr<StoredPayload> p = Borrow()->UpdateAfter(device_id, base_version);
  if (!p.ok()) return p.status();
  return ToStoredUpdate(*std::move(p));
}

absl::StatusOr<StoredUpdate> PgCloudStore::Snapshot(const std::string& device_id,
                                                    uint64_t version) const {
  absl::StatusOr<StoredPayload> p = Borrow()->Snapshot(device_id, version);
  if (!p.ok()) return p.status();
  return ToStoredUpdate(*std::move(p));
}

absl::StatusOr<uint64_t> PgCloudStore::Newest(const std::string& device_id) const {
  return Borrow()->LatestVersion(device_id);
}

absl::StatusOr<uint64_t> PgCloudStore::DigestOf(const std::string& device_id,
                                                uint64_t version) const {
  return Borrow()->DigestOf(device_id, version);
}

// ---- PgMirrorStates ---------------------------------------------------------------------------

void PgMirrorStates::Hold(const JobLease& lease) {
  absl::MutexLock lock(&mu_);
  held_[lease.device_id] = Held{lease, false};
}

bool PgMirrorStates::Forget(const std::string& device_id) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(device_id);
  if (it == held_.end()) return false;
  const bool published = it->second.published;
  held_.erase(it);
  return published;
}

absl::StatusOr<internal::MirrorFile> PgMirrorStates::Read(const std::string& device_id) {
  absl::StatusOr<MirrorState> stored = store_->Borrow()->LoadMirror(device_id);
  if (!stored.ok()) return stored.status();
  absl::StatusOr<internal::MirrorFile> f = internal::DecodeMirrorFile(
      stored->state, absl::StrCat("the mirror state of ", device_id, " in PostgreSQL"));
  if (!f.ok()) return f.status();
  if (f->version != stored->version || f->consumed != stored->consumed_sequence) {
    return absl::DataLossError(absl::StrCat("the mirror state of ", device_id,
                                            " in PostgreSQL disagrees with its row's version "
                                            "or cursor"));
  }
  return f;
}

absl::Status PgMirrorStates::Commit(const std::string& device_id, const internal::MirrorFile& state,
                                    bool new_version) {
  JobLease lease;
  {
    absl::MutexLock lock(&mu_);
    auto it = held_.find(device_id);
    if (it == held_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no job lease is held for ", device_id, ": the shared store commits only a leased job"));
    }
    if (it->second.published) {
      return absl::FailedPreconditionError(
          absl::StrCat("the job of ", device_id, " already committed under its lease"));
    }
    lease = it->second.lease;
  }
  if (new_version && state.version == 0) {
    return absl::InvalidArgumentError("a new version cannot be version 0");
  }
  Publication p;
  p.base_version = new_version ? state.version - 1 : state.version;
  p.mirror.version = state.version;
  p.mirror.consumed_sequence = state.consumed;
  p.mirror.state = internal::EncodeMirrorFile(state);
  p.state_digest = state.digest;
  if (new_version) {
    p.update_payload = state.update;
    p.snapshot_payload = state.snapshot;
  }
  if (absl::Status s = store_->Borrow()->Publish(lease, p); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto it = held_.find(device_id);
  if (it != held_.end() && it->second.lease.fencing_token == lease.fencing_token) {
    it->second.published = true;
  }
  return absl::OkStatus();
}

}  // namespace cdcca::cloud::pg
