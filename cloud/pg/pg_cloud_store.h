// The stores of cloud/stores.h on PostgreSQL (cloud/pg/pg_store.h), for cloud processes
// that share one database (`cdcca-cloud --store postgresql://...`):
//
//   PgCloudStore     the device registry, sample log and updates, on a pool of sessions.
//                    An uplink batch is acked once its transaction committed; appends run
//                    on the pool's sessions concurrently, so PostgreSQL's group commit (one
//                    WAL flush for the commits that wait together) serves many streams.
//                    Nothing of a device is cached: any process serves any device.
//   PgMirrorStates   the trainer's mirror states (MirrorStates). A job's commit publishes
//                    the mirror, the update and the snapshot in one transaction, only while
//                    the process still holds the job's lease (its fencing token): a trainer
//                    that stalled past its lease publishes nothing.
//
// Thread-safe.
#ifndef CDCCA_CLOUD_PG_PG_CLOUD_STORE_H_
#define CDCCA_CLOUD_PG_PG_CLOUD_STORE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cloud/internal/work_pool.h"
#include "cloud/pg/pg_store.h"
#include "cloud/stores.h"

namespace cdcca::cloud::pg {

struct PgCloudStoreOptions {
  // libpq connection string or postgresql:// URI.
  std::string conninfo;
  // Sessions in the pool, and threads that commit appends on them. Default: 4.
  int sessions = 4;
  // Updates and snapshots kept per device (each kind). Default: 16.
  int keep_per_device = 16;
  // Most bytes of one device's stored batches (PgStoreOptions::max_device_bytes): an append
  // past it fails with RESOURCE_EXHAUSTED, which the service answers as a transient QUOTA
  // refusal. 0 = no quota. Default: 1 GiB.
  uint64_t max_device_bytes = 1ull << 30;
};

class PgCloudStore final : public DeviceStore, public SampleLog, public UpdateLog {
 public:
  // Opens the sessions (the first migrates the schema). UNAVAILABLE when the server cannot
  // be reached.
  static absl::StatusOr<std::unique_ptr<PgCloudStore>> Open(const PgCloudStoreOptions& options);
  // Finishes the queued appends (their callbacks run).
  ~PgCloudStore() override;

  // DeviceStore.
  absl::StatusOr<store::v1::DeviceRecord> Register(const std::string& device_id,
                                                   uint64_t model_fingerprint,
                                                   const v1::Capabilities& capabilities) override;
  absl::Status SetApplied(const std::string& device_id, uint64_t version, uint64_t digest,
                          bool in_sync) override;
  absl::StatusOr<store::v1::DeviceRecord> Get(const std::string& device_id) const override;
  size_t size() const override;

  // SampleLog. Release deletes what the device's jobs consumed (the trainer keeps the
  // batches of the update guard's held-out pool, which a restart rebuilds from them) but the
  // device's newest batch. Stats counts this process's appends and releases since it opened
  // the store.
  void Append(const std::string& device_id, v1::UplinkBatch batch, AppendCallback done) override;
  absl::StatusOr<uint64_t> Durable(const std::string& device_id) const override;
  absl::StatusOr<uint64_t> CountSamples(const std::string& device_id, uint64_t from_sequence,
                                        uint64_t to_sequence) const override;
  absl::StatusOr<StoredBatches> ReadEach(const std::string& device_id, uint64_t from_sequence,
                                         size_t max_records) const override;
  absl::Status Release(const std::string& device_id, uint64_t through_sequence) override;
  SampleStoreStats Stats() const override;
  // Every later Append also makes the device's job due, in the append's own statement
  // (PgStore::Append's trigger): what a front's job queue trigger sets before it serves.
  void TriggerJobsOnAppend(AppendTrigger trigger);

  // UpdateLog. Updates are published by the job that made them (PgMirrorStates::Commit):
  // PutUpdate and PutSnapshot only confirm that the store holds that version
  // (FAILED_PRECONDITION otherwise).
  absl::Status PutUpdate(const std::string& device_id, uint64_t base_version, uint64_t new_version,
                         uint64_t state_digest, std::string payload) override;
  absl::Status PutSnapshot(const std::string& device_id, uint64_t version, uint64_t state_digest,
                           std::string payload) override;
  absl::StatusOr<StoredUpdate> UpdateAfter(const std::string& device_id,
                                           uint64_t base_version) const override;
  absl::StatusOr<StoredUpdate> Snapshot(const std::string& device_id,
                                        uint64_t version) const override;
  absl::StatusOr<uint64_t> Newest(const std::string& device_id) const override;
  absl::StatusOr<uint64_t> DigestOf(const std::string& device_id, uint64_t version) const override;

  // A session of the pool for calls this interface does not cover (the job queue, mirror
  // states): held until the returned object is destroyed.
  class Session {
   public:
    Session(Session&& other) noexcept : owner_(other.owner_), store_(other.store_) {
      other.owner_ = nullptr;
    }
    ~Session();
    PgStore* operator->() const { return store_; }
    PgStore& operator*() const { return *store_; }

   private:
    friend class PgCloudStore;
    Session(const PgCloudStore* owner, PgStore* store) : owner_(owner), store_(store) {}
    const PgCloudStore* owner_;
    PgStore* store_;
  };
  Session Borrow() const;

 private:
  PgCloudStore();
  void GiveBack(PgStore* store) const;

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<PgStore>> sessions_;
  mutable std::vector<PgStore*> idle_ ABSL_GUARDED_BY(mu_);
  std::optional<AppendTrigger> trigger_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> appended_records_{0};
  std::atomic<uint64_t> appended_bytes_{0};
  std::atomic<uint64_t> released_records_{0};
  std::unique_ptr<internal::WorkPool> appends_;  // destroyed first: its closures borrow
};

// The trainer's MirrorStates on the shared store. A process commits a device's state only
// while it holds that device's job lease (Hold); the commit is PgStore::Publish under it,
// and ends the lease.
class PgMirrorStates final : public MirrorStates {
 public:
  explicit PgMirrorStates(PgCloudStore* store) : store_(store) {}

  // The lease under which the next Commit of lease.device_id publishes.
  void Hold(const JobLease& lease);
  // Forgets the device's lease; true when a Commit published under it.
  bool Forget(const std::string& device_id);

  absl::StatusOr<internal::MirrorFile> Read(const std::string& device_id) override;
  // FAILED_PRECONDITION when no lease is held for the device, or the lease is no longer
  // the job's (expired, or another trainer took the job): nothing is written then.
  absl::Status Commit(const std::string& device_id, const internal::MirrorFile& state,
                      bool new_version) override;
  bool PublishesOnCommit() const override { return true; }

 private:
  struct Held {
    JobLease lease;
    bool published = false;
  };
  PgCloudStore* const store_;
  absl::Mutex mu_;
  std::map<std::string, Held> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cdcca::cloud::pg

#endif  // CDCCA_CLOUD_PG_PG_CLOUD_STORE_H_
