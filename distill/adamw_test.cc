#include "distill/adamw.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

namespace cdcca::distill {
namespace {

// Tensors of two dtypes and several shapes, twice: one copy for each optimizer.
std::vector<torch::Tensor> Params(torch::ScalarType second_dtype) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> out = {torch::randn({4, 16}), torch::randn({16}),
                                    torch::randn({8, 4}).to(second_dtype),
                                    torch::randn({33}).to(second_dtype), torch::randn({2, 3, 5})};
  for (torch::Tensor& t : out) t.set_requires_grad(true);
  return out;
}

std::vector<torch::Tensor> Clones(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& p : params) {
    out.push_back(p.detach().clone().set_requires_grad(true));
  }
  return out;
}

// Each step gives both sets the same gradients; tensor 1 gets none at step 2 (torch's AdamW
// leaves such a tensor and its moments alone).
void Check(double weight_decay, torch::ScalarType second_dtype) {
  std::vector<torch::Tensor> a = Params(second_dtype), b = Clones(a);
  torch::optim::AdamW reference(
      a, torch::optim::AdamWOptions(1e-2).weight_decay(weight_decay).betas({0.9, 0.999}));
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = weight_decay;
  MultiTensorAdamW mine(b, o);
  torch::manual_seed(5);
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE(step);
    reference.zero_grad();
    mine.zero_grad();
    for (size_t i = 0; i < a.size(); ++i) {
      if (step == 2 && i == 1) {
        a[i].mutable_grad() = torch::Tensor();
        continue;
      }
      torch::Tensor g = torch::randn(a[i].sizes()).to(a[i].scalar_type());
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
    reference.step();
    mine.step();
    for (size_t i = 0; i < a.size(); ++i) {
      SCOPED_TRACE(i);
      const double tol = a[i].scalar_type() == torch::kFloat ? 1e-6 : 1e-2;
      EXPECT_TRUE(torch::allclose(a[i].to(torch::kFloat), b[i].to(torch::kFloat), tol, tol))
          << (a[i] - b[i]).abs().max();
    }
  }
  // The updates did move the tensors.
  EXPECT_FALSE(torch::equal(a[0], Params(second_dtype)[0]));
}

TEST(MultiTensorAdamWTest, UpdatesAsTorchsAdamW) { Check(0.0, torch::kDouble); }

TEST(MultiTensorAdamWTest, UpdatesAsTorchsAdamWWithWeightDecayAndBf16Tensors) {
  Check(0.05, torch::kBFloat16);
}

TEST(MultiTensorAdamWTest, ZeroGradDropsTheGradients) {
  std::vector<torch::Tensor> p = Params(torch::kFloat);
  MultiTensorAdamW opt(p, AdamWOptions{});
  p[0].mutable_grad() = torch::ones_like(p[0]);
  opt.zero_grad();
  EXPECT_FALSE(p[0].grad().defined());
  const torch::Tensor before = p[0].detach().clone();
  opt.step();  // nothing has a gradient: nothing moves
  EXPECT_TRUE(torch::equal(p[0], before));
}

}  // namespace
}  // namespace cdcca::distill
