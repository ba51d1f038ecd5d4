#include "model/runtime/fused_ops.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace cdcca::model {
namespace {

using Fn = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

// `fused` and `plain` on copies of the same inputs: equal outputs, and equal gradients for
// every input that requires one, under the same random upstream gradient.
void ExpectSameAsPlain(const std::vector<torch::Tensor>& inputs, const Fn& fused, const Fn& plain,
                       double tol = 1e-5) {
  std::vector<torch::Tensor> a, b;
  for (const torch::Tensor& t : inputs) {
    // clone() keeps a dense input's strides: a transposed input stays transposed.
    a.push_back(t.detach().clone().requires_grad_(t.requires_grad()));
    b.push_back(t.detach().clone().requires_grad_(t.requires_grad()));
  }
  torch::Tensor out = fused(a), ref = plain(b);
  ASSERT_EQ(out.sizes(), ref.sizes());
  EXPECT_TRUE(torch::allclose(out, ref, tol, tol)) << (out - ref).abs().max().item<float>();
  torch::Tensor g = torch::randn_like(ref);
  (out * g).sum().backward();
  (ref * g).sum().backward();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    ASSERT_TRUE(a[i].grad().defined()) << "input " << i;
    EXPECT_TRUE(torch::allclose(a[i].grad(), b[i].grad(), tol, tol))
        << "input " << i << ": " << (a[i].grad() - b[i].grad()).abs().max().item<float>();
  }
}

torch::Tensor PlainRmsNorm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  torch::Tensor h = x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return w * h;
}

TEST(FusedOpsTest, RmsNormEqualsPlainFormula) {
  torch::manual_seed(1);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{3, 5, 37}, {300, 160}, {1, 8}}) {
    const int64_t d = shape.back();
    ExpectSameAsPlain(
        {torch::randn(shape).requires_grad_(true), (torch::rand({d}) + 0.5).requires_grad_(true)},
        [](const auto& v) { return RmsNorm(v[0], v[1], 1e-6); },
        [](const auto& v) { return PlainRmsNorm(v[0], v[1], 1e-6); });
  }
  // A transposed input, and a frozen weight (no gradient asked for it).
  ExpectSameAsPlain(
      {torch::randn({24, 6}).t().requires_grad_(true), torch::rand({24}) + 0.5},
      [](const auto& v) { return RmsNorm(v[0], v[1], 1e-5); },
      [](const auto& v) { return PlainRmsNorm(v[0], v[1], 1e-5); });
}

// The residual addition and the norm of its result: both outputs (stacked, so the gradient
// reaches each) and the gradients of x, a and the weight are those of x + a and RMSNorm.
TEST(FusedOpsTest, AddRmsNormEqualsTheAdditionAndThePlainFormula) {
  torch::manual_seed(4);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{3, 5, 48}, {64, 40}}) {
    ExpectSameAsPlain(
        {torch::randn(shape).requires_grad_(true), torch::randn(shape).requires_grad_(true),
         (torch::rand({shape.back()}) + 0.5).requires_grad_(true)},
        [](const auto& v) {
          auto [h, y] = AddRmsNorm(v[0], v[1], v[2], 1e-5);
          return torch::stack({h, y});
        },
        [](const auto& v) {
          const torch::Tensor h = v[0] + v[1];
          return torch::stack({h, PlainRmsNorm(h, v[2], 1e-5)});
        });
  }
}

TEST(FusedOpsTest, SiluMulEqualsPlainFormula) {
  torch::manual_seed(2);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{4, 7, 43}, {100, 432}}) {
    ExpectSameAsPlain(
        {(torch::randn(shape) * 4).requires_grad_(true), torch::randn(shape).requires_grad_(true)},
        [](const auto& v) { return SiluMul(v[0], v[1]); },
        [](const auto& v) { return torch::silu(v[0]) * v[1]; });
  }
  // Saturated gates (the exponential's clamped range) and an odd length (the scalar tail).
  torch::Tensor extreme =
      torch::tensor({-100.f, -87.f, -30.f, -1e-3f, 0.f, 2.f, 30.f, 90.f, 100.f});
  ExpectSameAsPlain(
      {extreme.requires_grad_(true), torch::randn({9}).requires_grad_(true)},
      [](const auto& v) { return SiluMul(v[0], v[1]); },
      [](const auto& v) { return torch::silu(v[0]) * v[1]; });
}

torch::Tensor PlainRotary(const torch::Tensor& x, const torch::Tensor& cos,
                          const torch::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

TEST(FusedOpsTest, RotaryEmbeddingEqualsPlainFormula) {
  torch::manual_seed(3);
  const int64_t b = 3, h = 5, t = 7, d = 32;
  torch::Tensor angle = torch::rand({b, t, d / 2}) * 6;
  torch::Tensor cos = torch::cat({angle, angle}, -1).cos(),
                sin = torch::cat({angle, angle}, -1).sin();
  // The attention's layout: heads as a transposed view of [B, T, H, D].
  torch::Tensor x = torch::randn({b, t, h, d}).transpose(1, 2).requires_grad_(true);
  ExpectSameAsPlain(
      {x, cos, sin}, [](const auto& v) { return RotaryEmbedding(v[0], v[1], v[2]); },
      [](const auto& v) { return PlainRotary(v[0], v[1], v[2]); });
  // One row of cos/sin for the whole batch.
  ExpectSameAsPlain(
      {torch::randn({b, h, t, d}).requires_grad_(true), cos.narrow(0, 0, 1), sin.narrow(0, 0, 1)},
      [](const auto& v) { return RotaryEmbedding(v[0], v[1], v[2]); },
      [](const auto& v) { return PlainRotary(v[0], v[1], v[2]); });
  EXPECT_TRUE(RotaryEmbedding(x, cos, sin).is_contiguous());
}

// Off the float CPU kernel (double here, a GPU in training) a recorded rotary embedding takes
// the rolled form: the same values and gradients as the formula, to double rounding.
TEST(FusedOpsTest, RotaryEmbeddingsRolledFormEqualsPlainFormula) {
  torch::manual_seed(6);
  const int64_t b = 2, h = 3, t = 5, d = 16;
  torch::Tensor angle = torch::rand({b, t, d / 2}, torch::kDouble) * 6;
  torch::Tensor cos = torch::cat({angle, angle}, -1).cos(),
                sin = torch::cat({angle, angle}, -1).sin();
  torch::Tensor x = torch::randn({b, t, h, d}, torch::kDouble).transpose(1, 2).requires_grad_(true);
  ExpectSameAsPlain(
      {x, cos, sin}, [](const auto& v) { return RotaryEmbedding(v[0], v[1], v[2]); },
      [](const auto& v) { return PlainRotary(v[0], v[1], v[2]); }, 1e-12);
  // Without autograd it is the plain formula itself.
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(RotaryEmbedding(x, cos, sin), PlainRotary(x, cos, sin)));
}

TEST(FusedOpsTest, DropoutKeepsOneMinusPScaledAndBackpropagatesItsMask) {
  const double p = 0.1;
  torch::Tensor x =
      (torch::rand({401, 251}) + 1.0).requires_grad_(true);  // splits off 8-lane blocks
  torch::manual_seed(4);
  torch::Tensor out = TrainingDropout(x, p);
  torch::Tensor kept = out != 0;
  const double fraction = kept.to(torch::kDouble).mean().item<double>();
  EXPECT_NEAR(fraction, 1.0 - p, 0.01);  // ~100,000 draws: standard error 0.001
  EXPECT_TRUE(torch::allclose(out.masked_select(kept), (x / (1.0 - p)).masked_select(kept)));
  // The gradient is the same mask and scale.
  torch::Tensor g = torch::randn_like(x);
  (out * g).sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), g * kept.to(torch::kFloat) / (1.0 - p)));
  // Rows and columns are not masked alike (no pattern along either axis).
  const torch::Tensor per_row = kept.to(torch::kDouble).mean(1),
                      per_col = kept.to(torch::kDouble).mean(0);
  EXPECT_LT((per_row - (1.0 - p)).abs().max().item<double>(), 0.1);
  EXPECT_LT((per_col - (1.0 - p)).abs().max().item<double>(), 0.1);

  // Reproducible from torch::manual_seed, whatever the thread count; another seed differs.
  const int threads = torch::get_num_threads();
  torch::set_num_threads(1);
  torch::manual_seed(4);
  torch::Tensor again = TrainingDropout(x.detach(), p);
  torch::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(again, out.detach()));
  torch::manual_seed(5);
  EXPECT_FALSE(torch::equal(TrainingDropout(x.detach(), p) != 0, kept));
  EXPECT_TRUE(TrainingDropout(x, 0.0).is_same(x));
}

}  // namespace
}  // namespace cdcca::model
