// libFuzzer entry for the sample log's record scanner (cloud/internal/record_log.h): the
// bytes of a segment file, as recovery reads them after a crash or a bad sector. Built with
// clang (-fsanitize=fuzzer,address,undefined) from torch-, gRPC- and protobuf-free sources.
//
// Input: byte 0 picks the mode. Even: the rest is the segment, as is. Odd: the rest is a
// list of pieces (u8 tag, u8 length, bytes): an even tag appends the piece as a record with
// a correct frame, an odd tag appends it raw (damage, a torn tail); most mutations of a raw
// segment stop at the checksum, so this is what reaches recovery's resynchronisation.
//
// Besides the sanitizers, every scan must account for each byte exactly once: intact
// records, damaged ranges and the tail tile the segment in order, and every record it
// reports is intact.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"
#include "cloud/internal/record_log.h"

namespace {

namespace rl = cdcca::cloud::internal;

// What the sample log accepts: a serialized SampleRecord starts with field 1 (device_id).
bool Accept(absl::string_view body) { return !body.empty() && body[0] == 0x0a; }

std::string Build(const uint8_t* data, size_t size) {
  std::string segment;
  size_t i = 0;
  while (i + 2 <= size) {
    const uint8_t tag = data[i], len = data[i + 1];
    i += 2;
    const size_t n = std::min<size_t>(len, size - i);
    const absl::string_view piece(reinterpret_cast<const char*>(data) + i, n);
    i += n;
    if ((tag & 1) == 0) {
      rl::AppendRecord(segment, piece);
    } else {
      segment.append(piece.data(), piece.size());
    }
  }
  return segment;
}

uint32_t U32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string segment = (data[0] & 1) != 0
                                  ? Build(data + 1, size - 1)
                                  : std::string(reinterpret_cast<const char*>(data) + 1, size - 1);
  const rl::SegmentScan scan = rl::ScanSegment(segment, Accept);
  uint64_t pos = 0;
  size_t r = 0, d = 0;
  while (r < scan.records.size() || d < scan.damaged.size()) {
    const bool record_next =
        d == scan.damaged.size() ||
        (r < scan.records.size() && scan.records[r].offset - rl::kRecordFrameBytes == pos);
    if (record_next) {
      const rl::ScannedRecord& rec = scan.records[r++];
      if (rec.offset != pos + rl::kRecordFrameBytes) __builtin_trap();
      if (rec.offset + rec.length > segment.size()) __builtin_trap();
      const absl::string_view body(segment.data() + rec.offset, rec.length);
      if (U32(segment.data() + pos) != rl::kRecordMagic || U32(segment.data() + pos + 4) != rec.length ||
          U32(segment.data() + pos + 8) != rl::RecordCrc(body) || !Accept(body)) {
        __builtin_trap();
      }
      pos = rec.offset + rec.length;
    } else {
      const rl::DamagedRange& bad = scan.damaged[d++];
      if (bad.offset != pos || bad.bytes == 0 || bad.why.empty()) __builtin_trap();
      pos += bad.bytes;
      // Damage is reported only when an intact record follows it.
      if (r >= scan.records.size()) __builtin_trap();
    }
  }
  if (pos != scan.valid_end) __builtin_trap();
  if (scan.valid_end > segment.size()) __builtin_trap();
  if ((scan.valid_end < segment.size()) != !scan.tail_why.empty()) __builtin_trap();
  return 0;
}
