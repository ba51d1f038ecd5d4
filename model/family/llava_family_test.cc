// The LLaVA-style families: a fresh model, its training forward, and the Hugging Face folder
// it is saved as (which LoadModel answers from with the same tokens, and whose chat template,
// tokenizer and image processor give the layout and pixels pretraining trains on).
#include "model/family/llava_family.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "model/arch/multimodal_model.h"
#include "model/hub/chat_template.h"
#include "model/hub/image_processor.h"
#include "model/hub/safetensors.h"
#include "nlohmann/json.hpp"
#ifdef CDCCA_HAVE_TOKENIZERS
#include "model/tokenizer/tokenizer.h"
#endif

namespace cdcca::model {
namespace {

constexpr int64_t kImageToken = 39;  // vocab_size - 1

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

TowerConfig TinyTower() {
  TowerConfig t;
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
  t.num_visual_tokens = 17;
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
  Llava model{nullptr};
  torch::Tensor images01;  // [2, 3, 16, 16] in [0, 1], multiples of 1/255
  torch::Tensor pixels;    // FamilyPixelValues(images01)

  Fixture() {
    torch::manual_seed(1);
    absl::StatusOr<Llava> m = NewLlavaFamilyModel(vision, tower);
    EXPECT_TRUE(m.ok()) << m.status();
    model = *m;
    Spread(*model, 3);
    model->eval();
    images01 = torch::randint(0, 256, {2, 3, 16, 16}).to(torch::kFloat) / 255.0;
    pixels = FamilyPixelValues(images01);
  }
};

std::vector<std::string> Vocabulary(int n) {
  std::vector<std::string> words = {"<pad>", "<bos>", "<eos>", "<unk>", "?", "a", "is", "it"};
  for (int i = static_cast<int>(words.size()); i < n; ++i) words.push_back("w" + std::to_string(i));
  return words;
}

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/llava_family_" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

GreedyOptions Greedy(MultimodalModel& m, int64_t n) {
  GreedyOptions o;
  o.max_new_tokens = n;
  o.eos_token_ids = m.eos_token_ids();
  return o;
}

TEST(LlavaFamilyTest, FreshModelTrainsEverythingUnderTransformersNames) {
  torch::manual_seed(1);
  absl::StatusOr<Llava> m = NewLlavaFamilyModel(TinyVision(), TinyTower());
  ASSERT_TRUE(m.ok()) << m.status();
  auto params = (*m)->named_parameters();
  for (const auto& p : params) {
    EXPECT_TRUE(p.value().requires_grad()) << p.key();
    EXPECT_TRUE(p.value().is_contiguous()) << p.key() << " is still a placeholder";
  }
  for (const char* name :
       {"model.vision_tower.vision_model.embeddings.class_embedding",
        "model.vision_tower.vision_model.embeddings.patch_embedding.weight",
        "model.multi_modal_projector.linear_1.weight", "model.multi_modal_projector.linear_2.bias",
        "model.language_model.embed_tokens.weight", "model.language_model.lm_head.weight"}) {
    EXPECT_TRUE(params.contains(name)) << name;
  }
  EXPECT_EQ(params["model.multi_modal_projector.linear_1.weight"].sizes(),
            (std::vector<int64_t>{24, 16}));
  // The ViT alone carries the same names under the tower's prefix.
  ClipVisionTower vit = MakeLlavaFamilyVit(TinyVision());
  for (const auto& p : vit->named_parameters()) {
    EXPECT_TRUE(params.contains("model.vision_tower." + p.key())) << p.key();
    EXPECT_TRUE(p.value().requires_grad()) << p.key();
  }
  // Its patch tokens: one per grid cell, no class token.
  EXPECT_EQ(LlavaFamilyVisualTokens(*vit, TinyVision(), torch::zeros({2, 3, 16, 16})).sizes(),
            (std::vector<int64_t>{2, 16, 16}));
}

TEST(LlavaFamilyTest, RefusesATowerWithoutRoomForTextOrOfAnotherWidth) {
  TowerConfig t = TinyTower();
  t.max_positions = 16;  // the 16 image tokens fill it
  absl::StatusOr<Llava> m = NewLlavaFamilyModel(TinyVision(), t);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
  EXPECT_NE(std::string(m.status().message()).find("max_positions"), std::string::npos);
  t = TinyTower();
  t.d_vis = 32;
  EXPECT_EQ(NewLlavaFamilyModel(TinyVision(), t).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The teacher-forced forward pretraining trains with computes, for each question, what the
// model computes for the same ids through the interface every program uses: with every image
// token, and with some dropped (visual_present).
TEST(LlavaFamilyTest, QuestionGroupsComputeWhatTheModelComputesPerRow) {
  Fixture f;
  std::unique_ptr<MultimodalModel> mm = LlavaFamilyMultimodalModel(f.model, torch::kCPU);
  torch::NoGradGuard no_grad;
  MultimodalInputs px;
  px.pixel_values = f.pixels;
  absl::StatusOr<torch::Tensor> tokens = mm->EncodeImages(px);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->sizes(), (std::vector<int64_t>{2, 16, 16}));
  // Three questions on two scenes; the second row is left-padded by two.
  const torch::Tensor text =
      torch::tensor({{1, 5, 6, 7, 4, 9}, {0, 0, 1, 6, 4, 8}, {1, 7, 6, 5, 4, 10}}, torch::kLong);
  const torch::Tensor valid =
      torch::tensor({{1, 1, 1, 1, 1, 1}, {0, 0, 1, 1, 1, 1}, {1, 1, 1, 1, 1, 1}}).to(torch::kBool);
  const torch::Tensor scene = torch::tensor({0, 1, 0}, torch::kLong);
  torch::Tensor dropped = torch::ones({2, 16}, torch::kBool);
  dropped[0].narrow(0, 0, 3).fill_(false);  // the first image token included
  dropped[1].narrow(0, 7, 5).fill_(false);
  for (const torch::Tensor& mask : {torch::Tensor(), dropped}) {
    SCOPED_TRACE(mask.defined() ? "some image tokens dropped" : "every image token");
    std::vector<FamilyGroupOutput> groups =
        ForwardQuestionGroups(*f.model, *tokens, mask, {{text, valid, scene}}, 0.0);
    ASSERT_EQ(groups.size(), 1u);
    for (int64_t r = 0; r < 3; ++r) {
      std::vector<int64_t> ids = {kImageToken};
      for (int64_t k = 0; k < text.size(1); ++k) {
        if (valid[r][k].item<bool>()) ids.push_back(text[r][k].item<int64_t>());
      }
      TokenInputs in;
      in.visual_tokens = tokens->index_select(0, scene.narrow(0, r, 1));
      if (mask.defined()) in.visual_present = mask.index_select(0, scene.narrow(0, r, 1));
      in.input_ids = torch::tensor(mm->ExpandImageTokens(ids), torch::kLong).unsqueeze(0);
      ASSERT_EQ(in.input_ids.size(1), 16 + static_cast<int64_t>(ids.size()) - 1);
      absl::StatusOr<TokenForward> one = mm->ForwardTokens(in);
      ASSERT_TRUE(one.ok()) << one.status();
      const int64_t n = static_cast<int64_t>(ids.size()) - 1;  // the text positions
      torch::Tensor theirs = one->logits[0].narrow(0, in.input_ids.size(1) - n, n);
      torch::Tensor mine = groups[0].logits[r].narrow(0, text.size(1) - n, n);
      EXPECT_TRUE(torch::allclose(mine, theirs, 1e-4, 1e-4))
          << "row " << r << ": max diff " << (mine - theirs).abs().max().item<float>();
    }
    EXPECT_EQ(groups[0].queries.sizes(), (std::vector<int64_t>{3, 16, 24}));
  }
}

// Dropout in the training forward is the model's own: on at dropout_p, off at 0.
TEST(LlavaFamilyTest, QuestionGroupsDropOutOnlyWhenAsked) {
  Fixture f;
  torch::NoGradGuard no_grad;
  std::unique_ptr<MultimodalModel> mm = LlavaFamilyMultimodalModel(f.model, torch::kCPU);
  MultimodalInputs px;
  px.pixel_values = f.pixels;
  torch::Tensor tokens = *mm->EncodeImages(px);
  const FamilyQuestionGroup g{torch::tensor({{1, 5, 6}, {1, 6, 5}}, torch::kLong), torch::Tensor(),
                              torch::tensor({0, 1}, torch::kLong)};
  auto run = [&](double p) {
    return ForwardQuestionGroups(*f.model, tokens, {}, {g}, p)[0].logits;
  };
  EXPECT_TRUE(torch::equal(run(0.0), run(0.0)));
  EXPECT_FALSE(torch::allclose(run(0.3), run(0.3)));
}

TEST(LlavaFamilyTest, HuggingFaceFolderAnswersWithTheSameTokensAndLoadsBack) {
  Fixture f;
  const std::string dir = TempDir("folder");
  ASSERT_TRUE(
      SaveLlavaFamilyFolder(dir, *f.model, f.vision, f.tower, Vocabulary(20), {{"role", "student"}})
          .ok());
  for (const char* file :
       {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "processor_config.json", "chat_template.jinja", "generation_config.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + file)) << file;
  }
  absl::StatusOr<ModelFolder> folder = ModelFolder::Open(dir);
  ASSERT_TRUE(folder.ok()) << folder.status();
  EXPECT_EQ(folder->config()["model_type"], "llava");
  EXPECT_EQ(folder->config()["architectures"][0], "LlavaForConditionalGeneration");
  EXPECT_EQ(folder->config()["image_token_index"], kImageToken);
  EXPECT_EQ(folder->config()["cdcca"]["role"], "student");
  // The head at the top level, as transformers names it (the module keeps it in its decoder).
  EXPECT_TRUE(folder->Has("lm_head.weight"));
  EXPECT_FALSE(folder->Has("model.language_model.lm_head.weight"));
  EXPECT_TRUE(folder->Has("model.vision_tower.vision_model.embeddings.class_embedding"));

  std::unique_ptr<MultimodalModel> mine = LlavaFamilyMultimodalModel(f.model, torch::kCPU);
  absl::StatusOr<std::unique_ptr<MultimodalModel>> hf = LoadModel(dir, ModelOptions{});
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ((*hf)->model_type(), "llava");
  const std::vector<std::vector<int64_t>> prompts = {{kImageToken, 1, 5, 6, 7, 4},
                                                     {kImageToken, 1, 7, 4}};
  for (int row = 0; row < 2; ++row) {
    MultimodalInputs in;
    in.pixel_values = f.pixels.narrow(0, row, 1);
    in.input_ids = torch::tensor((*hf)->ExpandImageTokens(prompts[row]), torch::kLong).unsqueeze(0);
    EXPECT_EQ(in.input_ids.size(1), 15 + static_cast<int64_t>(prompts[row].size()));
    absl::StatusOr<GreedyResult> theirs = (*hf)->Generate(in, Greedy(**hf, 5));
    absl::StatusOr<GreedyResult> ours = mine->Generate(in, Greedy(*mine, 5));
    ASSERT_TRUE(theirs.ok()) << theirs.status();
    ASSERT_TRUE(ours.ok()) << ours.status();
    EXPECT_EQ(theirs->tokens[0], ours->tokens[0]) << "row " << row;
    EXPECT_TRUE(torch::allclose(theirs->first_logits, ours->first_logits, 1e-5, 1e-5));
  }
  // Loaded back as a module to train (pretraining's resume), it holds the same weights.
  absl::StatusOr<Llava> back = LoadLlavaFamilyModel(dir, torch::kCPU);
  ASSERT_TRUE(back.ok()) << back.status();
  auto theirs = (*back)->named_parameters();
  for (const auto& p : f.model->named_parameters()) {
    ASSERT_TRUE(theirs.contains(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(theirs[p.key()], p.value())) << p.key();
  }
}

// What a program makes of a frame and a question through the folder (image processor, chat
// template, tokenizer) is what pretraining trains on: FamilyPixelValues, and the image tokens,
// <bos> and the question's words.
TEST(LlavaFamilyTest, FolderPromptsAndPreprocessesAsPretrainingTrains) {
  Fixture f;
  const std::string dir = TempDir("processor");
  ASSERT_TRUE(SaveLlavaFamilyFolder(dir, *f.model, f.vision, f.tower, Vocabulary(20)).ok());
  absl::StatusOr<ImageProcessorConfig> proc = LoadImageProcessorConfig(dir);
  ASSERT_TRUE(proc.ok()) << proc.status();
  torch::Tensor rgb =
      (f.images01[0] * 255).round().to(torch::kByte).permute({1, 2, 0}).contiguous();
  absl::StatusOr<PixelValues> pv = PreprocessImage(*proc, rgb.data_ptr<uint8_t>(), 16, 16);
  ASSERT_TRUE(pv.ok()) << pv.status();
  torch::Tensor theirs = torch::from_blob(pv->data.data(), {3, 16, 16}, torch::kFloat).clone();
  EXPECT_TRUE(torch::allclose(theirs, f.pixels[0], 1e-5, 1e-5))
      << "max diff " << (theirs - f.pixels[0]).abs().max().item<float>();

  absl::StatusOr<std::optional<ChatTemplate>> chat = LoadChatTemplate(dir);
  ASSERT_TRUE(chat.ok()) << chat.status();
  ASSERT_TRUE(chat->has_value());
  // `cdcca answer` appends LLaVA-1.5's answer-format line; the family reads the question.
  absl::StatusOr<std::string> prompt = RenderChatTemplate(
      **chat, OneImageUserTurn("a is it?\nAnswer the question using a single word or phrase."),
      /*add_generation_prompt=*/true);
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  EXPECT_EQ(*prompt, "<image> <bos> a is it?");
#ifdef CDCCA_HAVE_TOKENIZERS
  absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> tok = tokenizer::Tokenizer::FromFolder(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode(*prompt);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{static_cast<int32_t>(kImageToken), 1, 5, 6, 7, 4}));
#endif
}

}  // namespace
}  // namespace cdcca::model
