#include "cloud/update_store.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "proto/store.pb.h"
#include "proto/wire.h"
#include "storage/sealed_file.h"

namespace cdcca::cloud {
namespace {

constexpr char kUpdatePrefix[] = "update-";
constexpr char kSnapshotPrefix[] = "snapshot-";
constexpr char kSuffix[] = ".pb";
constexpr uint32_t kSealKind = storage::SealKind("UPDS");
constexpr uint32_t kSealFormat = 2;

std::string FileName(bool snapshot, uint64_t version) {
  return absl::StrFormat("%s%020u%s", snapshot ? kSnapshotPrefix : kUpdatePrefix, version, kSuffix);
}

// Parses "update-<20 digits>.pb" / "snapshot-<20 digits>.pb".
bool ParseFileName(const std::string& name, bool* snapshot, uint64_t* version) {
  absl::string_view rest = name;
  if (rest.size() < 4 || rest.substr(rest.size() - 3) != kSuffix) return false;
  rest.remove_suffix(3);
  if (rest.rfind(kUpdatePrefix, 0) == 0) {
    *snapshot = false;
    rest.remove_prefix(sizeof(kUpdatePrefix) - 1);
  } else if (rest.rfind(kSnapshotPrefix, 0) == 0) {
    *snapshot = true;
    rest.remove_prefix(sizeof(kSnapshotPrefix) - 1);
  } else {
    return false;
  }
  return rest.size() == 20 && absl::SimpleAtoi(rest, version);
}

}  // namespace

absl::StatusOr<std::unique_ptr<UpdateStore>> UpdateStore::Open(const UpdateStoreOptions& options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("UpdateStore: dir is empty");
  if (options.keep_per_device == 0) {
    return absl::InvalidArgumentError("UpdateStore: keep_per_device must be at least 1");
  }
  if (options.env == nullptr) return absl::InvalidArgumentError("UpdateStore: env is null");
  if (absl::Status s = options.env->CreateDirs(options.dir); !s.ok()) return s;
  std::unique_ptr<UpdateStore> store(new UpdateStore(options));
  if (absl::Status s = store->Load(); !s.ok()) return s;
  return store;
}

absl::Status UpdateStore::Load() {
  absl::StatusOr<std::vector<std::string>> device_dirs = options_.env->ListDirs(options_.dir);
  if (!device_dirs.ok()) return device_dirs.status();
  absl::MutexLock lock(&mu_);
  for (const std::string& device_id : *device_dirs) {
    if (!wire::ValidateDeviceId(device_id).ok()) continue;
    const std::string dir = absl::StrCat(options_.dir, "/", device_id);
    absl::StatusOr<std::vector<std::string>> files = options_.env->ListFiles(dir);
    if (!files.ok()) return files.status();
    for (const std::string& name : *files) {
      bool snapshot = false;
      uint64_t version = 0;
      if (!ParseFileName(name, &snapshot, &version)) continue;  // temp files of a crash
      const std::string path = absl::StrCat(dir, "/", name);
      absl::StatusOr<std::string> bytes = storage::ReadFile(*options_.env, path);
      if (!bytes.ok()) return bytes.status();
      // Format 1 files are the bare message; format 2 seals it.
      absl::StatusOr<absl::string_view> body = absl::string_view(*bytes);
      if (storage::IsSealed(*bytes)) body = storage::Unseal(*bytes, kSealKind, kSealFormat, path);
      store::v1::StoredPayload stored;
      if (!body.ok() || !stored.ParseFromArray(body->data(), static_cast<int>(body->size())) ||
          stored.device_id() != device_id || stored.new_version() != version ||
          wire::Sha256(stored.payload()) != stored.sha256()) {
        // Written atomically, so damage here is not a torn write: keep serving the rest and
        // leave the file for an operator, but never serve it.
        continue;
      }
      StoredUpdate u;
      u.base_version = stored.base_version();
      u.new_version = stored.new_version();
      u.state_digest = stored.state_digest();
      u.sha256 = stored.sha256();
      u.payload = std::make_shared<const std::string>(std::move(*stored.mutable_payload()));
      DeviceUpdates& d = devices_[device_id];
      (snapshot ? d.snapshots : d.updates)[version] = std::move(u);
    }
  }
  return absl::OkStatus();
}

absl::Status UpdateStore::PutUpdate(const std::string& device_id, uint64_t base_version,
                                    uint64_t new_version, uint64_t state_digest,
                                    std::string payload) {
  if (new_version <= base_version) {
    return absl::InvalidArgumentError(
        absl::StrCat("update version ", new_version, " is not newer than its base ", base_version));
  }
  StoredUpdate u{base_version, new_version, state_digest, "", nullptr};
  u.payload = std::make_shared<const std::string>(std::move(payload));
  return Put(device_id, /*snapshot=*/false, std::move(u));
}

absl::Status UpdateStore::PutSnapshot(const std::string& device_id, uint64_t version,
                                      uint64_t state_digest, std::string payload) {
  StoredUpdate u{version, version, state_digest, "", nullptr};
  u.payload = std::make_shared<const std::string>(std::move(payload));
  return Put(device_id, /*snapshot=*/true, std::move(u));
}

absl::Status UpdateStore::Put(const std::string& device_id, bool snapshot, StoredUpdate u) {
  if (absl::Status s = wire::ValidateDeviceId(device_id); !s.ok()) return s;
  if (u.payload->size() > wire::kMaxPayloadBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload of ", u.payload->size(), " bytes exceeds ", wire::kMaxPayloadBytes));
  }
  u.sha256 = wire::Sha256(*u.payload);
  absl::MutexLock lock(&mu_);
  DeviceUpdates& d = devices_[device_id];
  auto& kind = snapshot ? d.snapshots : d.updates;
  if (!snapshot && !kind.empty() && u.new_version <= kind.rbegin()->first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "update version ", u.new_version, " is not newer than the stored ", kind.rbegin()->first));
  }
  store::v1::StoredPayload stored;
  stored.set_device_id(device_id);
  stored.set_base_version(u.base_version);
  stored.set_new_version(u.new_version);
  stored.set_state_digest(u.state_digest);
  stored.set_sha256(u.sha256);
  stored.set_payload(*u.payload);
  stored.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
  const std::string dir = absl::StrCat(options_.dir, "/", device_id);
  if (absl::Status s = options_.env->CreateDirs(dir); !s.ok()) return s;
  if (absl::Status s = storage::WriteFileAtomically(
          *options_.env, absl::StrCat(dir, "/", FileName(snapshot, u.new_version)),
          storage::Seal(kSealKind, kSealFormat, stored.SerializeAsString()));
      !s.ok()) {
    return s;
  }
  kind[u.new_version] = std::move(u);
  while (kind.size() > options_.keep_per_device) {
    // Best effort: a file left behind is loaded again at the next start and trimmed by
    // the next Put.
    (void)options_.env->Remove(absl::StrCat(dir, "/", FileName(snapshot, kind.begin()->first)));
    kind.erase(kind.begin());
  }
  return absl::OkStatus();
}

absl::StatusOr<StoredUpdate> UpdateStore::UpdateAfter(const std::string& device_id,
                                                      uint64_t base_version) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device_id);
  const uint64_t latest = it == devices_.end() ? 0 : NewestVersion(it->second);
  if (base_version == latest) {
    return absl::NotFoundError(absl::StrCat("no update newer than version ", base_version));
  }
  if (base_version > latest) {
    return absl::FailedPreconditionError(absl::StrCat("device reports version ", base_version,
                                                      " but the cloud's newest is ", latest,
                                                      "; fetch a snapshot to resync"));
  }
  for (const auto& [version, u] : it->second.updates) {
    if (u.base_version == base_version) return u;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("no stored update applies on top of version ", base_version,
                   " (too old or unknown); fetch a snapshot to resync"));
}

absl::StatusOr<StoredUpdate> UpdateStore::Snapshot(const std::string& device_id,
                                                   uint64_t version) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device_id);
  if (it == devices_.end() || it->second.snapshots.empty()) {
    return absl::NotFoundError(absl::StrCat("no snapshot for device ", device_id));
  }
  if (version == 0) return it->second.snapshots.rbegin()->second;
  auto s = it->second.snapshots.find(version);
  if (s == it->second.snapshots.end()) {
    return absl::NotFoundError(
        absl::StrCat("no snapshot of version ", version, " for device ", device_id));
  }
  return s->second;
}

uint64_t UpdateStore::LatestVersion(const std::string& device_id) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device_id);
  return it == devices_.end() ? 0 : NewestVersion(it->second);
}

uint64_t UpdateStore::NewestVersion(const DeviceUpdates& d) {
  uint64_t v = 0;
  if (!d.updates.empty()) v = d.updates.rbegin()->first;
  if (!d.snapshots.empty()) v = std::max(v, d.snapshots.rbegin()->first);
  return v;
}

absl::StatusOr<uint64_t> UpdateStore::DigestOf(const std::string& device_id,
                                               uint64_t version) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device_id);
  if (it != devices_.end()) {
    if (auto u = it->second.updates.find(version); u != it->second.updates.end()) {
      return u->second.state_digest;
    }
    if (auto s = it->second.snapshots.find(version); s != it->second.snapshots.end()) {
      return s->second.state_digest;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no record of version ", version, " for device ", device_id));
}

}  // namespace cdcca::cloud
