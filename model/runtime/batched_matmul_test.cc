#include "model/runtime/batched_matmul.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

namespace cdcca::model {
namespace {

// Forward and both gradients against torch::matmul on the same inputs.
void ExpectSameAsMatmul(const torch::Tensor& a0, const torch::Tensor& b0) {
  ASSERT_TRUE(UsesSmallMatrixKernel(a0, b0));
  torch::Tensor a = a0.detach().clone().requires_grad_(true);
  torch::Tensor b = b0.detach().clone().requires_grad_(true);
  torch::Tensor ra = a0.detach().clone().requires_grad_(true);
  torch::Tensor rb = b0.detach().clone().requires_grad_(true);
  torch::Tensor out = BatchedMatmul(a, b);
  torch::Tensor ref = torch::matmul(ra, rb);
  ASSERT_EQ(out.sizes(), ref.sizes());
  EXPECT_TRUE(torch::allclose(out, ref, 1e-5, 1e-5)) << (out - ref).abs().max().item<float>();
  torch::Tensor g = torch::randn_like(ref);
  (out * g).sum().backward();
  (ref * g).sum().backward();
  EXPECT_TRUE(torch::allclose(a.grad(), ra.grad(), 1e-5, 1e-5))
      << (a.grad() - ra.grad()).abs().max().item<float>();
  EXPECT_TRUE(torch::allclose(b.grad(), rb.grad(), 1e-5, 1e-5))
      << (b.grad() - rb.grad()).abs().max().item<float>();
}

TEST(BatchedMatmulTest, EqualsMatmulForAttentionShapes) {
  torch::manual_seed(3);
  // Scores (q k^T) and weighted values (p v), head_dim 32, one and several blocks of 4 keys.
  ExpectSameAsMatmul(torch::randn({6, 5, 14, 32}), torch::randn({6, 5, 22, 32}).transpose(2, 3));
  ExpectSameAsMatmul(torch::randn({6, 5, 14, 22}), torch::randn({6, 5, 22, 32}));
  // Sides that are not multiples of the kernel's 8-wide and 4-row blocks.
  ExpectSameAsMatmul(torch::randn({7, 3, 5}), torch::randn({7, 5, 3}));
  ExpectSameAsMatmul(torch::randn({2, 1, 1}), torch::randn({2, 1, 9}));
  ExpectSameAsMatmul(torch::randn({4, 9, 17}), torch::randn({4, 17, 13}));
  // Gradients wider than one 64-column pass (K = 100 for a's, P = 128 for b's), a masked tail.
  ExpectSameAsMatmul(torch::randn({3, 7, 100}), torch::randn({3, 100, 128}));
  ExpectSameAsMatmul(torch::randn({2, 128, 65}), torch::randn({2, 65, 71}));
}

TEST(BatchedMatmulTest, TakesStridedInputs) {
  torch::manual_seed(4);
  // [B, T, heads, d] permuted to [B, heads, T, d], as attention lays them out.
  torch::Tensor q = torch::randn({3, 11, 4, 16}).permute({0, 2, 1, 3});
  torch::Tensor k = torch::randn({3, 13, 4, 16}).permute({0, 2, 3, 1});
  ExpectSameAsMatmul(q, k);
}

TEST(BatchedMatmulTest, WithoutGradientsEqualsMatmul) {
  torch::NoGradGuard no_grad;
  torch::Tensor a = torch::randn({8, 6, 40});
  torch::Tensor b = torch::randn({8, 40, 10});
  EXPECT_TRUE(torch::allclose(BatchedMatmul(a, b), torch::matmul(a, b), 1e-5, 1e-5));
}

TEST(BatchedMatmulTest, OtherShapesAndTypesFallBackToMatmul) {
  torch::Tensor a = torch::randn({2, 3, 4}), b = torch::randn({2, 4, 5});
  EXPECT_TRUE(UsesSmallMatrixKernel(a, b));
  EXPECT_FALSE(UsesSmallMatrixKernel(a.to(torch::kDouble), b.to(torch::kDouble)));
  EXPECT_FALSE(UsesSmallMatrixKernel(torch::randn({3, 4}), torch::randn({4, 5})));
  EXPECT_FALSE(UsesSmallMatrixKernel(a, torch::randn({1, 4, 5})));  // broadcast batch
  EXPECT_FALSE(UsesSmallMatrixKernel(torch::randn({2, 300, 4}), torch::randn({2, 4, 5})));
  torch::Tensor d = BatchedMatmul(a.to(torch::kDouble), b.to(torch::kDouble));
  EXPECT_EQ(d.scalar_type(), torch::kDouble);
  EXPECT_TRUE(torch::allclose(d, torch::matmul(a, b).to(torch::kDouble), 1e-5, 1e-5));
}

}  // namespace
}  // namespace cdcca::model
