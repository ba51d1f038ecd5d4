// libFuzzer entry for model.safetensors.index.json: the bounded JSON reader, then the
// weight_map check. An accepted index names only plain files of the model folder.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "model/hub/folder_json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string file = "model.safetensors.index.json";
  absl::StatusOr<nlohmann::json> j = cdcca::model::ParseHfJson(text, file);
  if (!j.ok()) return 0;
  absl::StatusOr<std::map<std::string, std::string>> map =
      cdcca::model::ParseSafetensorsIndex(*j, file);
  if (!map.ok()) return 0;
  for (const auto& [tensor, shard] : *map) {
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
        shard.find('\0') != std::string::npos) {
      __builtin_trap();
    }
  }
  return 0;
}
