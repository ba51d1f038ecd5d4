#include "device/internal/state_file.h"

#include <cstring>

#include "absl/status/status.h"
#include "compress/byte_io.h"
#include "compress/hash64.h"
#include "storage/sealed_file.h"

namespace cdcca::device::internal {
namespace {

constexpr uint32_t kKind = storage::SealKind("DVTS");
constexpr uint32_t kFormat = 1;

using compress::Put;

// The fields: u64 version | u64 digest | safetensors (the rest).
absl::StatusOr<TrainableStateFile> GetFields(absl::string_view in) {
  if (in.size() < 16) return absl::DataLossError("trainable state is truncated");
  TrainableStateFile f;
  std::memcpy(&f.version, in.data(), 8);
  std::memcpy(&f.digest, in.data() + 8, 8);
  f.safetensors = in.substr(16);
  return f;
}

// The framing before the sealed envelope: the fields, then a u64 Hash64 of them.
absl::StatusOr<TrainableStateFile> DecodeLegacy(absl::string_view bytes) {
  if (bytes.size() < 24) return absl::DataLossError("trainable state is truncated");
  uint64_t hash = 0;
  std::memcpy(&hash, bytes.data() + bytes.size() - 8, 8);
  if (hash != compress::Hash64(bytes.data(), bytes.size() - 8)) {
    return absl::DataLossError("trainable state checksum mismatch");
  }
  return GetFields(bytes.substr(0, bytes.size() - 8));
}

}  // namespace

std::string EncodeTrainableStateFile(uint64_t version, uint64_t digest,
                                     absl::string_view safetensors) {
  std::string body;
  body.reserve(16 + safetensors.size());
  Put(body, version);
  Put(body, digest);
  body.append(safetensors.data(), safetensors.size());
  return storage::Seal(kKind, kFormat, body);
}

absl::StatusOr<TrainableStateFile> DecodeTrainableStateFile(absl::string_view bytes) {
  if (!storage::IsSealed(bytes)) return DecodeLegacy(bytes);
  absl::StatusOr<absl::string_view> body =
      storage::Unseal(bytes, kKind, kFormat, "the trainable state");
  if (!body.ok()) {
    // A file of the old framing whose version happens to begin with the envelope's magic.
    absl::StatusOr<TrainableStateFile> legacy = DecodeLegacy(bytes);
    if (legacy.ok()) return legacy;
    return body.status();
  }
  return GetFields(*body);
}

}  // namespace cdcca::device::internal
