#include "distill/losses.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

namespace cdcca::distill {
namespace {

double Value(const torch::Tensor& t) { return t.item<double>(); }

TEST(LossesTest, FeatureMseByHand) {
  torch::Tensor t = torch::tensor({{1.0f, 2.0f}, {3.0f, 4.0f}});
  torch::Tensor s = torch::tensor({{1.0f, 0.0f}, {0.0f, 4.0f}});
  // Row 0: (0 + 4) / 2 = 2; row 1: (9 + 0) / 2 = 4.5.
  EXPECT_NEAR(Value(FeatureMse(t, s, {}, false)), 3.25, 1e-6);
  EXPECT_NEAR(Value(FeatureMse(t, s, torch::tensor({true, false}), false)), 2.0, 1e-6);
  EXPECT_NEAR(Value(FeatureMse(t, s, torch::tensor({false, false}), false)), 0.0, 1e-9);
  // Layer-normed, row 0: t -> [-1, 1], s -> [1, -1]; squared differences 4 and 4.
  EXPECT_NEAR(Value(FeatureMse(t, s, torch::tensor({true, false}), true)), 4.0, 1e-3);
  // Scale-free: multiplying the student's features leaves the normalised term unchanged.
  EXPECT_NEAR(Value(FeatureMse(t, s * 50, {}, true)), Value(FeatureMse(t, s, {}, true)), 1e-4);
}

TEST(LossesTest, TokenCrossEntropyIgnoresNegativeTargets) {
  torch::Tensor logits = torch::tensor({{{0.0f, 0.0f}, {std::log(3.0f), 0.0f}, {5.0f, 0.0f}}});
  torch::Tensor targets = torch::tensor({{int64_t{1}, int64_t{0}, int64_t{-1}}});
  const double expected = (std::log(2.0) + std::log(4.0 / 3.0)) / 2;
  EXPECT_NEAR(Value(TokenCrossEntropy(logits, targets)), expected, 1e-6);
}

TEST(LossesTest, SoftCrossEntropyByHand) {
  torch::Tensor logits = torch::zeros({1, 2, 2});
  torch::Tensor probs = torch::tensor({{{0.75f, 0.25f}, {1.0f, 0.0f}}});
  EXPECT_NEAR(Value(SoftCrossEntropy(logits, probs, torch::tensor({{true, false}}))), std::log(2.0),
              1e-6);
}

TEST(LossesTest, TemperatureKlByHand) {
  torch::Tensor teacher = torch::tensor({{{std::log(3.0f), 0.0f}}});
  torch::Tensor student = torch::zeros({1, 1, 2});
  torch::Tensor mask = torch::tensor({{true}});
  EXPECT_NEAR(Value(TemperatureKl(teacher, student, mask, 1.0)),
              0.75 * std::log(1.5) + 0.25 * std::log(0.5), 1e-6);
  // T = 2: p = softmax([ln3 / 2, 0]) = [sqrt3, 1] / (1 + sqrt3), times T^2 = 4.
  const double r3 = std::sqrt(3.0);
  const double p0 = r3 / (1 + r3), p1 = 1 / (1 + r3);
  EXPECT_NEAR(Value(TemperatureKl(teacher, student, mask, 2.0)),
              4 * (p0 * std::log(p0 / 0.5) + p1 * std::log(p1 / 0.5)), 1e-6);
  EXPECT_NEAR(Value(TemperatureKl(teacher, teacher, mask, 2.0)), 0.0, 1e-7);
}

TEST(LossesTest, WeightedTermsAreWeightedMeansAndEqualWeightsArePlain) {
  // Positions: p = softmax([0, 0]) -> nll ln 2; softmax([ln 3, 0]) at target 0 -> ln(4/3).
  torch::Tensor logits = torch::tensor({{0.0f, 0.0f}, {std::log(3.0f), 0.0f}});
  torch::Tensor targets = torch::tensor({int64_t{1}, int64_t{0}});
  const double a = std::log(2.0), b = std::log(4.0 / 3.0);
  EXPECT_NEAR(Value(WeightedTokenCrossEntropy(logits, targets, torch::tensor({3.0f, 1.0f}))),
              (3 * a + b) / 4, 1e-6);
  EXPECT_NEAR(Value(WeightedTokenCrossEntropy(logits, targets, torch::tensor({0.5f, 0.5f}))),
              Value(TokenCrossEntropy(logits, targets)), 1e-6);
  torch::Tensor teacher = torch::tensor({{std::log(3.0f), 0.0f}, {0.0f, 0.0f}});
  torch::Tensor student = torch::zeros({2, 2});
  const double kl0 = 0.75 * std::log(1.5) + 0.25 * std::log(0.5);  // position 1: 0
  EXPECT_NEAR(Value(WeightedTemperatureKl(teacher, student, torch::tensor({1.0f, 3.0f}), 1.0)),
              kl0 / 4, 1e-6);
  EXPECT_NEAR(Value(WeightedTemperatureKl(teacher, student, torch::tensor({2.0f, 2.0f}), 2.0)),
              Value(TemperatureKl(teacher, student, torch::Tensor(), 2.0)), 1e-6);
}

TEST(LossesTest, MeanEntropyByHand) {
  torch::Tensor logits = torch::tensor({{{0.0f, 0.0f}, {std::log(3.0f), 0.0f}}});
  const double h1 = -(0.75 * std::log(0.75) + 0.25 * std::log(0.25));
  EXPECT_NEAR(Value(MeanEntropy(logits, torch::tensor({{true, true}}))), (std::log(2.0) + h1) / 2,
              1e-6);
  EXPECT_NEAR(Value(MeanEntropy(logits, torch::tensor({{false, true}}))), h1, 1e-6);
}

TEST(LossesTest, PearsonDistanceByHand) {
  // Channel 0 perfectly correlated (r = 1), channel 1 anti-correlated (r = -1): 1 - 0 = 1.
  torch::Tensor t = torch::tensor({{1.0f, 1.0f}, {2.0f, 2.0f}, {3.0f, 3.0f}});
  torch::Tensor s = torch::tensor({{2.0f, 3.0f}, {4.0f, 2.0f}, {6.0f, 1.0f}});
  EXPECT_NEAR(Value(PearsonDistance(t, s, {})), 1.0, 1e-5);
  EXPECT_NEAR(Value(PearsonDistance(t, t * 3 + 1, {})), 0.0, 1e-5);
  // A masked-out outlier does not count.
  torch::Tensor t4 = torch::cat({t, torch::tensor({{100.0f, -100.0f}})});
  torch::Tensor s4 = torch::cat({t * 3 + 1, torch::tensor({{-7.0f, 9.0f}})});
  EXPECT_NEAR(Value(PearsonDistance(t4, s4, torch::tensor({true, true, true, false}))), 0.0, 1e-5);
}

TEST(LossesTest, ChannelWiseDivergenceByHand) {
  // One row, one channel, two positions: p = softmax([0, ln3]) = [.25, .75], q = [.5, .5].
  torch::Tensor t = torch::tensor({{{0.0f}, {std::log(3.0f)}}});
  torch::Tensor s = torch::zeros({1, 2, 1});
  const double kl = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);
  EXPECT_NEAR(Value(ChannelWiseDivergence(t, s, {}, 1.0)), kl, 1e-6);
  // A third, masked position with a huge value changes nothing, and gradients stay finite.
  torch::Tensor t3 = torch::cat({t, torch::full({1, 1, 1}, 100.0f)}, 1);
  torch::Tensor s3 = torch::cat({s, torch::full({1, 1, 1}, -100.0f)}, 1).requires_grad_(true);
  torch::Tensor loss = ChannelWiseDivergence(t3, s3, torch::tensor({{true, true, false}}), 1.0);
  EXPECT_NEAR(Value(loss), kl, 1e-6);
  loss.backward();
  EXPECT_TRUE(torch::isfinite(s3.grad()).all().item<bool>());
  EXPECT_EQ(s3.grad()[0][2][0].item<float>(), 0.0f);
  // tau^2 scaling: with tau = 2 the distributions soften and the term is multiplied by 4.
  const double p0 = 1 / (1 + std::sqrt(3.0)), p1 = 1 - p0;
  EXPECT_NEAR(Value(ChannelWiseDivergence(t, s, {}, 2.0)),
              4 * (p0 * std::log(p0 / 0.5) + p1 * std::log(p1 / 0.5)), 1e-6);
}

}  // namespace
}  // namespace cdcca::distill
