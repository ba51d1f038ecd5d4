// The config readers on hostile values (found by model/fuzz/config_fuzzer.cc or by
// reading it): every one is an InvalidArgument naming the field, never undefined behaviour.
#include "model/family/config.h"

#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

using ::cdcca::testing::StatusIs;
using nlohmann::json;
using ::testing::HasSubstr;

json Tiny() {
  std::ifstream in(std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

TEST(ConfigTest, CommittedConfigsParse) {
  for (const char* name : {"tiny", "small", "base", "small-caption", "llava-tiny", "llava-small"}) {
    std::ifstream in(std::string(CDCCA_SOURCE_DIR) + "/configs/models/" + name + ".json");
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_OK(ParseFamilyConfig(ss.str())) << name;
  }
  json j = Tiny();
  j["student"]["d_model"] = 32.0;  // an integral float reads as the integer
  ASSERT_OK_AND_ASSIGN(FamilyConfig f, ParseFamilyConfig(j.dump()));
  EXPECT_EQ(f.student.d_model, 32);
}

// "architecture" picks the towers' kind: BLIP-2 unless a config says "llava"; nothing else.
TEST(ConfigTest, ArchitectureIsBlip2OrLlava) {
  ASSERT_OK_AND_ASSIGN(FamilyConfig tiny, ParseFamilyConfig(Tiny().dump()));
  EXPECT_EQ(tiny.architecture, "blip-2");
  std::ifstream in(std::string(CDCCA_SOURCE_DIR) + "/configs/models/llava-small.json");
  std::stringstream ss;
  ss << in.rdbuf();
  ASSERT_OK_AND_ASSIGN(FamilyConfig llava, ParseFamilyConfig(ss.str()));
  EXPECT_EQ(llava.architecture, "llava");
  json j = Tiny();
  j["architecture"] = "flamingo";
  EXPECT_THAT(ParseFamilyConfig(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("config.architecture")));
}

// Regression: a double outside int's or float's range was converted with undefined
// behaviour (1e300 -> int, 1e300 -> float), and an integer over 2^31 wrapped silently.
TEST(ConfigTest, NumbersOutsideTheFieldsTypeAreInvalid) {
  const struct {
    const char* tower;
    const char* key;
    json value;
  } cases[] = {{"student", "d_model", 1e300},         {"teacher", "lm_layers", -1e300},
               {"student", "lora_alpha", 1e300},      {"student", "dropout", 1e39},
               {"student", "ffn_hidden", 4294967360}, {"teacher", "qa_dim", 32.5},
               {"student", "num_queries", "4"}};
  for (const auto& c : cases) {
    json j = Tiny();
    j[c.tower][c.key] = c.value;
    EXPECT_THAT(ParseFamilyConfig(j.dump()),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.key)))
        << c.tower << "." << c.key << " = " << c.value.dump();
  }
}

// Regression: the derived grid and token count must not overflow for huge images, and a
// patch size that does not divide the image, or heads that do not divide the width, are
// errors naming the field.
TEST(ConfigTest, VisionSizesAreBounded) {
  json j = Tiny();
  j["vision"]["image_size"] = 1 << 30;
  EXPECT_THAT(ParseFamilyConfig(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vision.image_size")));
  j = Tiny();
  j["vision"]["image_size"] = 8192;
  j["vision"]["patch_size"] = 1;  // 2^26 tokens
  EXPECT_THAT(ParseFamilyConfig(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tokens")));
  j = Tiny();
  j["vision"]["patch_size"] = 7;
  EXPECT_THAT(ParseFamilyConfig(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vision.patch_size")));
  j = Tiny();
  j["vision"]["heads"] = 3;
  EXPECT_THAT(ParseFamilyConfig(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vision.heads")));
  j = Tiny();
  j["vision"]["channels"] = {8, 8};  // a key no vision config has
  EXPECT_THAT(ParseFamilyConfig(j.dump()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vision.channels")));
  // The vision config stored in checkpoint metadata gets the same checks.
  EXPECT_THAT(ParseVisionConfig(R"({"image_size": 64, "patch_size": 0, "d_vis": 8})"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseVisionConfig(R"({"image_size": 64, "patch_size": 8, "d_vis": -8})"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(VisionConfig v, ParseVisionConfig(R"({"image_size": 64, "patch_size": 4,
      "d_vis": 8, "layers": 1, "heads": 2, "mlp_hidden": 16})"));
  EXPECT_EQ(v.GridSide(), 16);
  EXPECT_EQ(v.NumTokens(), 257);  // the class token and 16 x 16 patches
}

}  // namespace
}  // namespace cdcca::model
