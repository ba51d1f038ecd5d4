// Decode-and-apply of DWC update payloads, and the trainable-set digest; torch-free core.
// The torch entry points (ApplyUpdate, StateDigest in compress/named_tensors.h) wrap these,
// and the device and the cloud mirror both go through them, so both sides run the same
// arithmetic and stay bit-identical.
#ifndef CDCCA_COMPRESS_APPLY_H_
#define CDCCA_COMPRESS_APPLY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compress/tensor_view.h"
#include "compress/wire_format.h"

namespace cdcca::compress {

// Verifies `payload` and adds its delta into `live` in place (each value: live += decoded,
// one float add, so the result depends only on the two operands).
// All-or-nothing: the payload is parsed, checked and decoded into staging buffers before the
// first write, so on any error no live value has changed. Errors:
//   DATA_LOSS           truncated, corrupted (checksum) or malformed payload;
//   INVALID_ARGUMENT    unsupported format version or header flags; tensor names or shapes
//                       that differ from `live` (missing, extra or renamed tensors);
//   FAILED_PRECONDITION payload base version != expected_base_version;
//   RESOURCE_EXHAUSTED  body larger than `limits` allow.
// Returns the payload's new version. `live` is matched by name, in any order.
// Thread-safety: takes no locks. The caller holds the writer lock over every live buffer for
// the duration of the call (the device runtime wraps this; readers must be excluded).
absl::StatusOr<uint64_t> ApplyUpdateToViews(absl::string_view payload,
                                            uint64_t expected_base_version,
                                            absl::Span<const TensorView> live,
                                            const ParseLimits& limits = {});

// 64-bit digest of names, shapes and exact float bits (Hash64). Independent of the order of
// `tensors` (sorted by name inside). Equal digests on device and cloud mean identical
// trainable sets with overwhelming probability. Requires a little-endian host (all our
// targets are). Thread-safe if no one writes the buffers meanwhile.
uint64_t DigestViews(absl::Span<const TensorView> tensors);

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_APPLY_H_
