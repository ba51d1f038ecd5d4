// FNV-1a 64, the model module's fingerprint hash (checkpoint.h BaseFingerprint /
// ModuleFingerprint, multimodal_model.h TowerFingerprint, adapter_state.h FolderFingerprint):
// h = Fnv1a(h, bytes...) folded from kFnvOffset. Identity checks, not a MAC.
#ifndef CDCCA_MODEL_HUB_FNV_H_
#define CDCCA_MODEL_HUB_FNV_H_

#include <cstddef>
#include <cstdint>

namespace cdcca::model {

inline constexpr uint64_t kFnvOffset = 14695981039346656037ULL;

inline uint64_t Fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_FNV_H_
