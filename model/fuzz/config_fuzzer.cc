// libFuzzer entry for the model config readers: a family config file
// (configs/models/*.json, a checkpoint's config.json) and the tower / vision configs kept in
// checkpoint metadata. Every input goes through all three parsers.
#include <cstddef>
#include <cstdint>
#include <string>

#include "model/family/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  using namespace cdcca::model;
  absl::StatusOr<FamilyConfig> family = ParseFamilyConfig(text);
  if (family.ok()) {
    // Derived sizes are defined, and what the checkpoint writer stores reads back.
    if (family->vision.NumTokens() <= 0) __builtin_trap();
    for (const TowerConfig* t : {&family->teacher, &family->student}) {
      if (!ParseTowerConfig(TowerConfigToJson(*t)).ok()) __builtin_trap();
    }
    if (!ParseVisionConfig(VisionConfigToJson(family->vision)).ok()) __builtin_trap();
  }
  absl::StatusOr<TowerConfig> tower = ParseTowerConfig(text);
  if (tower.ok() && !ValidateTower(*tower).ok()) __builtin_trap();
  absl::StatusOr<VisionConfig> vision = ParseVisionConfig(text);
  if (vision.ok() && vision->NumTokens() <= 0) __builtin_trap();
  return 0;
}
