// Shapes, names and hand-checkable properties of the BLIP-2 ViT and Q-Former (parity with
// transformers is checked against the fixtures in blip2_test.cc).
#include "model/arch/qformer.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "model/arch/blip2.h"
#include "model/arch/blip2_vision.h"
#include "model/hub/blip2_config.h"
#include "model/hub/safetensors.h"

namespace cdcca::model {
namespace {

Blip2VisionConfig TinyVision() {
  Blip2VisionConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.image_size = 12;
  c.patch_size = 4;
  c.layer_norm_eps = 1e-6;
  return c;
}

QFormerConfig TinyQFormer() {
  QFormerConfig c;
  c.hidden_size = 16;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.intermediate_size = 20;
  c.cross_attention_frequency = 2;
  c.encoder_hidden_size = 12;
  c.vocab_size = 50;
  c.max_position_embeddings = 16;
  return c;
}

// Gives every parameter (placeholders until loaded) distinct random values, norm weights
// near 1, the way a checkpoint would.
void Randomize(torch::nn::Module& m, int seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    torch::Tensor v = torch::randn(p.value().sizes()) * 0.3;
    const std::string& name = p.key();
    if (name.find("orm") != std::string::npos && name.size() > 6 &&
        name.substr(name.size() - 6) == "weight") {
      v += 1.0;
    }
    p.value().set_data(v.to(p.value().scalar_type()));
  }
}

std::map<std::string, std::vector<int64_t>> Shapes(const torch::nn::Module& m) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().sizes().vec();
  return out;
}

TEST(Blip2ConfigTest, ParsesSectionsAndOverridesEncoderWidth) {
  nlohmann::json j = {{"model_type", "instructblip"},
                      {"num_query_tokens", 4},
                      {"image_token_index", 301},
                      {"vision_config",
                       {{"hidden_size", 32},
                        {"num_attention_heads", 4},
                        {"image_size", 30},
                        {"patch_size", 6},
                        {"hidden_act", "gelu"}}},
                      {"qformer_config",
                       {{"hidden_size", 24},
                        {"num_attention_heads", 4},
                        {"encoder_hidden_size", 999},
                        {"cross_attention_frequency", 1}}},
                      {"text_config", {{"model_type", "llama"}}}};
  absl::StatusOr<Blip2Config> c = ParseBlip2Config(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->instruct);
  EXPECT_EQ(c->vision.NumPositions(), 26);
  EXPECT_EQ(c->qformer.encoder_hidden_size, 32);  // the ViT's width, as transformers sets it
  EXPECT_TRUE(c->qformer.use_qformer_text_input);
  EXPECT_EQ(c->num_query_tokens, 4);
  ASSERT_TRUE(c->image_token_id.has_value());
  EXPECT_EQ(*c->image_token_id, 301);

  j["model_type"] = "blip-2";
  j.erase("image_token_index");
  c = ParseBlip2Config(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->instruct);
  EXPECT_FALSE(c->qformer.use_qformer_text_input);
  EXPECT_FALSE(c->image_token_id.has_value());
}

TEST(Blip2ConfigTest, BadFieldsAreNamed) {
  nlohmann::json j = {{"model_type", "blip-2"},
                      {"vision_config", {{"hidden_act", "swiglu_of_doom"}}}};
  absl::StatusOr<Blip2Config> c = ParseBlip2Config(j, "dir/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("dir/config.json"), std::string::npos);
  EXPECT_NE(c.status().message().find("vision_config.hidden_act"), std::string::npos);

  j = {{"model_type", "blip-2"}, {"qformer_config", {{"position_embedding_type", "relative_key"}}}};
  c = ParseBlip2Config(j, "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("qformer_config.position_embedding_type"), std::string::npos);

  j = {{"model_type", "blip-3"}};
  EXPECT_FALSE(ParseBlip2Config(j, "config.json").ok());
}

TEST(Blip2VisionTest, NamesAndShapesMirrorTransformers) {
  Blip2VisionConfig c = TinyVision();
  Blip2VisionModel vit(c);
  auto shapes = Shapes(*vit);
  using V = std::vector<int64_t>;
  EXPECT_EQ(shapes.at("embeddings.class_embedding"), (V{1, 1, 16}));
  EXPECT_EQ(shapes.at("embeddings.patch_embedding.weight"), (V{16, 3, 4, 4}));
  EXPECT_EQ(shapes.at("embeddings.patch_embedding.bias"), (V{16}));
  EXPECT_EQ(shapes.at("embeddings.position_embedding"), (V{1, 10, 16}));
  EXPECT_EQ(shapes.at("encoder.layers.1.self_attn.qkv.weight"), (V{48, 16}));
  EXPECT_EQ(shapes.at("encoder.layers.1.self_attn.qkv.bias"), (V{48}));
  EXPECT_EQ(shapes.at("encoder.layers.1.self_attn.projection.weight"), (V{16, 16}));
  EXPECT_EQ(shapes.at("encoder.layers.0.mlp.fc1.weight"), (V{24, 16}));
  EXPECT_EQ(shapes.at("encoder.layers.0.mlp.fc2.bias"), (V{16}));
  EXPECT_EQ(shapes.at("encoder.layers.0.layer_norm1.weight"), (V{16}));
  EXPECT_EQ(shapes.at("encoder.layers.0.layer_norm2.bias"), (V{16}));
  EXPECT_EQ(shapes.at("post_layernorm.weight"), (V{16}));
  EXPECT_EQ(shapes.size(), 4u + 2u * 12u + 2u);

  Randomize(*vit, 1);
  vit->eval();
  torch::NoGradGuard no_grad;
  torch::Tensor out = vit->forward(torch::randn({2, 3, 12, 12}));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 10, 16}));
}

TEST(Blip2VisionTest, OutputIsPostLayerNormed) {
  Blip2VisionModel vit(TinyVision());
  Randomize(*vit, 2);
  {
    torch::NoGradGuard no_grad;
    vit->post_layernorm->weight.fill_(1.0);
    vit->post_layernorm->bias.zero_();
  }
  torch::NoGradGuard no_grad;
  torch::Tensor out = vit->forward(torch::randn({1, 3, 12, 12}));
  EXPECT_LT(out.mean(-1).abs().max().item<double>(), 1e-5);
  EXPECT_LT((out.var(-1, /*unbiased=*/false) - 1.0).abs().max().item<double>(), 1e-3);
}

TEST(Blip2VisionTest, FusedQkvIsThreeLinearsWithQAndVBiasesAndNoKBias) {
  Blip2VisionConfig c = TinyVision();
  Blip2VisionAttention attn(c, WeightPrecision{});
  Randomize(*attn, 3);
  torch::Tensor q_bias = torch::randn({16});
  torch::Tensor v_bias = torch::randn({16});
  {
    torch::NoGradGuard no_grad;
    attn->qkv->bias.copy_(Blip2QkvBiasFromParts(q_bias, v_bias));
  }
  torch::NoGradGuard no_grad;
  torch::Tensor x = torch::randn({2, 5, 16});
  torch::Tensor w = attn->qkv->weight;
  torch::Tensor q = torch::nn::functional::linear(x, w.slice(0, 0, 16), q_bias);
  torch::Tensor k = torch::nn::functional::linear(x, w.slice(0, 16, 32));
  torch::Tensor v = torch::nn::functional::linear(x, w.slice(0, 32, 48), v_bias);
  auto heads = [](const torch::Tensor& t) { return t.view({2, 5, 2, 8}).transpose(1, 2); };
  torch::Tensor p =
      torch::softmax(torch::matmul(heads(q), heads(k).transpose(-1, -2)) / std::sqrt(8.0), -1);
  torch::Tensor ctx = torch::matmul(p, heads(v)).transpose(1, 2).reshape({2, 5, 16});
  torch::Tensor expected = attn->projection->forward(ctx);
  EXPECT_TRUE(torch::allclose(attn->forward(x), expected, 1e-5, 1e-6));
}

// Writes `module`'s parameters as a Hugging Face folder (config.json + model.safetensors)
// under `prefix`, optionally with the ViT's fused qkv bias split into q_bias / v_bias.
std::string WriteFolder(const std::string& name, torch::nn::Module& module,
                        const std::string& prefix, bool split_qkv_bias) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << R"({"model_type": "blip-2"})";
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& p : module.named_parameters()) {
    const std::string& n = p.key();
    const std::string suffix = "self_attn.qkv.bias";
    if (split_qkv_bias && n.size() > suffix.size() &&
        n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0) {
      const std::string base = prefix + n.substr(0, n.size() - std::string("qkv.bias").size());
      const int64_t h = p.value().size(0) / 3;
      tensors.emplace_back(base + "q_bias", p.value().slice(0, 0, h).to(torch::kHalf));
      tensors.emplace_back(base + "v_bias", p.value().slice(0, 2 * h).to(torch::kHalf));
      continue;
    }
    tensors.emplace_back(prefix + n, p.value().to(torch::kHalf));  // fp16 on disk, as the fixtures
  }
  absl::Status s = WriteSafetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  EXPECT_TRUE(s.ok()) << s;
  return dir;
}

TEST(Blip2VisionTest, LoadsFusedOrSplitQkvBiasFromHfNames) {
  Blip2VisionConfig c = TinyVision();
  Blip2VisionModel reference(c);
  Randomize(*reference, 8);
  {
    torch::NoGradGuard no_grad;  // a real k bias third is zero
    for (const auto& layer : *reference->encoder->layers) {
      layer->as<Blip2VisionLayerImpl>()->self_attn->qkv->bias.slice(0, 16, 32).zero_();
    }
  }
  torch::NoGradGuard no_grad;
  torch::Tensor pixels = torch::randn({1, 3, 12, 12});
  // What fp16 storage leaves of the weights.
  for (auto& p : reference->named_parameters())
    p.value().set_data(p.value().to(torch::kHalf).to(torch::kFloat));
  torch::Tensor expected = reference->forward(pixels);
  for (bool split : {false, true}) {
    SCOPED_TRACE(split ? "q_bias/v_bias" : "qkv.bias");
    const std::string dir =
        WriteFolder(split ? "vit_split" : "vit_fused", *reference, "vision_model.", split);
    absl::StatusOr<ModelFolder> folder = ModelFolder::Open(dir);
    ASSERT_TRUE(folder.ok()) << folder.status();
    Blip2VisionModel loaded(c);
    absl::Status s = LoadBlip2Vision(*folder, "vision_model.", *loaded, torch::kCPU);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(torch::allclose(loaded->forward(pixels), expected, 1e-5, 1e-6));
  }
  // A missing tensor is named.
  const std::string dir = WriteFolder("vit_wrong_prefix", *reference, "vision.", false);
  absl::StatusOr<ModelFolder> folder = ModelFolder::Open(dir);
  ASSERT_TRUE(folder.ok()) << folder.status();
  Blip2VisionModel loaded(c);
  absl::Status s = LoadBlip2Vision(*folder, "vision_model.", *loaded, torch::kCPU);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("vision_model."), std::string::npos) << s;
}

TEST(QFormerTest, CrossAttentionOnlyEveryFrequencyLayers) {
  QFormerConfig c = TinyQFormer();
  c.num_hidden_layers = 5;
  c.cross_attention_frequency = 2;
  QFormerModel qf(c, /*with_instruction=*/false);
  std::vector<bool> cross;
  for (const auto& layer : *qf->encoder->layer) {
    cross.push_back(layer->as<QFormerLayerImpl>()->has_cross_attention());
  }
  EXPECT_EQ(cross, (std::vector<bool>{true, false, true, false, true}));
  auto shapes = Shapes(*qf);
  using V = std::vector<int64_t>;
  EXPECT_EQ(shapes.at("layernorm.weight"), (V{16}));
  EXPECT_EQ(shapes.at("encoder.layer.0.attention.attention.query.weight"), (V{16, 16}));
  EXPECT_EQ(shapes.at("encoder.layer.0.attention.output.LayerNorm.bias"), (V{16}));
  EXPECT_EQ(shapes.at("encoder.layer.2.crossattention.attention.key.weight"), (V{16, 12}));
  EXPECT_EQ(shapes.at("encoder.layer.2.crossattention.attention.value.weight"), (V{16, 12}));
  EXPECT_EQ(shapes.at("encoder.layer.2.crossattention.output.dense.weight"), (V{16, 16}));
  EXPECT_EQ(shapes.at("encoder.layer.1.intermediate_query.dense.weight"), (V{20, 16}));
  EXPECT_EQ(shapes.at("encoder.layer.1.output_query.dense.weight"), (V{16, 20}));
  EXPECT_EQ(shapes.at("encoder.layer.1.output_query.LayerNorm.weight"), (V{16}));
  EXPECT_EQ(shapes.count("encoder.layer.1.crossattention.attention.key.weight"), 0u);
  EXPECT_EQ(shapes.count("encoder.layer.1.intermediate.dense.weight"), 0u);  // no text input
  EXPECT_EQ(shapes.count("embeddings.word_embeddings.weight"), 0u);

  QFormerModel instruct(c, /*with_instruction=*/true);
  auto ishapes = Shapes(*instruct);
  EXPECT_EQ(ishapes.at("embeddings.word_embeddings.weight"), (V{50, 16}));
  EXPECT_EQ(ishapes.at("embeddings.position_embeddings.weight"), (V{16, 16}));
  EXPECT_EQ(ishapes.at("embeddings.layernorm.weight"), (V{16}));
  EXPECT_EQ(ishapes.at("encoder.layer.3.intermediate.dense.weight"), (V{20, 16}));
  EXPECT_EQ(ishapes.at("encoder.layer.3.output.LayerNorm.bias"), (V{16}));
  EXPECT_EQ(ishapes.count("layernorm.weight"), 0u);
}

TEST(QFormerTest, ImageReachesQueriesOnlyThroughCrossAttentionLayers) {
  QFormerConfig c = TinyQFormer();
  QFormerModel qf(c, false);
  Randomize(*qf, 4);
  torch::NoGradGuard no_grad;
  torch::Tensor queries = torch::randn({2, 3, 16});
  torch::Tensor image = torch::randn({2, 7, 12});
  torch::Tensor out = qf->forward(queries, image);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, 16}));
  // Batch rows are independent.
  torch::Tensor first = qf->forward(queries.slice(0, 0, 1), image.slice(0, 0, 1));
  EXPECT_TRUE(torch::allclose(first, out.slice(0, 0, 1), 1e-5, 1e-6));
  // A different image changes the output; zeroing the cross-attention value/output path of
  // every cross-attention layer (dense weight and bias 0) removes the image's influence.
  EXPECT_FALSE(torch::allclose(qf->forward(queries, torch::randn({2, 7, 12})), out, 1e-3, 1e-3));
  for (const auto& layer : *qf->encoder->layer) {
    auto* l = layer->as<QFormerLayerImpl>();
    if (!l->has_cross_attention()) continue;
    l->crossattention->output->dense->weight.zero_();
    l->crossattention->output->dense->bias.zero_();
  }
  torch::Tensor a = qf->forward(queries, image);
  torch::Tensor b = qf->forward(queries, torch::randn({2, 7, 12}));
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-6));
}

// Copies every parameter of `from` into the same-named one of `to` ("layernorm" of BLIP-2
// into "embeddings.layernorm" of InstructBLIP).
void CopyShared(const torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto dst = to.named_parameters();
  for (const auto& p : from.named_parameters()) {
    std::string name = p.key();
    if (name.rfind("layernorm.", 0) == 0) name = "embeddings." + name;
    ASSERT_TRUE(dst.contains(name)) << name;
    dst[name].copy_(p.value());
  }
}

TEST(QFormerTest, InstructBlipWithEmptyInstructionEqualsBlip2Path) {
  QFormerConfig c = TinyQFormer();
  QFormerModel blip2(c, false);
  QFormerModel instruct(c, true);
  Randomize(*blip2, 5);
  Randomize(*instruct, 6);
  CopyShared(*blip2, *instruct);
  torch::NoGradGuard no_grad;
  torch::Tensor queries = torch::randn({1, 3, 16});
  torch::Tensor image = torch::randn({1, 7, 12});
  torch::Tensor expected = blip2->forward(queries, image);
  torch::Tensor empty = torch::zeros({1, 0}, torch::kLong);
  EXPECT_TRUE(torch::allclose(instruct->forward(queries, image), expected, 1e-5, 1e-6));
  EXPECT_TRUE(
      torch::allclose(instruct->forward(queries, image, empty, torch::zeros({1, 0}, torch::kLong)),
                      expected, 1e-5, 1e-6));
  // With an instruction the queries read it through self-attention.
  torch::Tensor ids = torch::tensor({{5, 9, 2}}, torch::kLong);
  torch::Tensor with_text = instruct->forward(queries, image, ids);
  EXPECT_EQ(with_text.sizes(), (std::vector<int64_t>{1, 6, 16}));
  EXPECT_FALSE(torch::allclose(with_text.slice(1, 0, 3), expected, 1e-3, 1e-3));
}

TEST(QFormerTest, PaddedInstructionTokensDoNotChangeQueries) {
  QFormerConfig c = TinyQFormer();
  QFormerModel qf(c, true);
  Randomize(*qf, 7);
  torch::NoGradGuard no_grad;
  torch::Tensor queries = torch::randn({1, 3, 16});
  torch::Tensor image = torch::randn({1, 7, 12});
  torch::Tensor ids = torch::tensor({{5, 9, 2}}, torch::kLong);
  torch::Tensor plain = qf->forward(queries, image, ids, torch::ones({1, 3}, torch::kLong));
  torch::Tensor padded = qf->forward(queries, image, torch::tensor({{5, 9, 2, 0, 0}}, torch::kLong),
                                     torch::tensor({{1, 1, 1, 0, 0}}, torch::kLong));
  EXPECT_TRUE(torch::allclose(padded.slice(1, 0, 6), plain, 1e-5, 1e-6));
  // A query's output depends on the instruction's token order only through positions.
  torch::Tensor swapped = qf->forward(queries, image, torch::tensor({{9, 5, 2}}, torch::kLong));
  EXPECT_FALSE(torch::allclose(swapped.slice(1, 0, 3), plain.slice(1, 0, 3), 1e-4, 1e-4));
}

}  // namespace
}  // namespace cdcca::model
