#include "datasets/tokenizer.h"

#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::datasets {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::ElementsAre;

TEST(TokenizerTest, SplitsPunctuationKeepsHyphens) {
  EXPECT_THAT(Tokenizer::Split("What is in the Top-Left?"),
              ElementsAre("what", "is", "in", "the", "top-left", "?"));
  EXPECT_THAT(Tokenizer::Split("a t-shirt, a bag and a coat."),
              ElementsAre("a", "t-shirt", ",", "a", "bag", "and", "a", "coat", "."));
  EXPECT_THAT(Tokenizer::Split("  "), ElementsAre());
}

TEST(TokenizerTest, SpecialsFirstAndStableOrder) {
  const Tokenizer a = Tokenizer::SceneLanguage(), b = Tokenizer::SceneLanguage();
  EXPECT_EQ(a.tokens(), b.tokens());
  EXPECT_EQ(a.Word(0), "<pad>");
  EXPECT_EQ(a.Word(1), "<bos>");
  EXPECT_EQ(a.Word(2), "<eos>");
  EXPECT_EQ(a.Word(3), "<unk>");
  EXPECT_TRUE(std::is_sorted(a.tokens().begin() + 4, a.tokens().end()));
  EXPECT_LT(a.size(), 400);  // a closed, small language
  EXPECT_NE(a.Id("ankle"), Tokenizer::kUnk);
  EXPECT_EQ(a.Id("{pos}"), Tokenizer::kUnk);
}

TEST(TokenizerTest, EncodeDecodeRoundTrip) {
  const Tokenizer tok = Tokenizer::SceneLanguage();
  const std::string q = "where is the red ankle boot?";
  const std::vector<int> ids = tok.Encode(q, true, true);
  EXPECT_EQ(ids.front(), Tokenizer::kBos);
  EXPECT_EQ(ids.back(), Tokenizer::kEos);
  EXPECT_EQ(tok.Decode(ids), q);
  EXPECT_EQ(tok.Encode("zebra")[0], Tokenizer::kUnk);
  std::vector<int> with_tail = tok.Encode("yes", false, true);
  with_tail.push_back(tok.Id("no"));
  EXPECT_EQ(tok.Decode(with_tail), "yes");  // stops at <eos>
}

TEST(TokenizerTest, JsonSaveLoad) {
  const Tokenizer tok = Tokenizer::SceneLanguage();
  const std::string path =
      (std::filesystem::temp_directory_path() / "cdcca_tokenizer_test.json").string();
  ASSERT_OK(tok.Save(path));
  ASSERT_OK_AND_ASSIGN(Tokenizer back, Tokenizer::Load(path));
  EXPECT_EQ(back.tokens(), tok.tokens());
  std::filesystem::remove(path);
  EXPECT_THAT(Tokenizer::Load(path), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(Tokenizer::FromJson("[1]"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Tokenizer::FromJson(R"({"format":"cdcca-word-tokenizer","tokens":["a"]})"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(
      Tokenizer::FromJson(
          R"({"format":"cdcca-word-tokenizer","tokens":["<pad>","<bos>","<eos>","<unk>","a","a"]})"),
      StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("duplicate")));
}

}  // namespace
}  // namespace cdcca::datasets
