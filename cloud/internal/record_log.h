// The sample log's on-disk framing (format 2) and the scanner that recovers records from a
// segment file.
//
// A segment starts with a 24-byte header
//   8 bytes "cdccaSLG" | u32 format version (2) | u64 nonce | u32 crc32 of the 20 bytes before
// (the nonce is random, drawn when the segment is created, and never leaves the cloud) and is
// cut into blocks of kLogBlockBytes, counted from the start of the file (as
// LevelDB's log). A record is written as one or more fragments; a fragment never crosses a
// block boundary:
//   u32 crc32(length, type, payload) | u16 length | u8 type | payload
// little-endian. A record that fits the rest of its block is one FULL fragment; else it is
// split into FIRST, MIDDLE..., LAST at block boundaries. A block with fewer than
// kFragmentHeaderBytes left is padded with zeros; one too short for a SYNC fragment gets
// a PADDING fragment. A SYNC fragment follows the records of
// each group commit once they are durable (cloud/sample_store.h); its payload is
//   u64 nonce (the segment's) | u64 offset (of the SYNC fragment itself).
//
// So every block begins with a fragment header the writer placed, and every later fragment
// of the block is found from checksummed lengths. After damage the scanner resumes at the
// next SYNC fragment of the damaged block, if any, else at the next block boundary: both are
// positions no payload (devices' bytes: features, JPEG frames) can choose (a SYNC fragment
// counts only with the segment's nonce, which devices never see), so a record planted inside
// a payload is never taken. The bytes it drops are reported.
//
// Torch-, gRPC- and protobuf-free (the caller decides whether a body parses), so the scanner
// builds under libFuzzer (cloud/fuzz/record_scan_fuzzer.cc).
#ifndef CDCCA_CLOUD_INTERNAL_RECORD_LOG_H_
#define CDCCA_CLOUD_INTERNAL_RECORD_LOG_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::cloud::internal {

inline constexpr uint32_t kLogFormatVersion = 2;
inline constexpr uint64_t kSegmentHeaderBytes = 24;
inline constexpr uint64_t kLogBlockBytes = 32 << 10;
inline constexpr uint64_t kFragmentHeaderBytes = 7;
// A body larger than this cannot be a record we wrote (batches are <= 1 MiB + framing).
inline constexpr uint32_t kMaxRecordBodyBytes = 4u << 20;

enum class FragmentType : uint8_t {
  kZero = 0,  // never written: zeroed bytes (a preallocated or lost page)
  kFull = 1,
  kFirst = 2,
  kMiddle = 3,
  kLast = 4,
  kSync = 5,     // the records before it are durable (acked)
  kPadding = 6,  // fills the rest of a block too short for a SYNC fragment
};
inline constexpr uint64_t kSyncFragmentBytes = kFragmentHeaderBytes + 16;

// The header of a new segment with `nonce` (draw it with NewSegmentNonce()).
std::string SegmentHeader(uint64_t nonce);
// A random nonce for a new segment.
uint64_t NewSegmentNonce();

// CRC-32 (zlib's) of `data`.
uint32_t RecordCrc(absl::string_view data);

// Where one record lies in its segment: [offset, end) holds its fragments (and the block
// padding between them), `offset` being its first fragment's header.
struct RecordSpan {
  uint64_t offset = 0;
  uint64_t end = 0;
};

// Appends records to a segment with `nonce` that ends at `file_size` (header included; at
// least kSegmentHeaderBytes). Thread-compatible.
class LogWriter {
 public:
  LogWriter(uint64_t file_size, uint64_t nonce) : offset_(file_size), nonce_(nonce) {}
  // Appends the fragments of `body` (at most kMaxRecordBodyBytes) to `out`.
  RecordSpan AddRecord(absl::string_view body, std::string& out);
  // Appends a SYNC fragment to `out`.
  void AddSync(std::string& out);
  // The file offset the next byte goes to.
  uint64_t offset() const { return offset_; }

 private:
  void AddFragment(FragmentType type, absl::string_view payload, std::string& out);
  uint64_t offset_;
  uint64_t nonce_;
};

// Bytes LogWriter::AddRecord writes for a body of `body_bytes` at file offset `offset`
// (fragment headers and block padding included).
uint64_t FramedBytes(uint64_t offset, uint64_t body_bytes);

// The body of the record whose span [offset, offset + span.size()) is `span`, its fragments
// checked again. DATA_LOSS saying what is wrong if they are not one intact record.
absl::StatusOr<std::string> ReadRecord(absl::string_view span, uint64_t offset);

struct ScannedRecord {
  RecordSpan span;
  uint32_t length = 0;  // of the body
};

// Bytes that hold no intact record, from where the damage starts (a record's first
// fragment, if the record broke later) to the next intact record or sync fragment, or to
// the end of the file.
struct DamagedRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::string why;  // what was wrong at the first bad fragment
};

struct SegmentScan {
  std::vector<ScannedRecord> records;  // intact, accepted records, in file order
  // In file order; a damaged header is [0, kSegmentHeaderBytes) (the whole file if shorter),
  // and bytes at the end of the file that hold no intact fragment are a range too.
  std::vector<DamagedRange> damaged;
  std::vector<uint64_t> syncs;       // offsets of the intact SYNC fragments, in file order
  std::vector<RecordSpan> paddings;  // intact PADDING fragments outside damaged ranges
  // The end of the last SYNC fragment: every record before it was acked. The header's end if
  // the segment has none; 0 if the file is shorter than a header (a crash as it was made).
  uint64_t synced_end = kSegmentHeaderBytes;
  // The segment's nonce: from its header, else (a damaged header) from its first SYNC
  // fragment; unknown (false) if neither is intact.
  bool nonce_known = false;
  uint64_t nonce = 0;
};

// Scans a whole segment file. FAILED_PRECONDITION, naming the format, for a segment of
// format 1 (records framed `magic | length | crc32 | body`, no blocks) or of an unknown
// version: such a log is refused, never scanned. `accept(body)` decides whether a body
// whose fragments are intact is a record (for the sample log: it parses as a SampleRecord);
// a body it refuses is a damaged range. The header, records, damaged ranges, SYNC and
// PADDING fragments and block padding tile the file in order. Reads only inside `data`.
absl::StatusOr<SegmentScan> ScanSegment(absl::string_view data,
                                        const std::function<bool(absl::string_view body)>& accept);

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_RECORD_LOG_H_
