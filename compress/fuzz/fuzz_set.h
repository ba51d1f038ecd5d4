// The trainable-set layout the decoder fuzzer applies to, shared by the fuzz entry and the
// seed generator so that seeds reach the apply path past the name and shape checks.
#ifndef CDCCA_COMPRESS_FUZZ_FUZZ_SET_H_
#define CDCCA_COMPRESS_FUZZ_FUZZ_SET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "compress/tensor_view.h"

namespace cdcca::compress::fuzz {

// Owns the buffers its views point into.
struct FuzzSet {
  std::vector<std::vector<float>> buffers;
  std::vector<TensorView> views;
};

inline FuzzSet MakeFuzzSet(float scale) {
  const struct {
    const char* name;
    std::vector<int64_t> shape;
  } layout[] = {{"norm.weight", {48}},
                {"layers.0.q_lora.A", {4, 40}},
                {"layers.0.q_lora.B", {40, 4}},
                {"query_tokens", {3, 33}},
                {"scalar", {}}};
  FuzzSet set;
  for (const auto& l : layout) {
    TensorView v;
    v.name = l.name;
    v.shape = l.shape;
    std::vector<float> data(v.numel());
    for (size_t i = 0; i < data.size(); ++i) {
      // Deterministic, sign-varying values of mixed magnitude.
      data[i] = scale * static_cast<float>((i * 2654435761u) % 1000) / 1000.0f *
                ((i % 3 == 0) ? -1.0f : 1.0f);
    }
    set.buffers.push_back(std::move(data));
    set.views.push_back(std::move(v));
  }
  for (size_t i = 0; i < set.views.size(); ++i) set.views[i].data = set.buffers[i].data();
  return set;
}

}  // namespace cdcca::compress::fuzz

#endif  // CDCCA_COMPRESS_FUZZ_FUZZ_SET_H_
