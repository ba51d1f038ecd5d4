#include "datasets/image.h"

#include "gtest/gtest.h"

namespace cdcca::datasets {
namespace {

TEST(ImageTest, NearestUpscaleReplicates) {
  const uint8_t src[4] = {10, 20, 30, 40};  // 2x2
  std::vector<uint8_t> dst = ResizeGray(src, 2, 2, 4, 4, Interpolation::kNearest);
  const std::vector<uint8_t> want = {10, 10, 20, 20, 10, 10, 20, 20,
                                     30, 30, 40, 40, 30, 30, 40, 40};
  EXPECT_EQ(dst, want);
}

TEST(ImageTest, BilinearUsesPixelCentres) {
  const uint8_t src[2] = {0, 200};  // 2x1
  // Destination centres map to -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1).
  std::vector<uint8_t> dst = ResizeGray(src, 2, 1, 4, 1, Interpolation::kBilinear);
  EXPECT_EQ(dst, (std::vector<uint8_t>{0, 50, 150, 200}));
}

TEST(ImageTest, RgbResizeKeepsConstantColour) {
  Image img(5, 3);
  for (int y = 0; y < 3; ++y) {
    for (int x = 0; x < 5; ++x) {
      img.at(x, y)[0] = 7;
      img.at(x, y)[1] = 100;
      img.at(x, y)[2] = 250;
    }
  }
  Image out = Resize(img, 11, 8, Interpolation::kBilinear);
  ASSERT_EQ(out.pixels.size(), 11u * 8 * 3);
  EXPECT_EQ(out.at(10, 7)[0], 7);
  EXPECT_EQ(out.at(3, 4)[1], 100);
  EXPECT_EQ(out.at(0, 0)[2], 250);
}

TEST(ImageTest, MeanAbsDiff) {
  Image a(2, 1, 10), b(2, 1, 10);
  b.at(1, 0)[2] = 70;  // one value differs by 60 out of 6
  EXPECT_DOUBLE_EQ(MeanAbsDiff(a, b), 10.0);
  EXPECT_EQ(MeanAbsDiff(a, Image(1, 1)), -1);
}

}  // namespace
}  // namespace cdcca::datasets
