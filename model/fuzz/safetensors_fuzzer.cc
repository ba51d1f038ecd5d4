// libFuzzer entry for the safetensors parser (snapshots, mirrors, device state, checkpoints):
// ParseSafetensors is the torch-free half of DecodeSafetensors, which only adds
// torch::empty + memcpy per checked entry.
#include <cstddef>
#include <cstdint>
#include <string>

#include "model/hub/safetensors_view.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<cdcca::model::SafetensorsView> view = cdcca::model::ParseSafetensors(bytes);
  if (!view.ok()) return 0;
  // What DecodeSafetensors relies on: ranges tile the data, sizes match dtype x shape.
  uint64_t covered = 0;
  for (const auto& e : view->tensors) {
    if (e.begin != covered || e.end < e.begin || e.bytes.size() != e.end - e.begin) {
      __builtin_trap();
    }
    covered = e.end;
    uint64_t want = cdcca::model::SafetensorsDtypeBytes(e.dtype);
    for (int64_t d : e.shape) {
      if (d < 0) __builtin_trap();
      if (__builtin_mul_overflow(want, static_cast<uint64_t>(d), &want)) __builtin_trap();
    }
    if (want != e.bytes.size()) __builtin_trap();
    if (e.bytes.data() < bytes.data() || e.bytes.data() + e.bytes.size() > bytes.data() + size) {
      __builtin_trap();
    }
  }
  return 0;
}
