#include "cloud/sample_store.h"

#include <algorithm>
#include <future>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cloud/internal/record_log.h"

namespace cdcca::cloud {
namespace {

using internal::kRecordFrameBytes;

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

}  // namespace

SampleStore::SampleStore(SampleStoreOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<SampleStore>> SampleStore::Open(const SampleStoreOptions& options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("SampleStore: dir is empty");
  if (options.segment_bytes < (1u << 16)) {
    return absl::InvalidArgumentError("SampleStore: segment_bytes must be at least 64 KiB");
  }
  if (options.env == nullptr) return absl::InvalidArgumentError("SampleStore: env is null");
  if (absl::Status s = options.env->CreateDirs(options.dir); !s.ok()) return s;
  std::unique_ptr<SampleStore> store(new SampleStore(options));
  if (absl::Status s = store->Recover(); !s.ok()) return s;
  store->flusher_ = std::thread([s = store.get()] { s->FlushLoop(); });
  return store;
}

SampleStore::~SampleStore() {
  {
    absl::MutexLock lock(&queue_mu_);
    shutting_down_ = true;
  }
  if (flusher_.joinable()) flusher_.join();
  absl::MutexLock lock(&write_mu_);
  segment_file_.reset();
}

std::string SampleStore::SegmentPath(uint32_t segment) const {
  return absl::StrFormat("%s/seg-%08u.log", options_.dir, segment);
}

absl::Status SampleStore::Recover() {
  absl::StatusOr<std::vector<std::string>> names = options_.env->ListFiles(options_.dir);
  if (!names.ok()) return names.status();
  std::vector<uint32_t> segments;
  for (const std::string& name : *names) {
    uint32_t id = 0;
    if (name.size() == 16 && name.rfind("seg-", 0) == 0 && name.substr(12) == ".log" &&
        absl::SimpleAtoi(name.substr(4, 8), &id)) {
      segments.push_back(id);
    }
  }
  std::sort(segments.begin(), segments.end());

  absl::MutexLock wlock(&write_mu_);
  absl::MutexLock ilock(&index_mu_);
  store::v1::SampleRecord record;
  const auto parses = [&record](absl::string_view body) {
    return record.ParseFromArray(body.data(), static_cast<int>(body.size()));
  };
  for (size_t i = 0; i < segments.size(); ++i) {
    const bool newest = i + 1 == segments.size();
    const std::string path = SegmentPath(segments[i]);
    absl::StatusOr<std::string> data = storage::ReadFile(*options_.env, path);
    if (!data.ok()) return data.status();
    const internal::SegmentScan scan = internal::ScanSegment(*data, parses);
    for (const internal::ScannedRecord& r : scan.records) {
      (void)parses(absl::string_view(*data).substr(r.offset, r.length));
      DeviceLog& log = index_[record.device_id()];
      const uint64_t seq = record.batch().sequence();
      if (log.records.empty() || seq > log.records.back().sequence) {
        log.records.push_back(
            {seq, segments[i], r.offset, r.length, record.batch().sample_count()});
        log.bytes += kRecordFrameBytes + r.length;
        ++stats_.records;
      }
    }
    for (const internal::DamagedRange& d : scan.damaged) {
      ++stats_.damaged_ranges;
      stats_.damaged_bytes += d.bytes;
      damage_.push_back({path, d.offset, d.bytes, false, d.why});
    }
    uint64_t kept_bytes = data->size();
    if (scan.valid_end < data->size()) {
      const uint64_t tail = data->size() - scan.valid_end;
      if (newest) {
        // A torn tail: the crash happened mid-write, so nothing past valid_end was acked.
        if (absl::Status s = options_.env->Truncate(path, scan.valid_end); !s.ok()) return s;
        stats_.truncated_tail_bytes += tail;
        damage_.push_back({path, scan.valid_end, tail, true, scan.tail_why});
        kept_bytes = scan.valid_end;
      } else {
        // An older segment was complete when the next one began: its end is corruption.
        ++stats_.damaged_ranges;
        stats_.damaged_bytes += tail;
        damage_.push_back({path, scan.valid_end, tail, false, scan.tail_why});
      }
    }
    stats_.bytes += kept_bytes;
  }
  const uint32_t next = segments.empty() ? 1 : segments.back();
  if (absl::Status s = OpenSegmentForAppend(next); !s.ok()) return s;
  // The scan may have indexed records that are only in the page cache (the process before
  // died between a write and its sync): make them durable before a resend of one is acked.
  return options_.sync ? segment_file_->Sync() : absl::OkStatus();
}

absl::Status SampleStore::OpenSegmentForAppend(uint32_t segment) {
  segment_file_.reset();
  absl::StatusOr<std::unique_ptr<storage::WritableFile>> file =
      options_.env->OpenForAppend(SegmentPath(segment), /*truncate=*/false);
  if (!file.ok()) return file.status();
  segment_file_ = *std::move(file);
  segment_ = segment;
  segment_size_ = segment_file_->Size();
  return options_.env->SyncDir(options_.dir);
}

void SampleStore::Append(const std::string& device_id, v1::UplinkBatch batch,
                         AppendCallback done) {
  absl::Status refused;
  {
    absl::MutexLock lock(&queue_mu_);
    if (!background_error_.ok()) {
      refused = background_error_;
    } else if (shutting_down_) {
      refused = absl::UnavailableError("SampleStore is shutting down");
    } else {
      queue_.push_back(Pending{device_id, std::move(batch), std::move(done)});
      return;
    }
  }
  done(refused);
}

absl::StatusOr<AppendResult> SampleStore::AppendAndWait(const std::string& device_id,
                                                        v1::UplinkBatch batch) {
  std::promise<absl::StatusOr<AppendResult>> promise;
  auto future = promise.get_future();
  Append(device_id, std::move(batch),
         [&promise](absl::StatusOr<AppendResult> r) { promise.set_value(std::move(r)); });
  return future.get();
}

void SampleStore::FlushLoop() {
  while (true) {
    std::vector<Pending> group;
    {
      absl::MutexLock lock(&queue_mu_);
      queue_mu_.Await(absl::Condition(
          +[](SampleStore* s) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return !s->queue_.empty() || s->shutting_down_;
          },
          this));
      if (queue_.empty()) return;  // shutting down with nothing left
      group.swap(queue_);
    }
    CommitGroup(group);
  }
}

void SampleStore::CommitGroup(std::vector<Pending>& group) {
  struct Outcome {
    absl::Status status;
    AppendResult result;
    bool store = false;
    Location loc{};
  };
  std::vector<Outcome> outcomes(group.size());
  // Highest sequence and bytes per device as this group would leave them.
  std::unordered_map<std::string, uint64_t> highest, device_bytes;
  {
    absl::MutexLock lock(&index_mu_);
    for (const Pending& p : group) {
      if (highest.count(p.device_id)) continue;
      auto it = index_.find(p.device_id);
      const bool none = it == index_.end() || it->second.records.empty();
      highest[p.device_id] = none ? 0 : it->second.records.back().sequence;
      device_bytes[p.device_id] = none ? 0 : it->second.bytes;
    }
  }
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  std::string buffer;
  absl::Status io_status;
  {
    absl::MutexLock wlock(&write_mu_);
    uint64_t offset = segment_size_;
    for (size_t i = 0; i < group.size(); ++i) {
      Pending& p = group[i];
      uint64_t& high = highest[p.device_id];
      const uint64_t seq = p.batch.sequence();
      if (seq == 0) {
        outcomes[i].status = absl::InvalidArgumentError("uplink sequence numbers start at 1");
        continue;
      }
      if (seq <= high) {
        outcomes[i].result = {true, 0};
        continue;
      }
      if (seq != high + 1) {
        outcomes[i].status = absl::FailedPreconditionError(absl::StrCat(
            "uplink sequence ", seq, " skips ahead: the next expected is ", high + 1));
        continue;
      }
      store::v1::SampleRecord record;
      record.set_device_id(p.device_id);
      *record.mutable_batch() = std::move(p.batch);
      record.set_received_unix_ms(now_ms);
      std::string body = record.SerializeAsString();
      uint64_t& bytes = device_bytes[p.device_id];
      if (options_.max_device_bytes != 0 &&
          bytes + kRecordFrameBytes + body.size() > options_.max_device_bytes) {
        outcomes[i].status = absl::ResourceExhaustedError(absl::StrCat(
            "device ", p.device_id, " has ", bytes, " bytes in the sample log; batch ", seq,
            " would pass its quota of ", options_.max_device_bytes, " bytes"));
        continue;
      }
      bytes += kRecordFrameBytes + body.size();
      if (offset > 0 && offset + kRecordFrameBytes + body.size() > options_.segment_bytes) {
        // Roll over: make what we have durable in the old segment first.
        io_status = WriteAndSync(buffer);
        if (io_status.ok()) io_status = OpenSegmentForAppend(segment_ + 1);
        if (!io_status.ok()) break;
        buffer.clear();
        offset = 0;
      }
      internal::AppendRecord(buffer, body);
      outcomes[i].loc = {seq, segment_, offset + kRecordFrameBytes,
                         static_cast<uint32_t>(body.size()), record.batch().sample_count()};
      outcomes[i].store = true;
      offset += kRecordFrameBytes + body.size();
      high = seq;
    }
    if (io_status.ok() && !buffer.empty()) io_status = WriteAndSync(buffer);
    if (io_status.ok()) segment_size_ = offset;
  }

  if (!io_status.ok()) {
    // Nothing of this group is acked; the store refuses further appends, since the file may
    // now hold records whose durability is unknown. A restart recovers from the log.
    absl::Status err = absl::UnavailableError(
        absl::StrCat("SampleStore stopped after an I/O error: ", io_status.message()));
    {
      absl::MutexLock lock(&queue_mu_);
      background_error_ = err;
    }
    for (Pending& p : group) p.done(err);
    return;
  }

  {
    absl::MutexLock lock(&index_mu_);
    bool synced = false;
    for (size_t i = 0; i < group.size(); ++i) {
      if (!outcomes[i].store) continue;
      DeviceLog& log = index_[group[i].device_id];
      log.records.push_back(outcomes[i].loc);
      log.bytes += kRecordFrameBytes + outcomes[i].loc.length;
      ++stats_.records;
      stats_.bytes += kRecordFrameBytes + outcomes[i].loc.length;
      synced = true;
    }
    if (synced && options_.sync) ++stats_.group_commits;
    for (size_t i = 0; i < group.size(); ++i) {
      auto it = index_.find(group[i].device_id);
      outcomes[i].result.highest_durable =
          (it == index_.end() || it->second.records.empty()) ? 0
                                                             : it->second.records.back().sequence;
    }
  }
  for (size_t i = 0; i < group.size(); ++i) {
    if (outcomes[i].status.ok()) {
      group[i].done(outcomes[i].result);
    } else {
      group[i].done(outcomes[i].status);
    }
  }
}

absl::Status SampleStore::WriteAndSync(absl::string_view data) {
  if (segment_file_ == nullptr) return absl::FailedPreconditionError("no open segment");
  if (absl::Status s = segment_file_->Append(data); !s.ok()) return s;
  return options_.sync ? segment_file_->Sync() : absl::OkStatus();
}

uint64_t SampleStore::HighestDurable(const std::string& device_id) const {
  absl::MutexLock lock(&index_mu_);
  auto it = index_.find(device_id);
  return (it == index_.end() || it->second.records.empty()) ? 0
                                                            : it->second.records.back().sequence;
}

uint64_t SampleStore::SampleCount(const std::string& device_id, uint64_t from_sequence,
                                  uint64_t to_sequence) const {
  absl::MutexLock lock(&index_mu_);
  auto it = index_.find(device_id);
  if (it == index_.end()) return 0;
  const std::vector<Location>& records = it->second.records;
  auto first = std::lower_bound(records.begin(), records.end(), from_sequence,
                                [](const Location& l, uint64_t seq) { return l.sequence < seq; });
  uint64_t samples = 0;
  for (; first != records.end() && first->sequence <= to_sequence; ++first) {
    samples += first->samples;
  }
  return samples;
}

uint64_t SampleStore::DeviceBytes(const std::string& device_id) const {
  absl::MutexLock lock(&index_mu_);
  auto it = index_.find(device_id);
  return it == index_.end() ? 0 : it->second.bytes;
}

std::vector<std::string> SampleStore::Devices() const {
  absl::MutexLock lock(&index_mu_);
  std::vector<std::string> out;
  for (const auto& [id, log] : index_) {
    if (!log.records.empty()) out.push_back(id);
  }
  std::sort(out.begin(), out.end());
  return out;
}

SampleStoreStats SampleStore::Stats() const {
  absl::MutexLock lock(&index_mu_);
  return stats_;
}

std::vector<SampleLogDamage> SampleStore::Damage() const {
  absl::MutexLock lock(&index_mu_);
  return damage_;
}

absl::StatusOr<std::vector<store::v1::SampleRecord>> SampleStore::Read(
    const std::string& device_id, uint64_t from_sequence, size_t max_records) const {
  std::vector<Location> wanted;
  {
    absl::MutexLock lock(&index_mu_);
    auto it = index_.find(device_id);
    if (it != index_.end()) {
      const std::vector<Location>& records = it->second.records;
      auto first = std::lower_bound(
          records.begin(), records.end(), from_sequence,
          [](const Location& l, uint64_t seq) { return l.sequence < seq; });
      for (; first != records.end() && wanted.size() < max_records; ++first) {
        wanted.push_back(*first);
      }
    }
  }
  std::vector<store::v1::SampleRecord> out;
  out.reserve(wanted.size());
  std::unique_ptr<storage::RandomAccessFile> file;
  uint32_t open_segment = 0;
  std::string body;
  absl::Status status;
  for (const Location& loc : wanted) {
    if (file == nullptr || open_segment != loc.segment) {
      absl::StatusOr<std::unique_ptr<storage::RandomAccessFile>> opened =
          options_.env->OpenForRead(SegmentPath(loc.segment));
      if (!opened.ok()) {
        status = opened.status();
        break;
      }
      file = *std::move(opened);
      open_segment = loc.segment;
    }
    char frame[kRecordFrameBytes];
    status = file->Read(loc.offset - kRecordFrameBytes, kRecordFrameBytes, frame);
    if (!status.ok()) break;
    body.resize(loc.length);
    status = file->Read(loc.offset, loc.length, body.data());
    if (!status.ok()) break;
    if (GetU32(frame + 8) != internal::RecordCrc(body)) {
      status = absl::DataLossError(absl::StrCat("SampleStore: checksum mismatch in ",
                                                SegmentPath(loc.segment), " at ", loc.offset));
      break;
    }
    store::v1::SampleRecord& record = out.emplace_back();
    if (!record.ParseFromString(body)) {
      status = absl::DataLossError(absl::StrCat("SampleStore: unparsable record in ",
                                                SegmentPath(loc.segment), " at ", loc.offset));
      break;
    }
  }
  if (!status.ok()) return status;
  return out;
}

}  // namespace cdcca::cloud
