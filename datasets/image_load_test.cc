// LoadImageRgb: OpenCV decoding into RGB as PIL's Image.open(path).convert("RGB") gives it.
#include <fstream>
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#include <string>

#include "datasets/formats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::datasets {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(LoadImageRgbTest, ColorIsReorderedToRgb) {
  ::cdcca::testing::TempDir dir;
  cv::Mat bgr(1, 2, CV_8UC3);
  bgr.at<cv::Vec3b>(0, 0) = {10, 20, 30};  // B, G, R
  bgr.at<cv::Vec3b>(0, 1) = {200, 100, 0};
  ASSERT_TRUE(cv::imwrite(dir.file("c.png"), bgr));
  ASSERT_OK_AND_ASSIGN(Image im, LoadImageRgb(dir.file("c.png")));
  EXPECT_EQ(im.width, 2);
  EXPECT_EQ(im.height, 1);
  EXPECT_THAT(im.pixels, ElementsAre(30, 20, 10, 0, 100, 200));
}

TEST(LoadImageRgbTest, GrayIsReplicated) {
  ::cdcca::testing::TempDir dir;
  cv::Mat gray(2, 1, CV_8UC1);
  gray.at<uint8_t>(0, 0) = 7;
  gray.at<uint8_t>(1, 0) = 250;
  ASSERT_TRUE(cv::imwrite(dir.file("g.png"), gray));
  ASSERT_OK_AND_ASSIGN(Image im, LoadImageRgb(dir.file("g.png")));
  EXPECT_THAT(im.pixels, ElementsAre(7, 7, 7, 250, 250, 250));
}

TEST(LoadImageRgbTest, AlphaIsDroppedNotBlended) {
  ::cdcca::testing::TempDir dir;
  cv::Mat bgra(1, 2, CV_8UC4);
  bgra.at<cv::Vec4b>(0, 0) = {1, 2, 3, 0};  // fully transparent: colour kept as stored
  bgra.at<cv::Vec4b>(0, 1) = {40, 50, 60, 128};
  ASSERT_TRUE(cv::imwrite(dir.file("a.png"), bgra));
  ASSERT_OK_AND_ASSIGN(Image im, LoadImageRgb(dir.file("a.png")));
  EXPECT_THAT(im.pixels, ElementsAre(3, 2, 1, 60, 50, 40));
}

TEST(LoadImageRgbTest, ErrorsNameTheFile) {
  ::cdcca::testing::TempDir dir;
  EXPECT_THAT(LoadImageRgb(dir.file("missing.png")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.png")));
  std::ofstream(dir.file("junk.jpg")) << "not an image at all";
  EXPECT_THAT(LoadImageRgb(dir.file("junk.jpg")),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("junk.jpg")));
  cv::Mat deep(2, 2, CV_16UC3, cv::Scalar(1000, 2000, 3000));
  ASSERT_TRUE(cv::imwrite(dir.file("deep.png"), deep));
  EXPECT_THAT(LoadImageRgb(dir.file("deep.png")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("deep.png"), HasSubstr("16-bit"))));
}

}  // namespace
}  // namespace cdcca::datasets
