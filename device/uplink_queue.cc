#include "device/uplink_queue.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "storage/sealed_file.h"

namespace cdcca::device {
namespace {

constexpr uint32_t kBatchKind = storage::SealKind("UPLQ");
constexpr uint32_t kAckedKind = storage::SealKind("UPLA");
constexpr uint32_t kSealFormat = 2;

// The body of a queue file of `kind`: sealed (format 2), or the bare bytes of format 1.
absl::StatusOr<std::string> ReadQueueFile(storage::Env& env, const std::string& path,
                                          uint32_t kind) {
  absl::StatusOr<std::string> bytes = storage::ReadFile(env, path);
  if (!bytes.ok() || !storage::IsSealed(*bytes)) return bytes;
  absl::StatusOr<absl::string_view> body = storage::Unseal(*bytes, kind, kSealFormat, path);
  if (!body.ok()) return body.status();
  return std::string(*body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<UplinkQueue>> UplinkQueue::Open(const UplinkQueueOptions& options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("uplink queue needs a directory");
  std::unique_ptr<UplinkQueue> q(new UplinkQueue(options));
  if (options.env == nullptr) return absl::InvalidArgumentError("uplink queue: env is null");
  if (absl::Status s = options.env->CreateDirs(options.dir); !s.ok()) return s;
  if (absl::Status s = q->Load(); !s.ok()) return s;
  return q;
}

std::string UplinkQueue::BatchPath(uint64_t slot) const {
  return absl::StrFormat("%s/batch-%020d.pb", options_.dir, slot);
}

absl::Status UplinkQueue::Load() {
  absl::MutexLock lock(&mu_);
  const std::string state_path = options_.dir + "/acked";
  storage::Env& env = *options_.env;
  absl::StatusOr<std::string> state = ReadQueueFile(env, state_path, kAckedKind);
  if (state.ok()) {
    std::vector<absl::string_view> fields =
        absl::StrSplit(*state, absl::ByAnyChar(" \t\n"), absl::SkipEmpty());
    if (fields.empty() || fields.size() > 2 || !absl::SimpleAtoi(fields[0], &done_) ||
        (fields.size() == 2 && !absl::SimpleAtoi(fields[1], &offset_)) || offset_ > done_) {
      return absl::DataLossError(absl::StrCat(state_path, " is not \"<slot> <offset>\""));
    }
  } else if (!absl::IsNotFound(state.status())) {
    return state.status();
  }
  absl::StatusOr<std::vector<std::string>> files = env.ListFiles(options_.dir);
  if (!files.ok()) return files.status();
  for (const std::string& name : *files) {
    absl::string_view rest = name;
    if (absl::EndsWith(rest, ".tmp")) {
      // A write the crash interrupted: never acked, never counted.
      (void)storage::RemoveDurably(env, absl::StrCat(options_.dir, "/", name));
      continue;
    }
    uint64_t slot = 0;
    if (!absl::ConsumePrefix(&rest, "batch-") || !absl::ConsumeSuffix(&rest, ".pb") ||
        !absl::SimpleAtoi(rest, &slot)) {
      continue;
    }
    const std::string path = absl::StrCat(options_.dir, "/", name);
    if (slot <= done_) {
      (void)storage::RemoveDurably(env, path);  // acked or dropped before the crash removed it
      continue;
    }
    absl::StatusOr<std::string> bytes = ReadQueueFile(env, path, kBatchKind);
    if (!bytes.ok()) return bytes.status();
    v1::UplinkBatch batch;
    if (!batch.ParseFromString(*bytes) || batch.sequence() != slot) {
      return absl::DataLossError(absl::StrCat("uplink queue file ", path, " is damaged"));
    }
    bytes_ += batch.payload().size();
    pending_.emplace(slot, std::move(batch));
  }
  next_ = std::max(done_, pending_.empty() ? 0 : pending_.rbegin()->first) + 1;
  // The slots must stay contiguous: a gap means files were removed by hand.
  uint64_t expect = done_ + 1;
  for (const auto& [slot, batch] : pending_) {
    if (slot != expect++) {
      return absl::DataLossError(
          absl::StrCat("uplink queue in ", options_.dir, " misses batch ", expect - 1));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> UplinkQueue::Enqueue(uint64_t model_version, uint32_t sample_count,
                                              uint32_t codec_version, std::string payload) {
  absl::MutexLock lock(&mu_);
  if (pending_.size() + 1 > options_.max_batches || bytes_ + payload.size() > options_.max_bytes) {
    ++refused_;
    return absl::ResourceExhaustedError(absl::StrCat("uplink queue full (", pending_.size(),
                                                     " batches, ", bytes_, " bytes waiting)"));
  }
  v1::UplinkBatch batch;
  batch.set_sequence(next_);
  batch.set_model_version(model_version);
  batch.set_sample_count(sample_count);
  batch.set_codec_version(codec_version);
  batch.set_payload(std::move(payload));
  if (absl::Status s = storage::WriteFileAtomically(
          *options_.env, BatchPath(next_),
          storage::Seal(kBatchKind, kSealFormat, batch.SerializeAsString()));
      !s.ok()) {
    return s;
  }
  bytes_ += batch.payload().size();
  pending_.emplace(next_, std::move(batch));
  return next_++ - offset_;
}

std::vector<v1::UplinkBatch> UplinkQueue::Peek(size_t max_batches, uint64_t max_bytes) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::UplinkBatch> out;
  uint64_t bytes = 0;
  for (const auto& [slot, batch] : pending_) {
    if (out.size() >= max_batches) break;
    if (!out.empty() && bytes + batch.payload().size() > max_bytes) break;
    bytes += batch.payload().size();
    out.push_back(batch);
    out.back().set_sequence(slot - offset_);
  }
  return out;
}

absl::Status UplinkQueue::SaveState(uint64_t done, uint64_t offset) {
  // Recorded first: a crash after it only leaves files that Load removes.
  if (absl::Status s = storage::WriteFileAtomically(
          *options_.env, options_.dir + "/acked",
          storage::Seal(kAckedKind, kSealFormat, absl::StrCat(done, " ", offset, "\n")));
      !s.ok()) {
    return s;
  }
  done_ = done;
  offset_ = offset;
  return absl::OkStatus();
}

void UplinkQueue::RemoveDone() {
  while (!pending_.empty() && pending_.begin()->first <= done_) {
    bytes_ -= pending_.begin()->second.payload().size();
    (void)storage::RemoveDurably(*options_.env, BatchPath(pending_.begin()->first));
    pending_.erase(pending_.begin());
  }
  next_ = std::max(next_, done_ + 1);
}

absl::Status UplinkQueue::AcknowledgeLocked(uint64_t highest_durable) {
  const uint64_t slot = highest_durable + offset_;
  if (slot <= done_) return absl::OkStatus();
  if (absl::Status s = SaveState(slot, offset_); !s.ok()) return s;
  RemoveDone();
  return absl::OkStatus();
}

absl::Status UplinkQueue::Acknowledge(uint64_t highest_durable) {
  absl::MutexLock lock(&mu_);
  return AcknowledgeLocked(highest_durable);
}

absl::StatusOr<v1::UplinkBatch> UplinkQueue::DropFront(uint64_t sequence) {
  absl::MutexLock lock(&mu_);
  const uint64_t slot = sequence + offset_;
  if (pending_.empty() || pending_.begin()->first != slot) {
    return absl::FailedPreconditionError(
        absl::StrCat("batch ", sequence, " is not the oldest waiting uplink batch (that is ",
                     pending_.empty() ? 0 : pending_.begin()->first - offset_, ")"));
  }
  v1::UplinkBatch dropped = pending_.begin()->second;
  dropped.set_sequence(sequence);
  // The slot is gone and the offset grows by one: the batch behind it now travels as
  // `sequence`, and the highest acked sequence stays what it was.
  if (absl::Status s = SaveState(slot, offset_ + 1); !s.ok()) return s;
  RemoveDone();
  ++dropped_;
  return dropped;
}

absl::StatusOr<uint64_t> UplinkQueue::Reconcile(uint64_t next_sequence) {
  if (next_sequence == 0) return uint64_t{0};
  absl::MutexLock lock(&mu_);
  const uint64_t cloud_has = next_sequence - 1;
  const uint64_t acked = done_ - offset_;
  if (cloud_has > acked) {
    if (absl::Status s = AcknowledgeLocked(cloud_has); !s.ok()) return s;
    return uint64_t{0};
  }
  if (cloud_has == acked) return uint64_t{0};
  // The cloud lost batches it had acked (a lost tail of its log, or a replaced data
  // directory): what waits, and what comes, continues where it expects.
  const uint64_t back = acked - cloud_has;
  if (absl::Status s = SaveState(done_, offset_ + back); !s.ok()) return s;
  ++renumbered_;
  return back;
}

UplinkQueueStats UplinkQueue::Stats() const {
  absl::MutexLock lock(&mu_);
  UplinkQueueStats s;
  s.batches = pending_.size();
  s.bytes = bytes_;
  s.acked = done_ - offset_;
  s.next_sequence = next_ - offset_;
  s.refused = refused_;
  s.dropped = dropped_;
  s.renumbered = renumbered_;
  return s;
}

}  // namespace cdcca::device
