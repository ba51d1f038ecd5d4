#include "model/runtime/threads.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace cdcca::model {
namespace {

TEST(BlasThreadsTest, TheCapIsWhatTheBlasReportsAndProductsAgreeUnderIt) {
  const int before = BlasThreads();
  if (before < 0) GTEST_SKIP() << "LibTorch's BLAS here is not OpenBLAS";
  torch::manual_seed(3);
  const torch::Tensor a = torch::randn({300, 200});
  const torch::Tensor b = torch::randn({200, 250});
  const torch::Tensor product = torch::mm(a, b);

  absl::StatusOr<int> one = SetBlasThreads(1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(*one, 1);
  EXPECT_EQ(BlasThreads(), 1);
  EXPECT_TRUE(torch::allclose(torch::mm(a, b), product, 1e-5, 1e-4));

  absl::StatusOr<int> restored = SetBlasThreads(before);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(*restored, before);
}

TEST(BlasThreadsTest, ACountBelowOneIsRefused) {
  EXPECT_EQ(SetBlasThreads(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SetBlasThreads(-2).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cdcca::model
