// The packed int8/int4 kernels compute x · DequantizeWeight(q)^T (+ bias) for decode-sized
// (few rows, packed path) and prefill-sized inputs (block-dequantized GEMM), at widths that
// are and are not multiples of the vector and group sizes.
#include "distill/model/qmatmul.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

namespace cdcca::model {
namespace {

TEST(QuantizedLinearTest, MatchesTheDequantizedWeight) {
  torch::manual_seed(3);
  torch::NoGradGuard no_grad;
  for (int64_t in : {32, 100, 256, 333}) {
    for (int64_t rows : {1, 3, 9}) {
      for (const auto& [precision, group] :
           {std::make_tuple(Precision::kInt8, int64_t{128}), std::make_tuple(Precision::kInt4, int64_t{32}),
            std::make_tuple(Precision::kInt4, int64_t{64}), std::make_tuple(Precision::kInt4, int64_t{128})}) {
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

TEST(QuantizedLinearTest, RejectsWhatItCannotCompute) {
  QuantizedWeight q = QuantizeWeight(torch::randn({4, 64}), Precision::kInt8, 128);
  EXPECT_THROW(QuantizedLinear(torch::randn({1, 63}), q, Precision::kInt8, 64, 128, {}), c10::Error);
  EXPECT_THROW(QuantizedLinear(torch::randn({1, 64}).to(torch::kDouble), q, Precision::kInt8, 64, 128, {}),
               c10::Error);
}

}  // namespace
}  // namespace cdcca::model
