// The trainer's per-device state file, `<state_dir>/<device>.mirror` (torch-free, so its
// decoder is fuzzed: cloud/fuzz/), in the stores' sealed envelope (storage/sealed_file.h, kind
// "CDMS", format 2) around, little-endian:
//   u64 version | u64 consumed sequence | u64 state digest |
//   4 x (u64 size | bytes): mirror safetensors, encoder residual, update payload, snapshot.
// Files of format 1 (the same fields between u32 "CDMS" | u32 1 and a u64 Hash64 of what
// precedes it, written before the envelope) are read too.
// The blobs are returned as bytes; their own decoders (ParseSafetensors,
// DeltaEncoder::RestoreState, ParsePayload) check them.
#ifndef CDCCA_CLOUD_INTERNAL_MIRROR_FILE_H_
#define CDCCA_CLOUD_INTERNAL_MIRROR_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::cloud::internal {

struct MirrorFile {
  uint64_t version = 0;
  uint64_t consumed = 0;
  uint64_t digest = 0;
  std::string mirror;    // safetensors of the trainable set
  std::string residual;  // DeltaEncoder::SerializeState
  std::string update;    // payload that produced `version` (empty at version 0)
  std::string snapshot;  // snapshot payload of `version` (empty at version 0)
  std::string replay;    // distill::ReplayBuffer::Serialize (empty: none kept, or format 2)
};

std::string EncodeMirrorFile(const MirrorFile& f);

// DATA_LOSS naming `path` for a bad checksum, magic or format, truncation or trailing
// bytes. Allocates only the blobs, which together are smaller than `in`.
absl::StatusOr<MirrorFile> DecodeMirrorFile(absl::string_view in, const std::string& path);

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_MIRROR_FILE_H_
