// UplinkQueue: the device's on-disk queue of encoded uplink batches waiting for the cloud's
// durable ack. It survives restarts, is bounded, and numbers batches with the contiguous
// per-device sequence the wire contract wants (1, 2, 3, ...).
//
// Layout in `dir`: one file per batch, "batch-<slot, 20 digits>.pb" (a serialized
// v1::UplinkBatch whose sequence is its slot), plus "acked": "<slot> <offset>" in decimal,
// each in a sealed file (storage/sealed_file.h: kinds "UPLQ" and "UPLA", format 2) written
// atomically (temp, fsync, rename, fsync of the directory). Files of format 1 (the bare
// message or text, no checksum) are still read; a damaged file makes Open fail with
// DATA_LOSS naming it. Every slot up to <slot> is gone from the queue
// (acked by the cloud, or dropped as refused for good), and a batch in slot s travels under
// sequence s - <offset>. Slots never change; the offset grows when the numbering must move
// back (a batch dropped, the cloud's lost tail), so renumbering the whole queue is one
// durable write. A file written before the offset existed holds the slot alone (offset 0).
//
// A batch file is removed only after the cloud acked it (or refused it for good), so nothing
// is lost between enqueue and ack; a batch resent after a crash is dropped by the cloud as a
// duplicate. When the queue is full, Enqueue refuses the new batch (RESOURCE_EXHAUSTED)
// rather than dropping queued ones.
//
// Thread-safe.
#ifndef CDCCA_DEVICE_UPLINK_QUEUE_H_
#define CDCCA_DEVICE_UPLINK_QUEUE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/cdcca.pb.h"
#include "storage/env.h"

namespace cdcca::device {

struct UplinkQueueOptions {
  std::string dir;  // created if missing
  // Bounds of what waits for an ack. Defaults: 64 MiB and 4096 batches.
  uint64_t max_bytes = 64ull << 20;
  size_t max_batches = 4096;
  // Every file call goes through it (not owned; must outlive the queue).
  storage::Env* env = storage::Env::Default();
};

struct UplinkQueueStats {
  size_t batches = 0;          // waiting for an ack
  uint64_t bytes = 0;          // payload bytes waiting
  uint64_t acked = 0;          // highest sequence acked durable by the cloud
  uint64_t next_sequence = 0;  // what the next Enqueue gets
  uint64_t refused = 0;        // Enqueue calls refused because the queue was full
  uint64_t dropped = 0;        // batches DropFront removed (this process)
  uint64_t renumbered = 0;     // times Reconcile moved the numbering back (this process)
};

class UplinkQueue {
 public:
  // Opens the queue and loads what a previous run left (temp files of a crash are removed).
  static absl::StatusOr<std::unique_ptr<UplinkQueue>> Open(const UplinkQueueOptions& options);

  // Stores a batch durably with the next sequence and returns that sequence.
  // RESOURCE_EXHAUSTED when the bounds would be exceeded.
  absl::StatusOr<uint64_t> Enqueue(uint64_t model_version, uint32_t sample_count,
                                   uint32_t codec_version, std::string payload);

  // The oldest waiting batches, in sequence order: at most `max_batches`, and at most
  // `max_bytes` of payload (but always at least one if any waits).
  std::vector<v1::UplinkBatch> Peek(size_t max_batches, uint64_t max_bytes) const;

  // The cloud holds every batch up to `highest_durable`: their files are removed.
  absl::Status Acknowledge(uint64_t highest_durable);

  // The cloud refused batch `sequence` for good: it leaves the queue, and every batch
  // behind it moves one sequence down (the next takes `sequence`), so the numbering stays
  // contiguous for the cloud, which never stored the dropped one. Returns the dropped batch.
  // FAILED_PRECONDITION unless `sequence` is the oldest waiting batch (the cloud stores
  // batches in order, so a refused batch is always the oldest it has not acked).
  absl::StatusOr<v1::UplinkBatch> DropFront(uint64_t sequence);

  // The cloud expects `next_sequence` next (its Register reply). If it already holds more
  // than this queue knows was acked, those batches count as acked. If it holds less than
  // was acked (its log lost a tail), the waiting batches and new ones are renumbered to
  // continue where the cloud expects, so they are not refused as skipping ahead; nothing
  // acked can be resent. Returns how many sequences the numbering moved back (0: none).
  absl::StatusOr<uint64_t> Reconcile(uint64_t next_sequence);

  UplinkQueueStats Stats() const;

 private:
  explicit UplinkQueue(UplinkQueueOptions options) : options_(std::move(options)) {}
  std::string BatchPath(uint64_t slot) const;
  absl::Status Load();
  // Makes (done, offset) durable in "acked", then takes them.
  absl::Status SaveState(uint64_t done, uint64_t offset) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the waiting batches in slots up to done_ (after SaveState moved it).
  void RemoveDone() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AcknowledgeLocked(uint64_t highest_durable) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const UplinkQueueOptions options_;
  mutable absl::Mutex mu_;
  // Waiting batches by slot; each one's sequence field holds its slot.
  std::map<uint64_t, v1::UplinkBatch> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;    // slots up to this one are gone
  uint64_t offset_ ABSL_GUARDED_BY(mu_) = 0;  // sequence = slot - offset_
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;    // the slot the next Enqueue takes
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t renumbered_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace cdcca::device

#endif  // CDCCA_DEVICE_UPLINK_QUEUE_H_
