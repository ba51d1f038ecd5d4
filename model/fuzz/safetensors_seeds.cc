// Writes a seed corpus for the safetensors fuzzer: small valid files of every dtype, with
// and without metadata, scalars and empty tensors.
// Usage: safetensors_fuzz_seeds OUT_DIR
#include <cstdio>
#include <string>

#include "model/fuzz/safetensors_seed.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  using cdcca::model::fuzz::SafetensorsSeed;
  const struct {
    const char* dtype;
    int bytes;
  } dtypes[] = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8},
                {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  int written = 0;
  const auto write = [&](const std::string& bytes) {
    // No checksum in this format: the file goes in as is.
    const std::string path = std::string(argv[1]) + "/seed_" + std::to_string(written++);
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) return false;
    const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    return std::fclose(f) == 0 && ok;
  };
  for (const auto& d : dtypes) {
    if (!write(SafetensorsSeed(
            {{"layers.0.w", d.dtype, d.bytes, {2, 3}}, {"norm", d.dtype, d.bytes, {3}}}))) {
      return 1;
    }
  }
  if (!write(SafetensorsSeed(
          {{"scalar", "F32", 4, {}}, {"empty", "F32", 4, {0, 4}}, {"q", "F16", 2, {1, 2, 2}}},
          {{"version", "3"}, {"format", "pt"}})) ||
      !write(SafetensorsSeed({}))) {
    return 1;
  }
  std::printf("wrote %d seeds to %s\n", written, argv[1]);
  return 0;
}
