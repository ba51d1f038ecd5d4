#include "compress/group_codec.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::compress {
namespace {

using ::cdcca::testing::StatusIs;

std::vector<float> Gaussian(size_t n, float sigma, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

double RelativeError(const std::vector<float>& x, const std::vector<float>& y) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * static_cast<double>(x[i] - y[i]);
    den += static_cast<double>(x[i]) * x[i];
  }
  return std::sqrt(num / den);
}

std::vector<float> RoundTrip(const std::vector<float>& x, int bits, size_t group) {
  std::string block;
  QuantizeBlock(x.data(), x.size(), bits, group, &block);
  EXPECT_EQ(block.size(), CodedBlockBytes(x.size(), bits, group));
  std::vector<float> y(x.size(), 123.0f);
  EXPECT_OK(DequantizeBlock(block, x.size(), bits, group, y.data()));
  return y;
}

// Relative RMS error on Gaussian data per width. The bounds are those of the optimal
// uniform quantizer of a unit Gaussian (1 bit: sqrt(1 - 2/pi) = 0.60; 2 bits: 0.35;
// 3 bits: 0.19; 4 bits: 0.10) plus margin for per-group scales; 8 bits: step/sqrt(12)
// relative to a max-abs grid of ~2.5 sigma over 127.5 levels.
TEST(GroupCodecTest, RoundTripErrorBoundsPerWidth) {
  const std::vector<float> x = Gaussian(64 * 1000 + 17, 1e-4f, 1);  // ragged last group
  const struct {
    int bits;
    double bound;
  } cases[] = {{1, 0.62}, {2, 0.36}, {3, 0.20}, {4, 0.11}, {8, 0.01}};
  double previous = 1.0;
  for (const auto& c : cases) {
    const double err = RelativeError(x, RoundTrip(x, c.bits, 64));
    EXPECT_LT(err, c.bound) << c.bits << " bits";
    EXPECT_LT(err, previous) << "more bits must not be worse";
    previous = err;
  }
}

// 8 bits spans the group's max |x|: every value is within half a step (+ bf16 rounding of
// the step) of the original, never clipped.
TEST(GroupCodecTest, EightBitsIsWithinHalfAStepEverywhere) {
  const std::vector<float> x = Gaussian(4096, 3e-3f, 2);
  const std::vector<float> y = RoundTrip(x, 8, 64);
  for (size_t g = 0; g < x.size(); g += 64) {
    float max_abs = 0.0f;
    for (size_t i = g; i < g + 64; ++i) max_abs = std::max(max_abs, std::fabs(x[i]));
    const double step = max_abs / 127.5;
    for (size_t i = g; i < g + 64; ++i) {
      EXPECT_LE(std::fabs(x[i] - y[i]), 0.5 * step * 1.01 + max_abs / 256.0) << i;
    }
  }
}

TEST(GroupCodecTest, OneBitIsSignTimesMeanAbs) {
  const std::vector<float> x = {1.0f, -3.0f, 2.0f, -2.0f};
  const std::vector<float> y = RoundTrip(x, 1, 4);
  EXPECT_THAT(y, ::testing::ElementsAre(2.0f, -2.0f, 2.0f, -2.0f));
}

TEST(GroupCodecTest, ZeroesStayZeroAndZeroBitsDecodesToZero) {
  const std::vector<float> x(100, 0.0f);
  for (int bits : {1, 2, 3, 4, 8}) {
    for (float v : RoundTrip(x, bits, 64)) EXPECT_EQ(std::fabs(v), 0.0f) << bits;
  }
  std::vector<float> y(5, 1.0f);
  EXPECT_OK(DequantizeBlock("", 5, 0, 0, y.data()));
  EXPECT_THAT(y, ::testing::Each(0.0f));
}

TEST(GroupCodecTest, Bfloat16RoundsToNearest) {
  EXPECT_EQ(Bfloat16ToFloat(FloatToBfloat16(1.0f)), 1.0f);
  EXPECT_EQ(Bfloat16ToFloat(FloatToBfloat16(-2.5f)), -2.5f);
  const float f = 1.0f + 1.0f / 256.0f + 1.0f / 1024.0f;  // just above a midpoint
  EXPECT_EQ(Bfloat16ToFloat(FloatToBfloat16(f)), 1.0f + 1.0f / 128.0f);
  EXPECT_NEAR(Bfloat16ToFloat(FloatToBfloat16(3.3e-7f)), 3.3e-7f, 3.3e-7f / 128);
}

TEST(GroupCodecTest, RejectsWrongLengthAndBadScales) {
  const std::vector<float> x = Gaussian(128, 1.0f, 3);
  std::string block;
  QuantizeBlock(x.data(), x.size(), 2, 64, &block);
  std::vector<float> y(x.size());
  EXPECT_THAT(DequantizeBlock(block.substr(1), x.size(), 2, 64, y.data()),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DequantizeBlock(block + "x", x.size(), 2, 64, y.data()),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DequantizeBlock(block, x.size(), 5, 64, y.data()),
              StatusIs(absl::StatusCode::kDataLoss));
  std::string nan_scale = block;
  nan_scale[0] = '\x7f';
  nan_scale[1] = '\x7f';  // bf16 0x7f7f is finite but > kMaxScale
  EXPECT_THAT(DequantizeBlock(nan_scale, x.size(), 2, 64, y.data()),
              StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("scale")));
  nan_scale[0] = '\xc0';  // 0x7fc0: NaN
  EXPECT_THAT(DequantizeBlock(nan_scale, x.size(), 2, 64, y.data()),
              StatusIs(absl::StatusCode::kDataLoss));
  std::string negative = block;
  negative[1] = '\xbf';  // sign bit set
  EXPECT_THAT(DequantizeBlock(negative, x.size(), 2, 64, y.data()),
              StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace cdcca::compress
