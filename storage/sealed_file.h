// A checksummed envelope for the stores' small whole files (registry records, update and
// snapshot files, uplink queue entries), so that a damaged file is told apart from a good
// one and a header field (a version, a digest) cannot change unnoticed. Layout,
// little-endian:
//   u32 magic "CDSF" | u32 kind (four characters naming what the body is) | u32 format |
//   u64 body size | body | u32 CRC-32 (zlib's) of every byte before it.
// Torch- and protobuf-free.
#ifndef CDCCA_STORAGE_SEALED_FILE_H_
#define CDCCA_STORAGE_SEALED_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::storage {

// A four-character kind, e.g. SealKind("UPLQ").
constexpr uint32_t SealKind(const char (&name)[5]) {
  return static_cast<uint32_t>(static_cast<uint8_t>(name[0])) |
         static_cast<uint32_t>(static_cast<uint8_t>(name[1])) << 8 |
         static_cast<uint32_t>(static_cast<uint8_t>(name[2])) << 16 |
         static_cast<uint32_t>(static_cast<uint8_t>(name[3])) << 24;
}

// `body` in the envelope.
std::string Seal(uint32_t kind, uint32_t format, absl::string_view body);

// Whether `bytes` start with the envelope's magic (a file written by Seal, intact or not).
bool IsSealed(absl::string_view bytes);

// The body of a sealed file of `kind` and `format`. DATA_LOSS naming `path` when the file is
// truncated, has trailing bytes or a bad checksum, or is of another kind or format.
absl::StatusOr<absl::string_view> Unseal(absl::string_view bytes, uint32_t kind, uint32_t format,
                                         absl::string_view path);

}  // namespace cdcca::storage

#endif  // CDCCA_STORAGE_SEALED_FILE_H_
