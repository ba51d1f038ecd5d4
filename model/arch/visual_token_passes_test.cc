// UTS stage 2 on Hugging Face folders (MultimodalModel::StochasticVisualTokens, hf_model.h)
// on the tiny random checkpoints under tests/fixtures/hf/models/:
// - the masks: drawn from the seed (same seed, same masks), or given;
// - Eq. 3: the variance is the population variance of the per-pass mass, absent tokens
//   receive none, and passes with the same mask give the same mass;
// - what a mask means: on LLaVA a masked pass equals the LM run with the absent image tokens
//   deleted from its input; on BLIP-2 it equals the Q-Former run on the present tokens only;
// - transformers: where uts_expected.safetensors is present (scripts/hf_fixtures.py --uts),
//   the mass matches what transformers' attentions give for the same masks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "model/arch/blip2.h"
#include "model/arch/hf_model.h"
#include "model/arch/llava.h"
#include "model/hub/safetensors.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

using nlohmann::json;

std::string FixtureDir(const std::string& variant) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + variant;
}

// The first case of a fixture as the model's inputs (batch of one).
MultimodalInputs FirstCase(const std::string& dir) {
  std::ifstream in(dir + "/expected.json");
  const json c = json::parse(in)["cases"][0];
  MultimodalInputs inputs;
  absl::StatusOr<SafetensorsContents> pixels =
      ReadSafetensors(dir + "/expected_pixels.safetensors");
  EXPECT_TRUE(pixels.ok()) << pixels.status();
  for (const auto& [name, t] : pixels->tensors) {
    if (name == "case0") inputs.pixel_values = t.unsqueeze(0);
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

class VisualTokenPassesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(VisualTokenPassesTest, VarianceIsEq3OverTheSeededPasses) {
  const std::string dir = FixtureDir(GetParam());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadHfModel(dir, {}));
  const MultimodalInputs in = FirstCase(dir);
  VisualTokenPassOptions o;
  o.passes = 6;
  o.dropout_p = 0.3;
  o.seed = 11;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses a, model->StochasticVisualTokens(in, o));
  const int64_t n = a.tokens.size(0);
  ASSERT_GT(n, 1);
  ASSERT_EQ(a.present.sizes(), (std::vector<int64_t>{6, n}));
  ASSERT_EQ(a.mass.sizes(), (std::vector<int64_t>{6, n}));
  ASSERT_EQ(a.variance.sizes(), (std::vector<int64_t>{n}));
  // Some tokens dropped, most kept, at about the rate asked for.
  const double absent = 1.0 - a.present.to(torch::kFloat).mean().item<double>();
  EXPECT_GT(absent, 0.1);
  EXPECT_LT(absent, 0.5);
  // Absent tokens receive no attention; present ones some.
  EXPECT_EQ(a.mass.masked_select(a.present.logical_not()).abs().max().item<float>(), 0.0f);
  EXPECT_GT(a.mass.masked_select(a.present).min().item<float>(), 0.0f);
  // Eq. 3: (1/M) sum (F_m - mean)^2, and not all equal.
  torch::Tensor mean = a.mass.mean(0);
  torch::Tensor want = torch::zeros({n});
  for (int64_t m = 0; m < 6; ++m) want += (a.mass[m] - mean).pow(2) / 6.0;
  EXPECT_TRUE(torch::allclose(a.variance, want, 1e-6, 1e-12));
  EXPECT_GT(a.variance.max().item<float>(), 0.0f);
  // The same seed draws the same masks and gives the same scores; another seed other masks.
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses b, model->StochasticVisualTokens(in, o));
  EXPECT_TRUE(torch::equal(a.present, b.present));
  EXPECT_TRUE(torch::allclose(a.variance, b.variance, 1e-6, 1e-12));
  o.seed = 12;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses c, model->StochasticVisualTokens(in, o));
  EXPECT_FALSE(torch::equal(a.present, c.present));
}

TEST_P(VisualTokenPassesTest, GivenMasksAreUsedAndEqualMasksGiveEqualMass) {
  const std::string dir = FixtureDir(GetParam());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadHfModel(dir, {}));
  const MultimodalInputs in = FirstCase(dir);
  VisualTokenPassOptions probe;
  probe.passes = 1;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses first, model->StochasticVisualTokens(in, probe));
  const int64_t n = first.tokens.size(0);
  // Pass 0 and 2 keep everything, pass 1 drops the first half.
  VisualTokenPassOptions o;
  o.present = torch::ones({3, n}, torch::kBool);
  o.present[1].narrow(0, 0, n / 2).fill_(false);
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses p, model->StochasticVisualTokens(in, o));
  EXPECT_TRUE(torch::equal(p.present, o.present));
  EXPECT_TRUE(torch::allclose(p.mass[0], p.mass[2], 1e-6, 1e-9));
  EXPECT_EQ(p.mass[1].narrow(0, 0, n / 2).abs().max().item<float>(), 0.0f);
  // Dropping half moves the other half's mass.
  EXPECT_GT((p.mass[1] - p.mass[0]).narrow(0, n / 2, n - n / 2).abs().max().item<float>(), 1e-6f);
  // All present in every pass: no variance.
  o.present = torch::ones({4, n}, torch::kBool);
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses still, model->StochasticVisualTokens(in, o));
  EXPECT_LT(still.variance.max().item<float>(), 1e-12f);
}

TEST_P(VisualTokenPassesTest, RefusesBadOptionsAndBatches) {
  const std::string dir = FixtureDir(GetParam());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadHfModel(dir, {}));
  MultimodalInputs in = FirstCase(dir);
  VisualTokenPassOptions o;
  o.passes = 0;
  EXPECT_EQ(model->StochasticVisualTokens(in, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.passes = 4;
  o.dropout_p = 1.0;
  EXPECT_EQ(model->StochasticVisualTokens(in, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.dropout_p = 0.1;
  o.present = torch::ones({2, 3}, torch::kBool);
  EXPECT_EQ(model->StochasticVisualTokens(in, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.present = torch::Tensor();
  in.pixel_values = torch::cat({in.pixel_values, in.pixel_values});
  if (in.qformer_input_ids.defined()) {
    in.qformer_input_ids = torch::cat({in.qformer_input_ids, in.qformer_input_ids});
  }
  in.input_ids = torch::cat({in.input_ids, in.input_ids});
  EXPECT_EQ(model->StochasticVisualTokens(in, o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Against transformers: scripts/hf_fixtures.py --uts writes, per folder, the masks it used
// and the mass transformers' attentions give (LLaVA: absent image tokens deleted from
// inputs_embeds, output_attentions of the LM; BLIP-2: the Q-Former's cross_attentions with
// encoder_attention_mask).
TEST_P(VisualTokenPassesTest, MassMatchesTransformers) {
  const std::string dir = FixtureDir(GetParam());
  if (!std::filesystem::exists(dir + "/uts_expected.safetensors")) {
    GTEST_SKIP() << dir << " has no uts_expected.safetensors (scripts/hf_fixtures.py --uts)";
  }
  ASSERT_OK_AND_ASSIGN(SafetensorsContents want,
                       ReadSafetensors(dir + "/uts_expected.safetensors"));
  torch::Tensor present, mass;
  for (const auto& [name, t] : want.tensors) {
    if (name == "present") present = t;
    if (name == "mass") mass = t;
  }
  ASSERT_TRUE(present.defined() && mass.defined());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadHfModel(dir, {}));
  VisualTokenPassOptions o;
  o.present = present.to(torch::kBool);
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses got, model->StochasticVisualTokens(FirstCase(dir), o));
  const float err = (got.mass - mass.to(torch::kFloat)).abs().max().item<float>();
  EXPECT_LT(err, 1e-5f * std::max(1.0f, mass.abs().max().item<float>())) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Folders, VisualTokenPassesTest,
                         ::testing::Values("llava_clip_llama", "llava_siglip_qwen2", "blip2_llama",
                                           "instructblip_llama"));

// LLaVA: a masked pass is what deleting the absent image tokens from the LM input computes.
TEST(LlavaVisualTokenPassesTest, MaskedPassEqualsTheInputWithoutTheAbsentTokens) {
  const std::string dir = FixtureDir("llava_clip_llama");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadHfModel(dir, {}));
  ASSERT_OK_AND_ASSIGN(HfFolder folder, HfFolder::Open(dir));
  ASSERT_OK_AND_ASSIGN(LlavaConfig config, ParseLlavaConfig(folder.config(), "config.json"));
  if (!folder.Has("lm_head.weight")) config.text.tie_word_embeddings = true;
  Llava llava(config, HfPrecision{});
  ASSERT_OK(llava->Load(folder, torch::kCPU));
  llava->eval();
  torch::NoGradGuard no_grad;

  const MultimodalInputs in = FirstCase(dir);
  const int64_t n = config.NumImageTokens();
  torch::Tensor keep = torch::ones({1, n}, torch::kBool);
  for (int64_t i = 0; i < n; i += 3) keep[0][i] = false;  // every third token absent
  VisualTokenPassOptions o;
  o.present = keep;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses got, model->StochasticVisualTokens(in, o));

  // The same pass by hand: the present features only, one image token per present feature.
  torch::Tensor features = llava->Project(llava->SelectedFeatures(in.pixel_values));
  torch::Tensor present_idx = keep[0].nonzero().squeeze(1);
  torch::Tensor kept_features = features.index_select(1, present_idx);
  std::vector<int64_t> ids;
  std::vector<int64_t> image_slots;  // position in the shortened input of each present token
  int64_t image_seen = 0;
  for (int64_t id : std::vector<int64_t>(in.input_ids.data_ptr<int64_t>(),
                                         in.input_ids.data_ptr<int64_t>() + in.input_ids.numel())) {
    if (id == config.image_token_id) {
      if (keep[0][image_seen++].item<bool>()) {
        image_slots.push_back(static_cast<int64_t>(ids.size()));
        ids.push_back(id);
      }
    } else {
      ids.push_back(id);
    }
  }
  ASSERT_OK_AND_ASSIGN(torch::Tensor embeds,
                       llava->MergeEmbeddings(torch::tensor(ids).unsqueeze(0), kept_features));
  std::vector<torch::Tensor> probs;
  DecoderForwardOptions fo;
  fo.last_logits_only = true;
  fo.last_query_attention = &probs;
  llava->language_model().Forward(embeds, torch::Tensor(), nullptr, fo);
  torch::Tensor mass = torch::zeros({static_cast<int64_t>(ids.size())});
  for (const torch::Tensor& p : probs) mass += p[0].mean(0);
  mass /= static_cast<double>(probs.size());
  torch::Tensor want = mass.index_select(0, torch::tensor(image_slots));
  torch::Tensor have = got.mass[0].index_select(0, present_idx);
  EXPECT_TRUE(torch::allclose(have, want, 1e-5, 1e-7)) << (have - want).abs().max().item<float>();
}

// BLIP-2: a masked pass is the Q-Former run on the present tokens alone.
TEST(Blip2VisualTokenPassesTest, MaskedPassEqualsTheQFormerOnThePresentTokens) {
  const std::string dir = FixtureDir("blip2_llama");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadHfModel(dir, {}));
  ASSERT_OK_AND_ASSIGN(HfFolder folder, HfFolder::Open(dir));
  ASSERT_OK_AND_ASSIGN(
      std::shared_ptr<Blip2ForConditionalGenerationImpl> blip,
      Blip2ForConditionalGenerationImpl::FromFolder(folder, HfPrecision{}, torch::kCPU));
  blip->eval();
  torch::NoGradGuard no_grad;
  const MultimodalInputs in = FirstCase(dir);
  torch::Tensor image = blip->vision_model->forward(in.pixel_values).to(torch::kFloat);
  const int64_t n = image.size(1);
  torch::Tensor keep = torch::ones({1, n}, torch::kBool);
  for (int64_t i = 1; i < n; i += 2) keep[0][i] = false;
  VisualTokenPassOptions o;
  o.present = keep;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses got, model->StochasticVisualTokens(in, o));
  EXPECT_TRUE(torch::allclose(got.tokens, image[0], 1e-6, 1e-6));

  torch::Tensor present_idx = keep[0].nonzero().squeeze(1);
  std::vector<torch::Tensor> probs;
  blip->qformer->ForwardMasked(blip->query_tokens, image.index_select(1, present_idx), {}, {}, {},
                               &probs);
  torch::Tensor mass = torch::zeros({present_idx.size(0)});
  for (const torch::Tensor& p : probs) mass += p[0].mean(0).mean(0);
  mass /= static_cast<double>(probs.size());
  torch::Tensor have = got.mass[0].index_select(0, present_idx);
  EXPECT_TRUE(torch::allclose(have, mass, 1e-5, 1e-7)) << (have - mass).abs().max().item<float>();
}

}  // namespace
}  // namespace cdcca::model
