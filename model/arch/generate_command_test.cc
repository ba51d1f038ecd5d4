// `cdcca generate` end to end (tokenizer + image processor + model) against transformers on
// every model fixture (LLaVA, BLIP-2, InstructBLIP): identical input_ids and greedy tokens, first
// logits within 1e-4 of the largest. The images go through OpenCV decoding and the PIL-exact resize
// here, so this also checks that the pixels the model sees are the processor's.
#include "model/arch/generate_command.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

using ::testing::HasSubstr;

std::string Fixtures() { return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf"; }

class GenerateCommandTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerateCommandTest, MatchesTransformers) {
  const std::string dir = Fixtures() + "/models/" + GetParam();
  std::ifstream in(dir + "/expected.json");
  const nlohmann::json expected = nlohmann::json::parse(in);
  for (const nlohmann::json& c : expected["cases"]) {
    GenerateRequest r;
    r.model_dir = dir;
    r.image_path = Fixtures() + "/images/" + c["image"].get<std::string>();
    r.prompt = c["prompt"].get<std::string>();
    r.max_new_tokens = c["max_new_tokens"].get<int64_t>();
    ASSERT_OK_AND_ASSIGN(GenerateReply reply, RunGenerate(r));
    EXPECT_EQ(reply.input_ids, c["input_ids"].get<std::vector<int64_t>>()) << r.prompt;
    EXPECT_EQ(reply.tokens, c["greedy_tokens"].get<std::vector<int64_t>>()) << r.image_path;
    EXPECT_EQ(reply.text, c["text"].get<std::string>());
    const std::vector<float> want = c["first_logits"].get<std::vector<float>>();
    ASSERT_EQ(reply.first_logits.size(), want.size());
    float largest = 0, worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      largest = std::max(largest, std::fabs(want[i]));
      worst = std::max(worst, std::fabs(want[i] - reply.first_logits[i]));
    }
    EXPECT_LT(worst, 1e-4 * largest) << r.image_path;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GenerateCommandTest,
                         ::testing::Values("llava_clip_llama", "llava_siglip_qwen2",
                                           "llava_clip_llama_gqa_rope",
                                           "llava_clip_llama_bias_yarn", "llava_clip_llama_dynamic",
                                           "blip2_llama", "instructblip_llama", "blip2_opt",
                                           "blip2_opt_proj", "blip2_flan_t5",
                                           "instructblip_flan_t5"));

TEST(GenerateCommandErrorsTest, NameTheCause) {
  GenerateRequest r;
  r.model_dir = Fixtures() + "/models/llava_clip_llama";
  r.image_path = "/nonexistent/image.png";
  r.prompt = "USER: <image>\nHi ASSISTANT:";
  EXPECT_THAT(RunGenerate(r).status(),
              testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/image.png")));
  r.template_name = "nope";
  EXPECT_THAT(RunGenerate(r).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--template nope")));
  EXPECT_EQ(*ApplyPromptTemplate("llava", "What?"), "USER: <image>\nWhat? ASSISTANT:");
}

}  // namespace
}  // namespace cdcca::model
