// TensorView: a named float32 buffer of the trainable set, as the torch-free DWC core sees
// it. The torch layer (compress/named_tensors.h) builds views over live tensors.
#ifndef CDCCA_COMPRESS_TENSOR_VIEW_H_
#define CDCCA_COMPRESS_TENSOR_VIEW_H_

#include <cstdint>
#include <string>
#include <vector>

namespace cdcca::compress {

// Does not own `data`: the caller keeps numel() contiguous floats alive and, where the view
// is written through (ApplyUpdateToViews), holds the writer lock on them.
struct TensorView {
  std::string name;
  std::vector<int64_t> shape;
  float* data = nullptr;

  uint64_t numel() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
  }
};

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_TENSOR_VIEW_H_
