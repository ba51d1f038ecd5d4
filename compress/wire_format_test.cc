#include "compress/wire_format.h"

#include <random>
#include <string>
#include <vector>

#include "compress/group_codec.h"
#include "compress/hash64.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::compress {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

TensorRecord Dense(const std::string& name, std::vector<int64_t> shape, int bits) {
  TensorRecord r;
  r.name = name;
  r.shape = std::move(shape);
  r.bits = bits;
  const uint64_t n = r.numel();
  std::vector<float> x(n);
  for (uint64_t i = 0; i < n; ++i) x[i] = 0.01f * static_cast<float>(i % 7) - 0.03f;
  if (bits > 0) {
    r.group_size = 16;
    r.coded_count = n;
    QuantizeBlock(x.data(), n, bits, 16, &r.block);
  }
  return r;
}

TEST(Hash64Test, DeterministicAndSensitiveToEveryByte) {
  std::string data(300, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 31);
  const uint64_t h = Hash64(data.data(), data.size());
  EXPECT_EQ(h, Hash64(data.data(), data.size()));
  EXPECT_NE(h, Hash64(data.data(), data.size(), 1));
  for (size_t len : {0, 1, 7, 8, 31, 32, 33, 299}) {
    EXPECT_NE(Hash64(data.data(), len), Hash64(data.data(), len + 1)) << len;
  }
  for (size_t i = 0; i < data.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = data;
      flipped[i] = static_cast<char>(flipped[i] ^ (1 << bit));
      ASSERT_NE(Hash64(flipped.data(), flipped.size()), h) << i << ":" << bit;
    }
  }
}

TEST(WireFormatTest, RoundTripsDenseSparseAndSkippedRecords) {
  std::vector<TensorRecord> records = {Dense("norm", {40}, 8), Dense("lora.A", {3, 5}, 3),
                                       Dense("skipped", {2, 2}, 0)};
  TensorRecord sparse;
  sparse.name = "sparse";
  sparse.shape = {100};
  sparse.bits = 4;
  sparse.group_size = 64;
  sparse.sparse = true;
  sparse.coded_count = 3;
  const float values[3] = {1.0f, -1.0f, 0.5f};
  QuantizeBlock(values, 3, 4, 64, &sparse.block);
  AppendVarint(5, &sparse.indices);   // index 5
  AppendVarint(0, &sparse.indices);   // index 6
  AppendVarint(92, &sparse.indices);  // index 99
  records.push_back(sparse);

  for (int level : {0, 3}) {
    ASSERT_OK_AND_ASSIGN(std::string bytes, SerializePayload(7, 8, records, level));
    ASSERT_OK_AND_ASSIGN(ParsedPayload parsed, ParsePayload(bytes));
    EXPECT_EQ(parsed.info.base_version, 7u);
    EXPECT_EQ(parsed.info.new_version, 8u);
    ASSERT_EQ(parsed.tensors.size(), records.size());
    for (size_t i = 0; i < records.size(); ++i) {
      EXPECT_EQ(parsed.tensors[i].name, records[i].name);
      EXPECT_EQ(parsed.tensors[i].shape, records[i].shape);
      EXPECT_EQ(parsed.tensors[i].bits, records[i].bits);
      EXPECT_EQ(parsed.tensors[i].block, records[i].block);
    }
    std::vector<float> out(100, 9.0f);
    ASSERT_OK(DecodeRecord(parsed.tensors[3], absl::MakeSpan(out)));
    for (size_t i = 0; i < out.size(); ++i) {
      if (i == 5 || i == 6 || i == 99) {
        EXPECT_NE(out[i], 0.0f);
      } else {
        EXPECT_EQ(out[i], 0.0f) << i;
      }
    }
    EXPECT_GT(out[5], 0.0f);
    EXPECT_LT(out[6], 0.0f);
  }
}

TEST(WireFormatTest, RejectsSparseIndicesOutOfRangeOrTrailing) {
  TensorRecord r;
  r.name = "s";
  r.shape = {10};
  r.bits = 1;
  r.group_size = 8;
  r.sparse = true;
  r.coded_count = 2;
  const float v[2] = {1.0f, 2.0f};
  QuantizeBlock(v, 2, 1, 8, &r.block);
  std::vector<float> out(10);
  AppendVarint(8, &r.indices);
  AppendVarint(1, &r.indices);  // 8, then 10: out of range
  EXPECT_THAT(DecodeRecord(r, absl::MakeSpan(out)), StatusIs(absl::StatusCode::kDataLoss));
  r.indices.clear();
  AppendVarint(1, &r.indices);
  EXPECT_THAT(DecodeRecord(r, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("malformed")));
  r.indices.clear();
  AppendVarint(1, &r.indices);
  AppendVarint(1, &r.indices);
  AppendVarint(1, &r.indices);
  EXPECT_THAT(DecodeRecord(r, absl::MakeSpan(out)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("left")));
}

TEST(WireFormatTest, SerializeRejectsInconsistentRecords) {
  TensorRecord bad = Dense("x", {4}, 2);
  bad.block.pop_back();
  EXPECT_THAT(SerializePayload(0, 1, {bad}, 3), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(SerializePayload(0, 1, {Dense("x", {4}, 2), Dense("x", {4}, 2)}, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate")));
  TensorRecord five = Dense("y", {4}, 4);
  five.bits = 5;
  EXPECT_THAT(SerializePayload(0, 1, {five}, 3), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(WireFormatTest, ParseRejectsTruncationAndOversizeBodies) {
  ASSERT_OK_AND_ASSIGN(std::string bytes,
                       SerializePayload(1, 2, {Dense("a", {300}, 4), Dense("b", {9}, 1)}, 3));
  for (size_t cut :
       {size_t{0}, size_t{4}, size_t{47}, size_t{55}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_THAT(ParsePayload(bytes.substr(0, cut)), StatusIs(absl::StatusCode::kDataLoss)) << cut;
  }
  ParseLimits tiny;
  tiny.max_body_bytes = 16;
  EXPECT_THAT(ParsePayload(bytes, tiny), StatusIs(absl::StatusCode::kResourceExhausted));
}

}  // namespace
}  // namespace cdcca::compress
