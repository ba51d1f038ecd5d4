// Writes a seed corpus for the device state fuzzer: trainable.state files as the agent
// writes them. Usage: device_state_fuzz_seeds OUT_DIR
#include <cstdio>
#include <string>

#include "compress/fuzz/reseal.h"
#include "device/internal/state_file.h"
#include "model/fuzz/safetensors_seed.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  using cdcca::model::fuzz::SafetensorsSeed;
  const std::string files[] = {
      cdcca::device::internal::EncodeTrainableStateFile(0, 0, SafetensorsSeed({})),
      cdcca::device::internal::EncodeTrainableStateFile(
          3, 0xfeed,
          SafetensorsSeed({{"query_tokens", "F32", 4, {3, 8}},
                           {"lora.B", "F32", 4, {8, 2}},
                           {"gate", "F32", 4, {}}})),
  };
  int written = 0;
  for (const std::string& f : files) {
    // A seed the decoder rejects would only test the rejection paths.
    if (!cdcca::device::internal::DecodeTrainableStateFile(f).ok()) {
      std::fprintf(stderr, "state file does not round-trip\n");
      return 1;
    }
    if (!cdcca::compress::fuzz::WriteSeed(argv[1], "seed_" + std::to_string(written++), f)) {
      return 1;
    }
  }
  std::printf("wrote %d seeds to %s\n", written, argv[1]);
  return 0;
}
