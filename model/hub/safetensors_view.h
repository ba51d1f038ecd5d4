// A torch-free, validating parser of the safetensors layout
// (https://github.com/huggingface/safetensors): 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets}} with optional "__metadata__" (string ->
// string), then the raw tensor bytes. DecodeSafetensors (safetensors.h) builds torch tensors
// on top of it; this half is what reads untrusted bytes, so it is fuzzed
// (model/fuzz/) without LibTorch.
//
// Thread-safe (no shared state).
#ifndef CDCCA_MODEL_HUB_SAFETENSORS_VIEW_H_
#define CDCCA_MODEL_HUB_SAFETENSORS_VIEW_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::model {

enum class SafetensorsDtype { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// "F64", "F32", ... "BOOL" (the format's names) and the element size in bytes.
absl::string_view SafetensorsDtypeName(SafetensorsDtype dtype);
uint64_t SafetensorsDtypeBytes(SafetensorsDtype dtype);
// False for a name outside the list above.
bool ParseSafetensorsDtype(absl::string_view name, SafetensorsDtype* dtype);

// The largest JSON header accepted: 16 MiB (a header of 10,000 tensors takes ~1 MiB). The
// parsed header takes at most ~20 x its size in memory, so parsing allocates at most about
// 350 MiB beyond the input, whatever the input claims.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{16} << 20;

struct SafetensorsEntry {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<int64_t> shape;  // every dim >= 0; numel x element size == bytes.size()
  uint64_t begin = 0;          // byte range in the data section (after the header)
  uint64_t end = 0;
  absl::string_view bytes;  // the tensor's bytes: a view into the parsed input
};

struct SafetensorsView {
  // In file order (ascending data offset); the ranges tile the data section exactly.
  std::vector<SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses and checks `bytes` without copying tensor data (the views point into `bytes`,
// which must outlive the result). DATA_LOSS, naming the tensor where there is one, for: a
// truncated file, a header over kMaxSafetensorsHeaderBytes or not a JSON object, a field of
// the wrong type, an unknown dtype, a negative dim, a dtype x shape size that overflows or
// differs from the byte range, ranges that overlap, leave gaps or run past the end, and
// trailing bytes.
absl::StatusOr<SafetensorsView> ParseSafetensors(absl::string_view bytes);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_SAFETENSORS_VIEW_H_
