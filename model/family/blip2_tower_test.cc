#include "model/family/blip2_tower.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "model/arch/hf_model.h"
#include "model/hub/hf_folder.h"
#include "model/hub/safetensors.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

VisionConfig TinyVision() {
  VisionConfig v;
  v.image_size = 16;
  v.patch_size = 4;  // a 4 x 4 token grid
  v.d_vis = 16;
  v.layers = 2;
  v.heads = 4;
  v.mlp_hidden = 32;
  return v;
}

TowerConfig TinyTower(int qa_layers = 2, int lora_rank = 2) {
  TowerConfig t;
  t.num_queries = 4;
  t.qa_dim = 16;
  t.qa_heads = 2;
  t.qa_layers = qa_layers;
  t.qa_mlp_hidden = 32;
  t.d_model = 24;
  t.lm_layers = 2;
  t.lm_heads = 2;
  t.ffn_hidden = 40;
  t.max_positions = 64;
  t.lora_rank = lora_rank;
  t.lora_alpha = 4.0f;
  t.dropout = 0.1f;
  t.vocab_size = 40;
  t.d_vis = 16;
  t.num_visual_tokens = 17;  // (16 / 4)^2 patches + the class token
  t.vision = TinyVision();
  return t;
}

// Weights large enough that logits spread (near-ties would make greedy comparisons flaky).
void Spread(torch::nn::Module& m, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    torch::Tensor& t = p.value();
    const std::string& name = p.key();
    if (t.dim() >= 2) {
      t.normal_(0.0, 0.15);
    } else if (name.find("orm") != std::string::npos && name.size() > 6 &&
               name.compare(name.size() - 6, 6, "weight") == 0) {
      t.normal_(1.0, 0.1);
    } else {
      t.normal_(0.0, 0.05);
    }
  }
}

struct Fixture {
  VisionConfig vision = TinyVision();
  TowerConfig tower = TinyTower();
  Blip2VisionModel vit{nullptr};
  Blip2Tower model{nullptr};
  torch::Tensor pixels;  // [2, 3, 16, 16]
  torch::Tensor tokens;  // ViT output [2, 17, 16]

  explicit Fixture(TowerConfig t = TinyTower()) : tower(t) {
    torch::manual_seed(1);
    vit = MakeFamilyVit(vision);
    model = Blip2Tower(vision, tower);
    Spread(*vit, 2);
    Spread(*model, 3);
    vit->eval();
    model->eval();
    pixels = FamilyPixelValues(torch::rand({2, 3, 16, 16}));
    torch::NoGradGuard no_grad;
    tokens = vit->forward(pixels);
  }
};

std::vector<std::string> Vocabulary(int n) {
  std::vector<std::string> words = {"<pad>", "<bos>", "<eos>", "<unk>", "?", "a", "is", "it"};
  for (int i = static_cast<int>(words.size()); i < n; ++i) words.push_back("w" + std::to_string(i));
  return words;
}

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/blip2_tower_" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(Blip2TowerTest, NamesAreTransformersAndLoraSitsOnQueryAndValue) {
  Fixture f;
  std::set<std::string> names;
  for (const auto& p : f.model->named_parameters()) names.insert(p.key());
  for (const char* n :
       {"query_tokens", "qformer.layernorm.weight",
        "qformer.encoder.layer.1.crossattention.attention.key.weight",
        "qformer.encoder.layer.0.output_query.LayerNorm.bias",
        "qformer.encoder.layer.0.attention.attention.query.lora_b", "language_projection.weight",
        "language_model.embed_tokens.weight", "language_model.layers.1.self_attn.v_proj.lora_a",
        "language_model.norm.weight", "language_model.lm_head.weight"}) {
    EXPECT_EQ(names.count(n), 1u) << n;
  }
  EXPECT_EQ(names.count("language_model.layers.0.self_attn.k_proj.lora_a"), 0u);
  for (const auto& p : f.model->parameters()) EXPECT_TRUE(p.requires_grad());
}

TEST(Blip2TowerTest, GenerateMatchesTeacherForcedForward) {
  Fixture f;
  torch::Tensor prompt = torch::tensor({{5, 6, 7, 4}, {1, 5, 6, 4}}, torch::kLong);
  GenerateResult g = f.model->Generate(f.tokens, {}, prompt, {}, 3, /*eos_id=*/2);
  ASSERT_EQ(g.tokens.size(0), 2);
  const int64_t n = g.tokens.size(1);
  torch::NoGradGuard no_grad;
  MllmInput in;
  in.visual_tokens = f.tokens;
  in.text_ids = torch::cat({prompt, g.tokens}, 1);
  MllmOutput out = f.model->Forward(in);
  ASSERT_EQ(out.logits.size(1), prompt.size(1) + n);
  EXPECT_EQ(out.queries.sizes(), (std::vector<int64_t>{2, 4, 16}));
  EXPECT_EQ(out.representation.sizes(), (std::vector<int64_t>{2, prompt.size(1) + n, 24}));
  for (int64_t s = 0; s < n; ++s) {
    torch::Tensor forced = out.logits.select(1, prompt.size(1) - 1 + s);
    EXPECT_TRUE(torch::allclose(forced, g.step_logits.select(1, s), 1e-4, 1e-4)) << "step " << s;
  }
  // Attention mass: one distribution over the 17 visual tokens per row.
  EXPECT_TRUE(torch::allclose(out.attention_mass.sum(1), torch::ones({2}), 1e-5, 1e-5));
}

TEST(Blip2TowerTest, LeftPaddingAndMaskedTokensChangeNothing) {
  Fixture f;
  torch::NoGradGuard no_grad;
  MllmInput plain;
  plain.visual_tokens = f.tokens;
  plain.text_ids = torch::tensor({{5, 6, 7}, {5, 6, 7}}, torch::kLong);
  MllmOutput a = f.model->Forward(plain);

  MllmInput padded = plain;
  padded.text_ids = torch::tensor({{0, 0, 5, 6, 7}, {0, 0, 5, 6, 7}}, torch::kLong);
  padded.text_valid = padded.text_ids.ne(0);
  MllmOutput b = f.model->Forward(padded);
  EXPECT_TRUE(torch::allclose(a.logits, b.logits.narrow(1, 2, 3), 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(a.representation, b.representation.narrow(1, 2, 3), 1e-5, 1e-5));

  // Tokens masked out may hold anything.
  MllmInput masked = plain;
  masked.visual_mask = torch::ones({2, 17}, torch::kBool);
  masked.visual_mask.narrow(1, 3, 5).fill_(false);
  MllmOutput c = f.model->Forward(masked);
  masked.visual_tokens = f.tokens.clone();
  masked.visual_tokens.narrow(1, 3, 5).normal_(0.0, 5.0);
  MllmOutput d = f.model->Forward(masked);
  EXPECT_TRUE(torch::allclose(c.logits, d.logits, 1e-5, 1e-5));
  EXPECT_EQ(c.attention_mass.narrow(1, 3, 5).abs().max().item<float>(), 0.0f);
  EXPECT_FALSE(torch::allclose(a.logits, c.logits, 1e-3, 1e-3));
}

TEST(Blip2TowerTest, ForwardGroupsMatchesForward) {
  Fixture f;
  torch::NoGradGuard no_grad;
  QuestionGroup g;
  g.text_ids = torch::tensor({{0, 5, 6}, {7, 6, 4}, {5, 5, 6}}, torch::kLong);
  g.text_valid = g.text_ids.ne(0);
  g.scene_index = torch::tensor({1, 0, 1}, torch::kLong);
  QuestionGroup tail = g;
  tail.logit_first = 1;
  tail.logit_count = 2;
  std::vector<MllmOutput> outs = f.model->ForwardGroups(f.tokens, {}, {g, tail});
  MllmInput in;
  in.visual_tokens = f.tokens.index_select(0, g.scene_index);
  in.text_ids = g.text_ids;
  in.text_valid = g.text_valid;
  MllmOutput ref = f.model->Forward(in);
  EXPECT_TRUE(torch::allclose(outs[0].logits, ref.logits, 1e-4, 1e-4));
  EXPECT_TRUE(torch::allclose(outs[0].representation, ref.representation, 1e-4, 1e-4));
  EXPECT_TRUE(torch::allclose(outs[1].logits, ref.logits.narrow(1, 1, 2), 1e-4, 1e-4));
  EXPECT_TRUE(torch::allclose(outs[0].queries, ref.queries, 1e-5, 1e-5));
}

TEST(Blip2TowerTest, StochasticPassesVaryOnlyWithDropout) {
  Fixture f;
  StochasticStats none = f.model->StochasticPasses(f.tokens, {}, 4, 0.0);
  EXPECT_EQ(none.attention_mass.sizes(), (std::vector<int64_t>{4, 2, 17}));
  EXPECT_EQ(none.attention_mass_variance.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(none.query_variance.abs().max().item<float>(), 0.0f);
  torch::manual_seed(9);
  StochasticStats some = f.model->StochasticAttention(f.tokens, {}, 6, 0.3);
  EXPECT_GT(some.attention_mass_variance.max().item<float>(), 0.0f);
  EXPECT_FALSE(some.queries.defined());
}

TEST(Blip2TowerTest, TrainModeDropoutOnlyWhileTraining) {
  Fixture f;
  MllmInput in;
  in.visual_tokens = f.tokens;
  in.text_ids = torch::tensor({{5, 6, 7}, {5, 6, 7}}, torch::kLong);
  torch::NoGradGuard no_grad;
  MllmOutput e1 = f.model->Forward(in);
  MllmOutput e2 = f.model->Forward(in);
  EXPECT_TRUE(torch::equal(e1.logits, e2.logits));
  f.model->train();
  torch::manual_seed(4);
  MllmOutput t1 = f.model->Forward(in);
  EXPECT_FALSE(torch::allclose(e1.logits, t1.logits, 1e-4, 1e-4));
}

// The folder is what transformers' Blip2ForConditionalGeneration loads; cdcca's own loader
// for downloaded checkpoints (LoadHfModel) must answer from it with the tower's tokens, and
// LoRA must be folded into the saved weights.
TEST(Blip2TowerTest, HuggingFaceFolderAnswersWithTheSameTokens) {
  Fixture f;
  const std::string dir = TempDir("folder");
  ASSERT_TRUE(SaveBlip2FamilyFolder(dir, *f.vit, *f.model, f.vision, Vocabulary(20)).ok());
  for (const char* file :
       {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "preprocessor_config.json", "generation_config.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + file)) << file;
  }
  absl::StatusOr<HfFolder> folder = HfFolder::Open(dir);
  ASSERT_TRUE(folder.ok()) << folder.status();
  EXPECT_EQ(folder->config()["model_type"], "blip-2");
  EXPECT_TRUE(folder->Has("language_model.model.layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(folder->Has("language_model.lm_head.weight"));
  EXPECT_TRUE(folder->Has("vision_model.embeddings.patch_embedding.weight"));
  for (const std::string& name : folder->Names()) {
    EXPECT_EQ(name.find("lora"), std::string::npos) << name;
  }

  absl::StatusOr<std::unique_ptr<MultimodalModel>> hf = LoadHfModel(dir, HfModelOptions{});
  ASSERT_TRUE(hf.ok()) << hf.status();
  const std::vector<std::vector<int64_t>> prompts = {{5, 6, 7, 4}, {1, 7, 4}};
  for (int row = 0; row < 2; ++row) {
    const std::vector<int64_t>& p = prompts[row];
    GenerateResult mine = f.model->Generate(f.tokens.narrow(0, row, 1), {},
                                            torch::tensor(p, torch::kLong).unsqueeze(0), {}, 5, 2);
    MultimodalInputs in;
    in.pixel_values = f.pixels.narrow(0, row, 1);
    in.input_ids = torch::tensor((*hf)->ExpandImageTokens(p), torch::kLong).unsqueeze(0);
    EXPECT_EQ(in.input_ids.size(1), 4 + static_cast<int64_t>(p.size()));
    GreedyOptions o;
    o.max_new_tokens = 5;
    o.eos_token_ids = (*hf)->eos_token_ids();
    absl::StatusOr<GreedyResult> theirs = (*hf)->Generate(in, o);
    ASSERT_TRUE(theirs.ok()) << theirs.status();
    const int64_t len = std::min<int64_t>(mine.lengths[0].item<int64_t>() + 1, 5);
    std::vector<int64_t> expected(mine.tokens[0].data_ptr<int64_t>(),
                                  mine.tokens[0].data_ptr<int64_t>() + len);
    EXPECT_EQ(theirs->tokens[0], expected) << "row " << row;
    EXPECT_TRUE(torch::allclose(theirs->first_logits[0], mine.step_logits[0][0], 1e-4, 1e-4));
  }

  // And the family's own loader gets back the same function (LoRA folded in, fresh again).
  absl::StatusOr<LoadedFamilyTower> back = LoadBlip2FamilyFolder(dir, f.vision, f.tower);
  ASSERT_TRUE(back.ok()) << back.status();
  back->vit->eval();
  back->tower->eval();
  torch::NoGradGuard no_grad;
  MllmInput in;
  in.visual_tokens = back->vit->forward(f.pixels);
  EXPECT_TRUE(torch::allclose(in.visual_tokens, f.tokens, 1e-5, 1e-5));
  in.text_ids = torch::tensor({{5, 6, 7}, {5, 6, 7}}, torch::kLong);
  MllmOutput again = back->tower->Forward(in);
  in.visual_tokens = f.tokens;
  EXPECT_TRUE(torch::allclose(again.logits, f.model->Forward(in).logits, 1e-4, 1e-4));
}

std::string CommittedFixture() {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/family/blip2_tower_tiny";
}

// The committed folder (what scripts/hf_fixtures.py --check_family compares with
// transformers) is regenerated by running this test with CDCCA_WRITE_FAMILY_FIXTURE=1; it
// must keep loading and answering as recorded, in both loaders.
TEST(Blip2TowerTest, CommittedFamilyFolderAnswersAsRecorded) {
  const std::string dir = CommittedFixture();
  if (std::getenv("CDCCA_WRITE_FAMILY_FIXTURE") != nullptr) {
    Fixture f;
    std::filesystem::remove_all(dir);
    ASSERT_TRUE(SaveBlip2FamilyFolder(dir, *f.vit, *f.model, f.vision, Vocabulary(20)).ok());
    ASSERT_TRUE(WriteFamilyParityCases(dir, *f.vit, *f.model, f.pixels,
                                       {{5, 6, 7, 4}, {6, 7, 5, 4}}, {"a is it?", "is it a?"}, 6)
                    .ok());
  }
  std::ifstream in(dir + "/cdcca_expected.json");
  ASSERT_TRUE(in.good()) << dir;
  nlohmann::json expected = nlohmann::json::parse(in);
  absl::StatusOr<SafetensorsContents> pixels = ReadSafetensors(dir + "/cdcca_pixels.safetensors");
  ASSERT_TRUE(pixels.ok()) << pixels.status();
  absl::StatusOr<std::unique_ptr<MultimodalModel>> hf = LoadHfModel(dir, HfModelOptions{});
  ASSERT_TRUE(hf.ok()) << hf.status();
  absl::StatusOr<LoadedFamilyTower> ours = LoadBlip2FamilyFolder(dir, TinyVision(), TinyTower());
  ASSERT_TRUE(ours.ok()) << ours.status();
  ours->vit->eval();
  ours->tower->eval();
  ASSERT_EQ(expected["cases"].size(), 2u);
  for (size_t i = 0; i < expected["cases"].size(); ++i) {
    const nlohmann::json& c = expected["cases"][i];
    const std::vector<int64_t> tokens = c["greedy_tokens"].get<std::vector<int64_t>>();
    ASSERT_EQ(pixels->tensors[i].first, "case" + std::to_string(i));
    torch::Tensor pv = pixels->tensors[i].second.unsqueeze(0);
    MultimodalInputs mi;
    mi.pixel_values = pv;
    mi.input_ids =
        torch::tensor(c["input_ids"].get<std::vector<int64_t>>(), torch::kLong).unsqueeze(0);
    GreedyOptions o;
    o.max_new_tokens = c["max_new_tokens"].get<int64_t>();
    o.eos_token_ids = (*hf)->eos_token_ids();
    absl::StatusOr<GreedyResult> theirs = (*hf)->Generate(mi, o);
    ASSERT_TRUE(theirs.ok()) << theirs.status();
    EXPECT_EQ(theirs->tokens[0], tokens) << "case " << i;
    torch::NoGradGuard no_grad;
    GenerateResult r = ours->tower->Generate(
        ours->vit->forward(pv), {},
        torch::tensor(c["prompt_ids"].get<std::vector<int64_t>>(), torch::kLong).unsqueeze(0), {},
        static_cast<int>(o.max_new_tokens), 2);
    EXPECT_EQ(r.tokens[0][0].item<int64_t>(), tokens[0]) << "case " << i;
  }
}

TEST(Blip2TowerTest, FolderErrorsNameTheTensor) {
  Fixture f;
  const std::string dir = TempDir("mismatch");
  ASSERT_TRUE(SaveBlip2FamilyFolder(dir, *f.vit, *f.model, f.vision, Vocabulary(20)).ok());
  TowerConfig wider = f.tower;
  wider.ffn_hidden = 48;
  absl::StatusOr<LoadedFamilyTower> back = LoadBlip2FamilyFolder(dir, f.vision, wider);
  ASSERT_FALSE(back.ok());
  EXPECT_NE(std::string(back.status().message()).find("mlp.gate_proj.weight"), std::string::npos)
      << back.status();
  EXPECT_FALSE(
      SaveBlip2FamilyFolder(TempDir("big"), *f.vit, *f.model, f.vision, Vocabulary(40)).ok());
}

TEST(Blip2TowerTest, QuantizedTowersComputeWithTheirDequantizedWeights) {
  TowerConfig t = TinyTower();
  t.int4_group = 8;  // divides every width of the tiny tower
  Fixture f(t);
  MllmInput in;
  in.visual_tokens = f.tokens;
  in.text_ids = torch::tensor({{5, 6, 7}, {7, 6, 5}}, torch::kLong);
  torch::NoGradGuard no_grad;
  const torch::Tensor ref = f.model->Forward(in).logits;
  int64_t bytes = TowerLinearWeightBytes(*f.model);
  for (Precision p : {Precision::kInt8, Precision::kInt4}) {
    Blip2Tower q = ConvertTowerPrecision(*f.model, p);
    EXPECT_FALSE(q->is_training());
    const torch::Tensor got = q->Forward(in).logits;
    const float err = (got - ref).abs().max().item<float>() / ref.abs().max().item<float>();
    // Random weights of this spread lose more to 4 bits than trained ones.
    EXPECT_LT(err, p == Precision::kInt8 ? 0.03f : 0.4f) << PrecisionName(p);
    // int8: a byte per weight + a scale per row, under 30 % of fp32; int4: half a byte + a
    // scale per group of 8, less than int8.
    EXPECT_LT(TowerLinearWeightBytes(*q), bytes * (p == Precision::kInt8 ? 0.3 : 0.95))
        << PrecisionName(p);
    bytes = TowerLinearWeightBytes(*q);
    // The fp32 mirror computes exactly what the quantized tower computes.
    Blip2Tower mirror = ConvertTowerPrecision(*q, Precision::kFp32);
    EXPECT_TRUE(torch::allclose(mirror->Forward(in).logits, got, 1e-5, 1e-5));
    // The trainable set (LoRA here) is carried over unchanged.
    EXPECT_TRUE(torch::equal(
        q->named_parameters()["language_model.layers.0.self_attn.q_proj.lora_a"],
        f.model->named_parameters()["language_model.layers.0.self_attn.q_proj.lora_a"]));
  }
}

TEST(Blip2TowerTest, AdapterPromptsStartInertAndBlockTheFolderOnceOpen) {
  TowerConfig t = TinyTower(/*qa_layers=*/1);
  t.adapter_prompt_len = 3;
  t.adapter_layers = 1;
  Fixture f(t);
  auto params = f.model->named_parameters();
  ASSERT_TRUE(params.contains("language_model.layers.1.self_attn.adapter_prompt"));
  ASSERT_FALSE(params.contains("language_model.layers.0.self_attn.adapter_prompt"));
  torch::Tensor gate = params["language_model.layers.1.self_attn.adapter_gate"];
  MllmInput in;
  in.visual_tokens = f.tokens;
  in.text_ids = torch::tensor({{5, 6, 7}, {7, 6, 5}}, torch::kLong);
  torch::NoGradGuard no_grad;
  gate.zero_();
  const torch::Tensor closed = f.model->Forward(in).logits;
  const std::string dir = TempDir("adapter");
  ASSERT_TRUE(SaveBlip2FamilyFolder(dir, *f.vit, *f.model, f.vision, Vocabulary(20)).ok());
  absl::StatusOr<std::unique_ptr<MultimodalModel>> hf = LoadHfModel(dir, HfModelOptions{});
  ASSERT_TRUE(hf.ok()) << hf.status();

  gate.fill_(0.5);
  EXPECT_FALSE(torch::allclose(f.model->Forward(in).logits, closed, 1e-3, 1e-3));
  absl::Status open =
      SaveBlip2FamilyFolder(TempDir("adapter_open"), *f.vit, *f.model, f.vision, Vocabulary(20));
  EXPECT_EQ(open.code(), absl::StatusCode::kFailedPrecondition) << open;

  // Loaded back, the prompts are fresh (gate zero) and the tower computes the closed function.
  absl::StatusOr<LoadedFamilyTower> back = LoadBlip2FamilyFolder(dir, f.vision, t);
  ASSERT_TRUE(back.ok()) << back.status();
  back->tower->eval();
  EXPECT_TRUE(torch::allclose(back->tower->Forward(in).logits, closed, 1e-4, 1e-4));
}

TEST(Blip2TowerTest, WordLevelTokenizerKeepsIdsAndMarksSpecials) {
  nlohmann::json j = WordLevelTokenizerJson(Vocabulary(10), 16);
  EXPECT_EQ(j["model"]["type"], "WordLevel");
  EXPECT_EQ(j["model"]["vocab"]["is"], 6);
  EXPECT_EQ(j["model"]["vocab"]["<image>"], 15);
  EXPECT_EQ(j["model"]["vocab"]["<unused_12>"], 12);
  EXPECT_EQ(j["added_tokens"].size(), 5u);
  EXPECT_EQ(j["model"]["unk_token"], "<unk>");
}

}  // namespace
}  // namespace cdcca::model
