#include "datasets/shifts.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include "datasets/domain.h"
#include "datasets/test_images.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::datasets {
namespace {

using ::cdcca::testing::StatusIs;

std::vector<Image> CleanScenes(int n) {
  static const ImageSet set = SyntheticImageSet(Split::kTrain);
  absl::StatusOr<SampleGenerator> gen =
      SampleGenerator::Create(&set, StudentSourceDomain(Split::kTrain), 5);
  std::vector<Image> out;
  for (int i = 0; i < n; ++i) out.push_back(gen->GenerateImageOnly(i).image);
  return out;
}

// Pearson correlation of the pixel values of two equal-size images.
double Correlation(const Image& a, const Image& b) {
  double sa = 0, sb = 0, saa = 0, sbb = 0, sab = 0;
  const double n = static_cast<double>(a.pixels.size());
  for (size_t i = 0; i < a.pixels.size(); ++i) {
    const double x = a.pixels[i], y = b.pixels[i];
    sa += x, sb += y, saa += x * x, sbb += y * y, sab += x * y;
  }
  const double cov = sab / n - sa / n * sb / n;
  const double va = saa / n - sa / n * sa / n, vb = sbb / n - sb / n * sb / n;
  return cov / std::sqrt(va * vb + 1e-12);
}

struct Damage {
  double mad = 0;          // mean absolute difference from the clean scene
  double correlation = 0;  // mean correlation with the clean scene
};

Damage MeanDamage(ImageShift shift, int severity, const std::vector<Image>& clean) {
  Damage d;
  for (size_t i = 0; i < clean.size(); ++i) {
    Image img = clean[i];
    EXPECT_OK(ApplyShift(shift, severity, 1000 + i, img));
    d.mad += MeanAbsDiff(clean[i], img) / clean.size();
    d.correlation += Correlation(clean[i], img) / clean.size();
  }
  return d;
}

class ShiftTest : public ::testing::TestWithParam<ImageShift> {};

TEST_P(ShiftTest, DamageGrowsWithSeverityAndStaysBounded) {
  const std::vector<Image> clean = CleanScenes(24);
  Damage prev;
  for (int s = 1; s <= kMaxSeverity; ++s) {
    const Damage d = MeanDamage(GetParam(), s, clean);
    std::printf("%-15s severity %d: mean abs diff %6.2f, correlation %.3f\n",
                std::string(ImageShiftName(GetParam())).c_str(), s, d.mad, d.correlation);
    EXPECT_GT(d.mad, prev.mad) << ImageShiftName(GetParam()) << " severity " << s;
    prev = d;
    if (s == 1) {
      // Mild: the picture stays almost the same as the clean one.
      EXPECT_GT(d.correlation, 0.9) << ImageShiftName(GetParam());
    }
  }
  // Severity 5 is hard but not destructive: the clean structure still dominates.
  EXPECT_GT(prev.correlation, 0.5) << ImageShiftName(GetParam());
}

TEST_P(ShiftTest, DeterministicPerSeed) {
  const std::vector<Image> clean = CleanScenes(1);
  Image a = clean[0], b = clean[0], c = clean[0];
  ASSERT_OK(ApplyShift(GetParam(), 3, 42, a));
  ASSERT_OK(ApplyShift(GetParam(), 3, 42, b));
  ASSERT_OK(ApplyShift(GetParam(), 3, 43, c));
  EXPECT_EQ(a.pixels, b.pixels);
  const bool random = GetParam() == ImageShift::kRain || GetParam() == ImageShift::kSnow ||
                      GetParam() == ImageShift::kFog || GetParam() == ImageShift::kGaussianNoise ||
                      GetParam() == ImageShift::kMotionBlur;
  if (random) EXPECT_NE(a.pixels, c.pixels);
}

INSTANTIATE_TEST_SUITE_P(AllShifts, ShiftTest, ::testing::ValuesIn(AllImageShifts()),
                         [](const auto& info) { return std::string(ImageShiftName(info.param)); });

TEST(ShiftsTest, SeverityZeroAndNoneAreIdentity) {
  Image img = CleanScenes(1)[0];
  const Image before = img;
  ASSERT_OK(ApplyShift(ImageShift::kRain, 0, 1, img));
  ASSERT_OK(ApplyShift(ImageShift::kNone, 5, 1, img));
  EXPECT_EQ(img.pixels, before.pixels);
}

TEST(ShiftsTest, BadSeverityIsInvalidArgument) {
  Image img(8, 8);
  EXPECT_THAT(ApplyShift(ImageShift::kFog, 6, 1, img),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ApplyShift(ImageShift::kFog, -1, 1, img),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ShiftsTest, NamesRoundTrip) {
  for (ImageShift s : AllImageShifts()) {
    ASSERT_OK_AND_ASSIGN(ImageShift back, ImageShiftFromName(ImageShiftName(s)));
    EXPECT_EQ(back, s);
  }
  EXPECT_THAT(ImageShiftFromName("hail"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(JpegTest, FlatBlocksSurviveAndQuality100IsNearLossless) {
  Image flat(16, 16, 0);
  for (int y = 0; y < 16; ++y) {
    for (int x = 0; x < 16; ++x) {
      flat.at(x, y)[0] = 200;
      flat.at(x, y)[1] = 50;
      flat.at(x, y)[2] = 90;
    }
  }
  Image j = flat;
  JpegRoundTrip(6, j);
  // A flat block has only a DC coefficient; even coarse quantization keeps it close.
  EXPECT_LT(MeanAbsDiff(flat, j), 12);
  Image scene = CleanScenes(1)[0], hi = scene, lo = scene;
  JpegRoundTrip(100, hi);
  JpegRoundTrip(10, lo);
  EXPECT_LT(MeanAbsDiff(scene, hi), 3);  // only 4:2:0 chroma and rounding remain
  EXPECT_GT(MeanAbsDiff(scene, lo), MeanAbsDiff(scene, hi));
}

TEST(JpegTest, QualityPerSeverityDecreases) {
  for (int s = 2; s <= kMaxSeverity; ++s) {
    EXPECT_LT(JpegQualityForSeverity(s), JpegQualityForSeverity(s - 1));
  }
}

}  // namespace
}  // namespace cdcca::datasets
