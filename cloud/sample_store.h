// SampleStore: the cloud's durable, append-only log of what devices uplink.
//
// Records live in segment files `<dir>/seg-<NNNNNNNN>.log`, in the block framing of
// cloud/internal/record_log.h (format 2); a record's body is a serialized
// store.v1.SampleRecord. A background flusher takes every append that is waiting, writes
// them in one go and fdatasyncs once (group commit), then appends a SYNC fragment (not
// synced itself) before it calls any of their callbacks: an ack sent after the callback is
// durable, and every acked record lies before a SYNC fragment unless the process died
// between that write and the acks' leaving (a power loss can drop the SYNC fragment).
//
// Recovery (on open, every segment is scanned):
//   - a torn tail, i.e. everything from the first damage after the newest segment's last
//     SYNC fragment to its end (a group commit that never finished: never acked, so intact
//     records after the damage are dropped too), is truncated, counted in Stats() and
//     listed in Damage();
//   - any other damage (a flipped bit, a bad sector: before the last SYNC fragment, or in
//     an older segment) is damage to acked records: the damaged bytes are skipped, every
//     intact record before and after them is kept, and the range is counted in Stats() and
//     listed in Damage(). The damaged records' batches are lost (their device's sequence has
//     holes there); nothing else is. The scanner resynchronises only at positions no
//     payload can choose, so a record planted inside a device's payload is never taken;
//   - a segment of another format (format 1, which resynchronised by searching a magic) is
//     refused: Open fails with FAILED_PRECONDITION naming the file.
//
// Sequences: each device's batches carry sequence numbers 1, 2, 3, ... A batch at or below
// the device's highest stored sequence is a resend and is not stored again (its callback
// still waits for the group commit in flight, so a resend is acked only once the original is
// durable); a batch that skips ahead is rejected with FAILED_PRECONDITION.
//
// Thread-safe: every method may be called from any thread.
#ifndef CDCCA_CLOUD_SAMPLE_STORE_H_
#define CDCCA_CLOUD_SAMPLE_STORE_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "cloud/stores.h"
#include "proto/store.pb.h"
#include "storage/env.h"

namespace cdcca::cloud {

struct SampleStoreOptions {
  // Directory of the segment files; created if missing.
  std::string dir;
  // A segment is closed and a new one started once it reaches this size. Default: 64 MiB.
  uint64_t segment_bytes = 64ull << 20;
  // fdatasync before acking. Turn off only to measure what syncing costs.
  bool sync = true;
  // Most bytes (framing included) of one device's unreleased records; an append past it
  // fails with RESOURCE_EXHAUSTED. Released records (Release) stop counting at once, so a
  // device whose samples are consumed is never blocked for good. 0 = no quota.
  // Default: 1 GiB.
  uint64_t max_device_bytes = 1ull << 30;
  // Every file call goes through it (not owned; must outlive the store).
  storage::Env* env = storage::Env::Default();
};

// One damaged place found on open: a torn tail (truncated) or a corrupt range (skipped).
struct SampleLogDamage {
  std::string path;  // the segment file
  uint64_t offset = 0;
  uint64_t bytes = 0;
  bool torn_tail = false;
  std::string why;
};

class SampleStore final : public SampleLog {
 public:
  // Opens (or creates) the store in options.dir and rebuilds its index by scanning.
  static absl::StatusOr<std::unique_ptr<SampleStore>> Open(const SampleStoreOptions& options);

  // Finishes every pending append (their callbacks run) and closes the files.
  ~SampleStore();

  SampleStore(const SampleStore&) = delete;
  SampleStore& operator=(const SampleStore&) = delete;

  // Queues `batch` for `device_id`. `done` runs exactly once, on the flusher thread, after the
  // record is durable (or with the error that stopped it). It must not block for long.
  void Append(const std::string& device_id, v1::UplinkBatch batch, AppendCallback done) override;

  // Append() that waits for its callback.
  absl::StatusOr<AppendResult> AppendAndWait(const std::string& device_id, v1::UplinkBatch batch);

  // The device's highest durable sequence; 0 if it has none.
  uint64_t HighestDurable(const std::string& device_id) const;

  // Samples in the device's durable batches with from_sequence <= sequence <= to_sequence,
  // from the index (each batch's sample_count as stored; the service stores only batches
  // whose sample_count equals what their payload holds). Reads no payload.
  uint64_t SampleCount(const std::string& device_id, uint64_t from_sequence,
                       uint64_t to_sequence) const;

  // Bytes of the device's unreleased durable records, framing included: what its quota
  // counts and what it holds on disk (a released record's bytes stay on disk until every
  // record of its segment is released, and are counted nowhere).
  uint64_t DeviceBytes(const std::string& device_id) const;

  // Releases the device's records with sequence <= through_sequence (a job consumed them;
  // the trainer's replay buffer holds its own copies): they stop counting against its quota
  // and are no longer read, and every segment file whose records are all released (the
  // current one aside) is deleted, oldest first. The device's newest record is kept, so a
  // restart still knows its highest sequence. I/O errors deleting a file are returned; the
  // release itself holds.
  absl::Status Release(const std::string& device_id, uint64_t through_sequence) override;

  // The first max_records durable records of `device_id` with sequence >= from_sequence,
  // in order: those that read back intact, and those that do not (each with its DATA_LOSS
  // status). Fails only on an I/O error (open, read), which a later call may not meet.
  absl::StatusOr<StoredBatches> ReadEach(const std::string& device_id, uint64_t from_sequence,
                                         size_t max_records) const override;

  // ReadEach's records; DATA_LOSS if any of them reads back damaged.
  absl::StatusOr<std::vector<store::v1::SampleRecord>> Read(const std::string& device_id,
                                                            uint64_t from_sequence,
                                                            size_t max_records) const;

  // Ids of every device with at least one durable record.
  std::vector<std::string> Devices() const;

  SampleStoreStats Stats() const override;

  // SampleLog's fallible forms of HighestDurable and SampleCount (they cannot fail here).
  absl::StatusOr<uint64_t> Durable(const std::string& device_id) const override {
    return HighestDurable(device_id);
  }
  absl::StatusOr<uint64_t> CountSamples(const std::string& device_id, uint64_t from_sequence,
                                        uint64_t to_sequence) const override {
    return SampleCount(device_id, from_sequence, to_sequence);
  }

  // What recovery found damaged when the store was opened (empty for a clean log).
  std::vector<SampleLogDamage> Damage() const;

 private:
  struct Location {
    uint64_t sequence;
    uint32_t segment;
    uint64_t offset;   // of the record's first fragment
    uint64_t end;      // of its last fragment
    uint32_t samples;  // the batch's sample_count
  };
  // One device's durable records, in sequence order, and their total size.
  struct DeviceLog {
    std::vector<Location> records;
    uint64_t bytes = 0;
  };
  struct Pending {
    std::string device_id;
    v1::UplinkBatch batch;
    AppendCallback done;
  };

  explicit SampleStore(SampleStoreOptions options);
  absl::Status Recover();
  // Opens `segment` for appends; an empty (or new) one gets a header with a new nonce and
  // is synced, else its nonce is `nonce`.
  absl::Status OpenSegmentForAppend(uint32_t segment, uint64_t nonce)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  // Writes `data` at the end of the current segment, then fdatasyncs it if `sync`.
  absl::Status WriteAndSync(absl::string_view data, bool sync)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);
  std::string SegmentPath(uint32_t segment) const;
  void FlushLoop();
  void CommitGroup(std::vector<Pending>& group);

  // Constant after construction.
  const SampleStoreOptions options_;

  // Guards the queue of appends and the flusher's lifetime.
  mutable absl::Mutex queue_mu_;
  std::vector<Pending> queue_ ABSL_GUARDED_BY(queue_mu_);
  bool shutting_down_ ABSL_GUARDED_BY(queue_mu_) = false;
  absl::Status background_error_ ABSL_GUARDED_BY(queue_mu_);

  // Only the flusher (and Recover, before it starts) writes segment files.
  absl::Mutex write_mu_;
  std::unique_ptr<storage::WritableFile> segment_file_ ABSL_GUARDED_BY(write_mu_);
  uint32_t segment_ ABSL_GUARDED_BY(write_mu_) = 0;
  uint64_t segment_size_ ABSL_GUARDED_BY(write_mu_) = 0;
  uint64_t nonce_ ABSL_GUARDED_BY(write_mu_) = 0;  // the current segment's

  // The index of durable records; read by Read/HighestDurable.
  mutable absl::Mutex index_mu_;
  std::unordered_map<std::string, DeviceLog> index_ ABSL_GUARDED_BY(index_mu_);
  // Unreleased records per segment that holds any.
  std::map<uint32_t, uint64_t> live_records_ ABSL_GUARDED_BY(index_mu_);
  // The segment appends go to (never deleted); written under write_mu_ and index_mu_.
  uint32_t current_segment_ ABSL_GUARDED_BY(index_mu_) = 0;
  SampleStoreStats stats_ ABSL_GUARDED_BY(index_mu_);
  std::vector<SampleLogDamage> damage_ ABSL_GUARDED_BY(index_mu_);

  std::thread flusher_;
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_SAMPLE_STORE_H_
