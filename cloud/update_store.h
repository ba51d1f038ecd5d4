// UpdateStore: the versioned updates and snapshots the cloud serves to each device.
//
// Layout: <dir>/<device_id>/update-<new_version>.pb and snapshot-<version>.pb, each a
// serialized store.v1.StoredPayload in a sealed file (storage/sealed_file.h: kind "UPDS",
// format 2), whose checksum covers the header fields (versions, state digest) as well as
// the payload, written atomically (temp file, fsync, rename, fsync of the directory). A
// file of format 1 (the bare StoredPayload, whose SHA-256 covers only the payload) is still
// read; a file that fails its checks is never served. Updates
// of a device form a chain: update v applies on top of v-1's state (base_version). The store
// keeps the newest `keep_per_device` of each kind and forgets older ones.
//
// The payload bytes are opaque here (a DWC update or a serialized trainable state); the
// store records their SHA-256 and the state digest the device must report once applied.
//
// Thread-safe.
#ifndef CDCCA_CLOUD_UPDATE_STORE_H_
#define CDCCA_CLOUD_UPDATE_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cloud/stores.h"
#include "storage/env.h"

namespace cdcca::cloud {

struct UpdateStoreOptions {
  std::string dir;
  // Updates and snapshots kept per device. Default: 16.
  size_t keep_per_device = 16;
  // Every file call goes through it (not owned; must outlive the store).
  storage::Env* env = storage::Env::Default();
};

class UpdateStore final : public UpdateLog {
 public:
  // Opens (or creates) the store and loads every stored payload's index.
  static absl::StatusOr<std::unique_ptr<UpdateStore>> Open(const UpdateStoreOptions& options);

  // Stores the update that takes `device_id` from base_version to new_version. new_version
  // must be newer than the device's newest update; INVALID_ARGUMENT otherwise.
  absl::Status PutUpdate(const std::string& device_id, uint64_t base_version, uint64_t new_version,
                         uint64_t state_digest, std::string payload) override;

  // Stores the full trainable state of `device_id` at `version`.
  absl::Status PutSnapshot(const std::string& device_id, uint64_t version, uint64_t state_digest,
                           std::string payload) override;

  // The update that applies on top of `base_version`:
  //   NOT_FOUND           nothing newer than base_version exists (the device is current);
  //   FAILED_PRECONDITION base_version is unknown (too old, or ahead of the cloud): resync.
  absl::StatusOr<StoredUpdate> UpdateAfter(const std::string& device_id,
                                           uint64_t base_version) const override;

  // The newest snapshot, or the one of `version` (0 = newest). NOT_FOUND if absent.
  absl::StatusOr<StoredUpdate> Snapshot(const std::string& device_id,
                                        uint64_t version) const override;

  // The newest version the cloud holds for the device (update or snapshot); 0 if none.
  uint64_t LatestVersion(const std::string& device_id) const;
  absl::StatusOr<uint64_t> Newest(const std::string& device_id) const override {
    return LatestVersion(device_id);
  }

  // The state digest recorded for `version` (from its update or snapshot). NOT_FOUND if the
  // store has no record of that version.
  absl::StatusOr<uint64_t> DigestOf(const std::string& device_id, uint64_t version) const override;

 private:
  struct DeviceUpdates {
    std::map<uint64_t, StoredUpdate> updates;    // by new_version
    std::map<uint64_t, StoredUpdate> snapshots;  // by version
  };

  explicit UpdateStore(UpdateStoreOptions options) : options_(std::move(options)) {}
  static uint64_t NewestVersion(const DeviceUpdates& d);
  absl::Status Load();
  absl::Status Put(const std::string& device_id, bool snapshot, StoredUpdate update);

  const UpdateStoreOptions options_;
  mutable absl::Mutex mu_;
  std::unordered_map<std::string, DeviceUpdates> devices_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_UPDATE_STORE_H_
