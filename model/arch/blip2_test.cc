// BLIP-2 / InstructBLIP model level: where the query outputs go in the LM input.
#include <torch/torch.h>

#include <optional>
#include <vector>

#include "gtest/gtest.h"
#include "model/arch/blip2_inputs.h"

namespace cdcca::model {
namespace {

TEST(Blip2InputsTest, ImageTokensGoBeforeTheWholePrompt) {
  const std::vector<int64_t> prompt = {1, 40, 41};  // BOS first, as the tokenizer adds it
  EXPECT_EQ(ExpandBlip2InputIds(prompt, 3, 99), (std::vector<int64_t>{99, 99, 99, 1, 40, 41}));
  EXPECT_EQ(ExpandBlip2InputIds(prompt, 3, std::nullopt), prompt);
}

TEST(Blip2InputsTest, ScatterAndPrependGiveTheSameSequence) {
  torch::manual_seed(0);
  torch::Tensor table = torch::randn({100, 4});
  torch::Tensor queries = torch::randn({1, 2, 4});
  const std::vector<int64_t> prompt = {1, 40, 41};

  std::vector<int64_t> expanded = ExpandBlip2InputIds(prompt, 2, 99);
  torch::Tensor ids = torch::tensor(expanded, torch::kLong).unsqueeze(0);
  absl::StatusOr<torch::Tensor> scattered = MergeBlip2Queries(table.index({ids}), ids, queries, 99);
  ASSERT_TRUE(scattered.ok()) << scattered.status();

  torch::Tensor plain = torch::tensor(prompt, torch::kLong).unsqueeze(0);
  absl::StatusOr<torch::Tensor> prepended =
      MergeBlip2Queries(table.index({plain}), plain, queries, std::nullopt);
  ASSERT_TRUE(prepended.ok()) << prepended.status();

  EXPECT_EQ(scattered->sizes(), (std::vector<int64_t>{1, 5, 4}));
  EXPECT_TRUE(torch::equal(*scattered, *prepended));
  EXPECT_TRUE(torch::equal(scattered->slice(1, 0, 2), queries));
  EXPECT_TRUE(torch::equal(scattered->slice(1, 2), table.index({plain})));
}

TEST(Blip2InputsTest, WrongImageTokenCountIsAnError) {
  torch::Tensor ids = torch::tensor({{99, 1, 40}}, torch::kLong);
  absl::StatusOr<torch::Tensor> merged =
      MergeBlip2Queries(torch::zeros({1, 3, 4}), ids, torch::zeros({1, 2, 4}), 99);
  ASSERT_FALSE(merged.ok());
  EXPECT_NE(merged.status().message().find("2 image tokens"), std::string::npos) << merged.status();
}

}  // namespace
}  // namespace cdcca::model
