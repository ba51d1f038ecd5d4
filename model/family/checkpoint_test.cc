// Safetensors format, strict loading and family checkpoints on the tiny config.
#include "model/family/checkpoint.h"

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hub/safetensors.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string TempDir(const std::string& name) {
  std::string dir = ::testing::TempDir() + "/cdcca_ckpt_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

FamilyConfig Tiny() {
  absl::StatusOr<FamilyConfig> c =
      LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(SafetensorsTest, RoundTripsEveryDtypeExactly) {
  torch::manual_seed(2);
  NamedTensors in = {
      {"f32", torch::randn({3, 4})},
      {"f16", torch::randn({5}).to(torch::kHalf)},
      {"bf16", torch::randn({2, 2}).to(torch::kBFloat16)},
      {"f64", torch::randn({1, 1, 3}, torch::kDouble)},
      {"i64", torch::randint(-1000, 1000, {4}, torch::kLong)},
      {"i32", torch::randint(-1000, 1000, {4}, torch::kInt)},
      {"i8", torch::randint(-128, 127, {7}, torch::kChar)},
      {"u8", torch::randint(0, 255, {2, 3}, torch::kByte)},
      {"b", torch::rand({6}) > 0.5},
      {"scalar", torch::tensor(3.5f)},
      {"empty", torch::zeros({0, 4})},
      {"strided", torch::randn({4, 6}).t()},
  };
  ASSERT_OK_AND_ASSIGN(std::string bytes, EncodeSafetensors(in, {{"k", "v"}}));
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);  // data 8-byte aligned
  EXPECT_EQ(bytes[8], '{');
  ASSERT_OK_AND_ASSIGN(SafetensorsContents out, DecodeSafetensors(bytes));
  EXPECT_EQ(out.metadata.at("k"), "v");
  ASSERT_EQ(out.tensors.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out.tensors[i].first, in[i].first);  // file order = write order
    EXPECT_EQ(out.tensors[i].second.scalar_type(), in[i].second.scalar_type());
    EXPECT_TRUE(torch::equal(out.tensors[i].second, in[i].second)) << in[i].first;
  }
}

TEST(SafetensorsTest, ReadsAHandWrittenFile) {
  // {"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} followed by 1.0f, -2.0f.
  const std::string head = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(head.size());
  bytes += head;
  const float v[2] = {1.0f, -2.0f};
  bytes.append(reinterpret_cast<const char*>(v), 8);
  ASSERT_OK_AND_ASSIGN(SafetensorsContents out, DecodeSafetensors(bytes));
  ASSERT_EQ(out.tensors.size(), 1u);
  EXPECT_TRUE(torch::equal(out.tensors[0].second, torch::tensor({1.0f, -2.0f})));
}

TEST(SafetensorsTest, CorruptionIsDataLoss) {
  ASSERT_OK_AND_ASSIGN(std::string bytes, EncodeSafetensors({{"w", torch::ones({4})}}, {}));
  EXPECT_THAT(DecodeSafetensors(bytes.substr(0, bytes.size() - 1)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("w")));
  EXPECT_THAT(DecodeSafetensors(bytes.substr(0, 5)), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecodeSafetensors(bytes + "xx"), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(EncodeSafetensors({{"w", torch::ones({1})}, {"w", torch::ones({1})}}, {}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Regression (safetensors fuzzer): 2^32 x 2^32 elements wrapped to 0 bytes, matched the
// empty range, and torch::empty threw on the real shape instead of a DataLoss status.
TEST(SafetensorsTest, ShapeWhoseSizeOverflowsIsDataLoss) {
  const std::string head =
      R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})";
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(head.size());
  bytes += head;
  EXPECT_THAT(DecodeSafetensors(bytes), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("w")));
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(11);
    family_ = Tiny();
  }
  FamilyConfig family_;
};

TEST_F(CheckpointTest, TowerRoundTripsExactlyAtEveryPrecision) {
  const std::string dir = TempDir("tower");
  Blip2Tower fp32(family_.student);
  {
    torch::NoGradGuard g;  // non-trivial trainable values, as after adaptation
    for (auto& [n, t] : TrainableParameters(*fp32)) t.normal_();
  }
  for (Precision p : {Precision::kFp32, Precision::kInt8, Precision::kInt4}) {
    ASSERT_OK_AND_ASSIGN(Blip2Tower m, ConvertPrecision(fp32, p));
    const std::string path = dir + "/m.safetensors";
    ASSERT_OK(SaveTower(path, m, "student"));
    ASSERT_OK_AND_ASSIGN(Blip2Tower back, LoadTower(path));
    EXPECT_EQ(back->config().precision, p);
    NamedTensors a = DequantizedState(m);
    NamedTensors b = DequantizedState(back);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first);
      EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
    }
    EXPECT_EQ(BaseFingerprint(back), BaseFingerprint(m));
    // Loading at another precision converts.
    ASSERT_OK_AND_ASSIGN(Blip2Tower as_int8, LoadTower(path, Precision::kInt8));
    EXPECT_EQ(as_int8->config().precision, Precision::kInt8);
  }
}

TEST_F(CheckpointTest, MissingMisshapedOrExtraTensorIsNamed) {
  Blip2Tower m(family_.student);
  NamedTensors state = ModuleState(*m);
  Blip2Tower target(family_.student);

  NamedTensors missing(state.begin() + 1, state.end());
  EXPECT_THAT(LoadModuleState(*target, missing),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("missing tensor " + state.front().first)));

  NamedTensors misshaped = state;
  misshaped[3].second = torch::zeros({misshaped[3].second.numel() + 1});
  EXPECT_THAT(LoadModuleState(*target, misshaped),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(state[3].first)));

  NamedTensors extra = state;
  extra.emplace_back("lm.layers.9.q.weight", torch::zeros({2}));
  EXPECT_THAT(LoadModuleState(*target, extra),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lm.layers.9.q.weight")));

  // Through a file too: drop one tensor and re-save.
  const std::string dir = TempDir("strict");
  ASSERT_OK(WriteSafetensors(dir + "/m.safetensors", missing,
                             {{"tower_config", TowerConfigToJson(family_.student)}}));
  EXPECT_THAT(LoadTower(dir + "/m.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(state.front().first)));
  // A failed load leaves the target untouched.
  Blip2Tower fresh(family_.student);
  NamedTensors before = ModuleState(*fresh);
  NamedTensors half = state;
  half.back().second = torch::zeros({1, 1, 1});
  EXPECT_FALSE(LoadModuleState(*fresh, half).ok());
  NamedTensors after = ModuleState(*fresh);
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i].second, after[i].second)) << before[i].first;
  }
}

TEST_F(CheckpointTest, FamilyRoundTripAndFingerprintCheck) {
  const std::string dir = TempDir("family");
  VisionEncoder enc(family_.vision);
  Blip2Tower teacher(family_.teacher);
  Blip2Tower student(family_.student);
  const std::vector<std::string> words = {"<pad>", "<bos>", "<eos>", "<unk>", "a", "shirt"};
  ASSERT_OK(SaveFamily(dir, family_, enc, teacher, student, R"({"steps": 3})", words));
  // The folder is the student's Hugging Face BLIP-2 folder; the teacher's is teacher/.
  for (const char* file :
       {"/config.json", "/model.safetensors", "/tokenizer.json", "/preprocessor_config.json",
        "/teacher/config.json", "/teacher/model.safetensors"}) {
    EXPECT_TRUE(std::filesystem::exists(dir + file)) << file;
  }
  ASSERT_OK_AND_ASSIGN(FamilyConfig config, LoadFamilyConfig(dir + "/config.json"));
  EXPECT_EQ(config.name, "tiny");
  EXPECT_EQ(config.student.num_queries, family_.student.num_queries);

  ASSERT_OK_AND_ASSIGN(FamilyCheckpoint ck, LoadFamily(dir, Precision::kInt4));
  EXPECT_EQ(ck.config.name, "tiny");
  EXPECT_EQ(ck.student->config().precision, Precision::kInt4);
  EXPECT_FALSE(ck.encoder->is_training());
  NamedTensors a = ModuleState(*enc);
  NamedTensors b = ModuleState(*ck.encoder);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
  }
  EXPECT_EQ(BaseFingerprint(ck.teacher), BaseFingerprint(teacher));
  // Fresh LoRA and adapter prompts are the same on every load (a device and its cloud mirror
  // start equal), and loading leaves the caller's random stream alone.
  torch::manual_seed(5);
  const torch::Tensor expected_draw = torch::rand({4});
  torch::manual_seed(5);
  ASSERT_OK_AND_ASSIGN(FamilyCheckpoint again, LoadFamily(dir, Precision::kFp32));
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected_draw));
  const NamedTensors t1 = TrainableParameters(*ck.student),
                     t2 = TrainableParameters(*again.student);
  ASSERT_EQ(t1.size(), t2.size());
  for (size_t i = 0; i < t1.size(); ++i) {
    EXPECT_TRUE(torch::equal(t1[i].second, t2[i].second)) << t1[i].first;
  }
  // A frozen weight changed behind config.json's back is detected.
  Blip2Tower other(family_.teacher);
  ASSERT_OK(
      SaveBlip2FamilyFolder(dir + "/teacher", *enc->vision_model, *other, family_.vision, words));
  EXPECT_THAT(LoadFamily(dir, Precision::kFp32),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("teacher")));
  // The right teacher next to another vision tower: not a pair (issue 21).
  torch::manual_seed(99);
  VisionEncoder other_encoder(family_.vision);
  ASSERT_OK(SaveBlip2FamilyFolder(dir + "/teacher", *other_encoder->vision_model, *teacher,
                                  family_.vision, words));
  EXPECT_THAT(LoadFamily(dir, Precision::kFp32),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("the teacher's vision tower"),
                             HasSubstr(FingerprintHex(ModuleFingerprint(*enc->vision_model))))));
}

}  // namespace
}  // namespace cdcca::model
