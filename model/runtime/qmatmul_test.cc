// The packed int8/int4 kernels compute x · DequantizeWeight(q)^T (+ bias) for decode-sized
// (few rows, packed path) and prefill-sized inputs (block-dequantized GEMM), at widths that
// are and are not multiples of the vector and group sizes.
#include "model/runtime/qmatmul.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

#include "model/arch/layers.h"

namespace cdcca::model {
namespace {

TEST(QuantizedLinearTest, MatchesTheDequantizedWeight) {
  torch::manual_seed(3);
  torch::NoGradGuard no_grad;
  for (int64_t in : {32, 100, 256, 333}) {
    for (int64_t rows : {1, 3, 9}) {
      for (const auto& [precision, group] : {std::make_tuple(Precision::kInt8, int64_t{128}),
                                             std::make_tuple(Precision::kInt4, int64_t{32}),
                                             std::make_tuple(Precision::kInt4, int64_t{64}),
                                             std::make_tuple(Precision::kInt4, int64_t{128})}) {
        const int64_t out = 37;
        torch::Tensor w = torch::randn({out, in});
        torch::Tensor bias = torch::randn({out});
        torch::Tensor x = torch::randn({1, rows, in});
        QuantizedWeight q = QuantizeWeight(w, precision, group);
        torch::Tensor want = torch::linear(x, DequantizeWeight(q, precision, in, group), bias);
        torch::Tensor got = QuantizedLinear(x, q, precision, in, group, bias);
        ASSERT_EQ(got.sizes(), want.sizes());
        const float rel = ((got - want).abs().max() / want.abs().max()).item<float>();
        EXPECT_LT(rel, 1e-5) << "in " << in << " rows " << rows << " group " << group;
        torch::Tensor no_bias = QuantizedLinear(x, q, precision, in, group, torch::Tensor());
        EXPECT_TRUE(torch::allclose(no_bias + bias, got, 1e-5, 1e-5));
      }
    }
  }
}

// The packed int4 layout read one element at a time: byte k of a row holds column 2k in the
// low nibble and 2k + 1 in the high nibble, each q + 8; the weight is (q - 8) * scale in fp32.
TEST(DequantizeWeightTest, Int4IsTheOneRoundingOfEachNibbleTimesItsScale) {
  torch::manual_seed(5);
  for (const auto& [in, group] :
       {std::make_pair(int64_t{64}, int64_t{32}), std::make_pair(int64_t{100}, int64_t{32}),
        std::make_pair(int64_t{256}, int64_t{128})}) {
    const int64_t out = 7;
    QuantizedWeight q = QuantizeWeight(torch::randn({out, in}) * 3, Precision::kInt4, group);
    torch::Tensor got = DequantizeWeight(q, Precision::kInt4, in, group);
    ASSERT_EQ(got.sizes(), (std::vector<int64_t>{out, in}));
    auto bytes = q.values.accessor<uint8_t, 2>();
    auto scales = q.scales.accessor<float, 2>();
    auto w = got.accessor<float, 2>();
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t c = 0; c < in; ++c) {
        const uint8_t b = bytes[r][c / 2];
        const int nibble = c % 2 == 0 ? (b & 15) : (b >> 4);
        const float want = static_cast<float>(nibble - 8) * scales[r][c / group];
        ASSERT_EQ(w[r][c], want) << "row " << r << " column " << c;
      }
    }
  }
}

// A training product of a quantized layer (its input needs a gradient) takes the gradients of
// the input and the bias that autograd takes through the dequantized weight, without keeping
// that weight for the backward pass; with and without a bias.
TEST(QuantizedLinearTest, TrainingProductHasTheGradientsOfTheDequantizedWeight) {
  torch::manual_seed(7);
  for (bool with_bias : {true, false}) {
    for (Precision precision : {Precision::kInt8, Precision::kInt4}) {
      WeightPrecision p;
      p.weights = precision;
      p.int4_group = 32;
      Linear layer(LinearOptions{64, 24, with_bias, p});
      torch::Tensor w = torch::randn({24, 64});
      ASSERT_TRUE(layer->Adopt("weight", w).ok());
      if (with_bias) {
        ASSERT_TRUE(layer->Adopt("bias", torch::randn({24})).ok());
        layer->bias.set_requires_grad(true);
      }
      torch::Tensor x = torch::randn({2, 5, 64}, torch::requires_grad());
      torch::Tensor y = layer->forward(x);
      torch::Tensor upstream = torch::randn_like(y);
      (y * upstream).sum().backward();

      torch::Tensor x_ref = x.detach().clone().requires_grad_(true);
      torch::Tensor bias_ref;
      if (with_bias) bias_ref = layer->bias.detach().clone().requires_grad_(true);
      torch::Tensor y_ref = torch::linear(x_ref, layer->EffectiveWeight(), bias_ref);
      (y_ref * upstream).sum().backward();
      EXPECT_TRUE(torch::allclose(y, y_ref, 1e-6, 1e-6));
      EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-5));
      if (with_bias) EXPECT_TRUE(torch::allclose(layer->bias.grad(), bias_ref.grad(), 1e-5, 1e-5));
    }
  }
}

TEST(QuantizedLinearTest, RejectsWhatItCannotCompute) {
  QuantizedWeight q = QuantizeWeight(torch::randn({4, 64}), Precision::kInt8, 128);
  EXPECT_THROW(QuantizedLinear(torch::randn({1, 63}), q, Precision::kInt8, 64, 128, {}),
               c10::Error);
  EXPECT_THROW(
      QuantizedLinear(torch::randn({1, 64}).to(torch::kDouble), q, Precision::kInt8, 64, 128, {}),
      c10::Error);
}

}  // namespace
}  // namespace cdcca::model
