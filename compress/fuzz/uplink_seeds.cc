// Writes a seed corpus for the uplink fuzzer: valid batches of one and several samples, fp16,
// int8, int4 and jpeg, each behind the reseal flag (compress/fuzz/reseal.h).
// Usage: uplink_fuzz_seeds OUT_DIR
#include <cstdio>
#include <string>
#include <vector>

#include "compress/fuzz/reseal.h"
#include "compress/uplink_codec.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  using cdcca::compress::FeaturePrecision;
  using cdcca::compress::UplinkSample;
  int written = 0;
  for (FeaturePrecision p : {FeaturePrecision::kFp16, FeaturePrecision::kInt8,
                             FeaturePrecision::kInt4, FeaturePrecision::kJpeg}) {
    for (int count : {1, 3}) {
      std::vector<UplinkSample> samples;
      for (int i = 0; i < count; ++i) {
        UplinkSample s;
        s.sample_id = 100 + i;
        s.model_version = 7;
        s.entropy = 0.25f * i;
        s.grid_tokens = 16;
        s.feature_dim = 6 + i;
        s.kept_indices = {1, 4, static_cast<uint16_t>(9 + i)};
        s.prompt_tokens = {5, 6, 7};
        s.answer_tokens = {9};
        if (p == FeaturePrecision::kJpeg) {  // a frame header the codec reads, 8 x 8
          s.frame = std::string(
              "\xFF\xD8\xFF\xC0\x00\x08\x08\x00\x08\x00\x08\x03"
              "\xFF\xDA\x00\x02",
              16);
        } else {
          for (size_t k = 0; k < s.kept_indices.size() * s.feature_dim; ++k) {
            s.features.push_back(static_cast<float>(k % 7) - 3.0f + 0.125f * i);
          }
        }
        samples.push_back(std::move(s));
      }
      auto payload = cdcca::compress::EncodeUplinkBatch(samples, p);
      if (!payload.ok()) {
        std::fprintf(stderr, "encode failed: %s\n", payload.status().ToString().c_str());
        return 1;
      }
      if (!cdcca::compress::fuzz::WriteSeed(argv[1], "seed_" + std::to_string(written++),
                                            *payload)) {
        return 1;
      }
    }
  }
  std::printf("wrote %d seeds to %s\n", written, argv[1]);
  return 0;
}
