// Bounded decompression of one zstd frame from untrusted bytes (DWC update bodies, uplink
// batch bodies). Torch-free.
#ifndef CDCCA_COMPRESS_ZSTD_FRAME_H_
#define CDCCA_COMPRESS_ZSTD_FRAME_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::compress {

// Largest zstd window the decoders accept: 2^24 = 16 MiB. The encoders here use levels
// 1-19, whose windows are at most 2^23; a frame asking for more is rejected before the
// decoder allocates its window.
inline constexpr int kMaxZstdWindowLog = 24;

// Decompresses `frame`, which must be exactly one zstd frame whose header declares exactly
// `declared` content bytes, with declared <= max_bytes (checked before anything is
// allocated). The output grows with what the frame really produces (geometrically, from at
// most 1 MiB), so a small frame that claims much more than it holds fails having allocated
// about twice what it produced, plus the window (<= 16 MiB); the peak is bounded by
// 2 x max_bytes + 16 MiB. DATA_LOSS (prefixed with `what`) for a frame that is not one
// valid frame of the declared size, RESOURCE_EXHAUSTED when declared > max_bytes.
// Thread-safe.
absl::StatusOr<std::string> DecompressBoundedFrame(absl::string_view frame, uint64_t declared,
                                                   uint64_t max_bytes, absl::string_view what);

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_ZSTD_FRAME_H_
