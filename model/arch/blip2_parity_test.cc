// BLIP-2 and InstructBLIP against transformers 5.x: the tiny random checkpoints under
// tests/fixtures/hf/models/ (fp16 weights, reference logits computed in fp32 by
// scripts/hf_fixtures.py) with a Llama LM (blip2_llama, instructblip_llama) and OPT's
// (blip2_opt: pre-LayerNorm; blip2_opt_proj: post-LayerNorm with project_in / project_out)
// and Flan-T5's encoder-decoder (blip2_flan_t5, instructblip_flan_t5; the tokens are the
// decoder's after its start token), given the pixel values and ids the processor produced
// there. First-step logits within 1e-4 of the largest logit, identical greedy tokens.
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "model/arch/blip2.h"
#include "model/arch/multimodal_model.h"
#include "model/arch/t5_lm.h"
#include "model/hub/model_folder.h"
#include "model/hub/safetensors.h"

namespace cdcca::model {
namespace {

std::string FixtureDir(const std::string& variant) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + variant;
}

torch::Tensor Ids(const nlohmann::json& list) {
  return torch::tensor(list.get<std::vector<int64_t>>(), torch::kLong).unsqueeze(0);
}

// Runs every case of a fixture through `generate` (the model under test) and compares.
// `legacy`: the folder is a copy of the fixture whose config.json has no image token id,
// as the InstructBLIP checkpoints transformers 4.x published: the prompt's ids go in without
// image tokens and the queries are prepended, which must give the same logits and tokens.
void CheckFixture(const std::string& variant, bool through_loader,
                  const std::string& legacy_dir = "") {
  const std::string fixture = FixtureDir(variant);
  const std::string dir = legacy_dir.empty() ? fixture : legacy_dir;
  absl::StatusOr<nlohmann::json> expected = ReadJsonFile(fixture + "/expected.json");
  ASSERT_TRUE(expected.ok()) << expected.status();
  absl::StatusOr<SafetensorsContents> pixels =
      ReadSafetensors(fixture + "/expected_pixels.safetensors");
  ASSERT_TRUE(pixels.ok()) << pixels.status();
  std::map<std::string, torch::Tensor> pixel_by_case(pixels->tensors.begin(),
                                                     pixels->tensors.end());

  absl::StatusOr<ModelFolder> folder = ModelFolder::Open(dir);
  ASSERT_TRUE(folder.ok()) << folder.status();
  absl::StatusOr<std::shared_ptr<Blip2ForConditionalGenerationImpl>> direct;
  absl::StatusOr<std::unique_ptr<MultimodalModel>> via_loader;
  if (through_loader) {
    via_loader = LoadModel(dir, ModelOptions{});
    ASSERT_TRUE(via_loader.ok()) << via_loader.status();
  } else {
    direct = Blip2ForConditionalGenerationImpl::FromFolder(*folder, WeightPrecision{}, torch::kCPU);
    ASSERT_TRUE(direct.ok()) << direct.status();
  }

  const auto& cases = (*expected)["cases"];
  ASSERT_FALSE(cases.empty());
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(variant + " case " + std::to_string(i));
    const nlohmann::json& c = cases[i];
    const std::vector<int64_t> input_ids = c["input_ids"].get<std::vector<int64_t>>();
    const int64_t q = folder->config()["num_query_tokens"].get<int64_t>();
    // The processor's expansion: Q image tokens before the tokenized prompt (BOS included).
    const std::vector<int64_t> prompt_ids(input_ids.begin() + q, input_ids.end());
    MultimodalInputs in;
    in.pixel_values = pixel_by_case.at("case" + std::to_string(i)).unsqueeze(0);
    in.input_ids = legacy_dir.empty() ? Ids(c["input_ids"])
                                      : torch::tensor(prompt_ids, torch::kLong).unsqueeze(0);
    if (c.contains("qformer_input_ids")) in.qformer_input_ids = Ids(c["qformer_input_ids"]);
    GreedyOptions options;
    options.max_new_tokens = c["max_new_tokens"].get<int64_t>();

    absl::StatusOr<GreedyResult> result;
    if (through_loader) {
      MultimodalModel& m = **via_loader;
      EXPECT_EQ(m.ExpandImageTokens(prompt_ids), legacy_dir.empty() ? input_ids : prompt_ids);
      options.eos_token_ids = m.eos_token_ids();
      result = m.Generate(in, options);
    } else {
      Blip2ForConditionalGenerationImpl& m = **direct;
      EXPECT_EQ(m.ExpandInputIds(prompt_ids), legacy_dir.empty() ? input_ids : prompt_ids);
      options.eos_token_ids = ReadEosTokenIds(dir, {2});
      Blip2Inputs b{in.pixel_values, in.input_ids, in.attention_mask, in.qformer_input_ids,
                    in.qformer_attention_mask};
      result = m.Generate(b, options);
    }
    ASSERT_TRUE(result.ok()) << result.status();
    torch::Tensor want = torch::tensor(c["first_logits"].get<std::vector<float>>());
    torch::Tensor got = result->first_logits[0].to(torch::kFloat);
    ASSERT_EQ(got.sizes(), want.sizes());
    const double scale = want.abs().max().item<double>();
    const double err = (got - want).abs().max().item<double>();
    EXPECT_LE(err, 1e-4 * scale) << "max |diff| " << err << " vs largest logit " << scale;
    std::printf("%s case %zu: max |logit diff| / max |logit| = %.3g\n", variant.c_str(), i,
                err / scale);
    EXPECT_EQ(result->tokens[0], c["greedy_tokens"].get<std::vector<int64_t>>());
  }
}

TEST(Blip2ParityTest, Blip2LlamaMatchesTransformers) { CheckFixture("blip2_llama", false); }

TEST(Blip2ParityTest, InstructBlipLlamaMatchesTransformers) {
  CheckFixture("instructblip_llama", false);
}

TEST(Blip2ParityTest, CheckpointWithoutImageTokenPrependsTheQueries) {
  const std::string fixture = FixtureDir("instructblip_llama");
  const std::string dir = ::testing::TempDir() + "/instructblip_4x";
  std::filesystem::create_directories(dir);
  std::filesystem::copy(fixture + "/model.safetensors", dir + "/model.safetensors",
                        std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy(fixture + "/generation_config.json", dir + "/generation_config.json",
                        std::filesystem::copy_options::overwrite_existing);
  absl::StatusOr<nlohmann::json> config = ReadJsonFile(fixture + "/config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  config->erase("image_token_index");
  std::ofstream(dir + "/config.json") << config->dump(2);
  CheckFixture("instructblip_llama", false, dir);
  CheckFixture("instructblip_llama", true, dir);
}

// Loads `variant` at `precision` (int8 or int4) and at fp32: the quantized model holds fewer
// bytes and its first logits on `prompt_ids` (image tokens added by Generate) stay within
// `tolerance` of the largest fp32 logit.
void CheckQuantized(const std::string& variant, const std::string& precision,
                    const std::vector<int64_t>& prompt_ids, double tolerance) {
  SCOPED_TRACE(variant + " " + precision);
  const std::string dir = FixtureDir(variant);
  absl::StatusOr<std::unique_ptr<MultimodalModel>> fp32 = LoadModel(dir, ModelOptions{});
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  ModelOptions o;
  o.precision = precision;
  o.int4_group = 32;
  absl::StatusOr<std::unique_ptr<MultimodalModel>> quantized = LoadModel(dir, o);
  ASSERT_TRUE(quantized.ok()) << quantized.status();
  EXPECT_LT((*quantized)->ResidentBytes(), (*fp32)->ResidentBytes());
  absl::StatusOr<SafetensorsContents> pixels =
      ReadSafetensors(dir + "/expected_pixels.safetensors");
  ASSERT_TRUE(pixels.ok()) << pixels.status();
  MultimodalInputs in;
  in.pixel_values = pixels->tensors[0].second.unsqueeze(0);
  in.input_ids = torch::tensor(prompt_ids, torch::kLong).unsqueeze(0);
  GreedyOptions g;
  g.max_new_tokens = 2;
  absl::StatusOr<GreedyResult> a = (*quantized)->Generate(in, g);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(torch::isfinite(a->first_logits).all().item<bool>());
  absl::StatusOr<GreedyResult> b = (*fp32)->Generate(in, g);
  ASSERT_TRUE(b.ok()) << b.status();
  const double scale = b->first_logits.abs().max().item<double>();
  EXPECT_LT((a->first_logits - b->first_logits).abs().max().item<double>(), tolerance * scale);
}

TEST(Blip2ParityTest, Int8WeightsLoadSmallerAndAnswer) {
  CheckQuantized("blip2_llama", "int8", {1, 312, 71}, 0.1);
}

TEST(Blip2ParityTest, Blip2OptMatchesTransformers) {
  CheckFixture("blip2_opt", false);
  CheckFixture("blip2_opt", true);
}

TEST(Blip2ParityTest, Blip2OptWithProjectionsMatchesTransformers) {
  CheckFixture("blip2_opt_proj", false);
  CheckFixture("blip2_opt_proj", true);
}

TEST(Blip2ParityTest, Blip2FlanT5MatchesTransformers) {
  CheckFixture("blip2_flan_t5", false);
  CheckFixture("blip2_flan_t5", true);
}

TEST(Blip2ParityTest, InstructBlipFlanT5MatchesTransformers) {
  CheckFixture("instructblip_flan_t5", false);
  CheckFixture("instructblip_flan_t5", true);
}

TEST(Blip2ParityTest, T5QuantizedWeightsLoadSmallerAndAnswer) {
  CheckQuantized("blip2_flan_t5", "int8", {196, 10, 52, 11, 1}, 0.1);
  // 4-bit groups of tiny random weights move T5's unscaled attention scores the most.
  CheckQuantized("blip2_flan_t5", "int4", {196, 10, 52, 11, 1}, 0.5);
}

// The relative position buckets of T5Attention._relative_position_bucket's formula for 32
// buckets and max distance 128, past the exact range the fixtures' short prompts reach (e.g.
// bidirectional -100: 8 + int(ln(100 / 8) / ln(128 / 8) * 8) = 15; causal -20:
// 16 + int(ln(20 / 16) / ln(128 / 16) * 16) = 17).
TEST(Blip2ParityTest, T5RelativeBucketsMatchTransformers) {
  torch::Tensor rel = torch::tensor(
      std::vector<int64_t>{-200, -128, -100, -20, -8, -7, -1, 0, 1, 7, 8, 20, 100, 128, 200});
  EXPECT_TRUE(torch::equal(
      T5RelativeBucket(rel, true, 32, 128),
      torch::tensor(std::vector<int64_t>{15, 15, 15, 10, 8, 7, 1, 0, 17, 23, 24, 26, 31, 31, 31})))
      << T5RelativeBucket(rel, true, 32, 128);
  EXPECT_TRUE(torch::equal(
      T5RelativeBucket(rel, false, 32, 128),
      torch::tensor(std::vector<int64_t>{31, 31, 30, 17, 8, 7, 1, 0, 0, 0, 0, 0, 0, 0, 0})))
      << T5RelativeBucket(rel, false, 32, 128);
}

// T5's teacher-forced forward on visual tokens (what the cloud's AKD trains on) agrees with
// its own greedy decoding: over each row's answer the logits are the step logits generation
// chose the answer from, for two left-padded rows of different lengths in one batch.
TEST(Blip2ParityTest, T5ForwardTokensMatchesItsGreedyDecoding) {
  for (const char* variant : {"blip2_flan_t5", "instructblip_flan_t5"}) {
    SCOPED_TRACE(variant);
    const std::string dir = FixtureDir(variant);
    absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(dir, ModelOptions{});
    ASSERT_TRUE(m.ok()) << m.status();
    absl::StatusOr<nlohmann::json> expected = ReadJsonFile(dir + "/expected.json");
    ASSERT_TRUE(expected.ok()) << expected.status();
    absl::StatusOr<SafetensorsContents> pixels =
        ReadSafetensors(dir + "/expected_pixels.safetensors");
    ASSERT_TRUE(pixels.ok()) << pixels.status();
    std::map<std::string, torch::Tensor> pixel_by_case(pixels->tensors.begin(),
                                                       pixels->tensors.end());
    std::vector<std::vector<int64_t>> prompts, answers, qformer;
    std::vector<torch::Tensor> tokens, step_logits;
    for (size_t i = 0; i < 2; ++i) {
      const nlohmann::json& c = (*expected)["cases"][i];
      MultimodalInputs px;
      px.pixel_values = pixel_by_case.at("case" + std::to_string(i)).unsqueeze(0);
      absl::StatusOr<torch::Tensor> t = (*m)->EncodeImages(px);
      ASSERT_TRUE(t.ok()) << t.status();
      tokens.push_back(*t);
      prompts.push_back(c["input_ids"].get<std::vector<int64_t>>());
      if (c.contains("qformer_input_ids")) {
        qformer.push_back(c["qformer_input_ids"].get<std::vector<int64_t>>());
      }
      TokenInputs in;
      in.visual_tokens = *t;
      in.input_ids = Ids(c["input_ids"]);
      if (!qformer.empty()) in.qformer_input_ids = Ids(c["qformer_input_ids"]);
      GreedyOptions g;
      g.max_new_tokens = 4;
      g.keep_step_logits = true;
      absl::StatusOr<GreedyResult> r = (*m)->GenerateFromTokens(in, g);
      ASSERT_TRUE(r.ok()) << r.status();
      answers.push_back(r->tokens[0]);
      step_logits.push_back(torch::stack(r->step_logits).select(1, 0));  // [a, V]
    }
    int64_t width = 0, q_width = 0;
    for (size_t i = 0; i < 2; ++i) {
      width = std::max<int64_t>(width, prompts[i].size() + answers[i].size());
      if (!qformer.empty()) q_width = std::max<int64_t>(q_width, qformer[i].size());
    }
    TokenInputs batch;
    batch.visual_tokens = torch::cat(tokens);
    batch.input_ids = torch::zeros({2, width}, torch::kLong);
    batch.attention_mask = torch::zeros({2, width}, torch::kLong);
    batch.prompt_lengths = torch::tensor(
        {static_cast<int64_t>(prompts[0].size()), static_cast<int64_t>(prompts[1].size())});
    if (!qformer.empty()) {
      batch.qformer_input_ids = torch::zeros({2, q_width}, torch::kLong);
      batch.qformer_attention_mask = torch::zeros({2, q_width}, torch::kLong);
    }
    for (int64_t r = 0; r < 2; ++r) {
      std::vector<int64_t> row = prompts[r];
      row.insert(row.end(), answers[r].begin(), answers[r].end());
      const int64_t n = static_cast<int64_t>(row.size());
      batch.input_ids[r].narrow(0, width - n, n).copy_(torch::tensor(row, torch::kLong));
      batch.attention_mask[r].narrow(0, width - n, n).fill_(1);
      if (!qformer.empty()) {
        const int64_t qn = static_cast<int64_t>(qformer[r].size());
        batch.qformer_input_ids[r].narrow(0, 0, qn).copy_(torch::tensor(qformer[r], torch::kLong));
        batch.qformer_attention_mask[r].narrow(0, 0, qn).fill_(1);
      }
    }
    absl::StatusOr<TokenForward> f = (*m)->ForwardTokens(batch);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE(torch::isfinite(f->logits).all().item<bool>());
    for (int64_t r = 0; r < 2; ++r) {
      const int64_t a = static_cast<int64_t>(answers[r].size());
      const int64_t first = width - a - 1;  // the prompt's last position predicts answer[0]
      torch::Tensor got = f->logits[r].narrow(0, first, a);
      const double scale = step_logits[r].abs().max().item<double>();
      EXPECT_LE((got - step_logits[r]).abs().max().item<double>(), 1e-4 * scale) << "row " << r;
    }
    batch.prompt_lengths = torch::Tensor();
    EXPECT_EQ((*m)->ForwardTokens(batch).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(Blip2ParityTest, OptQuantizedWeightsLoadSmallerAndAnswer) {
  for (const char* variant : {"blip2_opt", "blip2_opt_proj"}) {
    CheckQuantized(variant, "int8", {2, 579, 29}, 0.1);
    CheckQuantized(variant, "int4", {2, 579, 29}, 0.3);
  }
}

TEST(Blip2ParityTest, LoadHfModelDispatchesBothTypes) {
  CheckFixture("blip2_llama", true);
  CheckFixture("instructblip_llama", true);
}

}  // namespace
}  // namespace cdcca::model
