// UplinkQueue: the device's on-disk queue of encoded uplink batches waiting for the cloud's
// durable ack. It survives restarts, is bounded, and numbers batches with the contiguous
// per-device sequence the wire contract wants (1, 2, 3, ...).
//
// Layout in `dir`: one file per batch, "batch-<sequence, 20 digits>.pb" (a serialized
// v1::UplinkBatch), plus "acked" (the highest sequence the cloud acked as durable, decimal),
// each in a sealed file (storage/sealed_file.h: kinds "UPLQ" and "UPLA", format 2) written
// atomically (temp, fsync, rename, fsync of the directory). Files of format 1 (the bare
// message or number, no checksum) are still read; a damaged file makes Open fail with
// DATA_LOSS naming it. A batch file is removed only after the cloud acked
// it, so nothing is lost between enqueue and ack; a batch resent after a crash is dropped by
// the cloud as a duplicate. When the queue is full, Enqueue refuses the new batch
// (RESOURCE_EXHAUSTED) rather than dropping queued ones, which would leave a hole in the
// sequence.
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

  // The cloud expects `next_sequence` next (its Register reply). If it already holds more
  // than this queue knows was acked, those batches count as acked. If it holds less than
  // was acked (its data was lost), the numbering continues where the cloud expects it,
  // so new batches are not refused as skipping ahead; nothing acked can be resent.
  absl::Status Reconcile(uint64_t next_sequence);

  UplinkQueueStats Stats() const;

 private:
  explicit UplinkQueue(UplinkQueueOptions options) : options_(std::move(options)) {}
  std::string BatchPath(uint64_t sequence) const;
  absl::Status Load();
  absl::Status AcknowledgeLocked(uint64_t highest_durable) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Durably records `acked` in the "acked" file.
  absl::Status WriteAcked(uint64_t acked) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const UplinkQueueOptions options_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, v1::UplinkBatch> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace cdcca::device

#endif  // CDCCA_DEVICE_UPLINK_QUEUE_H_
