#include "datasets/fashion_mnist.h"

#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::datasets {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

void WriteGz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  gzclose(f);
}

void Put32(std::vector<uint8_t>& v, uint32_t x) {
  for (int s = 24; s >= 0; s -= 8) v.push_back(static_cast<uint8_t>(x >> s));
}

class IdxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("cdcca_idx_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const char* name) { return (dir_ / name).string(); }
  // Three 2x3 images with labels 4, 0, 4.
  void WriteValid() {
    std::vector<uint8_t> img;
    Put32(img, 0x803);
    Put32(img, 3);
    Put32(img, 2);
    Put32(img, 3);
    for (int i = 0; i < 18; ++i) img.push_back(static_cast<uint8_t>(i * 10));
    std::vector<uint8_t> lab;
    Put32(lab, 0x801);
    Put32(lab, 3);
    lab.insert(lab.end(), {4, 0, 4});
    WriteGz(Path("img.gz"), img);
    WriteGz(Path("lab.gz"), lab);
  }
  std::filesystem::path dir_;
};

TEST_F(IdxTest, ReadsImagesLabelsAndClassIndex) {
  WriteValid();
  ASSERT_OK_AND_ASSIGN(ImageSet set, ReadIdxPair(Path("img.gz"), Path("lab.gz"), Split::kTest));
  EXPECT_EQ(set.size(), 3u);
  EXPECT_EQ(set.rows, 2);
  EXPECT_EQ(set.cols, 3);
  EXPECT_EQ(set.split, Split::kTest);
  EXPECT_EQ(set.image(1)[0], 60);  // image 1 starts at byte 6
  EXPECT_THAT(set.by_class[4], ::testing::ElementsAre(0, 2));
  EXPECT_THAT(set.by_class[0], ::testing::ElementsAre(1));
}

TEST_F(IdxTest, MissingFileNamesThePackage) {
  absl::StatusOr<ImageSet> set = LoadFashionMnist(Split::kTrain, dir_.string());
  EXPECT_THAT(set, StatusIs(absl::StatusCode::kNotFound, HasSubstr("dataset-fashion-mnist")));
}

TEST_F(IdxTest, BadMagicTruncationAndCountMismatchAreDataLoss) {
  WriteValid();
  std::vector<uint8_t> bad;
  Put32(bad, 0x801);
  Put32(bad, 3);
  WriteGz(Path("bad.gz"), bad);
  EXPECT_THAT(ReadIdxPair(Path("bad.gz"), Path("lab.gz"), Split::kTrain),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("bad magic")));

  std::vector<uint8_t> trunc;
  Put32(trunc, 0x803);
  Put32(trunc, 3);
  Put32(trunc, 2);
  Put32(trunc, 3);
  trunc.resize(trunc.size() + 10);
  WriteGz(Path("trunc.gz"), trunc);
  EXPECT_THAT(ReadIdxPair(Path("trunc.gz"), Path("lab.gz"), Split::kTrain),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));

  std::vector<uint8_t> lab2;
  Put32(lab2, 0x801);
  Put32(lab2, 2);
  lab2.insert(lab2.end(), {1, 2});
  WriteGz(Path("lab2.gz"), lab2);
  EXPECT_THAT(ReadIdxPair(Path("img.gz"), Path("lab2.gz"), Split::kTrain),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("2 labels")));

  std::vector<uint8_t> lab3;
  Put32(lab3, 0x801);
  Put32(lab3, 3);
  lab3.insert(lab3.end(), {1, 12, 2});
  WriteGz(Path("lab3.gz"), lab3);
  EXPECT_THAT(ReadIdxPair(Path("img.gz"), Path("lab3.gz"), Split::kTrain),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("out of range")));
}

TEST(FashionMnistTest, ClassNamesRoundTrip) {
  EXPECT_EQ(ClassName(0), "t-shirt");
  EXPECT_EQ(ClassName(9), "ankle boot");
  for (int i = 0; i < kNumClasses; ++i) EXPECT_EQ(ClassFromName(ClassName(i)), i);
  EXPECT_EQ(ClassFromName("hat"), -1);
}

TEST(FashionMnistTest, LoadsTheInstalledTestSplit) {
  if (!std::filesystem::exists(std::string(kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist not installed";
  }
  ASSERT_OK_AND_ASSIGN(ImageSet set, LoadFashionMnist(Split::kTest));
  EXPECT_EQ(set.size(), 10000u);
  EXPECT_EQ(set.rows, 28);
  for (int c = 0; c < kNumClasses; ++c) EXPECT_EQ(set.by_class[c].size(), 1000u);
}

}  // namespace
}  // namespace cdcca::datasets
