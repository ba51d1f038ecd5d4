// PgStore: the cloud's state in PostgreSQL, so that several cloud processes (fronts that
// serve devices, trainers that run jobs) share one store: the device registry, the sample
// log, the trainers' mirror states, the updates served to devices, and the job queue.
//
// It keeps the contracts of the embedded stores (cloud/sample_store.h,
// cloud/update_store.h, cloud/device_registry.h):
//   - a call returns OK only after its transaction committed (with the server's default
//     synchronous_commit, durably): an uplink batch is acked after its commit;
//   - a device's batches carry sequences 1, 2, 3, ...; a resend is stored once (primary key
//     (device_id, sequence)) and reported as a duplicate only once the original committed;
//     a batch that skips ahead is refused with FAILED_PRECONDITION;
//   - updates form a chain per device (update v applies on v-1's state); UpdateAfter says
//     NOT_FOUND when the device is current and FAILED_PRECONDITION when it must resync.
// Across processes, the job queue hands each due job to one trainer at a time: a lease with
// an expiry, renewed by heartbeats, and a fencing token that grows with every lease. A
// trainer publishes its job's result (mirror state, update, the job's end) in one
// transaction that first checks it still holds the lease with its token; a trainer that
// stalled past its lease (taken over or not) publishes nothing.
//
// Values: sequences and versions must be below 2^63 (INVALID_ARGUMENT otherwise); digests
// and fingerprints use all 64 bits (stored bit-cast in bigint). Device ids are checked by
// the caller (wire::ValidateDeviceId).
//
// Errors: those of cloud/pg/connection.h. After UNAVAILABLE the outcome of the call's
// transaction is unknown (the connection dropped around COMMIT); the next call reconnects
// (and is UNAVAILABLE while the server cannot be reached). Every call here is idempotent or
// checked against the stored state, so retrying one that may have committed is safe: a
// resent batch is a duplicate, a republished job fails its lease check.
//
// Thread-safe; the calls of one store are serialized on its one connection: open a store
// per thread that needs to run in parallel.
#ifndef CDCCA_CLOUD_PG_PG_STORE_H_
#define CDCCA_CLOUD_PG_PG_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cloud/pg/connection.h"
#include "proto/cdcca.pb.h"
#include "proto/store.pb.h"

namespace cdcca::cloud::pg {

struct PgStoreOptions {
  // libpq connection string or postgresql:// URI.
  std::string conninfo;
  // Updates and snapshots kept per device (each kind); older ones are deleted by Publish.
  // Default: 16.
  int keep_per_device = 16;
  // Most bytes of one device's stored batches (the serialized batches its rows hold); an
  // Append past it fails with RESOURCE_EXHAUSTED, as the embedded sample log's quota
  // (SampleStoreOptions::max_device_bytes). Release deletes consumed rows, so a device whose
  // samples are consumed is never blocked for good. 0 = no quota. Default: 1 GiB.
  uint64_t max_device_bytes = 1ull << 30;
};

// A front's job trigger, taken in the append's own statement (PgStore::Append): the device's
// job is due now once min_samples samples lie past its mirror's cursor, else max_wait after a
// batch when any do (InfiniteDuration: only the former).
struct AppendTrigger {
  uint64_t min_samples = 1;
  absl::Duration max_wait = absl::InfiniteDuration();
};

struct AppendOutcome {
  bool duplicate = false;         // the batch was a resend of a stored one
  uint64_t highest_sequence = 0;  // the device's highest stored sequence after the call
};

// A trainer's mirror of one device, as the trainer last published it.
struct MirrorState {
  uint64_t version = 0;            // the version of the last update published
  uint64_t consumed_sequence = 0;  // the highest uplink sequence its jobs consumed
  std::string state;               // opaque to the store (the trainer's serialized state)
};

// One stored update or snapshot.
struct StoredPayload {
  bool snapshot = false;
  uint64_t base_version = 0;  // for snapshots: equal to new_version
  uint64_t new_version = 0;
  uint64_t state_digest = 0;  // digest of the trainable state after applying
  std::string sha256;         // of payload, 32 raw bytes (computed by the server)
  std::string payload;
};

// A job leased to one trainer. The fencing token is the job row's, incremented by every
// lease, so a newer lease of the same job always has a larger token.
struct JobLease {
  std::string device_id;
  std::string owner;
  int64_t fencing_token = 0;
  absl::Time expires_at;  // the server's clock
  // LeaseJob: how long the job had been due when it was leased (its wait in the queue, on
  // the server's clock); zero for LeaseDeviceJob.
  absl::Duration waited = absl::ZeroDuration();
};

// What a job publishes: the mirror after it, and the update it made (if any).
struct Publication {
  // The mirror's version before the job: the stored mirror's (0 when none is stored yet).
  uint64_t base_version = 0;
  // The mirror after the job. Its version is base_version when the job shipped no update
  // (nothing trained, or the update was withheld); else the update's new version.
  MirrorState mirror;
  // The update from base_version to mirror.version, with the state digest after it;
  // nullopt when the job shipped no update.
  std::optional<std::string> update_payload;
  uint64_t state_digest = 0;
  // The full state at mirror.version (with state_digest), served to devices that resync;
  // nullopt = none this time.
  std::optional<std::string> snapshot_payload;
};

class PgStore {
 public:
  // Connects and migrates the schema to the newest version (cloud/pg/schema.h).
  static absl::StatusOr<std::unique_ptr<PgStore>> Open(const PgStoreOptions& options);

  PgStore(const PgStore&) = delete;
  PgStore& operator=(const PgStore&) = delete;

  // ---- device registry ----

  // Records a (re-)registration: a new device is stored in sync at version 0; a known one
  // gets its capabilities and last-seen time updated. FAILED_PRECONDITION when the device
  // registered before with another model fingerprint (nothing is changed then).
  absl::StatusOr<store::v1::DeviceRecord> Register(const std::string& device_id,
                                                   uint64_t model_fingerprint,
                                                   const v1::Capabilities& capabilities);
  // Records the version the device reports it runs, its digest and whether it matched.
  // NOT_FOUND if the device never registered.
  absl::Status SetApplied(const std::string& device_id, uint64_t version, uint64_t digest,
                          bool in_sync);
  // NOT_FOUND if the device never registered.
  absl::StatusOr<store::v1::DeviceRecord> GetDevice(const std::string& device_id);
  // Registered devices.
  absl::StatusOr<uint64_t> DeviceCount();
  // Stores the SHA-256 of the device's bearer token (32 bytes), replacing any earlier one.
  // NOT_FOUND if the device never registered; ALREADY_EXISTS if another device has it.
  absl::Status SetTokenHash(const std::string& device_id, const std::string& token_sha256);
  // The device whose token has this SHA-256; NOT_FOUND if none.
  absl::StatusOr<std::string> DeviceForTokenHash(const std::string& token_sha256);

  // ---- sample log ----

  // Stores `batch` (without its `dropped` list, which is reported once and not stored) for
  // `device_id`, or finds it stored: returns after the commit. A batch whose sequence is at
  // or below the device's highest stored one is a duplicate, not stored again (and reported
  // only once the original committed). FAILED_PRECONDITION for a sequence beyond the
  // highest + 1, INVALID_ARGUMENT for sequence 0, RESOURCE_EXHAUSTED when storing it would
  // take the device's stored batches past options.max_device_bytes (nothing is stored).
  // With `trigger`, the statement that stores the batch also makes the device's job due as
  // TriggerJob would after it: one statement and one commit per batch, and no stored batch
  // without its trigger.
  absl::StatusOr<AppendOutcome> Append(const std::string& device_id, const v1::UplinkBatch& batch,
                                       const std::optional<AppendTrigger>& trigger = std::nullopt);
  // The device's highest stored sequence; 0 if it has none.
  absl::StatusOr<uint64_t> HighestSequence(const std::string& device_id);
  // The device's first `max_batches` stored batches with sequence > after_sequence, in
  // sequence order (a job reads after its mirror's consumed_sequence).
  absl::StatusOr<std::vector<store::v1::SampleRecord>> ReadBatches(const std::string& device_id,
                                                                   uint64_t after_sequence,
                                                                   int max_batches);
  // Deletes the device's batches with sequence <= through_sequence (its jobs consumed them),
  // except its newest, which keeps its highest sequence; returns how many were deleted.
  absl::StatusOr<uint64_t> Release(const std::string& device_id, uint64_t through_sequence);
  // Samples in the device's stored batches with from_sequence <= sequence <= to_sequence
  // (each batch's sample_count); reads no payload.
  absl::StatusOr<uint64_t> SampleCount(const std::string& device_id, uint64_t from_sequence,
                                       uint64_t to_sequence);

  // ---- mirrors and updates ----

  // The device's mirror as last published; NOT_FOUND if no job published one.
  absl::StatusOr<MirrorState> LoadMirror(const std::string& device_id);
  // LoadMirror's version and cursor without the state (state is empty).
  absl::StatusOr<MirrorState> MirrorCursor(const std::string& device_id);
  // The update that applies on top of `base_version`: NOT_FOUND when nothing newer exists
  // (the device is current); FAILED_PRECONDITION when base_version is unknown (too old,
  // or ahead of the cloud): the device must resync from a snapshot.
  absl::StatusOr<StoredPayload> UpdateAfter(const std::string& device_id, uint64_t base_version);
  // The newest snapshot, or the one of `version` (0 = newest). NOT_FOUND if absent.
  absl::StatusOr<StoredPayload> Snapshot(const std::string& device_id, uint64_t version);
  // The newest version stored for the device (update or snapshot); 0 if none.
  absl::StatusOr<uint64_t> LatestVersion(const std::string& device_id);
  // The state digest of `version` (from its update or snapshot); NOT_FOUND if neither is
  // stored.
  absl::StatusOr<uint64_t> DigestOf(const std::string& device_id, uint64_t version);

  // ---- job queue ----

  // Makes the device's job due at `due_at`, or earlier if it already was due earlier. A
  // job being run stays leased; it stays due after its publication if samples remain
  // beyond what it consumed (Publish).
  absl::Status ScheduleJob(const std::string& device_id, absl::Time due_at);
  // A front's trigger after a stored batch, in one statement: makes the device's job due
  // now when at least min_samples samples lie past its mirror's cursor, else due after
  // max_wait when any do (InfiniteDuration: only the former), or earlier if it already was.
  absl::Status TriggerJob(const std::string& device_id, uint64_t min_samples,
                          absl::Duration max_wait);
  // Leases the job due longest ago that no live lease holds (never leased, released, or
  // with its lease expired), for `lease` from now (server clock), to `owner`: its fencing
  // token is incremented and returned. nullopt when no job is due now; under contention it
  // may also say nullopt while a job is due (another trainer took the row it looked at):
  // call again later. Two calls never get the same job while the first's lease lives.
  absl::StatusOr<std::optional<JobLease>> LeaseJob(const std::string& owner, absl::Duration lease);
  // Leases `device_id`'s job whether it is due or not (work on the device outside a job, such
  // as a rollback, under the same lease and fencing as a job). nullopt while another lease of
  // it lives (a job of the device runs): call again later.
  absl::StatusOr<std::optional<JobLease>> LeaseDeviceJob(const std::string& device_id,
                                                         const std::string& owner,
                                                         absl::Duration lease);
  // Extends a live lease to `lease` from now and updates lease->expires_at.
  // FAILED_PRECONDITION when the lease is no longer held (expired, or another trainer's
  // newer lease replaced it); the trainer must then stop the job and publish nothing.
  absl::Status Heartbeat(JobLease* lease, absl::Duration lease_duration);
  // Gives a live lease back without publishing: the job is due again at `due_at` (a failed
  // job's retry); with absl::InfiniteFuture() (the lease found nothing to do) it is due now
  // if samples lie past the mirror's cursor (a batch stored while the lease was held) and
  // not due otherwise. FAILED_PRECONDITION when the lease is no longer held.
  absl::Status ReleaseLease(const JobLease& lease, absl::Time due_at);
  // Publishes a job's result in one transaction: the device's mirror state, the update
  // from base_version (if any), the snapshot (if any), the pruning of older updates and
  // snapshots, and the job's end (the lease is cleared; the job stays due only when
  // samples beyond mirror.consumed_sequence are stored). Before any write, the transaction
  // locks the job row and checks that `lease` is still held: same owner and fencing token,
  // not expired on the server's clock; FAILED_PRECONDITION otherwise, and nothing is
  // written. Also FAILED_PRECONDITION when the stored mirror's version is not
  // base_version; INVALID_ARGUMENT for a version that does not follow (an update's new
  // version must be above base_version, no update's must equal it). Any failure writes
  // nothing.
  absl::Status Publish(const JobLease& lease, const Publication& publication);

  // Test-only: the store's connection (its statement hook injects faults).
  Connection* connection_for_testing() { return conn_.get(); }

 private:
  PgStore(PgStoreOptions options, std::unique_ptr<Connection> conn)
      : options_(std::move(options)), conn_(std::move(conn)) {}
  // Reopens the session if the last call lost it.
  absl::Status ReconnectIfLost() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint64_t> HighestSequenceLocked(const std::string& device_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint64_t> LatestVersionLocked(const std::string& device_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StoredPayload> PayloadRow(const Result& result, int row);
  // The device's mirror row; its state only `with_state` (LoadMirror and MirrorCursor).
  absl::StatusOr<MirrorState> ReadMirror(const std::string& device_id, bool with_state);
  // FAILED_PRECONDITION unless the job row of lease.device_id, locked FOR UPDATE by this
  // call (inside the caller's transaction), still holds `lease`.
  absl::Status LockHeldLease(const JobLease& lease) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PgStoreOptions options_;
  absl::Mutex mu_;
  const std::unique_ptr<Connection> conn_ ABSL_PT_GUARDED_BY(mu_);
};

}  // namespace cdcca::cloud::pg

#endif  // CDCCA_CLOUD_PG_PG_STORE_H_
