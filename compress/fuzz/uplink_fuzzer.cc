// libFuzzer entry for the uplink batch decoder (device bytes the cloud parses), with the
// cloud's default limits. Input: reseal flag + payload (compress/fuzz/reseal.h).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "compress/fuzz/reseal.h"
#include "compress/uplink_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string payload = cdcca::compress::fuzz::Reseal(data, size);
  const cdcca::compress::UplinkLimits limits;
  absl::StatusOr<std::vector<cdcca::compress::UplinkSample>> samples =
      cdcca::compress::DecodeUplinkBatch(payload, limits);
  if (!samples.ok()) return 0;
  // What the decoder promises about an accepted batch.
  if (samples->empty() || samples->size() > limits.max_samples) __builtin_trap();
  for (const auto& s : *samples) {
    if (s.grid_tokens == 0 || s.grid_tokens > limits.max_grid_tokens || s.feature_dim == 0 ||
        s.feature_dim > limits.max_feature_dim || s.kept_indices.size() > s.grid_tokens ||
        (s.frame.empty() ? s.features.size() != s.kept_indices.size() * s.feature_dim
                         : !s.features.empty() || s.frame.size() > limits.max_frame_bytes ||
                               !cdcca::compress::ReadJpegSize(s.frame).ok()) ||
        s.prompt_tokens.size() > limits.max_prompt_tokens ||
        s.answer_tokens.size() > limits.max_answer_tokens) {
      __builtin_trap();
    }
    for (size_t i = 0; i < s.kept_indices.size(); ++i) {
      if (s.kept_indices[i] >= s.grid_tokens) __builtin_trap();
      if (i > 0 && s.kept_indices[i] <= s.kept_indices[i - 1]) __builtin_trap();
    }
  }
  return 0;
}
