#include "device/internal/state_file.h"

#include <cstring>

#include "absl/status/status.h"
#include "compress/hash64.h"

namespace cdcca::device::internal {
namespace {

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

}  // namespace

std::string EncodeTrainableStateFile(uint64_t version, uint64_t digest,
                                     absl::string_view safetensors) {
  std::string out;
  out.reserve(24 + safetensors.size());
  Put(out, version);
  Put(out, digest);
  out.append(safetensors.data(), safetensors.size());
  Put(out, compress::Hash64(out.data(), out.size()));
  return out;
}

absl::StatusOr<TrainableStateFile> DecodeTrainableStateFile(absl::string_view bytes) {
  if (bytes.size() < 24) return absl::DataLossError("trainable state is truncated");
  uint64_t hash = 0;
  std::memcpy(&hash, bytes.data() + bytes.size() - 8, 8);
  if (hash != compress::Hash64(bytes.data(), bytes.size() - 8)) {
    return absl::DataLossError("trainable state checksum mismatch");
  }
  TrainableStateFile f;
  std::memcpy(&f.version, bytes.data(), 8);
  std::memcpy(&f.digest, bytes.data() + 8, 8);
  f.safetensors = bytes.substr(16, bytes.size() - 24);
  return f;
}

}  // namespace cdcca::device::internal
