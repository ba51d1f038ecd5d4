// libFuzzer entry for the device's trainable state file (`<state_dir>/trainable.state`):
// the framing, then the safetensors it holds (what LoadTrainableState decodes).
// Input: reseal flag + file (compress/fuzz/reseal.h).
#include <cstddef>
#include <cstdint>
#include <string>

#include "compress/fuzz/reseal.h"
#include "device/internal/state_file.h"
#include "model/hub/safetensors_view.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string file = cdcca::compress::fuzz::Reseal(data, size);
  absl::StatusOr<cdcca::device::internal::TrainableStateFile> f =
      cdcca::device::internal::DecodeTrainableStateFile(file);
  if (!f.ok()) return 0;
  if (f->safetensors.size() + 24 != file.size()) __builtin_trap();
  (void)cdcca::model::ParseSafetensors(f->safetensors);
  return 0;
}
