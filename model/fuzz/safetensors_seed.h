// Torch-free safetensors bytes for seed generators (the safetensors, mirror and device state
// fuzzers): a header written with nlohmann_json, padded to 8 bytes as writers do, then
// deterministic data.
#ifndef CDCCA_MODEL_FUZZ_SAFETENSORS_SEED_H_
#define CDCCA_MODEL_FUZZ_SAFETENSORS_SEED_H_

#include <cstdint>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace cdcca::model::fuzz {

struct SeedTensor {
  std::string name;
  std::string dtype;  // "F32", "F16", ...
  int element_bytes;
  std::vector<int64_t> shape;
};

inline std::string SafetensorsSeed(const std::vector<SeedTensor>& tensors,
                                   const nlohmann::json& metadata = nlohmann::json()) {
  nlohmann::json header = nlohmann::json::object();
  if (metadata.is_object()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SeedTensor& t : tensors) {
    uint64_t bytes = t.element_bytes;
    for (int64_t d : t.shape) bytes *= d;
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = head.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += head;
  for (uint64_t i = 0; i < offset; ++i) out.push_back(static_cast<char>(i * 37));
  return out;
}

}  // namespace cdcca::model::fuzz

#endif  // CDCCA_MODEL_FUZZ_SAFETENSORS_SEED_H_
