// The project's families as the one BLIP-2 implementation: a fresh model, its training
// forward, and the Hugging Face folder it is saved as (which LoadModel, and transformers,
// answer from with the same tokens).
#include "model/family/family_model.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/arch/multimodal_model.h"
#include "model/hub/model_folder.h"
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

TowerConfig TinyTower(int qa_layers = 2) {
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
  t.lora_rank = 2;
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
  Blip2ForConditionalGeneration model{nullptr};
  torch::Tensor pixels;  // [2, 3, 16, 16]

  Fixture() {
    torch::manual_seed(1);
    absl::StatusOr<Blip2ForConditionalGeneration> m = NewFamilyModel(vision, tower);
    EXPECT_TRUE(m.ok()) << m.status();
    model = *m;
    Spread(*model, 3);
    model->eval();
    pixels = FamilyPixelValues(torch::rand({2, 3, 16, 16}));
  }
};

std::vector<std::string> Vocabulary(int n) {
  std::vector<std::string> words = {"<pad>", "<bos>", "<eos>", "<unk>", "?", "a", "is", "it"};
  for (int i = static_cast<int>(words.size()); i < n; ++i) words.push_back("w" + std::to_string(i));
  return words;
}

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/family_model_" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

GreedyOptions Greedy(MultimodalModel& m, int64_t n) {
  GreedyOptions o;
  o.max_new_tokens = n;
  o.eos_token_ids = m.eos_token_ids();
  return o;
}

TEST(FamilyModelTest, RefusesATowerThatDoesNotFitItsVision) {
  TowerConfig t = TinyTower();
  t.d_vis = 32;
  absl::StatusOr<Blip2ForConditionalGeneration> m = NewFamilyModel(TinyVision(), t);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(m.status().message()).find("d_vis"), std::string::npos) << m.status();
}

TEST(FamilyModelTest, FreshModelTrainsEverythingAndStartsItsVitOnTheGrid) {
  torch::manual_seed(1);
  absl::StatusOr<Blip2ForConditionalGeneration> m = NewFamilyModel(TinyVision(), TinyTower());
  ASSERT_TRUE(m.ok()) << m.status();
  for (const auto& p : (*m)->named_parameters()) {
    EXPECT_TRUE(p.value().requires_grad()) << p.key();
    EXPECT_EQ(p.value().strides().size(), p.value().sizes().size()) << p.key();
    EXPECT_TRUE(p.value().is_contiguous()) << p.key() << " is still a placeholder";
  }
  // The grid sinusoid: the class token's row is zero, the patch rows are not.
  torch::Tensor pos = (*m)->vision_model->named_parameters()["embeddings.position_embedding"];
  EXPECT_EQ(pos[0][0].abs().sum().item<float>(), 0.0f);
  EXPECT_GT(pos[0][1].abs().sum().item<float>(), 0.0f);
}

// The teacher-forced forward pretraining trains with computes, for each question, what the
// model computes for the same ids through the interface every program uses.
TEST(FamilyModelTest, QuestionGroupsComputeWhatTheModelComputesPerRow) {
  Fixture f;
  std::unique_ptr<MultimodalModel> mm = FamilyMultimodalModel(f.model, torch::kCPU);
  torch::NoGradGuard no_grad;
  MultimodalInputs px;
  px.pixel_values = f.pixels;
  absl::StatusOr<torch::Tensor> tokens = mm->EncodeImages(px);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  // Three questions on two scenes; the second row is left-padded by two.
  const torch::Tensor text =
      torch::tensor({{1, 5, 6, 7, 4, 9}, {0, 0, 1, 6, 4, 8}, {1, 7, 6, 5, 4, 10}}, torch::kLong);
  const torch::Tensor valid =
      torch::tensor({{1, 1, 1, 1, 1, 1}, {0, 0, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1}}).to(torch::kBool);
  const torch::Tensor scene = torch::tensor({0, 1, 0}, torch::kLong);
  std::vector<FamilyGroupOutput> groups =
      ForwardQuestionGroups(*f.model, *tokens, torch::Tensor(), {{text, valid, scene}}, 0.0);
  ASSERT_EQ(groups.size(), 1u);
  for (int64_t r = 0; r < 3; ++r) {
    std::vector<int64_t> ids;
    for (int64_t k = 0; k < text.size(1); ++k) {
      if (valid[r][k].item<bool>()) ids.push_back(text[r][k].item<int64_t>());
    }
    TokenInputs in;
    in.visual_tokens = tokens->index_select(0, scene.narrow(0, r, 1));
    in.input_ids = torch::tensor(mm->ExpandImageTokens(ids), torch::kLong).unsqueeze(0);
    absl::StatusOr<TokenForward> one = mm->ForwardTokens(in);
    ASSERT_TRUE(one.ok()) << one.status();
    const int64_t n = static_cast<int64_t>(ids.size());
    torch::Tensor theirs = one->logits[0].narrow(0, in.input_ids.size(1) - n, n);
    torch::Tensor mine = groups[0].logits[r].narrow(0, text.size(1) - n, n);
    EXPECT_TRUE(torch::allclose(mine, theirs, 1e-4, 1e-4)) << "row " << r;
  }
  EXPECT_EQ(groups[0].queries.sizes(), (std::vector<int64_t>{3, 4, 16}));
}

// Dropout in the training forward is the model's own: on at dropout_p, off at 0.
TEST(FamilyModelTest, QuestionGroupsDropOutOnlyWhenAsked) {
  Fixture f;
  torch::NoGradGuard no_grad;
  torch::Tensor tokens = f.model->vision_model->forward(f.pixels);
  const FamilyQuestionGroup g{torch::tensor({{1, 5, 6}, {1, 6, 5}}, torch::kLong), torch::Tensor(),
                              torch::tensor({0, 1}, torch::kLong)};
  auto run = [&](double p) {
    return ForwardQuestionGroups(*f.model, tokens, {}, {g}, p)[0].logits;
  };
  EXPECT_TRUE(torch::equal(run(0.0), run(0.0)));
  EXPECT_FALSE(torch::allclose(run(0.3), run(0.3)));
}

TEST(FamilyModelTest, HuggingFaceFolderAnswersWithTheSameTokens) {
  Fixture f;
  const std::string dir = TempDir("folder");
  ASSERT_TRUE(
      SaveFamilyFolder(dir, *f.model, f.vision, f.tower, Vocabulary(20), {{"role", "student"}})
          .ok());
  for (const char* file :
       {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "preprocessor_config.json", "generation_config.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + file)) << file;
  }
  absl::StatusOr<ModelFolder> folder = ModelFolder::Open(dir);
  ASSERT_TRUE(folder.ok()) << folder.status();
  EXPECT_EQ(folder->config()["model_type"], "blip-2");
  EXPECT_EQ(folder->config()["cdcca"]["role"], "student");
  EXPECT_TRUE(folder->Has("language_model.model.layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(folder->Has("language_model.lm_head.weight"));
  EXPECT_TRUE(folder->Has("vision_model.embeddings.patch_embedding.weight"));
  EXPECT_TRUE(folder->Has("query_tokens"));

  std::unique_ptr<MultimodalModel> mine = FamilyMultimodalModel(f.model, torch::kCPU);
  absl::StatusOr<std::unique_ptr<MultimodalModel>> hf = LoadModel(dir, ModelOptions{});
  ASSERT_TRUE(hf.ok()) << hf.status();
  const std::vector<std::vector<int64_t>> prompts = {{5, 6, 7, 4}, {1, 7, 4}};
  for (int row = 0; row < 2; ++row) {
    MultimodalInputs in;
    in.pixel_values = f.pixels.narrow(0, row, 1);
    in.input_ids = torch::tensor((*hf)->ExpandImageTokens(prompts[row]), torch::kLong).unsqueeze(0);
    EXPECT_EQ(in.input_ids.size(1), 4 + static_cast<int64_t>(prompts[row].size()));
    absl::StatusOr<GreedyResult> theirs = (*hf)->Generate(in, Greedy(**hf, 5));
    absl::StatusOr<GreedyResult> ours = mine->Generate(in, Greedy(*mine, 5));
    ASSERT_TRUE(theirs.ok()) << theirs.status();
    ASSERT_TRUE(ours.ok()) << ours.status();
    EXPECT_EQ(theirs->tokens[0], ours->tokens[0]) << "row " << row;
    EXPECT_TRUE(torch::allclose(theirs->first_logits, ours->first_logits, 1e-5, 1e-5));
  }
}

TEST(FamilyModelTest, FolderRefusesAVocabularyThatDoesNotFit) {
  Fixture f;
  const std::string dir = TempDir("vocab");
  absl::Status s = SaveFamilyFolder(dir, *f.model, f.vision, f.tower, Vocabulary(40));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors"));
}

std::string CommittedFixture() {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/family/blip2_family_tiny";
}

// The committed folder (what scripts/hf_fixtures.py --check_family compares with
// transformers) is regenerated by running this test with CDCCA_WRITE_FAMILY_FIXTURE=1; it
// must keep loading and answering as recorded.
TEST(FamilyModelTest, CommittedFamilyFolderAnswersAsRecorded) {
  const std::string dir = CommittedFixture();
  if (std::getenv("CDCCA_WRITE_FAMILY_FIXTURE") != nullptr) {
    Fixture f;
    std::filesystem::remove_all(dir);
    ASSERT_TRUE(SaveFamilyFolder(dir, *f.model, f.vision, f.tower, Vocabulary(20)).ok());
    std::unique_ptr<MultimodalModel> mine = FamilyMultimodalModel(f.model, torch::kCPU);
    ASSERT_TRUE(WriteFamilyParityCases(dir, *mine, f.pixels, {{5, 6, 7, 4}, {6, 7, 5, 4}},
                                       {"a is it?", "is it a?"}, 6)
                    .ok());
  }
  std::ifstream in(dir + "/cdcca_expected.json");
  ASSERT_TRUE(in.good()) << dir;
  nlohmann::json expected = nlohmann::json::parse(in);
  absl::StatusOr<SafetensorsContents> pixels = ReadSafetensors(dir + "/cdcca_pixels.safetensors");
  ASSERT_TRUE(pixels.ok()) << pixels.status();
  absl::StatusOr<std::unique_ptr<MultimodalModel>> hf = LoadModel(dir, ModelOptions{});
  ASSERT_TRUE(hf.ok()) << hf.status();
  ASSERT_EQ(expected["cases"].size(), 2u);
  for (size_t i = 0; i < expected["cases"].size(); ++i) {
    const nlohmann::json& c = expected["cases"][i];
    ASSERT_EQ(pixels->tensors[i].first, "case" + std::to_string(i));
    MultimodalInputs mi;
    mi.pixel_values = pixels->tensors[i].second.unsqueeze(0);
    mi.input_ids =
        torch::tensor(c["input_ids"].get<std::vector<int64_t>>(), torch::kLong).unsqueeze(0);
    absl::StatusOr<GreedyResult> theirs =
        (*hf)->Generate(mi, Greedy(**hf, c["max_new_tokens"].get<int64_t>()));
    ASSERT_TRUE(theirs.ok()) << theirs.status();
    EXPECT_EQ(theirs->tokens[0], c["greedy_tokens"].get<std::vector<int64_t>>()) << "case " << i;
    const std::vector<float> first = c["first_logits"].get<std::vector<float>>();
    ASSERT_EQ(theirs->first_logits[0].numel(), static_cast<int64_t>(first.size()));
    EXPECT_TRUE(torch::allclose(theirs->first_logits[0], torch::tensor(first), 1e-4, 1e-4));
  }
}

TEST(FamilyModelTest, WordLevelTokenizerKeepsIdsAndMarksSpecials) {
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
