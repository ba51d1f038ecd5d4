#include "cloud/device_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "proto/wire.h"
#include "storage/sealed_file.h"

namespace cdcca::cloud {
namespace {

constexpr uint32_t kSealKind = storage::SealKind("DREG");
constexpr uint32_t kSealFormat = 2;

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceRegistry>> DeviceRegistry::Open(const std::string& dir,
                                                                     storage::Env* env) {
  if (env == nullptr) return absl::InvalidArgumentError("DeviceRegistry: env is null");
  if (absl::Status s = env->CreateDirs(dir); !s.ok()) return s;
  std::unique_ptr<DeviceRegistry> registry(new DeviceRegistry(dir, env));
  if (absl::Status s = registry->Load(); !s.ok()) return s;
  return registry;
}

absl::Status DeviceRegistry::Load() {
  absl::StatusOr<std::vector<std::string>> files = env_->ListFiles(dir_);
  if (!files.ok()) return files.status();
  absl::MutexLock lock(&mu_);
  for (const std::string& name : *files) {
    if (name.size() < 4 || name.substr(name.size() - 3) != ".pb") continue;
    const std::string path = absl::StrCat(dir_, "/", name);
    absl::StatusOr<std::string> bytes = storage::ReadFile(*env_, path);
    if (!bytes.ok()) return bytes.status();
    // Format 1 files are the bare message; format 2 seals it.
    absl::StatusOr<absl::string_view> body = absl::string_view(*bytes);
    if (storage::IsSealed(*bytes)) body = storage::Unseal(*bytes, kSealKind, kSealFormat, path);
    if (!body.ok()) {
      return absl::DataLossError(
          absl::StrCat("device registry file is damaged: ", body.status().message()));
    }
    store::v1::DeviceRecord record;
    if (!record.ParseFromArray(body->data(), static_cast<int>(body->size())) ||
        absl::StrCat(record.device_id(), ".pb") != name) {
      return absl::DataLossError(absl::StrCat("device registry file ", path, " is damaged"));
    }
    devices_[record.device_id()] = std::move(record);
  }
  return absl::OkStatus();
}

absl::Status DeviceRegistry::Persist(const store::v1::DeviceRecord& record) {
  return storage::WriteFileAtomically(
      *env_, absl::StrCat(dir_, "/", record.device_id(), ".pb"),
      storage::Seal(kSealKind, kSealFormat, record.SerializeAsString()));
}

absl::StatusOr<store::v1::DeviceRecord> DeviceRegistry::Register(
    const std::string& device_id, uint64_t model_fingerprint,
    const v1::Capabilities& capabilities) {
  if (absl::Status s = wire::ValidateDeviceId(device_id); !s.ok()) return s;
  const int64_t now = absl::ToUnixMillis(absl::Now());
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device_id);
  store::v1::DeviceRecord record;
  if (it != devices_.end()) {
    record = it->second;
    if (record.model_fingerprint() != model_fingerprint) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "device %s registered before with model fingerprint %016x, now %016x: it runs a "
          "different base model",
          device_id, record.model_fingerprint(), model_fingerprint));
    }
  } else {
    record.set_device_id(device_id);
    record.set_model_fingerprint(model_fingerprint);
    record.set_registered_unix_ms(now);
    record.set_in_sync(true);
  }
  *record.mutable_capabilities() = capabilities;
  record.set_last_seen_unix_ms(now);
  if (absl::Status s = Persist(record); !s.ok()) return s;
  devices_[device_id] = record;
  return record;
}

absl::Status DeviceRegistry::SetApplied(const std::string& device_id, uint64_t version,
                                        uint64_t digest, bool in_sync) {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device_id);
  if (it == devices_.end()) {
    return absl::NotFoundError(absl::StrCat("device ", device_id, " is not registered"));
  }
  store::v1::DeviceRecord record = it->second;
  record.set_applied_version(version);
  record.set_applied_digest(digest);
  record.set_in_sync(in_sync);
  record.set_last_seen_unix_ms(absl::ToUnixMillis(absl::Now()));
  if (absl::Status s = Persist(record); !s.ok()) return s;
  it->second = std::move(record);
  return absl::OkStatus();
}

absl::StatusOr<store::v1::DeviceRecord> DeviceRegistry::Get(const std::string& device_id) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(device_id);
  if (it == devices_.end()) {
    return absl::NotFoundError(absl::StrCat("device ", device_id, " is not registered"));
  }
  return it->second;
}

std::vector<std::string> DeviceRegistry::DeviceIds() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, r] : devices_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

size_t DeviceRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return devices_.size();
}

}  // namespace cdcca::cloud
