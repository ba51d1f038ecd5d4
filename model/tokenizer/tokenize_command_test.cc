// `cdcca tokenize` prints the fixture's transformers ids as {"ids": [...]}.
#include "model/tokenizer/tokenize_command.h"

#include <string>

#include "absl/flags/flag.h"
#include "gtest/gtest.h"

ABSL_DECLARE_FLAG(std::string, text);

namespace cdcca::tokenizer {
namespace {

TEST(TokenizeCommand, PrintsTransformersIds) {
  absl::SetFlag(&FLAGS_model, std::string(CDCCA_SOURCE_DIR) +
                                  "/tests/fixtures/hf/tokenizers/bpe_metaspace_llama2");
  absl::SetFlag(&FLAGS_text, "Hello world");
  testing::internal::CaptureStdout();
  const int rc = TokenizeCommand({});
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 0);
  // expected.json: "Hello world" -> [1, 312, 75, 343, 638].
  EXPECT_EQ(out, "{\"ids\": [1, 312, 75, 343, 638]}\n");
}

TEST(TokenizeCommand, BadFolderFailsWithoutOutput) {
  absl::SetFlag(&FLAGS_model, "/nonexistent");
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int rc = TokenizeCommand({});
  const std::string out = testing::internal::GetCapturedStdout();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 1);
  EXPECT_TRUE(out.empty());
  EXPECT_NE(err.find("/nonexistent"), std::string::npos);
  absl::SetFlag(&FLAGS_model, "");
  testing::internal::CaptureStderr();
  EXPECT_EQ(TokenizeCommand({}), 2);
  testing::internal::GetCapturedStderr();
}

}  // namespace
}  // namespace cdcca::tokenizer
