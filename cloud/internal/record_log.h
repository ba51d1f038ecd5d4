// The sample log's record framing and the scanner that recovers records from a segment.
//
// A record is framed as
//   u32 magic | u32 length | u32 crc32(body) | body
// little-endian. The scanner never trusts a length it has not checked against the bytes
// that are there, and after damage it looks for the next intact record byte by byte, so one
// bad record never hides the good ones after it.
//
// Torch-, gRPC- and protobuf-free (the caller decides whether a body parses), so the
// scanner builds under libFuzzer (cloud/fuzz/record_scan_fuzzer.cc).
#ifndef CDCCA_CLOUD_INTERNAL_RECORD_LOG_H_
#define CDCCA_CLOUD_INTERNAL_RECORD_LOG_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace cdcca::cloud::internal {

inline constexpr uint32_t kRecordMagic = 0xCDCA5A11u;
inline constexpr size_t kRecordFrameBytes = 12;
// A body larger than this cannot be a record we wrote (batches are <= 1 MiB + framing).
inline constexpr uint32_t kMaxRecordBodyBytes = 4u << 20;

// Appends the frame of `body` and `body` itself to `out`.
void AppendRecord(std::string& out, absl::string_view body);

// CRC-32 (zlib's) of `data`.
uint32_t RecordCrc(absl::string_view data);

struct ScannedRecord {
  uint64_t offset = 0;  // of the body in the segment
  uint32_t length = 0;  // of the body
};

// Bytes between two intact records that hold no intact record.
struct DamagedRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::string why;  // what was wrong at `offset`
};

struct SegmentScan {
  std::vector<ScannedRecord> records;  // intact records, in file order
  // Damage followed by at least one intact record (corruption, not a torn write).
  std::vector<DamagedRange> damaged;
  // End of the last intact record. Bytes after it hold no intact record: a torn tail (a
  // crash mid-write) when this is the newest segment. tail_why says what was wrong there.
  uint64_t valid_end = 0;
  std::string tail_why;
};

// Scans a segment's bytes. `accept(body)` decides whether a body whose checksum matches is
// a record (for the sample log: it parses as a SampleRecord). Reads only inside `data`.
SegmentScan ScanSegment(absl::string_view data,
                        const std::function<bool(absl::string_view body)>& accept);

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_RECORD_LOG_H_
