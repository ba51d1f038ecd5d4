// Writes a seed corpus for the ingest-check fuzzer (cloud/fuzz/ingest_spec.h): batches at
// fp16, int8, int4 and jpeg, each after spec bytes that accept it, so that the fuzzer starts
// from inputs the check passes.
// Usage: ingest_fuzz_seeds OUT_DIR
#include <cstdio>
#include <string>
#include <vector>

#include "cloud/fuzz/ingest_spec.h"
#include "compress/uplink_codec.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  using cdcca::compress::FeaturePrecision;
  int written = 0;
  for (FeaturePrecision p : {FeaturePrecision::kFp16, FeaturePrecision::kInt8,
                             FeaturePrecision::kInt4, FeaturePrecision::kJpeg}) {
    std::vector<cdcca::compress::UplinkSample> samples;
    for (int i = 0; i < 2; ++i) {
      cdcca::compress::UplinkSample s;
      s.sample_id = 10 + i;
      s.grid_tokens = 16;
      s.feature_dim = 8;
      s.kept_indices = {0, 3, static_cast<uint16_t>(7 + i)};
      s.prompt_tokens = {5, 6, 7};
      s.answer_tokens = {9};
      if (p == FeaturePrecision::kJpeg) {  // a baseline 8 x 8 frame header
        s.frame =
            std::string("\xFF\xD8\xFF\xC0\x00\x08\x08\x00\x08\x00\x08\x03\xFF\xDA\x00\x02", 16);
      } else {
        for (int k = 0; k < 3 * 8; ++k) s.features.push_back(0.5f * (k % 5) - 1.0f);
      }
      samples.push_back(std::move(s));
    }
    absl::StatusOr<std::string> payload = cdcca::compress::EncodeUplinkBatch(samples, p);
    if (!payload.ok()) {
      std::fprintf(stderr, "encode failed: %s\n", payload.status().ToString().c_str());
      return 1;
    }
    // grid 16, dim 8, vocab 40, prompt <= 64, answer <= 32, 16 samples, 256 KiB, frame 8 x 8;
    // then the reseal flag (1: the payload's own checksum is kept valid under mutation).
    const std::string spec = {16, 8, 10, 63, 31, 15, static_cast<char>(255), 7, 7, 0};
    static_assert(cdcca::cloud::fuzz::kSpecBytes == 10);
    const std::string input = spec + '\x01' + *payload;
    const std::string path = std::string(argv[1]) + "/seed_" + std::to_string(written++);
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr || std::fwrite(input.data(), 1, input.size(), f) != input.size() ||
        std::fclose(f) != 0) {
      std::perror(path.c_str());
      return 1;
    }
  }
  std::printf("wrote %d seeds to %s\n", written, argv[1]);
  return 0;
}
