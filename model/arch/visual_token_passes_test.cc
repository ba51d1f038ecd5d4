// UTS stage 2 on Hugging Face folders: VIS (MultimodalModel::StochasticVisualTokens,
// multimodal_model.h) on the tiny random checkpoints under tests/fixtures/hf/models/:
// - the draw: element-wise input masks (features, not whole tokens) at about the rate asked
//   for, from the seed (same seed, same scores), and the model's own dropout active;
// - Eq. 3: the score is the population variance over the passes of F, averaged over F's
//   features (and the scale-free ablation, over F's mean square); the batched passes give
//   what the passes one at a time give;
// - what F is: against a plain computation from the model's parts, pass by pass (LLaVA: what
//   the lower half of the LM adds to each image row; BLIP-2: each token's contribution to
//   the Q-Former's cross-attention output);
// - M and p out of range are refused with errors that name them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>

#include "model/arch/blip2.h"
#include "model/arch/llava.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/safetensors.h"
#include "tests/testing/hf_fixture_case.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

using ::cdcca::testing::FirstCase;
using ::cdcca::testing::HfFixtureDir;
using ::cdcca::testing::StatusIs;

class VisualTokenPassesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(VisualTokenPassesTest, VisIsEq3OverElementWiseDropoutPasses) {
  const std::string dir = HfFixtureDir(GetParam());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadModel(dir, {}));
  const MultimodalInputs in = FirstCase(dir);
  VisualTokenPassOptions o;
  o.passes = 6;
  o.dropout_p = 0.3;
  o.seed = 11;
  o.keep_features = true;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses a, model->StochasticVisualTokens(in, o));
  const int64_t n = a.tokens.size(0);
  ASSERT_GT(n, 1);
  ASSERT_EQ(a.variance.sizes(), (std::vector<int64_t>{n}));
  ASSERT_EQ(a.mass.sizes(), (std::vector<int64_t>{6, n}));
  ASSERT_EQ(a.features.dim(), 3);
  ASSERT_EQ(a.features.size(0), 6);
  ASSERT_EQ(a.features.size(1), n);
  ASSERT_EQ(a.input_masks.dim(), 3);
  ASSERT_EQ(a.input_masks.size(0), 6);
  ASSERT_EQ(a.input_masks.size(1), n);
  // Element-wise dropout: multipliers 0 or 1/(1-p), about p of them zero, and within every
  // pass every token keeps some features and loses others (no token is dropped whole).
  const torch::Tensor zero = a.input_masks.eq(0);
  EXPECT_TRUE(
      torch::logical_or(zero, a.input_masks.sub(1.0 / 0.7).abs().lt(1e-6)).all().item<bool>());
  const double rate = zero.to(torch::kFloat).mean().item<double>();
  EXPECT_GT(rate, 0.2);
  EXPECT_LT(rate, 0.4);
  const torch::Tensor dropped_per_row = zero.sum(-1);  // [M, N]
  EXPECT_GT(dropped_per_row.min().item<int64_t>(), 0);
  EXPECT_LT(dropped_per_row.max().item<int64_t>(), a.input_masks.size(2));
  // F varies over the passes for every token, and the score is Eq. 3 per feature, averaged.
  torch::Tensor mean = a.features.mean(0);
  torch::Tensor want = torch::zeros_like(mean);
  for (int64_t m = 0; m < 6; ++m) want += (a.features[m] - mean).pow(2) / 6.0;
  EXPECT_TRUE(torch::allclose(a.variance, want.mean(-1), 1e-5, 1e-10));
  EXPECT_GT(a.variance.min().item<float>(), 0.0f);
  // The scale-free ablation (vis_relative): the same spread summed over F's features, over
  // the squared norm of F's pass mean; it does not change when F is scaled.
  ASSERT_EQ(a.relative_variance.sizes(), (std::vector<int64_t>{n}));
  EXPECT_TRUE(
      torch::allclose(a.relative_variance, want.sum(-1) / mean.pow(2).sum(-1), 1e-4, 1e-10));
  EXPECT_TRUE(
      torch::allclose(VisRelativeVariance(a.features * 7.0), a.relative_variance, 1e-4, 1e-10));
  EXPECT_TRUE(torch::equal(VisRelativeVariance(torch::zeros({3, 2, 4})), torch::zeros({2})));
  // The same seed gives the same passes; another seed other masks.
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses b, model->StochasticVisualTokens(in, o));
  EXPECT_TRUE(torch::equal(a.input_masks, b.input_masks));
  EXPECT_TRUE(torch::equal(a.variance, b.variance));
  o.seed = 12;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses c, model->StochasticVisualTokens(in, o));
  EXPECT_FALSE(torch::equal(a.input_masks, c.input_masks));
  // The model's own dropout is active: the same input masks with it off give other F.
  VisualTokenPassOptions given;
  given.input_masks = a.input_masks;
  given.keep_features = true;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses d, model->StochasticVisualTokens(in, given));
  EXPECT_GT((d.features - a.features).abs().max().item<float>(), 1e-4f);
}

// Stage 2 from the tower's tokens (what the answer computed; the device's path) gives what
// it gives from the pixels, which run the tower again: the same tokens, scores and F.
TEST_P(VisualTokenPassesTest, PassesFromTheTowersTokensEqualThePassesFromThePixels) {
  const std::string dir = HfFixtureDir(GetParam());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadModel(dir, {}));
  const MultimodalInputs pixels = FirstCase(dir);
  ASSERT_OK_AND_ASSIGN(torch::Tensor tokens, model->EncodeImages(pixels));
  MultimodalInputs given = pixels;
  given.pixel_values = torch::Tensor();
  given.visual_tokens = tokens;
  VisualTokenPassOptions o;
  o.passes = 4;
  o.dropout_p = 0.25;
  o.seed = 5;
  o.keep_features = true;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses a, model->StochasticVisualTokens(pixels, o));
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses b, model->StochasticVisualTokens(given, o));
  EXPECT_TRUE(torch::equal(a.tokens, b.tokens));
  EXPECT_TRUE(torch::equal(a.input_masks, b.input_masks));
  EXPECT_TRUE(torch::allclose(a.features, b.features, 1e-5, 1e-7));
  EXPECT_TRUE(torch::allclose(a.variance, b.variance, 1e-5, 1e-10));
  EXPECT_GT(b.variance.max().item<float>(), 0.0f);
  // Tokens of another shape are refused, naming the shape expected.
  given.visual_tokens = tokens.narrow(1, 0, tokens.size(1) - 1);
  EXPECT_THAT(model->StochasticVisualTokens(given, o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The M passes run as one batch compute what running them one at a time computes.
TEST_P(VisualTokenPassesTest, BatchedPassesEqualThePassesOneByOne) {
  const std::string dir = HfFixtureDir(GetParam());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadModel(dir, {}));
  const MultimodalInputs in = FirstCase(dir);
  VisualTokenPassOptions draw;
  draw.passes = 4;
  draw.dropout_p = 0.25;
  draw.seed = 5;
  draw.keep_features = true;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses drawn, model->StochasticVisualTokens(in, draw));
  VisualTokenPassOptions o;
  o.input_masks = drawn.input_masks;
  o.keep_features = true;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses batched, model->StochasticVisualTokens(in, o));
  std::vector<torch::Tensor> one_by_one;
  for (int64_t m = 0; m < 4; ++m) {
    VisualTokenPassOptions single;
    single.input_masks = drawn.input_masks.narrow(0, m, 1);
    single.keep_features = true;
    ASSERT_OK_AND_ASSIGN(VisualTokenPasses p, model->StochasticVisualTokens(in, single));
    one_by_one.push_back(p.features[0]);
  }
  torch::Tensor f = torch::stack(one_by_one);
  EXPECT_TRUE(torch::allclose(batched.features, f, 1e-4, 1e-5))
      << (batched.features - f).abs().max().item<float>();
  torch::Tensor want = (f - f.mean(0)).pow(2).mean(0).mean(-1);
  EXPECT_TRUE(torch::allclose(batched.variance, want, 1e-3, 1e-9))
      << (batched.variance - want).abs().max().item<float>();
}

TEST_P(VisualTokenPassesTest, RefusesBadPassesRatesMasksAndBatches) {
  const std::string dir = HfFixtureDir(GetParam());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadModel(dir, {}));
  MultimodalInputs in = FirstCase(dir);
  VisualTokenPassOptions o;
  for (int passes : {0, -1, 257}) {
    o.passes = passes;
    EXPECT_THAT(model->StochasticVisualTokens(in, o).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::HasSubstr("passes M must be in 1-256")))
        << passes;
  }
  o.passes = 4;
  for (double p : {0.0, 1.0, -0.1, 1.5, std::nan("")}) {
    o.dropout_p = p;
    EXPECT_THAT(model->StochasticVisualTokens(in, o).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::HasSubstr("rate p must be in (0, 1)")))
        << p;
  }
  o.dropout_p = 0.1;
  o.input_masks = torch::ones({2, 3, 4});
  EXPECT_THAT(model->StochasticVisualTokens(in, o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("input masks")));
  o.input_masks = torch::Tensor();
  in.pixel_values = torch::cat({in.pixel_values, in.pixel_values});
  if (in.qformer_input_ids.defined()) {
    in.qformer_input_ids = torch::cat({in.qformer_input_ids, in.qformer_input_ids});
  }
  in.input_ids = torch::cat({in.input_ids, in.input_ids});
  EXPECT_EQ(model->StochasticVisualTokens(in, o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Folders, VisualTokenPassesTest,
                         ::testing::Values("llava_clip_llama", "llava_siglip_qwen2", "blip2_llama",
                                           "instructblip_llama", "blip2_opt", "blip2_flan_t5",
                                           "instructblip_flan_t5"));

// Eq. 3 by hand over F_m computed pass by pass from the model's parts.
torch::Tensor PlainVis(const std::vector<torch::Tensor>& f) {
  torch::Tensor x = torch::stack(f);
  return (x - x.mean(0)).pow(2).mean(0).mean(-1);
}

// LLaVA: F is what the first half of the LM's layers add to each dropped-out image row.
TEST(LlavaVisualTokenPassesTest, VisIsThePlainComputationPassByPass) {
  const std::string dir = HfFixtureDir("llava_clip_llama");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadModel(dir, {}));
  ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir));
  ASSERT_OK_AND_ASSIGN(LlavaConfig config, ParseLlavaConfig(folder.config(), "config.json"));
  if (!folder.Has("lm_head.weight")) config.text.tie_word_embeddings = true;
  Llava llava(config, WeightPrecision{});
  ASSERT_OK(llava->Load(folder, torch::kCPU));
  llava->eval();
  torch::NoGradGuard no_grad;
  const MultimodalInputs in = FirstCase(dir);
  torch::Tensor projected = llava->Project(llava->SelectedFeatures(in.pixel_values));  // [1, N, H]
  const int64_t n = projected.size(1);
  VisualTokenPassOptions draw;
  draw.passes = 3;
  draw.dropout_p = 0.3;
  draw.seed = 2;
  ASSERT_OK_AND_ASSIGN(torch::Tensor masks, VisInputMasks(draw, n, projected.size(2)));
  VisualTokenPassOptions o;
  o.input_masks = masks;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses got, model->StochasticVisualTokens(in, o));

  std::vector<int64_t> image_pos;
  for (int64_t t = 0; t < in.input_ids.size(1); ++t) {
    if (in.input_ids[0][t].item<int64_t>() == config.image_token_id) image_pos.push_back(t);
  }
  ASSERT_EQ(static_cast<int64_t>(image_pos.size()), n);
  std::vector<torch::Tensor> f;
  for (int64_t m = 0; m < 3; ++m) {
    torch::Tensor rows = projected[0] * masks[m];  // [N, H]
    ASSERT_OK_AND_ASSIGN(torch::Tensor embeds,
                         llava->MergeEmbeddings(in.input_ids, rows.unsqueeze(0)));
    DecoderForwardOptions fo;
    fo.capture_layer = config.text.num_hidden_layers / 2;
    DecoderOutput out = llava->language_model().Forward(embeds, torch::Tensor(), nullptr, fo);
    f.push_back(out.captured[0].index_select(0, torch::tensor(image_pos)) - rows);
  }
  torch::Tensor want = PlainVis(f);
  EXPECT_TRUE(torch::allclose(got.variance, want, 1e-3, 1e-9))
      << (got.variance - want).abs().max().item<float>();
}

// BLIP-2: F is each token's contribution to the cross-attention output of every
// cross-attending Q-Former layer, here recomputed from the layers' weights.
TEST(Blip2VisualTokenPassesTest, VisIsThePlainComputationPassByPass) {
  const std::string dir = HfFixtureDir("blip2_llama");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> model, LoadModel(dir, {}));
  ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir));
  ASSERT_OK_AND_ASSIGN(
      std::shared_ptr<Blip2ForConditionalGenerationImpl> blip,
      Blip2ForConditionalGenerationImpl::FromFolder(folder, WeightPrecision{}, torch::kCPU));
  blip->eval();
  torch::NoGradGuard no_grad;
  const MultimodalInputs in = FirstCase(dir);
  torch::Tensor image = blip->vision_model->forward(in.pixel_values).to(torch::kFloat);
  const int64_t n = image.size(1), e = image.size(2);
  VisualTokenPassOptions draw;
  draw.passes = 3;
  draw.dropout_p = 0.3;
  draw.seed = 4;
  ASSERT_OK_AND_ASSIGN(torch::Tensor masks, VisInputMasks(draw, n, e));
  VisualTokenPassOptions o;
  o.input_masks = masks;
  ASSERT_OK_AND_ASSIGN(VisualTokenPasses got, model->StochasticVisualTokens(in, o));
  EXPECT_TRUE(torch::allclose(got.tokens, image[0], 1e-6, 1e-6));

  const int64_t heads = blip->qformer->config().num_attention_heads;
  std::vector<torch::Tensor> f;
  for (int64_t m = 0; m < 3; ++m) {
    torch::Tensor img = image * masks[m].unsqueeze(0);  // [1, N, E]
    torch::Tensor hidden = blip->qformer->layernorm->forward(blip->query_tokens);
    std::vector<torch::Tensor> per_layer;
    for (const auto& module : *blip->qformer->encoder->layer) {
      auto* layer = module->as<QFormerLayerImpl>();
      torch::Tensor queries = layer->attention->forward(hidden, hidden, {});
      if (layer->has_cross_attention()) {
        QFormerMultiHeadAttentionImpl& a = *layer->crossattention->attention;
        torch::Tensor q = a.query->forward(queries)[0];  // [Q, H]
        torch::Tensor k = a.key->forward(img)[0];        // [N, H]
        torch::Tensor v = a.value->forward(img)[0];      // [N, H]
        const int64_t d = q.size(1) / heads;
        std::vector<torch::Tensor> c;
        for (int64_t h = 0; h < heads; ++h) {
          torch::Tensor w = torch::softmax(q.narrow(1, h * d, d).matmul(k.narrow(1, h * d, d).t()) /
                                               std::sqrt(static_cast<double>(d)),
                                           -1);  // [Q, N]
          c.push_back(w.sum(0).unsqueeze(1) * v.narrow(1, h * d, d));
        }
        per_layer.push_back(torch::cat(c, 1));  // [N, H]
        queries = layer->crossattention->forward(queries, img, {});
      }
      hidden = layer->output_query->forward(layer->intermediate_query->forward(queries), queries);
    }
    ASSERT_FALSE(per_layer.empty());
    f.push_back(torch::cat(per_layer, 1));
  }
  torch::Tensor want = PlainVis(f);
  EXPECT_TRUE(torch::allclose(got.variance, want, 1e-3, 1e-9))
      << (got.variance - want).abs().max().item<float>();
}

}  // namespace
}  // namespace cdcca::model
