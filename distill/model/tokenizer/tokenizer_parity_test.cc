// Parity with transformers 5 / tokenizers: every case of
// tests/fixtures/hf/tokenizers/*/expected.json (made by scripts/hf_fixtures.py) and the
// model folders' tokenizers give the same ids and decoded text here.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "distill/model/tokenizer/tokenizer.h"
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
                                         "wordpiece_bert", "wordlevel", "sentencepiece_llama"));

}  // namespace
}  // namespace cdcca::tokenizer
