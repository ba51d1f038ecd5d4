// The ingest-check fuzzer's input layout, shared with its seed generator: kSpecBytes bytes
// that become the cloud's SampleSpec, then a reseal flag and the uplink payload
// (compress/fuzz/reseal.h).
#ifndef CDCCA_CLOUD_FUZZ_INGEST_SPEC_H_
#define CDCCA_CLOUD_FUZZ_INGEST_SPEC_H_

#include <cstddef>
#include <cstdint>

#include "cloud/uplink_check.h"

namespace cdcca::cloud::fuzz {

inline constexpr size_t kSpecBytes = 10;

// Every byte maps onto a value the cloud could be configured with (0 = unchecked where the
// spec allows it), small enough that one input exercises the bounds.
inline SampleSpec SpecFromBytes(const uint8_t* b) {
  SampleSpec spec;
  spec.grid_tokens = b[0] % 65;  // 0 = any
  spec.feature_dim = b[1] % 65;
  spec.vocab_size = b[2] == 0 ? 0 : uint32_t{b[2]} * 4;
  spec.max_prompt_tokens = 1 + b[3] % 64;
  spec.max_answer_tokens = 1 + b[4] % 32;
  spec.max_samples_per_batch = 1 + b[5] % 16;
  spec.max_decoded_bytes_per_batch = (uint64_t{b[6]} + 1) << 10;
  // A frame size, or none (a cloud that takes visual tokens only).
  if (b[7] != 0) {
    spec.frame_width = b[7] % 64 + 1;
    spec.frame_height = b[8] % 64 + 1;
  }
  return spec;
}

}  // namespace cdcca::cloud::fuzz

#endif  // CDCCA_CLOUD_FUZZ_INGEST_SPEC_H_
