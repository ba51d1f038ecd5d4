// The torch-free safetensors parser: layout checks and the inputs its fuzzer
// (model/fuzz/) must reject without undefined behaviour.
#include "model/hub/safetensors_view.h"

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

// A file from a header text and `data_bytes` bytes of data (0, 1, 2, ...).
std::string File(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<char>(i));
  return out;
}

TEST(SafetensorsViewTest, ReadsNamesDtypesShapesAndRangesInFileOrder) {
  const std::string bytes =
      File(R"({"__metadata__":{"k":"v"},"b":{"dtype":"F16","shape":[3],"data_offsets":[8,14]},)"
           R"("a":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]}})",
           14);
  ASSERT_OK_AND_ASSIGN(SafetensorsView v, ParseSafetensors(bytes));
  ASSERT_EQ(v.tensors.size(), 2u);
  EXPECT_EQ(v.tensors[0].name, "a");
  EXPECT_EQ(v.tensors[0].dtype, SafetensorsDtype::kF32);
  EXPECT_EQ(v.tensors[0].shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(v.tensors[0].bytes.size(), 8u);
  EXPECT_EQ(v.tensors[1].name, "b");
  EXPECT_EQ(v.tensors[1].begin, 8u);
  EXPECT_EQ(v.tensors[1].bytes[0], 8);
  EXPECT_EQ(v.metadata.at("k"), "v");
}

TEST(SafetensorsViewTest, EmptyTensorsMayShareAnOffset) {
  const std::string bytes = File(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                                 R"("z":{"dtype":"F32","shape":[0,7],"data_offsets":[0,0]}})",
                                 4);
  ASSERT_OK_AND_ASSIGN(SafetensorsView v, ParseSafetensors(bytes));
  EXPECT_EQ(v.tensors.size(), 2u);
}

// Regression (fuzzing): a shape whose element count overflows 64 bits wrapped to 0 and
// matched an empty byte range; torch::empty then threw on the real shape.
TEST(SafetensorsViewTest, ShapeWhoseSizeOverflowsIsDataLoss) {
  EXPECT_THAT(
      ParseSafetensors(
          File(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0)),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("tensor w")));
}

// Regression: float, negative or out-of-range numbers were converted with undefined
// behaviour (nlohmann's get<int64_t> of a double).
TEST(SafetensorsViewTest, NonIntegerNumbersAreDataLoss) {
  for (const char* h : {
           R"({"w":{"dtype":"U8","shape":[1e300],"data_offsets":[0,1]}})",
           R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})",
           R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1e30]}})",
           R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,1]}})",
           R"({"w":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,1]}})",
       }) {
    EXPECT_THAT(ParseSafetensors(File(h, 1)), StatusIs(absl::StatusCode::kDataLoss)) << h;
  }
}

TEST(SafetensorsViewTest, MalformedLayoutsAreDataLoss) {
  for (const char* h : {
           R"([1,2])",
           R"({"w":3})",
           R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})",
           R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})",
           R"({"w":{"dtype":"U8","shape":1,"data_offsets":[0,1]}})",
           R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})",
           R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,1]}})",
           R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
           R"({"__metadata__":[1],"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
           R"({"__metadata__":{"k":1},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
           R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]})",
       }) {
    EXPECT_THAT(ParseSafetensors(File(h, 1)), StatusIs(absl::StatusCode::kDataLoss)) << h;
  }
  // Overlap, trailing bytes, truncation.
  EXPECT_THAT(ParseSafetensors(File(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                    R"("b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
                                    3)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("overlaps")));
  EXPECT_THAT(ParseSafetensors(File(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 2)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("trailing")));
  EXPECT_THAT(ParseSafetensors(std::string("\xff\0\0\0\0\0\0\0{}", 10)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("past the end")));
  EXPECT_THAT(ParseSafetensors("abc"), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(SafetensorsViewTest, HeaderOverTheLimitIsRejectedBeforeParsing) {
  std::string bytes = File("{}", 0);
  const uint64_t n = kMaxSafetensorsHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  bytes.resize(8 + n, ' ');
  EXPECT_THAT(ParseSafetensors(bytes),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("exceeds the limit")));
}

}  // namespace
}  // namespace cdcca::model
