// The cloud's stores as the service (cloud/cloud_service.h) and the trainer
// (cloud/trainer.h) use them, so that one process's files (the embedded default:
// DeviceRegistry, SampleStore, UpdateStore) and a store shared by several processes
// (PostgreSQL: cloud/pg/pg_cloud_store.h) serve the same code.
//
// Contracts (both implementations keep them):
//   - a call returns OK only once what it wrote is durable; an uplink batch is acked only
//     after its Append callback said OK;
//   - a device's batches carry sequences 1, 2, 3, ...; a resend of a stored batch is a
//     duplicate, stored once;
//   - updates form a chain per device (update v applies on v-1's state).
// The calls whose embedded form cannot fail (it answers from memory) still return a status
// here: a shared store answers over the network and says UNAVAILABLE when it cannot.
#ifndef CDCCA_CLOUD_STORES_H_
#define CDCCA_CLOUD_STORES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cloud/internal/mirror_file.h"
#include "proto/cdcca.pb.h"
#include "proto/store.pb.h"

namespace cdcca::cloud {

// ---- device registry ----

class DeviceStore {
 public:
  virtual ~DeviceStore() = default;
  // Records a (re-)registration. FAILED_PRECONDITION for a device that registered before
  // with another model fingerprint.
  virtual absl::StatusOr<store::v1::DeviceRecord> Register(
      const std::string& device_id, uint64_t model_fingerprint,
      const v1::Capabilities& capabilities) = 0;
  // Records the version a device reports it runs, with its digest and whether it matched.
  virtual absl::Status SetApplied(const std::string& device_id, uint64_t version, uint64_t digest,
                                  bool in_sync) = 0;
  // NOT_FOUND if the device never registered.
  virtual absl::StatusOr<store::v1::DeviceRecord> Get(const std::string& device_id) const = 0;
  // Registered devices (for health output; a shared store answers 0 when it cannot count).
  virtual size_t size() const = 0;
};

// ---- sample log ----

struct AppendResult {
  bool duplicate = false;        // the batch was a resend of a stored one
  uint64_t highest_durable = 0;  // the device's highest durable sequence after this
};

struct SampleStoreStats {
  uint64_t records = 0;               // durable records
  uint64_t bytes = 0;                 // bytes of segment files, framing included
  uint64_t group_commits = 0;         // fdatasync calls that made appended records durable
  uint64_t truncated_tail_bytes = 0;  // bytes of torn tail removed on open
  uint64_t damaged_ranges = 0;        // corrupt ranges skipped on open (records after kept)
  uint64_t damaged_bytes = 0;         // their bytes
  uint64_t released_records = 0;      // records released since open (Release)
  uint64_t deleted_segments = 0;      // segment files deleted since open, all records released
};

// A stored batch that reads back damaged (DATA_LOSS): it rotted after it was acked.
struct UnreadableBatch {
  uint64_t sequence = 0;
  uint32_t samples = 0;  // its sample_count, from the index
  absl::Status status;   // DATA_LOSS saying what is wrong
};

struct StoredBatches {
  std::vector<store::v1::SampleRecord> records;  // in sequence order
  std::vector<UnreadableBatch> unreadable;       // in sequence order
};

class SampleLog {
 public:
  using AppendCallback = std::function<void(absl::StatusOr<AppendResult>)>;
  virtual ~SampleLog() = default;
  // Stores `batch` for `device_id`; `done` runs exactly once, off the caller's thread,
  // after the batch is durable (or with the error that stopped it). It must not block for
  // long. FAILED_PRECONDITION for a sequence beyond the highest stored + 1.
  virtual void Append(const std::string& device_id, v1::UplinkBatch batch, AppendCallback done) = 0;
  // The device's highest durable sequence; 0 if it has none.
  virtual absl::StatusOr<uint64_t> Durable(const std::string& device_id) const = 0;
  // Samples in the device's durable batches with from <= sequence <= to (no payload read).
  virtual absl::StatusOr<uint64_t> CountSamples(const std::string& device_id,
                                                uint64_t from_sequence,
                                                uint64_t to_sequence) const = 0;
  // The first max_records durable batches with sequence >= from_sequence, in order: those
  // that read back intact and those that do not (each with its DATA_LOSS status). Fails
  // only on an I/O error a later call may not meet.
  virtual absl::StatusOr<StoredBatches> ReadEach(const std::string& device_id,
                                                 uint64_t from_sequence,
                                                 size_t max_records) const = 0;
  // The device's batches through `through_sequence` were consumed: the log may drop them
  // (the newest is kept, so the highest sequence survives).
  virtual absl::Status Release(const std::string& device_id, uint64_t through_sequence) = 0;
  virtual SampleStoreStats Stats() const = 0;
};

// ---- updates and snapshots ----

// One stored payload. `payload` is shared and immutable, so serving it copies nothing.
struct StoredUpdate {
  uint64_t base_version = 0;  // for snapshots: equal to new_version
  uint64_t new_version = 0;
  uint64_t state_digest = 0;  // digest of the trainable state after applying
  std::string sha256;         // of *payload, 32 raw bytes
  std::shared_ptr<const std::string> payload;
};

class UpdateLog {
 public:
  virtual ~UpdateLog() = default;
  // Stores the update that takes the device from base_version to new_version, which must
  // be newer than its newest (INVALID_ARGUMENT otherwise).
  virtual absl::Status PutUpdate(const std::string& device_id, uint64_t base_version,
                                 uint64_t new_version, uint64_t state_digest,
                                 std::string payload) = 0;
  // Stores the full trainable state of the device at `version`.
  virtual absl::Status PutSnapshot(const std::string& device_id, uint64_t version,
                                   uint64_t state_digest, std::string payload) = 0;
  // The update that applies on top of `base_version`: NOT_FOUND when nothing is newer
  // (the device is current), FAILED_PRECONDITION when base_version is unknown (resync).
  virtual absl::StatusOr<StoredUpdate> UpdateAfter(const std::string& device_id,
                                                   uint64_t base_version) const = 0;
  // The newest snapshot, or the one of `version` (0 = newest). NOT_FOUND if absent.
  virtual absl::StatusOr<StoredUpdate> Snapshot(const std::string& device_id,
                                                uint64_t version) const = 0;
  // The newest version held for the device (update or snapshot); 0 if none.
  virtual absl::StatusOr<uint64_t> Newest(const std::string& device_id) const = 0;
  // The state digest recorded for `version`. NOT_FOUND if no update or snapshot has it.
  virtual absl::StatusOr<uint64_t> DigestOf(const std::string& device_id,
                                            uint64_t version) const = 0;
};

// ---- the trainer's mirror states ----

// Where the trainer commits each device's state (its mirror, version, cursor, residual and
// newest update and snapshot): by default a file per device in the trainer's state
// directory; in a shared store, a row published under the job's lease.
class MirrorStates {
 public:
  virtual ~MirrorStates() = default;
  // The device's committed state; NOT_FOUND if none was committed.
  virtual absl::StatusOr<internal::MirrorFile> Read(const std::string& device_id) = 0;
  // Commits `state` atomically. `new_version`: the state is a new version (its update and
  // snapshot are in it) rather than the same version with its cursor moved. A store that
  // publishes the update with the commit (PublishesOnCommit) does so in the same
  // transaction, and fails with FAILED_PRECONDITION when the job may no longer commit.
  virtual absl::Status Commit(const std::string& device_id, const internal::MirrorFile& state,
                              bool new_version) = 0;
  // True when Commit also publishes the update and snapshot (the UpdateLog then already
  // holds them); false when the trainer publishes them after the commit.
  virtual bool PublishesOnCommit() const = 0;
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_STORES_H_
