#include "cloud/sample_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cloud/internal/file_io.h"
#include "cloud/internal/record_log.h"

namespace cdcca::cloud {
namespace {

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return internal::ErrnoStatus("write", path, errno);
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status PreadAll(int fd, char* buf, size_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    ssize_t r = ::pread(fd, buf, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return internal::ErrnoStatus("pread", path, errno);
    }
    if (r == 0) return absl::DataLossError(absl::StrCat(path, ": unexpected end of file"));
    buf += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

}  // namespace

SampleStore::SampleStore(SampleStoreOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<SampleStore>> SampleStore::Open(const SampleStoreOptions& options) {
  if (options.dir.empty()) return absl::InvalidArgumentError("SampleStore: dir is empty");
  if (options.segment_bytes < (1u << 16)) {
    return absl::InvalidArgumentError("SampleStore: segment_bytes must be at least 64 KiB");
  }
  if (absl::Status s = internal::MakeDirs(options.dir); !s.ok()) return s;
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
  if (fd_ >= 0) ::close(fd_);
}

std::string SampleStore::SegmentPath(uint32_t segment) const {
  return absl::StrFormat("%s/seg-%08u.log", options_.dir, segment);
}

absl::Status SampleStore::Recover() {
  absl::StatusOr<std::vector<std::string>> names = internal::ListDir(options_.dir);
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
  // What each accepted record is, in scan order (the scanner's records, one for one).
  struct Entry {
    std::string device_id;
    uint64_t sequence;
    uint32_t samples;
  };
  std::vector<Entry> entries;
  store::v1::SampleRecord record;
  const auto parses = [&record, &entries](absl::string_view body) {
    if (!record.ParseFromArray(body.data(), static_cast<int>(body.size()))) return false;
    entries.push_back(
        {record.device_id(), record.batch().sequence(), record.batch().sample_count()});
    return true;
  };
  bool newest_writable = false;
  uint64_t newest_nonce = 0;
  uint64_t newest_kept = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const bool newest = i + 1 == segments.size();
    const std::string path = SegmentPath(segments[i]);
    absl::StatusOr<std::string> data = internal::ReadFile(path);
    if (!data.ok()) return data.status();
    entries.clear();
    absl::StatusOr<internal::SegmentScan> scan = internal::ScanSegment(*data, parses);
    if (!scan.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " is ", scan.status().message(),
          ". This cloud does not read it: move the directory ", options_.dir,
          " aside to start an empty sample log (its batches will not be trained), or run the "
          "cdcca version that wrote it"));
    }
    // In the newest segment, the first damage after the last SYNC fragment starts a torn
    // tail: those bytes were written by a group commit that never finished (never acked),
    // and any intact record after them was never acked either. Damage before the last SYNC
    // fragment, and anywhere in an older segment (complete and synced before the next one
    // began), is damage to acked records.
    uint64_t cut = data->size();
    std::string torn_why;
    if (newest) {
      for (const internal::DamagedRange& d : scan->damaged) {
        if (d.offset >= scan->synced_end) {
          cut = d.offset;
          torn_why = d.why;
          break;
        }
      }
    }
    for (size_t k = 0; k < scan->records.size(); ++k) {
      const internal::ScannedRecord& r = scan->records[k];
      if (r.span.offset >= cut) break;
      const Entry& e = entries[k];
      DeviceLog& log = index_[e.device_id];
      if (log.records.empty() || e.sequence > log.records.back().sequence) {
        log.records.push_back({e.sequence, segments[i], r.span.offset, r.span.end, e.samples});
        log.bytes += r.span.end - r.span.offset;
        ++live_records_[segments[i]];
        ++stats_.records;
      }
    }
    for (const internal::DamagedRange& d : scan->damaged) {
      if (d.offset >= cut) break;
      ++stats_.damaged_ranges;
      stats_.damaged_bytes += d.bytes;
      damage_.push_back({path, d.offset, d.bytes, false, d.why});
    }
    if (cut < data->size()) {
      if (::truncate(path.c_str(), static_cast<off_t>(cut)) != 0) {
        return internal::ErrnoStatus("truncate", path, errno);
      }
      stats_.truncated_tail_bytes += data->size() - cut;
      damage_.push_back({path, cut, data->size() - cut, true, torn_why});
    }
    stats_.bytes += cut;
    if (newest) {
      // Appends continue in it unless its nonce is lost (a damaged header and no SYNC).
      newest_writable = cut == 0 || scan->nonce_known;
      newest_nonce = scan->nonce;
      newest_kept = cut;
    }
  }
  const bool reopen = !segments.empty() && newest_writable;
  absl::Status s = reopen ? OpenSegmentForAppend(segments.back(), newest_nonce)
                          : OpenSegmentForAppend(segments.empty() ? 1 : segments.back() + 1, 0);
  if (!s.ok()) return s;
  stats_.bytes += segment_size_ - (reopen ? newest_kept : 0);  // a header written
  current_segment_ = segment_;
  return absl::OkStatus();
}

absl::Status SampleStore::OpenSegmentForAppend(uint32_t segment, uint64_t nonce) {
  if (fd_ >= 0) ::close(fd_);
  const std::string path = SegmentPath(segment);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) return internal::ErrnoStatus("open", path, errno);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return internal::ErrnoStatus("fstat", path, errno);
  segment_ = segment;
  segment_size_ = static_cast<uint64_t>(st.st_size);
  nonce_ = nonce;
  if (segment_size_ == 0) {
    // A new segment: its header is durable before any record is written after it.
    nonce_ = internal::NewSegmentNonce();
    const std::string header = internal::SegmentHeader(nonce_);
    if (absl::Status s = WriteAll(fd_, header, path); !s.ok()) return s;
    if (::fdatasync(fd_) != 0) return internal::ErrnoStatus("fdatasync", path, errno);
    segment_size_ = header.size();
  }
  return internal::SyncDir(options_.dir);
}

void SampleStore::Append(const std::string& device_id, v1::UplinkBatch batch, AppendCallback done) {
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
          +[](SampleStore* s)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return !s->queue_.empty() || s->shutting_down_; },
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
  uint64_t appended = 0;  // bytes added to segment files
  {
    absl::MutexLock wlock(&write_mu_);
    internal::LogWriter writer(segment_size_, nonce_);
    uint64_t writer_start = segment_size_;
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
        outcomes[i].status = absl::FailedPreconditionError(
            absl::StrCat("uplink sequence ", seq, " skips ahead: the next expected is ", high + 1));
        continue;
      }
      store::v1::SampleRecord record;
      record.set_device_id(p.device_id);
      *record.mutable_batch() = std::move(p.batch);
      record.set_received_unix_ms(now_ms);
      std::string body = record.SerializeAsString();
      if (body.size() > internal::kMaxRecordBodyBytes) {
        outcomes[i].status = absl::InvalidArgumentError(
            absl::StrCat("batch ", seq, " is ", body.size(), " bytes stored, more than the ",
                         internal::kMaxRecordBodyBytes, " a sample log record may hold"));
        continue;
      }
      uint64_t& bytes = device_bytes[p.device_id];
      const uint64_t framed = internal::FramedBytes(writer.offset(), body.size());
      if (options_.max_device_bytes != 0 && bytes + framed > options_.max_device_bytes) {
        outcomes[i].status = absl::ResourceExhaustedError(
            absl::StrCat("device ", p.device_id, " has ", bytes, " bytes in the sample log; batch ",
                         seq, " would pass its quota of ", options_.max_device_bytes, " bytes"));
        continue;
      }
      bytes += framed;
      if (writer.offset() > internal::kSegmentHeaderBytes &&
          writer.offset() + framed > options_.segment_bytes) {
        // Roll over: make what we have durable in the old segment first.
        io_status = WriteAndSync(buffer, /*sync=*/options_.sync);
        if (io_status.ok()) io_status = OpenSegmentForAppend(segment_ + 1, 0);
        if (!io_status.ok()) break;
        {
          absl::MutexLock lock(&index_mu_);
          current_segment_ = segment_;
        }
        appended += writer.offset() - writer_start + segment_size_;
        buffer.clear();
        writer = internal::LogWriter(segment_size_, nonce_);
        writer_start = segment_size_;
      }
      const internal::RecordSpan span = writer.AddRecord(body, buffer);
      outcomes[i].loc = {seq, segment_, span.offset, span.end, record.batch().sample_count()};
      outcomes[i].store = true;
      high = seq;
    }
    if (io_status.ok() && !buffer.empty()) {
      io_status = WriteAndSync(buffer, options_.sync);
      // Mark the group durable. The mark itself need not be synced before the acks: lost,
      // it only makes recovery take these (intact) records for an unacked tail, which it
      // keeps unless they are damaged too.
      if (io_status.ok()) {
        std::string sync;
        writer.AddSync(sync);
        io_status = WriteAndSync(sync, /*sync=*/false);
      }
    }
    if (io_status.ok()) {
      appended += writer.offset() - writer_start;
      segment_size_ = writer.offset();
    }
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
      log.bytes += outcomes[i].loc.end - outcomes[i].loc.offset;
      ++live_records_[outcomes[i].loc.segment];
      ++stats_.records;
      synced = true;
    }
    stats_.bytes += appended;
    if (synced && options_.sync) ++stats_.group_commits;
    for (size_t i = 0; i < group.size(); ++i) {
      auto it = index_.find(group[i].device_id);
      outcomes[i].result.highest_durable = (it == index_.end() || it->second.records.empty())
                                               ? 0
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

absl::Status SampleStore::WriteAndSync(absl::string_view data, bool sync) {
  const std::string path = SegmentPath(segment_);
  if (absl::Status s = WriteAll(fd_, data, path); !s.ok()) return s;
  if (sync && ::fdatasync(fd_) != 0) return internal::ErrnoStatus("fdatasync", path, errno);
  return absl::OkStatus();
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

absl::Status SampleStore::Release(const std::string& device_id, uint64_t through_sequence) {
  std::vector<uint32_t> empty;
  {
    absl::MutexLock lock(&index_mu_);
    auto it = index_.find(device_id);
    if (it == index_.end()) return absl::OkStatus();
    DeviceLog& log = it->second;
    size_t n = 0;
    // The newest record stays: it carries the device's highest sequence across a restart.
    while (n + 1 < log.records.size() && log.records[n].sequence <= through_sequence) {
      const Location& loc = log.records[n];
      log.bytes -= loc.end - loc.offset;
      auto live = live_records_.find(loc.segment);
      if (live != live_records_.end() && --live->second == 0) {
        live_records_.erase(live);
        if (loc.segment != current_segment_) empty.push_back(loc.segment);
      }
      ++n;
    }
    log.records.erase(log.records.begin(), log.records.begin() + n);
    stats_.released_records += n;
  }
  if (empty.empty()) return absl::OkStatus();
  std::sort(empty.begin(), empty.end());
  for (uint32_t segment : empty) {
    const std::string path = SegmentPath(segment);
    struct stat st {};
    const uint64_t size = ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    if (::unlink(path.c_str()) != 0) return internal::ErrnoStatus("unlink", path, errno);
    absl::MutexLock lock(&index_mu_);
    stats_.bytes -= std::min(stats_.bytes, size);
    ++stats_.deleted_segments;
  }
  return internal::SyncDir(options_.dir);
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

absl::StatusOr<StoredBatches> SampleStore::ReadEach(const std::string& device_id,
                                                    uint64_t from_sequence,
                                                    size_t max_records) const {
  std::vector<Location> wanted;
  {
    absl::MutexLock lock(&index_mu_);
    auto it = index_.find(device_id);
    if (it != index_.end()) {
      const std::vector<Location>& records = it->second.records;
      auto first =
          std::lower_bound(records.begin(), records.end(), from_sequence,
                           [](const Location& l, uint64_t seq) { return l.sequence < seq; });
      for (; first != records.end() && wanted.size() < max_records; ++first) {
        wanted.push_back(*first);
      }
    }
  }
  StoredBatches out;
  out.records.reserve(wanted.size());
  int fd = -1;
  uint32_t open_segment = 0;
  std::string span;
  absl::Status status;
  for (const Location& loc : wanted) {
    const std::string path = SegmentPath(loc.segment);
    if (fd < 0 || open_segment != loc.segment) {
      if (fd >= 0) ::close(fd);
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) {
        status = internal::ErrnoStatus("open", path, errno);
        break;
      }
      open_segment = loc.segment;
    }
    span.resize(loc.end - loc.offset);
    absl::Status read = PreadAll(fd, span.data(), span.size(), loc.offset, path);
    if (!read.ok() && !absl::IsDataLoss(read)) {
      status = read;  // an I/O error, not damage: the caller may try again
      break;
    }
    absl::StatusOr<std::string> body =
        read.ok() ? internal::ReadRecord(span, loc.offset) : absl::StatusOr<std::string>(read);
    store::v1::SampleRecord record;
    if (body.ok() && !record.ParseFromString(*body)) {
      body = absl::DataLossError(absl::StrCat("record at ", loc.offset, " does not parse"));
    }
    if (!body.ok()) {
      out.unreadable.push_back({loc.sequence, loc.samples,
                                absl::DataLossError(absl::StrCat("SampleStore: ", path, ": ",
                                                                 body.status().message()))});
      continue;
    }
    out.records.push_back(std::move(record));
  }
  if (fd >= 0) ::close(fd);
  if (!status.ok()) return status;
  return out;
}

absl::StatusOr<std::vector<store::v1::SampleRecord>> SampleStore::Read(const std::string& device_id,
                                                                       uint64_t from_sequence,
                                                                       size_t max_records) const {
  absl::StatusOr<StoredBatches> read = ReadEach(device_id, from_sequence, max_records);
  if (!read.ok()) return read.status();
  if (!read->unreadable.empty()) return read->unreadable.front().status;
  return std::move(read->records);
}

}  // namespace cdcca::cloud
