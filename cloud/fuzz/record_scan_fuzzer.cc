// libFuzzer entry for the sample log's scanner (cloud/internal/record_log.h) with the record
// parser recovery uses (store.v1.SampleRecord, protobuf): the bytes of a segment file, as
// recovery reads them after a crash or a bad sector. Built with clang
// (-fsanitize=fuzzer,address,undefined) from torch- and gRPC-free sources.
//
// Input: byte 0 picks the mode.
//   Even: the rest is the segment file, as is. Every record the scan reports must read back
//   (ReadRecord) and parse, and the header, records, damaged ranges, SYNC and PADDING
//   fragments and block padding must tile the file in order.
//   Odd: the rest is a list of steps (u8 tag, u8 repeat, u16 length, bytes) that build a
//   segment with the real LogWriter: tag % 4 == 0 appends a record whose batch payload (the
//   bytes a device controls) is the step's bytes repeated 1 + repeat times (so payloads can
//   carry planted fragments across block boundaries), 1 appends a SYNC fragment, 2 flips bit
//   (tag >> 2) % 8 of the byte at the step's u32 (mod the size) once the segment is built (at
//   most 2 flips: CRC-32 detects any 2-bit error in a fragment), 3 truncates the segment at
//   the step's u32 (mod the size). Besides the tiling, every record the scan reports must be
//   one the writer wrote, at the place it wrote it: nothing planted in a payload is taken.
//   Without flips or truncation, every record written is reported and nothing is damaged.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "cloud/internal/record_log.h"
#include "proto/store.pb.h"

namespace {

namespace rl = cdcca::cloud::internal;

constexpr uint64_t kNonce = 0x5eedf00dcafe1234ull;
constexpr size_t kMaxBody = 200 << 10;

// What recovery accepts (cloud/sample_store.cc): a body that parses as a SampleRecord.
bool Parses(absl::string_view body) {
  cdcca::store::v1::SampleRecord record;
  return record.ParseFromArray(body.data(), static_cast<int>(body.size()));
}

uint32_t U32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Checks that the scan's pieces tile `file` and that every reported record reads back.
void CheckScan(const std::string& file, const rl::SegmentScan& scan) {
  std::vector<std::pair<uint64_t, uint64_t>> units;  // [begin, end)
  bool header_damaged = false;
  for (const rl::DamagedRange& d : scan.damaged) {
    if (d.bytes == 0 || d.why.empty() || d.offset + d.bytes > file.size()) __builtin_trap();
    if (d.offset == 0) header_damaged = true;
    units.emplace_back(d.offset, d.offset + d.bytes);
  }
  for (const rl::ScannedRecord& r : scan.records) {
    if (r.span.end > file.size() || r.span.offset >= r.span.end) __builtin_trap();
    const absl::string_view span =
        absl::string_view(file).substr(r.span.offset, r.span.end - r.span.offset);
    absl::StatusOr<std::string> body = rl::ReadRecord(span, r.span.offset);
    if (!body.ok() || body->size() != r.length || !Parses(*body)) __builtin_trap();
    units.emplace_back(r.span.offset, r.span.end);
  }
  for (uint64_t s : scan.syncs) units.emplace_back(s, s + rl::kSyncFragmentBytes);
  for (const rl::RecordSpan& p : scan.paddings) units.emplace_back(p.offset, p.end);
  std::sort(units.begin(), units.end());
  uint64_t pos = 0;
  if (!file.empty() && !header_damaged) {
    if (file.size() < rl::kSegmentHeaderBytes) __builtin_trap();
    pos = rl::kSegmentHeaderBytes;
  }
  size_t u = 0;
  while (pos < file.size()) {
    if (u < units.size() && units[u].first == pos) {
      pos = units[u++].second;
      continue;
    }
    const uint64_t left = rl::kLogBlockBytes - pos % rl::kLogBlockBytes;
    if (left >= rl::kFragmentHeaderBytes) __builtin_trap();  // bytes nothing accounts for
    pos = std::min<uint64_t>(pos + left, file.size());
  }
  if (pos != file.size() || u != units.size()) __builtin_trap();
  if (scan.synced_end > file.size()) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if ((data[0] & 1) == 0) {
    const std::string file(reinterpret_cast<const char*>(data) + 1, size - 1);
    absl::StatusOr<rl::SegmentScan> scan = rl::ScanSegment(file, Parses);
    if (scan.ok()) CheckScan(file, *scan);
    return 0;
  }

  std::string file = rl::SegmentHeader(kNonce);
  rl::LogWriter writer(file.size(), kNonce);
  std::map<uint64_t, std::pair<uint64_t, std::string>> written;  // offset -> end, body
  std::vector<std::pair<uint32_t, int>> flips;
  bool truncate = false;
  uint32_t truncate_at = 0;
  uint64_t sequence = 0;
  size_t i = 1;
  while (i + 4 <= size) {
    const uint8_t tag = data[i], repeat = data[i + 1];
    const size_t length = std::min<size_t>(data[i + 2] | (data[i + 3] << 8), size - i - 4);
    const uint8_t* bytes = data + i + 4;
    i += 4 + length;
    switch (tag % 4) {
      case 0: {
        cdcca::store::v1::SampleRecord record;
        record.set_device_id("dev-0");
        record.mutable_batch()->set_sequence(++sequence);
        std::string payload;
        for (int r = 0; r <= repeat && payload.size() < kMaxBody; ++r) {
          payload.append(reinterpret_cast<const char*>(bytes), length);
        }
        record.mutable_batch()->set_payload(payload);
        const std::string body = record.SerializeAsString();
        const rl::RecordSpan span = writer.AddRecord(body, file);
        written[span.offset] = {span.end, body};
        break;
      }
      case 1:
        writer.AddSync(file);
        break;
      case 2:
        if (length >= 4 && flips.size() < 2) flips.emplace_back(U32(bytes), (tag >> 2) % 8);
        break;
      case 3:
        if (length >= 4) {
          truncate = true;
          truncate_at = U32(bytes);
        }
        break;
    }
  }
  if (writer.offset() != file.size()) __builtin_trap();
  for (const auto& [at, bit] : flips) file[at % file.size()] ^= static_cast<char>(1 << bit);
  if (truncate) file.resize(truncate_at % (file.size() + 1));

  absl::StatusOr<rl::SegmentScan> scan = rl::ScanSegment(file, Parses);
  if (!scan.ok()) {
    // Only a header whose bytes were changed can read as another format.
    if (flips.empty() && !truncate) __builtin_trap();
    return 0;
  }
  CheckScan(file, *scan);
  for (const rl::ScannedRecord& r : scan->records) {
    auto it = written.find(r.span.offset);
    if (it == written.end() || it->second.first != r.span.end) __builtin_trap();  // forged
    absl::StatusOr<std::string> body = rl::ReadRecord(
        absl::string_view(file).substr(r.span.offset, r.span.end - r.span.offset), r.span.offset);
    if (!body.ok() || *body != it->second.second) __builtin_trap();
  }
  if (flips.empty() && !truncate &&
      (scan->records.size() != written.size() || !scan->damaged.empty())) {
    __builtin_trap();
  }
  return 0;
}
