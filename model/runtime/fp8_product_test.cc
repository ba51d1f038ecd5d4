#include "model/runtime/fp8_product.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "model/arch/layers.h"

namespace cdcca::model {
namespace {

// Every finite e4m3fn value from its bits (sign, 4 exponent bits biased by 7, 3 mantissa
// bits; exponent 0 is subnormal; 0x7f and 0xff are NaN), with whether its mantissa is even.
struct GridValue {
  double value;
  bool even;
};
std::vector<GridValue> E4m3Grid() {
  std::vector<GridValue> grid;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const int exponent = (code >> 3) & 0xf, mantissa = code & 7;
    double v = exponent == 0 ? mantissa * std::ldexp(1.0, -9)
                             : (1.0 + mantissa / 8.0) * std::ldexp(1.0, exponent - 7);
    if (code & 0x80) v = -v;
    grid.push_back({v, mantissa % 2 == 0});
  }
  return grid;
}

// The grid value nearest `x`, ties to the even mantissa, saturated at 448: the definition,
// by search.
double NearestE4m3(double x, const std::vector<GridValue>& grid) {
  double best = 0, best_d = INFINITY;
  bool best_even = true;
  for (const GridValue& g : grid) {
    const double d = std::abs(x - g.value);
    if (d < best_d || (d == best_d && g.even && !best_even)) {
      best = g.value, best_d = d, best_even = g.even;
    }
  }
  return best;
}

TEST(Fp8ProductTest, RoundingIsTheFormatsNearestValueWithTiesToEven) {
  const std::vector<GridValue> grid = E4m3Grid();
  ASSERT_EQ(grid.size(), 254u);
  std::vector<float> inputs;
  for (const GridValue& g : grid) inputs.push_back(static_cast<float>(g.value));
  // Every midpoint between neighbours (a tie) and points a quarter step either side of it.
  std::vector<double> sorted;
  for (const GridValue& g : grid) sorted.push_back(g.value);
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i + 1 < sorted.size(); ++i) {
    const double mid = 0.5 * (sorted[i] + sorted[i + 1]), q = 0.25 * (sorted[i + 1] - sorted[i]);
    for (double v : {mid, mid - q, mid + q}) inputs.push_back(static_cast<float>(v));
  }
  // Beyond the largest value (saturates), below the smallest subnormal, and a spread of
  // magnitudes.
  for (float v : {460.0f, 1e4f, -700.0f, 1e-4f, -2e-3f, 0.0f}) inputs.push_back(v);
  torch::manual_seed(3);
  const torch::Tensor spread =
      torch::exp(torch::rand({2000}) * 16 - 10) * torch::sign(torch::randn({2000}));
  for (int64_t i = 0; i < spread.numel(); ++i) inputs.push_back(spread[i].item<float>());

  const torch::Tensor x = torch::tensor(inputs);
  const torch::Tensor rounded = RoundToE4m3(x);
  int64_t wrong = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const double want = NearestE4m3(inputs[i], grid), got = rounded[i].item<float>();
    if (want != got) {
      if (++wrong <= 5) ADD_FAILURE() << inputs[i] << " rounds to " << got << ", not " << want;
    }
  }
  EXPECT_EQ(wrong, 0) << "of " << inputs.size();
}

// A matrix whose rows are e4m3 values with +-448 in each row, each row then multiplied by
// `row_factor[r]`: its FP8 form is exact (the scale recovers the grid values).
torch::Tensor OnGridRows(int64_t rows, int64_t cols, const torch::Tensor& row_factor,
                         uint64_t seed) {
  torch::manual_seed(seed);
  torch::Tensor m = RoundToE4m3(torch::randn({rows, cols}) * 60);
  for (int64_t r = 0; r < rows; ++r) m[r][(r * 7) % cols] = (r % 2 ? -448.0 : 448.0);
  return m * row_factor.unsqueeze(1);
}

TEST(Fp8ProductTest, OperandsOnTheGridMultiplyExactlyForwardAndBackward) {
  // W [32, 32] with 448 on its diagonal: every row and every column holds the largest
  // value, so both of its FP8 copies (per row, per input channel) are exact.
  torch::manual_seed(4);
  torch::Tensor w = RoundToE4m3(torch::randn({32, 32}) * 40);
  w.diagonal().fill_(448.0);
  const torch::Tensor factors = torch::tensor({0.3f, 1.0f, 2.5e-3f, 17.0f, 0.0625f, 1e3f});
  const torch::Tensor x = OnGridRows(6, 32, factors, 5).requires_grad_(true);
  const Fp8Weight fw = MakeFp8Weight(w);
  EXPECT_FALSE(fw.native);  // the CPU emulates
  EXPECT_TRUE(torch::equal(Fp8WeightValues(fw, torch::kFloat), w));

  const torch::Tensor y = Fp8Linear(x, fw);
  const torch::Tensor exact =
      torch::matmul(x.detach().to(torch::kDouble), w.to(torch::kDouble).t());
  EXPECT_TRUE(torch::allclose(y.to(torch::kDouble), exact, 1e-6, 1e-9))
      << (y.to(torch::kDouble) - exact).abs().max().item<double>();

  const torch::Tensor g =
      OnGridRows(6, 32, torch::tensor({1.0f, 0.01f, 3.0f, 0.5f, 8.0f, 1.0f}), 6);
  y.backward(g);
  const torch::Tensor exact_dx = torch::matmul(g.to(torch::kDouble), w.to(torch::kDouble));
  EXPECT_TRUE(torch::allclose(x.grad().to(torch::kDouble), exact_dx, 1e-6, 1e-9))
      << (x.grad().to(torch::kDouble) - exact_dx).abs().max().item<double>();
}

TEST(Fp8ProductTest, GeneralOperandsAreRoundedAsTheFormatRounds) {
  torch::manual_seed(7);
  const torch::Tensor w = torch::randn({48, 64}) / 8;
  const torch::Tensor x = torch::randn({2, 5, 64}).requires_grad_(true);
  const Fp8Weight fw = MakeFp8Weight(w);
  const torch::Tensor y = Fp8Linear(x, fw);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 5, 48}));

  // The product of the rounded operands, computed here from the definition.
  const torch::Tensor xs = std::get<0>(x.detach().abs().max(-1, true)) / 448;
  const torch::Tensor ws = std::get<0>(w.abs().max(-1, true)) / 448;
  const torch::Tensor want =
      torch::matmul(RoundToE4m3(x.detach() / xs) * xs, (RoundToE4m3(w / ws) * ws).t());
  EXPECT_TRUE(torch::allclose(y, want, 1e-5, 1e-6)) << (y - want).abs().max().item<float>();
  // Rounding changed it: about e4m3's half step (2^-4 relative) averaged over 64 terms.
  const torch::Tensor plain = torch::matmul(x.detach(), w.t());
  const double rel = ((y - plain).norm() / plain.norm()).item<double>();
  EXPECT_GT(rel, 3e-3);
  EXPECT_LT(rel, 6e-2);

  const torch::Tensor g = torch::randn({2, 5, 48});
  y.backward(g);
  const torch::Tensor g2 = g.reshape({10, 48});
  const torch::Tensor gs = std::get<0>(g2.abs().max(-1, true)) / 448;
  const torch::Tensor wts = std::get<0>(w.t().abs().max(-1, true)) / 448;
  const torch::Tensor want_dx =
      torch::matmul(RoundToE4m3(g2 / gs) * gs, (RoundToE4m3(w.t() / wts) * wts).t())
          .reshape({2, 5, 64});
  EXPECT_TRUE(torch::allclose(x.grad(), want_dx, 1e-5, 1e-6))
      << (x.grad() - want_dx).abs().max().item<float>();
}

TEST(Fp8ProductTest, HeldFp8ReplacesTheFloatWeightOfAQuantizedLayer) {
  EXPECT_FALSE(NativeFp8Available(torch::kCPU));
  LinearOptions o;
  o.in_features = 64;
  o.out_features = 32;
  o.bias = true;
  o.precision.weights = Precision::kInt8;
  Linear plain(o), held(o);
  torch::manual_seed(8);
  const torch::Tensor w = torch::randn({32, 64}) / 8, b = torch::randn({32});
  for (Linear* l : {&plain, &held}) {
    ASSERT_TRUE((*l)->Adopt("weight", w).ok());
    ASSERT_TRUE((*l)->Adopt("bias", b).ok());
    torch::manual_seed(9);
    (*l)->AddLora(4, 8.0);
    torch::NoGradGuard no_grad;
    (*l)->lora_b.normal_(0.0, 0.1);
  }
  held->HoldFp8();
  ASSERT_TRUE(held->holds_fp8());
  EXPECT_FALSE(held->holds_dequantized());
  held->HoldDequantized();  // held one way already: no-op
  EXPECT_FALSE(held->holds_dequantized());
  // The emulated copies: bf16 values, two of them, plus their scales.
  EXPECT_EQ(held->WeightBytes() - plain->WeightBytes(), 2 * 32 * 64 * 2 + (32 + 64) * 4);

  const torch::Tensor x = torch::randn({3, 64});
  const torch::Tensor y = held->forward(x);
  const torch::Tensor base = Fp8Linear(x, held->fp8_weight()) + b;
  const torch::Tensor lora =
      torch::linear(torch::linear(x, held->lora_a), held->lora_b) * (8.0 / 4);
  EXPECT_TRUE(torch::allclose(y, base + lora, 1e-5, 1e-6));
  // The base it rounds is the dequantized int8 weight's.
  EXPECT_TRUE(
      torch::allclose(held->EffectiveWeight(),
                      Fp8WeightValues(MakeFp8Weight(plain->EffectiveWeight()), torch::kFloat)));
  const torch::Tensor y_plain = plain->forward(x);
  const double rel = ((y - y_plain).norm() / y_plain.norm()).item<double>();
  EXPECT_GT(rel, 1e-3);
  EXPECT_LT(rel, 5e-2);
  // The LoRA factors train through it.
  y.square().sum().backward();
  y_plain.square().sum().backward();
  for (const auto& [a, p] :
       {std::pair{held->lora_a, plain->lora_a}, std::pair{held->lora_b, plain->lora_b}}) {
    ASSERT_TRUE(a.grad().defined());
    const double cos =
        torch::cosine_similarity(a.grad().flatten(), p.grad().flatten(), 0).item<double>();
    EXPECT_GT(cos, 0.99);
  }
}

}  // namespace
}  // namespace cdcca::model
