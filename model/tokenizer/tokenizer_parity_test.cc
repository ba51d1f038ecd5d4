// Parity with transformers 5 / tokenizers: every case of
// tests/fixtures/hf/tokenizers/*/expected.json (made by scripts/hf_fixtures.py) and the
// model folders' tokenizers give the same ids and decoded text here.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace cdcca::tokenizer {
namespace {

namespace fs = std::filesystem;

std::string FixtureDir(const std::string& rel) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/" + rel;
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

class TokenizerParity : public testing::TestWithParam<std::string> {};

TEST_P(TokenizerParity, IdsAndDecodedTextMatchTransformers) {
  const std::string dir = FixtureDir("tokenizers/" + GetParam());
  ASSERT_TRUE(fs::exists(dir + "/expected.json")) << dir;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromFolder(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const nlohmann::json expected = ReadJson(dir + "/expected.json");
  ASSERT_GE(expected["cases"].size(), 10u);
  for (const auto& c : expected["cases"]) {
    const std::string text = c["text"];
    SCOPED_TRACE("text: " + text);
    absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode(text, true);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, c["ids"].get<std::vector<int32_t>>());
    absl::StatusOr<std::vector<int32_t>> plain = (*tok)->Encode(text, false);
    ASSERT_TRUE(plain.ok()) << plain.status();
    EXPECT_EQ(*plain, c["ids_no_special"].get<std::vector<int32_t>>());
    const std::vector<int32_t> reference = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ((*tok)->Decode(reference, false), c["decoded"].get<std::string>());
    EXPECT_EQ((*tok)->Decode(reference, true), c["decoded_skip_special"].get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerParity,
                         testing::Values("bpe_bytelevel_qwen2", "bpe_bytelevel_llama3",
                                         "bpe_metaspace_llama2", "bpe_metaspace_pretok",
                                         "wordpiece_bert", "wordlevel", "sentencepiece_llama",
                                         "bpe_bytelevel_gpt2", "unigram_t5",
                                         "unigram_bytefallback"));

// A folder with only T5's spiece.model (and tokenizer_config.json): converted as transformers
// converts it, the same ids and text as the tokenizer.json made from it.
class SentencePieceUnigramParity : public testing::TestWithParam<std::string> {};

TEST_P(SentencePieceUnigramParity, SpieceModelAloneMatchesItsTokenizerJson) {
  const std::string fixture = FixtureDir("tokenizers/" + GetParam());
  const std::string dir = testing::TempDir() + "/spiece_only_" + GetParam();
  fs::create_directories(dir);
  for (const char* name : {"spiece.model", "tokenizer_config.json"}) {
    fs::copy_file(fixture + "/" + name, dir + "/" + name, fs::copy_options::overwrite_existing);
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromFolder(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const nlohmann::json expected = ReadJson(fixture + "/expected.json");
  ASSERT_GE(expected["cases"].size(), 10u);
  for (const auto& c : expected["cases"]) {
    const std::string text = c["text"];
    SCOPED_TRACE("text: " + text);
    absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode(text, true);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, c["ids"].get<std::vector<int32_t>>());
    const std::vector<int32_t> reference = c["ids"].get<std::vector<int32_t>>();
    EXPECT_EQ((*tok)->Decode(reference, true), c["decoded_skip_special"].get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SentencePieceUnigramParity,
                         testing::Values("unigram_t5", "unigram_bytefallback"));

// The model folders' tokenizers: the LM input transformers' processor built is the prompt's
// ids with the <image> placeholder expanded (LLaVA) or the query tokens' placeholders put
// in front (BLIP-2); the Q-Former gets qformer_tokenizer/'s ids; the answer decodes to text.
class ModelFolderTokenizer : public testing::TestWithParam<std::string> {};

TEST_P(ModelFolderTokenizer, PromptIdsAndAnswerTextMatchTransformers) {
  const std::string dir = FixtureDir("models/" + GetParam());
  ASSERT_TRUE(fs::exists(dir + "/expected.json")) << dir;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromFolder(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::optional<int32_t> image = (*tok)->TokenToId("<image>");
  ASSERT_TRUE(image.has_value());
  std::unique_ptr<Tokenizer> qformer;
  if (fs::exists(dir + "/qformer_tokenizer")) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> q =
        Tokenizer::FromFolder(dir + "/qformer_tokenizer");
    ASSERT_TRUE(q.ok()) << q.status();
    qformer = *std::move(q);
  }
  const nlohmann::json expected = ReadJson(dir + "/expected.json");
  ASSERT_FALSE(expected["cases"].empty());
  for (const auto& c : expected["cases"]) {
    const std::string prompt = c["prompt"];
    SCOPED_TRACE("prompt: " + prompt);
    absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode(prompt);
    ASSERT_TRUE(ids.ok()) << ids.status();
    // Collapse each run of image tokens to one placeholder.
    std::vector<int32_t> lm;
    for (int32_t id : c["input_ids"].get<std::vector<int32_t>>()) {
      if (id == *image && !lm.empty() && lm.back() == *image) continue;
      lm.push_back(id);
    }
    const bool prompt_has_image = prompt.find("<image>") != std::string::npos;
    if (!prompt_has_image && !lm.empty() && lm.front() == *image) lm.erase(lm.begin());
    EXPECT_EQ(*ids, lm);
    if (c.contains("qformer_input_ids")) {
      ASSERT_NE(qformer, nullptr);
      absl::StatusOr<std::vector<int32_t>> q = qformer->Encode(prompt);
      ASSERT_TRUE(q.ok()) << q.status();
      EXPECT_EQ(*q, c["qformer_input_ids"].get<std::vector<int32_t>>());
    }
    EXPECT_EQ((*tok)->Decode(c["greedy_tokens"].get<std::vector<int32_t>>(), true),
              c["text"].get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ModelFolderTokenizer,
                         testing::Values("llava_clip_llama", "llava_siglip_qwen2",
                                         "llava_clip_llama_gqa_rope", "blip2_llama",
                                         "instructblip_llama", "blip2_opt", "blip2_flan_t5",
                                         "instructblip_flan_t5"));

}  // namespace
}  // namespace cdcca::tokenizer
