// The trainable set as LibTorch tensors, and the torch entry points of DWC. This header
// does not include <torch/torch.h>; at::Tensor is only forward-declared.
#ifndef CDCCA_COMPRESS_NAMED_TENSORS_H_
#define CDCCA_COMPRESS_NAMED_TENSORS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "compress/tensor_view.h"
#include "compress/wire_format.h"

namespace at {
class Tensor;
}  // namespace at

namespace cdcca::compress {

// The trainable set: (name, tensor) pairs with unique names, in a stable order (the model's
// named_parameters() order or sorted; DWC matches by name, so the order only fixes the
// order of records in a payload). Tensors are float32, contiguous, on the CPU.
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Views over the tensors' storage (no copy). INVALID_ARGUMENT for a tensor that is not
// float32, not contiguous, not on the CPU, or a duplicate name. The views stay valid as
// long as the tensors' storage does.
absl::StatusOr<std::vector<TensorView>> ViewsOf(const NamedTensors& tensors);

// THE decode-and-apply function, for the device and the cloud mirror alike: verifies the
// payload (checksum, format, base version, names, shapes), decodes it fully into staging,
// then adds it into the existing storage of `live` in place (no reallocation: every
// data_ptr() stays the same). Any error leaves `live` bit-identical. Error codes as for
// ApplyUpdateToViews (compress/apply.h); INVALID_ARGUMENT also for a live tensor that is not
// float32 contiguous CPU. Returns the new version.
// Thread-safety: takes no locks; the caller holds the writer lock over `live` (the device
// runtime wraps this call) and nobody reads the tensors meanwhile. Not autograd-tracked.
absl::StatusOr<uint64_t> ApplyUpdate(absl::string_view payload, uint64_t expected_base_version,
                                     NamedTensors& live, const ParseLimits& limits = {});

// Fast 64-bit digest of names, shapes and exact float bits; equals DigestViews over the same
// tensors (compress/apply.h); independent of order. float32 tensors that are not contiguous
// or not on the CPU are digested through a contiguous CPU copy; other dtypes are converted
// to float32 first (exact for fp16 and bf16). Thread-safe for concurrent readers.
uint64_t StateDigest(const NamedTensors& tensors);

// Detached fp32, contiguous CPU clones of `tensors` (a model's trainable set, any dtype or
// device): the form a state is kept, digested and encoded in.
NamedTensors Fp32Clones(const NamedTensors& tensors);

// Copies every tensor of `from` into the same-named tensor of `into`, whatever the latter's
// dtype and device (a model's parameters, which `into` aliases: a CUDA bf16 copy gets the
// rounding of an fp32 state); tensors of `into` that `from` lacks are an error. This is how a
// state kept in fp32 (a cloud mirror, a device's applied updates) reaches a model.
// INVALID_ARGUMENT naming the first tensor `from` lacks or whose shape differs; nothing is
// copied then. Not autograd-tracked.
absl::Status CopyInto(const NamedTensors& from, const NamedTensors& into);

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_NAMED_TENSORS_H_
