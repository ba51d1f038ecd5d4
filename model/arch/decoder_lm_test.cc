#include "model/arch/decoder_lm.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "model/arch/rope.h"
#include "model/hub/safetensors.h"
#include "model/runtime/generation.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::model {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

TEST(RopeTest, DefaultAndLinearFollowTheFormula) {
  RopeConfig r;
  r.theta = 500.0;
  torch::Tensor inv = RopeInvFreq(r, 8, 16);
  ASSERT_EQ(inv.size(0), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(inv[i].item<float>(), 1.0 / std::pow(500.0, 2.0 * i / 8), 1e-6);
  }
  r.type = "linear";
  r.factor = 4.0;
  EXPECT_TRUE(torch::allclose(RopeInvFreq(r, 8, 16), inv / 4));
}

TEST(RopeTest, Llama3ScalesLowFrequenciesAndBlendsTheMiddle) {
  RopeConfig r;
  r.type = "llama3";
  r.theta = 10000.0;
  r.factor = 8.0;
  r.low_freq_factor = 1.0;
  r.high_freq_factor = 4.0;
  r.original_max_position_embeddings = 64;
  const int d = 16;
  torch::Tensor got = RopeInvFreq(r, d, 1);
  for (int i = 0; i < d / 2; ++i) {
    const double f = 1.0 / std::pow(10000.0, 2.0 * i / d);
    const double wavelen = 2 * M_PI / f;
    double want;
    if (wavelen < 64 / 4.0) {
      want = f;  // high frequency: unchanged
    } else if (wavelen > 64 / 1.0) {
      want = f / 8;  // low frequency: interpolated by the factor
    } else {
      const double smooth = (64 / wavelen - 1.0) / (4.0 - 1.0);
      want = (1 - smooth) * f / 8 + smooth * f;
    }
    EXPECT_NEAR(got[i].item<float>(), want, 1e-6 * std::max(1.0, want)) << i;
  }
}

TEST(RopeTest, ParsesBothSpellingsAndRejectsUnknownTypes) {
  json v4 = {{"rope_theta", 1000.0}, {"rope_scaling", {{"type", "linear"}, {"factor", 2.0}}}};
  json v5 = {
      {"rope_parameters", {{"rope_type", "linear"}, {"rope_theta", 1000.0}, {"factor", 2.0}}}};
  ASSERT_OK_AND_ASSIGN(RopeConfig a, ParseRopeConfig(v4, "config.json"));
  ASSERT_OK_AND_ASSIGN(RopeConfig b, ParseRopeConfig(v5, "config.json"));
  EXPECT_EQ(a.type, "linear");
  EXPECT_EQ(b.type, "linear");
  EXPECT_EQ(a.theta, 1000.0);
  EXPECT_EQ(b.theta, 1000.0);
  EXPECT_EQ(a.factor, 2.0);
  EXPECT_EQ(b.factor, 2.0);
  json longrope = {{"rope_scaling", {{"rope_type", "longrope"}, {"factor", 4.0}}}};
  EXPECT_THAT(ParseRopeConfig(longrope, "dir/config.json").status(),
              testing::StatusIs(
                  absl::StatusCode::kInvalidArgument,
                  ::testing::AllOf(HasSubstr("dir/config.json"),
                                   HasSubstr("rope_scaling.rope_type"), HasSubstr("longrope"))));
  json yarn_no_context = {{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}};
  EXPECT_THAT(ParseRopeConfig(yarn_no_context, "c.json").status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("original_max_position_embeddings")));
  json llama3_missing = {{"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}}};
  EXPECT_THAT(ParseRopeConfig(llama3_missing, "c.json").status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("low_freq_factor")));
}

// yarn as the YaRN paper and transformers define it, recomputed here in double: the ramp
// runs between the dimensions that turn beta_fast and beta_slow times over the original
// context (rounded outwards), interpolated (f / factor) below it, extrapolated (f) above.
TEST(RopeTest, YarnBlendsByRotationCountAndScalesCosSin) {
  json c = {{"max_position_embeddings", 64},
            {"rope_theta", 10000.0},
            {"rope_scaling",
             {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16}}}};
  ASSERT_OK_AND_ASSIGN(RopeConfig r, ParseRopeConfig(c, "config.json"));
  EXPECT_EQ(r.type, "yarn");
  EXPECT_EQ(r.original_max_position_embeddings, 16);
  EXPECT_NEAR(r.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-12);
  const int d = 32;
  auto corr = [&](double rot) { return d * std::log(16 / (rot * 2 * M_PI)) / (2 * std::log(1e4)); };
  const double low = std::max(0.0, std::floor(corr(32.0)));
  const double high = std::min(d - 1.0, std::ceil(corr(1.0)));
  torch::Tensor got = RopeInvFreq(r, d, 1);
  for (int i = 0; i < d / 2; ++i) {
    const double f = 1.0 / std::pow(10000.0, 2.0 * i / d);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double want = f / 4 * ramp + f * (1 - ramp);
    EXPECT_NEAR(got[i].item<float>(), want, 1e-6 * std::max(1.0, want)) << i;
  }
  torch::Tensor cos, sin;
  torch::Tensor pos = torch::arange(3, torch::kLong).view({1, 3});
  RopeCosSin(got, pos, torch::kFloat, &cos, &sin, r.attention_factor);
  EXPECT_NEAR(cos[0][0][0].item<float>(), r.attention_factor, 1e-6);  // position 0: cos 1
  EXPECT_NEAR(sin[0][2][0].item<float>(), r.attention_factor * std::sin(2.0), 1e-5);
  // mscale / mscale_all_dim replace the default attention factor; an explicit one wins.
  c["rope_scaling"]["mscale"] = 0.707;
  c["rope_scaling"]["mscale_all_dim"] = 1.0;
  ASSERT_OK_AND_ASSIGN(RopeConfig m, ParseRopeConfig(c, "config.json"));
  EXPECT_NEAR(m.attention_factor, (0.0707 * std::log(4.0) + 1) / (0.1 * std::log(4.0) + 1), 1e-12);
  c["rope_scaling"]["attention_factor"] = 1.5;
  ASSERT_OK_AND_ASSIGN(RopeConfig a, ParseRopeConfig(c, "config.json"));
  EXPECT_EQ(a.attention_factor, 1.5);
}

json TinyConfig(int heads, int kv_heads, bool tied = false) {
  return {{"model_type", "llama"},
          {"vocab_size", 50},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"num_hidden_layers", 2},
          {"num_attention_heads", heads},
          {"num_key_value_heads", kv_heads},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 100.0},
          {"attention_bias", true},
          {"tie_word_embeddings", tied},
          {"eos_token_id", 7}};
}

// Fills every parameter with seeded random values (the constructor leaves placeholders).
void Randomize(torch::nn::Module& m, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    const bool norm = p.key().find("norm") != std::string::npos;
    p.value().set_data(norm ? 1 + 0.1 * torch::randn(p.value().sizes())
                            : 0.2 * torch::randn(p.value().sizes()));
  }
}

// Writes `lm`'s parameters (bf16) and `config` as a Hugging Face folder in `dir`.
absl::Status WriteFolder(DecoderLmImpl& lm, const json& config, const testing::TempDir& dir) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& p : lm.named_parameters()) {
    const std::string name = p.key().rfind("lm_head", 0) == 0 ? p.key() : "model." + p.key();
    tensors.emplace_back(name, p.value().to(torch::kBFloat16));
  }
  std::ofstream(dir.file("config.json")) << config.dump();
  return WriteSafetensors(dir.file("model.safetensors"), tensors, {});
}

TEST(DecoderConfigTest, ReadsFieldsDefaultsAndRejectsUnknownTypes) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "config.json"));
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  EXPECT_FALSE(c.mlp_bias);
  EXPECT_THAT(c.eos_token_ids, ::testing::ElementsAre(7));
  // A published LLaVA text_config lists only what differs from LlamaConfig's defaults.
  ASSERT_OK_AND_ASSIGN(
      DecoderConfig sparse,
      ParseDecoderConfig(json{{"model_type", "llama"}, {"vocab_size", 32064}}, "c"));
  EXPECT_EQ(sparse.hidden_size, 4096);
  EXPECT_EQ(sparse.num_hidden_layers, 32);
  EXPECT_EQ(sparse.head_dim, 128);
  ASSERT_OK_AND_ASSIGN(DecoderConfig qwen, ParseDecoderConfig(json{{"model_type", "qwen2"},
                                                                   {"hidden_size", 64},
                                                                   {"num_attention_heads", 4},
                                                                   {"eos_token_id", {3, 4}}},
                                                              "c"));
  EXPECT_TRUE(qwen.qkv_bias);
  EXPECT_FALSE(qwen.o_bias);
  EXPECT_THAT(qwen.eos_token_ids, ::testing::ElementsAre(3, 4));
  EXPECT_THAT(
      ParseDecoderConfig(json{{"model_type", "gpt2"}}, "m/config.json").status(),
      testing::StatusIs(absl::StatusCode::kInvalidArgument,
                        ::testing::AllOf(HasSubstr("m/config.json"), HasSubstr("model_type"))));
}

TEST(DecoderLmTest, GqaEqualsMhaWithRepeatedKvHeads) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig gqa_c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  ASSERT_OK_AND_ASSIGN(DecoderConfig mha_c, ParseDecoderConfig(TinyConfig(4, 4), "c"));
  DecoderLm gqa(gqa_c, WeightPrecision{});
  DecoderLm mha(mha_c, WeightPrecision{});
  Randomize(*gqa, 3);
  torch::NoGradGuard no_grad;
  auto mha_params = mha->named_parameters();
  for (const auto& p : gqa->named_parameters()) {
    torch::Tensor v = p.value();
    const bool kv =
        p.key().find("k_proj") != std::string::npos || p.key().find("v_proj") != std::string::npos;
    if (kv) {
      // [kv_heads * d, ...] -> each kv head repeated for the 2 query heads that read it.
      torch::Tensor heads = v.reshape({2, 8, -1});
      v = heads.repeat_interleave(2, 0).reshape({32, -1});
      if (p.key().find("bias") != std::string::npos) v = v.reshape({32});
    }
    mha_params[p.key()].set_data(v.clone());
  }
  torch::Tensor ids = torch::tensor({{1, 5, 9, 2, 30, 11}}, torch::kLong);
  torch::Tensor a = gqa->Forward(gqa->EmbedTokens(ids), {}, nullptr).logits;
  torch::Tensor b = mha->Forward(mha->EmbedTokens(ids), {}, nullptr).logits;
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-5));
}

TEST(DecoderLmTest, KvCacheDecodeEqualsFullRecompute) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 4);
  torch::NoGradGuard no_grad;
  torch::Tensor ids = torch::tensor({{3, 8, 1, 44, 20, 6, 13}}, torch::kLong);
  torch::Tensor full = lm->Forward(lm->EmbedTokens(ids), {}, nullptr).logits;
  DecoderKvCache cache;
  torch::Tensor prefix = lm->Forward(lm->EmbedTokens(ids.narrow(1, 0, 4)), {}, &cache).logits;
  EXPECT_EQ(cache.length(), 4);
  EXPECT_TRUE(torch::allclose(prefix, full.narrow(1, 0, 4), 1e-5, 1e-5));
  for (int t = 4; t < 7; ++t) {
    torch::Tensor step = lm->Forward(lm->EmbedTokens(ids.narrow(1, t, 1)), {}, &cache).logits;
    EXPECT_TRUE(torch::allclose(step, full.narrow(1, t, 1), 1e-5, 1e-5)) << t;
  }
}

// A FusedAttentionScope opens for its thread and nests; on the CPU a pass inside one is the
// eager pass, bit for bit (the scope changes CUDA passes only).
TEST(DecoderLmTest, FusedAttentionScopeNestsAndLeavesCpuPassesEager) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 5);
  torch::NoGradGuard no_grad;
  torch::Tensor ids = torch::tensor({{3, 8, 1, 44, 20, 6, 13}}, torch::kLong);
  torch::Tensor outside = lm->Forward(lm->EmbedTokens(ids), {}, nullptr).logits;
  EXPECT_FALSE(FusedAttentionScope::Open());
  {
    FusedAttentionScope outer;
    EXPECT_TRUE(FusedAttentionScope::Open());
    {
      FusedAttentionScope inner;
      EXPECT_TRUE(FusedAttentionScope::Open());
    }
    EXPECT_TRUE(FusedAttentionScope::Open());
    torch::Tensor inside = lm->Forward(lm->EmbedTokens(ids), {}, nullptr).logits;
    EXPECT_TRUE(torch::equal(inside, outside));
  }
  EXPECT_FALSE(FusedAttentionScope::Open());
}

TEST(DecoderLmTest, LeftPaddedBatchGeneratesAsUnpaddedRows) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 5);
  torch::NoGradGuard no_grad;
  GreedyOptions o;
  o.max_new_tokens = 6;
  o.keep_step_logits = true;
  torch::Tensor short_ids = torch::tensor({{4, 9, 12}}, torch::kLong);
  torch::Tensor long_ids = torch::tensor({{2, 33, 4, 9, 12}}, torch::kLong);
  GreedyResult s = GreedyGenerateFromEmbeds(*lm, lm->EmbedTokens(short_ids), {}, o);
  GreedyResult l = GreedyGenerateFromEmbeds(*lm, lm->EmbedTokens(long_ids), {}, o);
  torch::Tensor batch = torch::tensor({{0, 0, 4, 9, 12}, {2, 33, 4, 9, 12}}, torch::kLong);
  torch::Tensor mask = torch::tensor({{0, 0, 1, 1, 1}, {1, 1, 1, 1, 1}}, torch::kLong);
  GreedyResult both = GreedyGenerateFromEmbeds(*lm, lm->EmbedTokens(batch), mask, o);
  ASSERT_EQ(both.tokens.size(), 2u);
  EXPECT_EQ(both.tokens[0], s.tokens[0]);
  EXPECT_EQ(both.tokens[1], l.tokens[0]);
  EXPECT_TRUE(torch::allclose(both.first_logits[0], s.first_logits[0], 1e-4, 1e-4));
  EXPECT_EQ(s.step_logits.size(), s.tokens[0].size());
}

TEST(DecoderLmTest, StopsAtEosAndLoadsQuantizedFromAFolder) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 6);
  testing::TempDir dir;
  ASSERT_OK(WriteFolder(*lm, TinyConfig(4, 2), dir));
  ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir.path()));
  DecoderLm fp(c, WeightPrecision{});
  ASSERT_OK(fp->Load(folder, "model.", "lm_head.", torch::kCPU));
  WeightPrecision p8;
  p8.weights = Precision::kInt8;
  DecoderLm q8(c, p8);
  ASSERT_OK(q8->Load(folder, "model.", "lm_head.", torch::kCPU));
  EXPECT_LT(ResidentBytes(*q8), ResidentBytes(*fp) * 0.6);

  torch::NoGradGuard no_grad;
  torch::Tensor ids = torch::tensor({{1, 2, 3, 4}}, torch::kLong);
  GreedyOptions o;
  o.max_new_tokens = 8;
  GreedyResult free_run = GreedyGenerateFromEmbeds(*fp, fp->EmbedTokens(ids), {}, o);
  ASSERT_EQ(free_run.tokens[0].size(), 8u);
  o.eos_token_ids = {free_run.tokens[0][2]};
  GreedyResult stopped = GreedyGenerateFromEmbeds(*fp, fp->EmbedTokens(ids), {}, o);
  const auto first_eos =
      std::find(free_run.tokens[0].begin(), free_run.tokens[0].end(), o.eos_token_ids[0]);
  EXPECT_EQ(stopped.tokens[0], std::vector<int64_t>(free_run.tokens[0].begin(), first_eos + 1));

  torch::Tensor a = fp->Forward(fp->EmbedTokens(ids), {}, nullptr).logits;
  torch::Tensor b = q8->Forward(q8->EmbedTokens(ids), {}, nullptr).logits;
  EXPECT_LT((a - b).abs().max().item<float>(), 0.05 * a.abs().max().item<float>());
}

// A float model holding what `weights` / `group` make of `folder`'s weights: every linear
// weight and the token embedding replaced by their dequantized quantization.
DecoderLm DequantizedFloatModel(const DecoderConfig& c, const ModelFolder& folder,
                                Precision weights, int64_t group) {
  DecoderLm ref(c, WeightPrecision{});
  EXPECT_OK(ref->Load(folder, "model.", "lm_head.", torch::kCPU));
  torch::NoGradGuard no_grad;
  auto roundtrip = [&](const torch::Tensor& w) {
    return DequantizeWeight(QuantizeWeight(w, weights, group), weights, w.size(1), group);
  };
  for (const auto& m : ref->modules()) {
    if (auto* linear = dynamic_cast<LinearImpl*>(m.get()); linear != nullptr) {
      linear->weight.set_data(roundtrip(linear->weight));
    }
  }
  ref->embed_tokens->weight.set_data(roundtrip(ref->embed_tokens->weight));
  return ref;
}

// The packed int8/int4 kernels (qmatmul.h) compute what the quantized weights stand for: a
// float model holding the dequantized weights gives the same logits (within 1e-4 of the
// largest) and greedy tokens, through prefill (block-dequantized GEMM) and decode (packed,
// with the fused q/k/v and gate/up products), tied or untied, the embedding lookup reading
// the packed rows.
TEST(DecoderLmTest, QuantizedKernelsEqualTheDequantizedFloatModel) {
  for (const bool tied : {false, true}) {
    ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2, tied), "c"));
    DecoderLm lm(c, WeightPrecision{});
    Randomize(*lm, 7);
    testing::TempDir dir;
    ASSERT_OK(WriteFolder(*lm, TinyConfig(4, 2, tied), dir));
    ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir.path()));
    torch::NoGradGuard no_grad;
    torch::Tensor ids = torch::tensor({{3, 1, 4, 1, 5, 9, 2, 6}}, torch::kLong);
    for (const auto& [weights, group] : {std::make_pair(Precision::kInt8, int64_t{128}),
                                         std::make_pair(Precision::kInt4, int64_t{32})}) {
      WeightPrecision p;
      p.weights = weights;
      p.int4_group = group;
      DecoderLm q(c, p);
      ASSERT_OK(q->Load(folder, "model.", "lm_head.", torch::kCPU));
      DecoderLm ref = DequantizedFloatModel(c, folder, weights, group);
      EXPECT_TRUE(torch::equal(q->EmbedTokens(ids), ref->EmbedTokens(ids))) << tied;
      torch::Tensor a = ref->Forward(ref->EmbedTokens(ids), {}, nullptr).logits;
      torch::Tensor b = q->Forward(q->EmbedTokens(ids), {}, nullptr).logits;
      EXPECT_LT(((a - b).abs().max() / a.abs().max()).item<float>(), 1e-4) << tied;
      GreedyOptions o;
      o.max_new_tokens = 12;
      EXPECT_EQ(GreedyGenerateFromEmbeds(*q, q->EmbedTokens(ids), {}, o).tokens,
                GreedyGenerateFromEmbeds(*ref, ref->EmbedTokens(ids), {}, o).tokens)
          << tied;
    }
  }
}

// With int8/int4 weights no float embedding matrix stays resident: the lookup reads the
// packed rows, and a tied head multiplies with those same bytes (no second copy).
TEST(DecoderLmTest, QuantizedModelsHoldNoFloatEmbedding) {
  for (const bool tied : {false, true}) {
    ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2, tied), "c"));
    DecoderLm lm(c, WeightPrecision{});
    Randomize(*lm, 8);
    testing::TempDir dir;
    ASSERT_OK(WriteFolder(*lm, TinyConfig(4, 2, tied), dir));
    ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir.path()));
    DecoderLm fp(c, WeightPrecision{});
    ASSERT_OK(fp->Load(folder, "model.", "lm_head.", torch::kCPU));
    EXPECT_EQ(fp->embed_tokens->weight.storage().nbytes(), 50 * 32 * sizeof(float));
    for (const Precision weights : {Precision::kInt8, Precision::kInt4}) {
      WeightPrecision p;
      p.weights = weights;
      p.int4_group = 32;
      DecoderLm q(c, p);
      ASSERT_OK(q->Load(folder, "model.", "lm_head.", torch::kCPU));
      ASSERT_TRUE(q->embed_tokens->quantized());
      // The registered weight is a one-element placeholder.
      EXPECT_LE(q->embed_tokens->weight.storage().nbytes(), sizeof(float));
      EXPECT_EQ(q->embed_tokens->weight.sizes(), fp->embed_tokens->weight.sizes());
      const QuantizedWeight& rows = q->embed_tokens->quantized_weight();
      if (tied) {
        ASSERT_TRUE(q->tied_head);
        EXPECT_EQ(q->tied_head->quantized_weight().values.data_ptr(), rows.values.data_ptr());
      } else {
        EXPECT_FALSE(q->tied_head);
      }
      // The packed rows are counted once, shared or not.
      EXPECT_EQ(ResidentBytes(*q->embed_tokens), QuantizedBytes(rows) + int64_t{sizeof(float)});
      int64_t parts = 0;
      for (const auto& child : q->named_children()) {
        if (child.key() != "tied_head") parts += ResidentBytes(*child.value());
      }
      EXPECT_EQ(ResidentBytes(*q), parts + (tied ? int64_t{sizeof(float)} : 0));
      torch::NoGradGuard no_grad;
      torch::Tensor ids = torch::tensor({{0, 49, 7}, {7, 7, 1}}, torch::kLong);
      torch::Tensor want = DequantizeWeight(rows, weights, 32, 32)
                               .index_select(0, ids.reshape({-1}))
                               .view({2, 3, 32});
      EXPECT_TRUE(torch::equal(q->EmbedTokens(ids), want));
      EXPECT_LT((q->EmbedTokens(ids) - fp->EmbedTokens(ids)).abs().max().item<float>(),
                0.1 * fp->embed_tokens->weight.abs().max().item<float>());
    }
  }
}

// The fused q/k/v and gate/up products compute exactly what the separate packed layers do,
// hold no extra bytes, and step aside when a layer is given another weight.
TEST(DecoderLmTest, FusedPackedProjectionsEqualTheSeparateLayers) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 9);
  testing::TempDir dir;
  ASSERT_OK(WriteFolder(*lm, TinyConfig(4, 2), dir));
  ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir.path()));
  WeightPrecision p;
  p.weights = Precision::kInt4;
  p.int4_group = 32;
  DecoderLm q(c, p);
  ASSERT_OK(q->Load(folder, "model.", "lm_head.", torch::kCPU));
  torch::NoGradGuard no_grad;
  auto* layer = q->layers->ptr(1)->as<DecoderLayerImpl>();
  DecoderAttentionImpl& attn = *layer->self_attn;
  torch::Tensor x = torch::randn({1, 3, 32});
  ASSERT_TRUE(attn.packed_qkv.Serves(x));
  ASSERT_TRUE(layer->mlp->packed_gate_up.Serves(x));
  EXPECT_TRUE(torch::equal(attn.packed_qkv.forward(x),
                           torch::cat({attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)}, -1)));
  EXPECT_TRUE(torch::equal(layer->mlp->packed_gate_up.forward(x),
                           torch::cat({layer->mlp->gate_proj(x), layer->mlp->up_proj(x)}, -1)));
  // The parts are views of the fused bytes: fusing twice changes nothing, counts once.
  const int64_t resident = ResidentBytes(*q);
  q->FuseProjections();
  EXPECT_EQ(ResidentBytes(*q), resident);
  EXPECT_FALSE(attn.packed_qkv.Serves(x.to(torch::kDouble)));
  // A part adopting a new weight leaves the fused product stale: it no longer serves, and
  // the layer computes with its new weight.
  torch::Tensor w = torch::randn({16, 32});
  ASSERT_OK(attn.k_proj->Adopt("weight", w));
  EXPECT_FALSE(attn.packed_qkv.Serves(x));
  torch::Tensor full = q->Forward(x, {}, nullptr).logits;
  q->FuseProjections();
  EXPECT_TRUE(attn.packed_qkv.Serves(x));
  EXPECT_TRUE(torch::allclose(q->Forward(x, {}, nullptr).logits, full, 1e-5, 1e-5));
}

// Loads `m` (int4 in groups of 32, as `p` says) from `folder` and gives q and v LoRA with
// nonzero B, the same draws on every call: two models loaded alike compute alike.
void LoadInt4WithLora(DecoderLm& m, const ModelFolder& folder) {
  ASSERT_OK(m->Load(folder, "model.", "lm_head.", torch::kCPU));
  torch::manual_seed(5);
  for (size_t i = 0; i < m->layers->size(); ++i) {
    DecoderAttentionImpl& attn = *m->layers->ptr(i)->as<DecoderLayerImpl>()->self_attn;
    for (LinearImpl* proj : {attn.q_proj.get(), attn.v_proj.get()}) {
      proj->AddLora(4, 8.0);
      torch::NoGradGuard no_grad;
      proj->lora_b.normal_(0.0, 0.1);
    }
  }
}

WeightPrecision Int4Groups32() {
  WeightPrecision p;
  p.weights = Precision::kInt4;
  p.int4_group = 32;
  return p;
}

// The LoRA gradients of two models' losses, by name: {the first's, the second's}.
std::vector<std::pair<torch::Tensor, torch::Tensor>> LoraGradients(DecoderLm& a, DecoderLm& b) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  const auto b_parameters = b->named_parameters();
  for (const auto& item : a->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    out.emplace_back(item.value().grad(), b_parameters[item.key()].grad());
  }
  return out;
}

// A LoRA layer's side path (one addmm accumulating into the base product) is the formula
// x W^T + b + (alpha / r) (x A^T) B^T, forward and every gradient: on a quantized layer (the
// side path always) and on a float one with few rows (the fold takes many rows), rows of
// three dimensions.
TEST(DecoderLmTest, ALoraSidePathEqualsItsFormulaForwardAndBackward) {
  for (Precision precision : {Precision::kInt8, Precision::kFp32}) {
    LinearOptions o;
    o.in_features = 48;
    o.out_features = 40;
    o.bias = true;
    o.precision.weights = precision;
    Linear l(o);
    torch::manual_seed(21);
    const torch::Tensor w = torch::randn({40, 48}) / 8, b = torch::randn({40});
    ASSERT_OK(l->Adopt("weight", w));
    ASSERT_OK(l->Adopt("bias", b));
    l->AddLora(4, 8.0);
    {
      torch::NoGradGuard no_grad;
      l->lora_b.normal_(0.0, 0.1);
    }
    const torch::Tensor x = torch::randn({2, 3, 48}).requires_grad_(true);
    const torch::Tensor y = l->forward(x);
    const torch::Tensor x2 = x.detach().clone().requires_grad_(true);
    const torch::Tensor a2 = l->lora_a.detach().clone().requires_grad_(true);
    const torch::Tensor b2 = l->lora_b.detach().clone().requires_grad_(true);
    const torch::Tensor want = torch::linear(x2, l->EffectiveWeight().detach(), b) +
                               torch::linear(torch::linear(x2, a2), b2) * (8.0 / 4);
    ASSERT_EQ(y.sizes(), want.sizes());
    EXPECT_TRUE(torch::allclose(y, want, 1e-5, 1e-6)) << (y - want).abs().max().item<float>();
    const torch::Tensor g = torch::randn_like(want);
    (y * g).sum().backward();
    (want * g).sum().backward();
    for (const auto& [got, expected] :
         {std::pair{x.grad(), x2.grad()}, std::pair{l->lora_a.grad(), a2.grad()},
          std::pair{l->lora_b.grad(), b2.grad()}}) {
      ASSERT_TRUE(got.defined());
      EXPECT_GT(expected.abs().sum().item<double>(), 0.0);
      EXPECT_TRUE(torch::allclose(got, expected, 1e-5, 1e-6))
          << (got - expected).abs().max().item<float>();
    }
  }
}

// A trainer's model holding its quantized weights dequantized (HoldDequantizedWeights)
// computes what the per-call path computes: the same logits and LoRA gradients.
TEST(DecoderLmTest, HeldDequantizedWeightsGiveTheProductsAndGradientsOfThePerCallPath) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 11);
  testing::TempDir dir;
  ASSERT_OK(WriteFolder(*lm, TinyConfig(4, 2), dir));
  ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir.path()));
  DecoderLm per_call(c, Int4Groups32()), held(c, Int4Groups32());
  LoadInt4WithLora(per_call, folder);
  LoadInt4WithLora(held, folder);
  const int64_t packed_bytes = ResidentBytes(*held);
  EXPECT_GT(HoldDequantizedWeights(*held), 0);
  EXPECT_GT(ResidentBytes(*held), packed_bytes);  // the float copies are there
  const torch::Tensor x = torch::randn({2, 5, 32});
  torch::Tensor a = per_call->Forward(x, {}, nullptr).logits;
  torch::Tensor b = held->Forward(x, {}, nullptr).logits;
  EXPECT_TRUE(torch::allclose(a, b, 1e-6, 1e-6));
  a.square().mean().backward();
  b.square().mean().backward();
  const auto grads = LoraGradients(per_call, held);
  for (const auto& [ga, gb] : grads) {
    ASSERT_TRUE(ga.defined() && gb.defined());
    EXPECT_GT(ga.abs().sum().item<double>(), 0.0);
    EXPECT_TRUE(torch::allclose(ga, gb, 1e-5, 1e-6));
  }
  EXPECT_EQ(grads.size(), 4 * per_call->layers->size());
}

// Layers that read one input, as a trainer holds them (dequantized, LoRA on the first and
// last): SharedInputForward computes each layer's own output in one node, and its gradients
// (x's summed in the products, each LoRA factor's) are the layers' own, with every output used
// and with one left out of the loss.
TEST(DecoderLmTest, SharedInputProjectionsGiveEachLayersOutputAndTheSummedGradients) {
  torch::manual_seed(21);
  std::vector<Linear> layers;
  for (int64_t out : {32, 16, 16}) {
    Linear layer(LinearOptions{32, out, false, Int4Groups32()});
    ASSERT_OK(layer->Adopt("weight", torch::randn({out, 32}) * 0.2));
    layers.push_back(layer);
  }
  for (size_t i : {0, 2}) {
    layers[i]->AddLora(4, 8.0);
    torch::NoGradGuard no_grad;
    layers[i]->lora_b.normal_(0.0, 0.1);
  }
  for (Linear& layer : layers) layer->HoldDequantized();
  const torch::Tensor x0 = torch::randn({2, 5, 32});
  std::vector<torch::Tensor> weights;  // the loss's weights per output
  for (const Linear& layer : layers) {
    weights.push_back(torch::randn({2, 5, layer->options().out_features}));
  }
  for (const bool skip_middle : {false, true}) {
    SCOPED_TRACE(skip_middle ? "the middle output left out" : "every output used");
    // The gradients of x and of each LoRA factor: {x, A0, B0, A2, B2}.
    auto run = [&](bool shared) {
      for (Linear& layer : layers) {
        for (torch::Tensor& p : {std::ref(layer->lora_a), std::ref(layer->lora_b)}) {
          if (p.defined()) p.mutable_grad() = torch::Tensor();
        }
      }
      const torch::Tensor x = x0.clone().requires_grad_(true);
      std::vector<torch::Tensor> outputs;
      if (shared) {
        outputs = SharedInputForward(layers, x);
        EXPECT_THAT(outputs[0].grad_fn()->name(), ::testing::HasSubstr("SharedInputFunction"));
      } else {
        for (Linear& layer : layers) outputs.push_back(layer->forward(x));
      }
      torch::Tensor loss = torch::zeros({});
      for (size_t i = 0; i < outputs.size(); ++i) {
        if (skip_middle && i == 1) continue;
        loss = loss + (outputs[i] * weights[i]).sum();
      }
      loss.backward();
      std::vector<torch::Tensor> out = outputs;
      out.push_back(x.grad());
      for (size_t i : {0, 2}) {
        out.push_back(layers[i]->lora_a.grad().clone());
        out.push_back(layers[i]->lora_b.grad().clone());
      }
      return out;
    };
    const std::vector<torch::Tensor> plain = run(false), shared = run(true);
    ASSERT_EQ(plain.size(), shared.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      SCOPED_TRACE(i < 3 ? "output " + std::to_string(i) : "gradient " + std::to_string(i - 3));
      ASSERT_TRUE(shared[i].defined());
      EXPECT_GT(plain[i].abs().sum().item<double>(), 0.0);
      if (i < 3) {
        EXPECT_TRUE(torch::equal(plain[i], shared[i]));  // the same operations forward
      } else {
        EXPECT_TRUE(torch::allclose(plain[i], shared[i], 1e-5, 1e-6))
            << (plain[i] - shared[i]).abs().max().item<double>();
      }
    }
  }
}

// Inside an Fp8BaseScope every quantized layer multiplies in FP8 (rounded, so the logits move
// a little and the LoRA gradients point where the plain ones do); after it each layer holds its
// weight as before, packed or dequantized, and computes exactly what it computed before.
TEST(DecoderLmTest, AnFp8ScopeRoundsTheBaseAndLeavesItAsItWas) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 12);
  testing::TempDir dir;
  ASSERT_OK(WriteFolder(*lm, TinyConfig(4, 2), dir));
  ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir.path()));
  DecoderLm plain(c, Int4Groups32()), rounded(c, Int4Groups32()), held(c, Int4Groups32());
  for (DecoderLm* m : {&plain, &rounded, &held}) LoadInt4WithLora(*m, folder);
  HoldDequantizedWeights(*held);
  torch::manual_seed(13);
  const torch::Tensor x = torch::randn({2, 5, 32});
  torch::Tensor before, held_before;
  {
    torch::NoGradGuard no_grad;
    before = rounded->Forward(x, {}, nullptr).logits;
    held_before = held->Forward(x, {}, nullptr).logits;
  }
  auto count = [](DecoderLm& m, bool fp8) {
    int64_t n = 0;
    for (const auto& module : m->modules()) {
      const auto* l = dynamic_cast<const LinearImpl*>(module.get());
      if (l != nullptr && (fp8 ? l->holds_fp8() : l->holds_dequantized())) ++n;
    }
    return n;
  };
  const int64_t quantized = count(held, /*fp8=*/false);
  ASSERT_GT(quantized, 0);
  {
    Fp8BaseScope off(*rounded, /*on=*/false);
    EXPECT_EQ(off.changed(), 0);
    Fp8BaseScope scope(*rounded, /*on=*/true), held_scope(*held, /*on=*/true);
    EXPECT_EQ(scope.changed(), quantized);
    EXPECT_EQ(count(rounded, /*fp8=*/true), quantized);
    EXPECT_EQ(count(held, /*fp8=*/false), 0);  // the float copies gave way
    torch::Tensor a = plain->Forward(x, {}, nullptr).logits;
    torch::Tensor b = rounded->Forward(x, {}, nullptr).logits;
    const double rel = ((b - a).norm() / a.norm()).item<double>();
    EXPECT_GT(rel, 1e-3);
    EXPECT_LT(rel, 0.1);
    EXPECT_TRUE(torch::allclose(held->Forward(x, {}, nullptr).logits, b, 1e-5, 1e-6));
    a.square().mean().backward();
    b.square().mean().backward();
    for (const auto& [ga, gb] : LoraGradients(plain, rounded)) {
      ASSERT_TRUE(gb.defined());
      EXPECT_GT(torch::cosine_similarity(ga.flatten(), gb.flatten(), 0).item<double>(), 0.98);
    }
  }
  EXPECT_EQ(count(rounded, /*fp8=*/true), 0);
  EXPECT_EQ(count(held, /*fp8=*/false), quantized);  // held dequantized again
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(rounded->Forward(x, {}, nullptr).logits, before));
  EXPECT_TRUE(torch::equal(held->Forward(x, {}, nullptr).logits, held_before));
}

// Without autograd a decode step writes its keys into the cache's buffer in place (no copy
// of the whole cache per step); with it the cache concatenates, so gradients flow.
TEST(DecoderLmTest, KvCacheGrowsInPlaceWithoutAutograd) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 10);
  torch::Tensor ids = torch::tensor({{3, 8, 1, 44, 20, 6}}, torch::kLong);
  {
    torch::NoGradGuard no_grad;
    DecoderKvCache cache;
    lm->Forward(lm->EmbedTokens(ids.narrow(1, 0, 3)), {}, &cache);
    const void* storage = cache.keys[1].data_ptr();
    for (int t = 3; t < 6; ++t) lm->Forward(lm->EmbedTokens(ids.narrow(1, t, 1)), {}, &cache);
    EXPECT_EQ(cache.length(), 6);
    EXPECT_EQ(cache.keys[1].data_ptr(), storage);
    // A cache whose keys were set from elsewhere (a batch row selected) is copied first.
    DecoderKvCache picked;
    for (size_t i = 0; i < cache.keys.size(); ++i) {
      picked.keys.push_back(cache.keys[i].index_select(0, torch::tensor({0})));
      picked.values.push_back(cache.values[i].index_select(0, torch::tensor({0})));
    }
    torch::Tensor next = torch::tensor({{9}}, torch::kLong);
    torch::Tensor a = lm->Forward(lm->EmbedTokens(next), {}, &picked).logits;
    torch::Tensor b = lm->Forward(lm->EmbedTokens(next), {}, &cache).logits;
    EXPECT_TRUE(torch::allclose(a, b, 1e-6, 1e-6));
  }
  lm->embed_tokens->weight.set_requires_grad(true);
  DecoderKvCache cache;
  lm->Forward(lm->EmbedTokens(ids.narrow(1, 0, 3)), {}, &cache);
  torch::Tensor logits = lm->Forward(lm->EmbedTokens(ids.narrow(1, 3, 1)), {}, &cache).logits;
  EXPECT_FALSE(cache.key_buffers[0].defined());
  logits.sum().backward();
  EXPECT_GT(
      lm->embed_tokens->weight.grad().index_select(0, torch::tensor({3})).abs().sum().item<float>(),
      0.0f);
}

// Module::to moves a quantized layer's packed weight with the parameters and keeps its
// placeholder one element (an expanded tensor's to() would allocate the full weight);
// on a machine with CUDA the moved model computes the CPU logits.
TEST(DecoderLmTest, QuantizedModelFollowsToWithoutAFullWeight) {
  ASSERT_OK_AND_ASSIGN(DecoderConfig c, ParseDecoderConfig(TinyConfig(4, 2), "c"));
  DecoderLm lm(c, WeightPrecision{});
  Randomize(*lm, 8);
  testing::TempDir dir;
  ASSERT_OK(WriteFolder(*lm, TinyConfig(4, 2), dir));
  ASSERT_OK_AND_ASSIGN(ModelFolder folder, ModelFolder::Open(dir.path()));
  WeightPrecision p;
  p.weights = Precision::kInt4;
  p.int4_group = 32;
  DecoderLm q(c, p);
  ASSERT_OK(q->Load(folder, "model.", "lm_head.", torch::kCPU));
  torch::NoGradGuard no_grad;
  torch::Tensor ids = torch::tensor({{3, 1, 4, 1, 5}}, torch::kLong);
  torch::Tensor before = q->Forward(q->EmbedTokens(ids), {}, nullptr).logits;
  q->to(torch::kCPU, torch::kFloat);
  q->to(torch::kCPU);
  int checked = 0;
  for (const auto& m : q->modules()) {
    if (auto* linear = dynamic_cast<LinearImpl*>(m.get()); linear != nullptr) {
      EXPECT_EQ(linear->weight.storage().nbytes(),
                static_cast<size_t>(linear->weight.element_size()));
      EXPECT_EQ(linear->weight.sizes(), torch::IntArrayRef({linear->options().out_features,
                                                            linear->options().in_features}));
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_TRUE(torch::equal(q->Forward(q->EmbedTokens(ids), {}, nullptr).logits, before));
  if (!torch::cuda::is_available()) return;
  q->to(torch::kCUDA);
  torch::Tensor on_cuda =
      q->Forward(q->EmbedTokens(ids.to(torch::kCUDA)), {}, nullptr).logits.to(torch::kCPU);
  EXPECT_LT(((on_cuda - before).abs().max() / before.abs().max()).item<float>(), 1e-4);
}

}  // namespace
}  // namespace cdcca::model
