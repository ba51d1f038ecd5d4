// libFuzzer entry for the device's trainable state file (`<state_dir>/trainable.state`):
// the framing, then the safetensors it holds (what LoadTrainableState decodes).
// Input: reseal flag + file (storage/fuzz/reseal_envelope.h: the sealed envelope or the older
// framing).
#include <cstddef>
#include <cstdint>
#include <string>

#include "device/internal/state_file.h"
#include "model/hub/safetensors_view.h"
#include "storage/fuzz/reseal_envelope.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string file = cdcca::storage::fuzz::ResealStateFile(data, size);
  absl::StatusOr<cdcca::device::internal::TrainableStateFile> f =
      cdcca::device::internal::DecodeTrainableStateFile(file);
  if (!f.ok()) return 0;
  // The fixed fields and the framing: 16 + the envelope's 24, or 16 + the Hash64's 8.
  if (f->safetensors.size() > file.size()) __builtin_trap();
  const size_t framing = file.size() - f->safetensors.size();
  if (framing != 40 && framing != 24) __builtin_trap();
  (void)cdcca::model::ParseSafetensors(f->safetensors);
  return 0;
}
