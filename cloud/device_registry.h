// DeviceRegistry: what the cloud remembers of each device across restarts (fingerprint,
// capabilities, the version it last reported and whether its digest matched).
//
// One file per device, <dir>/<device_id>.pb: a store.v1.DeviceRecord in a sealed file
// (storage/sealed_file.h: kind "DREG", format 2), written atomically. A file of format 1
// (the bare DeviceRecord, no checksum) is still read and is sealed at its next write; a
// file that fails its checks makes Open fail with DATA_LOSS naming it.
// Thread-safe.
#ifndef CDCCA_CLOUD_DEVICE_REGISTRY_H_
#define CDCCA_CLOUD_DEVICE_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cloud/stores.h"
#include "proto/store.pb.h"
#include "storage/env.h"

namespace cdcca::cloud {

class DeviceRegistry final : public DeviceStore {
 public:
  // Every file call goes through `env` (not owned; must outlive the registry).
  static absl::StatusOr<std::unique_ptr<DeviceRegistry>> Open(
      const std::string& dir, storage::Env* env = storage::Env::Default());

  // Records a (re-)registration. A device that registered before with another model
  // fingerprint gets FAILED_PRECONDITION: its base model differs from the one it had.
  absl::StatusOr<store::v1::DeviceRecord> Register(const std::string& device_id,
                                                   uint64_t model_fingerprint,
                                                   const v1::Capabilities& capabilities) override;

  // Records the version a device reports it runs, with its digest and whether it matched.
  absl::Status SetApplied(const std::string& device_id, uint64_t version, uint64_t digest,
                          bool in_sync) override;

  // NOT_FOUND if the device never registered.
  absl::StatusOr<store::v1::DeviceRecord> Get(const std::string& device_id) const override;

  std::vector<std::string> DeviceIds() const;
  size_t size() const override;

 private:
  DeviceRegistry(std::string dir, storage::Env* env) : dir_(std::move(dir)), env_(env) {}
  absl::Status Load();
  absl::Status Persist(const store::v1::DeviceRecord& record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string dir_;
  storage::Env* const env_;
  mutable absl::Mutex mu_;
  std::unordered_map<std::string, store::v1::DeviceRecord> devices_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_DEVICE_REGISTRY_H_
