// The DWC update payload: what the cloud sends and the device applies. Torch-free (bytes in,
// bytes out), so the parser builds under libFuzzer with clang.
//
// Layout, all integers little-endian:
//   offset  0  u32  magic 'C','D','W','C'
//           4  u16  format version (kFormatVersion)
//           6  u16  flags (kFlagBodyZstd; other bits must be 0)
//           8  u64  base model version (the trainable-set version the delta applies to)
//          16  u64  new model version (the version after applying)
//          24  u32  tensor count
//          28  u32  reserved, 0
//          32  u64  body size, uncompressed
//          40  u64  stored body size (bytes that follow)
//          48  ...  body: one zstd frame (flag set) or the raw body
//   last 8 bytes u64  Hash64 of every byte before it (compress/hash64.h)
// Body: `tensor count` records, nothing after them:
//   u16 name length, name bytes (non-empty, unique in the payload)
//   u8 rank, rank x i64 dims (each >= 0)
//   u8 bits (0, 1, 2, 3, 4, 8), u8 record flags (kRecordSparse), u32 group size (0 iff bits 0)
//   u64 coded value count (numel when dense, the kept count when sparse; 0 when bits 0)
//   if sparse: u64 index bytes, then the kept flat indices as LEB128 varints: the first
//     index, then (gap - 1) for each next one, so they strictly increase
//   u64 block bytes, then the coded block (compress/group_codec.h)
// Every tensor of the trainable set has a record, skipped ones with bits 0, so a receiver
// can check that names and shapes match its set exactly.
#ifndef CDCCA_COMPRESS_WIRE_FORMAT_H_
#define CDCCA_COMPRESS_WIRE_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace cdcca::compress {

inline constexpr uint32_t kPayloadMagic = 0x43574443u;  // bytes "CDWC"
inline constexpr uint16_t kFormatVersion = 1;
inline constexpr uint16_t kFlagBodyZstd = 1u << 0;
inline constexpr uint8_t kRecordSparse = 1u << 0;
inline constexpr size_t kFixedHeaderBytes = 48;
inline constexpr size_t kChecksumBytes = 8;
inline constexpr int kMaxRank = 8;
inline constexpr size_t kMaxNameBytes = 1024;
inline constexpr uint64_t kMaxGroupSize = 1u << 24;

// One tensor's entry. On the parse side `indices` and `block` view the ParsedPayload's body.
struct TensorRecord {
  std::string name;
  std::vector<int64_t> shape;
  int bits = 0;             // 0 (skipped), 1, 2, 3, 4 or 8
  uint32_t group_size = 0;  // values per scale; 0 when bits == 0
  bool sparse = false;      // only `coded_count` entries (at `indices`) are coded
  uint64_t coded_count = 0;
  std::string indices;  // LEB128 gap-coded flat indices when sparse
  std::string block;    // group_codec block

  uint64_t numel() const;  // product of shape (1 for rank 0)
};

struct PayloadInfo {
  uint16_t format_version = kFormatVersion;
  uint16_t flags = 0;
  uint64_t base_version = 0;
  uint64_t new_version = 0;
  uint64_t body_bytes = 0;         // uncompressed body
  uint64_t stored_body_bytes = 0;  // on the wire
  uint64_t checksum = 0;
};

struct ParsedPayload {
  PayloadInfo info;
  std::vector<TensorRecord> tensors;
};

// Resource caps for parsing untrusted input. A body declaring more than max_body_bytes is
// rejected before anything is allocated; a zstd body is decoded by DecompressBoundedFrame
// (compress/zstd_frame.h), so parsing allocates at most 2 x max_body_bytes + 16 MiB, and
// only as much as the frame really produces. Default: 256 MiB uncompressed body (8-bit
// deltas of a 256M-parameter trainable set).
struct ParseLimits {
  uint64_t max_body_bytes = uint64_t{256} << 20;
};

// Serialises records into a payload. zstd_level <= 0 stores the body raw; otherwise the body
// is zstd-compressed at that level (clamped to 1-19, whose windows the decoder accepts), unless that does not make it smaller. Fails with
// INVALID_ARGUMENT for a record the format cannot carry (bad bits, inconsistent sizes,
// duplicate or empty names) and INTERNAL if zstd fails. Thread-safe.
absl::StatusOr<std::string> SerializePayload(uint64_t base_version, uint64_t new_version,
                                             const std::vector<TensorRecord>& tensors,
                                             int zstd_level);

// Verifies and parses a payload. Checks, in order: length and magic (DATA_LOSS), the
// checksum (DATA_LOSS), format version and flags (INVALID_ARGUMENT), declared sizes against
// the actual length (DATA_LOSS), decompression (DATA_LOSS, or RESOURCE_EXHAUSTED beyond
// `limits`), then every record's fields (DATA_LOSS). Does not decode the coded blocks or
// indices (see DecodeRecord). Thread-safe.
absl::StatusOr<ParsedPayload> ParsePayload(absl::string_view payload,
                                           const ParseLimits& limits = {});

// Decodes one record into dense out[0..numel) (overwritten; zeros where nothing is coded).
// DATA_LOSS for a malformed index list or block. Thread-safe.
absl::Status DecodeRecord(const TensorRecord& record, absl::Span<float> out);

// Appends `value` as a LEB128 varint (used for sparse index lists).
void AppendVarint(uint64_t value, std::string* out);

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_WIRE_FORMAT_H_
