// The tiny Hugging Face fixtures under tests/fixtures/hf/models/ (made by
// scripts/hf_fixtures.py): a fixture's folder and its first recorded case as a model's
// inputs. Header-only, for the model tests.
#ifndef CDCCA_TESTS_TESTING_HF_FIXTURE_CASE_H_
#define CDCCA_TESTS_TESTING_HF_FIXTURE_CASE_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/safetensors.h"
#include "nlohmann/json.hpp"

namespace cdcca::testing {

inline std::string HfFixtureDir(const std::string& variant) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + variant;
}

// The first case of a fixture's expected.json as the model's inputs (batch of one).
inline model::MultimodalInputs FirstCase(const std::string& dir) {
  std::ifstream in(dir + "/expected.json");
  const nlohmann::json c = nlohmann::json::parse(in)["cases"][0];
  model::MultimodalInputs inputs;
  absl::StatusOr<model::SafetensorsContents> pixels =
      model::ReadSafetensors(dir + "/expected_pixels.safetensors");
  EXPECT_TRUE(pixels.ok()) << pixels.status();
  if (pixels.ok()) {
    for (const auto& [name, t] : pixels->tensors) {
      if (name == "case0") inputs.pixel_values = t.unsqueeze(0);
    }
  }
  inputs.input_ids =
      torch::tensor(c["input_ids"].get<std::vector<int64_t>>(), torch::kLong).unsqueeze(0);
  if (c.contains("qformer_input_ids")) {
    inputs.qformer_input_ids =
        torch::tensor(c["qformer_input_ids"].get<std::vector<int64_t>>(), torch::kLong)
            .unsqueeze(0);
    inputs.qformer_attention_mask = torch::ones_like(inputs.qformer_input_ids);
  }
  return inputs;
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_HF_FIXTURE_CASE_H_
