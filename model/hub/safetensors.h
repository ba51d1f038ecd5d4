// A safetensors reader and writer (https://github.com/huggingface/safetensors format):
// 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
// optional "__metadata__" (string -> string), then the raw little-endian tensor bytes.
// Files written here load in any safetensors reader and vice versa (dtypes F64, F32, F16,
// BF16, I64, I32, I16, I8, U8, BOOL).
//
// Thread-safe (no shared state). Writes go to "<path>.tmp" and are renamed into place, so
// a crash never leaves a half-written file under `path`.
#ifndef CDCCA_MODEL_HUB_SAFETENSORS_H_
#define CDCCA_MODEL_HUB_SAFETENSORS_H_

#include <torch/types.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::model {

struct SafetensorsContents {
  // In file order (ascending data offset). CPU, contiguous, owning their memory.
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::map<std::string, std::string> metadata;
};

// Serialises tensors (any device; copied to CPU) in the given order. Names must be unique
// and not "__metadata__". InvalidArgument on an unsupported dtype or duplicate name.
absl::StatusOr<std::string> EncodeSafetensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata);

// Parses bytes produced by any safetensors writer. DataLoss on truncation, overlapping or
// out-of-range offsets, or a size that does not match dtype x shape (naming the tensor).
// The layout is checked by ParseSafetensors (safetensors_view.h, torch-free and fuzzed)
// before any tensor is allocated; the tensors then take exactly the file's data bytes.
absl::StatusOr<SafetensorsContents> DecodeSafetensors(absl::string_view bytes);

// Writes `bytes` to `path` through `path`.tmp and a rename, so a reader never sees a partly
// written file. Unavailable naming the file when a write or the rename fails.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes);

// EncodeSafetensors' bytes written as WriteFileAtomically writes, one tensor at a time.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata);
absl::StatusOr<SafetensorsContents> ReadSafetensors(const std::string& path);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_SAFETENSORS_H_
