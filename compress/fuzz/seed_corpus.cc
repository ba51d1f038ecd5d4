// Writes a seed corpus for the decoder fuzzer: valid payloads for the fuzz set at every bit
// width, dense and sparse, zstd and raw, each behind the reseal flag (compress/fuzz/reseal.h).
// Usage: compress_fuzz_seeds OUT_DIR
#include <cstdio>
#include <string>

#include "compress/delta_encoder.h"
#include "compress/fuzz/fuzz_set.h"
#include "compress/fuzz/reseal.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  using cdcca::compress::DeltaEncoder;
  using cdcca::compress::DeltaEncoderOptions;
  const cdcca::compress::fuzz::FuzzSet mirror = cdcca::compress::fuzz::MakeFuzzSet(0.5f);
  const cdcca::compress::fuzz::FuzzSet fresh = cdcca::compress::fuzz::MakeFuzzSet(0.53f);
  int written = 0;
  for (int bits : {1, 2, 3, 4, 8}) {
    for (double topk : {0.0, 0.3}) {
      for (int level : {0, 3}) {
        DeltaEncoderOptions options;
        options.allowed_bits = {0, bits};
        options.bits_per_param = 0.0;
        options.topk_fraction = topk;
        options.zstd_level = level;
        options.group_size = 16;
        DeltaEncoder encoder(options);
        auto payload = encoder.Encode(fresh.views, mirror.views, 3, 4);
        if (!payload.ok()) {
          std::fprintf(stderr, "encode failed: %s\n", payload.status().ToString().c_str());
          return 1;
        }
        if (!cdcca::compress::fuzz::WriteSeed(argv[1], "seed_" + std::to_string(written++),
                                              payload->bytes)) {
          return 1;
        }
      }
    }
  }
  std::printf("wrote %d seeds to %s\n", written, argv[1]);
  return 0;
}
