// The weight pack (weight_pack.h) on the tiny random checkpoints under
// tests/fixtures/hf/models/, each copied to a temporary folder:
// - a load at int8 / int4 through the pack gives the model that quantizing at load gives, bit
//   for bit (the first logits and the greedy tokens), and the pack holds every quantized
//   tensor, so the second load reads no checkpoint float it would quantize;
// - writing the pack leaves the folder's fingerprint as it was;
// - a pack of other weights, of another format or a damaged one is not used, and the load
//   still gives the same model.
#include "model/hub/weight_pack.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "model/arch/multimodal_model.h"
#include "model/hub/adapter_state.h"
#include "model/hub/safetensors.h"
#include "tests/testing/hf_fixture_case.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::model {
namespace {

using Use = ModelOptions::WeightPackUse;
using ::cdcca::testing::FirstCase;

struct Loaded {
  GreedyResult result;
  ModelOptions::WeightPackReport report;
};

Loaded LoadAndAnswer(const std::string& dir, const std::string& precision, Use use) {
  ModelOptions options;
  options.precision = precision;
  options.weight_pack = use;
  Loaded out;
  options.weight_pack_report = &out.report;
  absl::StatusOr<std::unique_ptr<MultimodalModel>> model = LoadModel(dir, options);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return out;
  GreedyOptions g;
  g.max_new_tokens = 6;
  absl::StatusOr<GreedyResult> r = (*model)->Generate(FirstCase(dir), g);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) out.result = *std::move(r);
  return out;
}

void ExpectSameAnswer(const Loaded& a, const Loaded& b) {
  ASSERT_TRUE(a.result.first_logits.defined());
  ASSERT_TRUE(b.result.first_logits.defined());
  EXPECT_TRUE(torch::equal(a.result.first_logits, b.result.first_logits));
  EXPECT_EQ(a.result.tokens, b.result.tokens);
}

class WeightPackTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = tmp_.file("model");
    std::filesystem::copy(std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + GetParam(),
                          dir_, std::filesystem::copy_options::recursive);
  }
  testing::TempDir tmp_;
  std::string dir_;
};

TEST_P(WeightPackTest, ALoadThroughThePackIsTheLoadThatQuantizesBitForBit) {
  for (const std::string precision : {"int8", "int4"}) {
    SCOPED_TRACE(precision);
    ASSERT_OK_AND_ASSIGN(uint64_t before, FolderFingerprint(dir_));
    const Loaded plain = LoadAndAnswer(dir_, precision, Use::kIgnore);
    EXPECT_EQ(plain.report.read, "");
    EXPECT_EQ(plain.report.written, "");

    const Loaded writing = LoadAndAnswer(dir_, precision, Use::kWrite);
    const std::string path =
        WeightPack::PathFor(dir_, precision == "int8" ? Precision::kInt8 : Precision::kInt4, 128);
    EXPECT_EQ(writing.report.written, path);
    EXPECT_GT(writing.report.written_tensors, 0);
    EXPECT_TRUE(std::filesystem::exists(path));
    ExpectSameAnswer(plain, writing);
    ASSERT_OK_AND_ASSIGN(uint64_t after, FolderFingerprint(dir_));
    EXPECT_EQ(before, after) << "the pack changed the folder's fingerprint";

    const Loaded packed = LoadAndAnswer(dir_, precision, Use::kUse);
    EXPECT_EQ(packed.report.read, path);
    EXPECT_EQ(packed.report.written, "");
    ExpectSameAnswer(plain, packed);

    // kWrite with a usable pack there reads it and writes nothing.
    const Loaded again = LoadAndAnswer(dir_, precision, Use::kWrite);
    EXPECT_EQ(again.report.read, path);
    EXPECT_EQ(again.report.written, "");

    // Every tensor the writing load packed is read back from the pack, none quantized again.
    EXPECT_EQ(packed.report.read_tensors, writing.report.written_tensors);
    ASSERT_OK_AND_ASSIGN(SafetensorsContents contents, ReadSafetensors(path));
    EXPECT_EQ(static_cast<int64_t>(contents.tensors.size()), 2 * writing.report.written_tensors);
    EXPECT_EQ(contents.metadata.at("format"), "cdcca-weight-pack");
  }
}

TEST_P(WeightPackTest, APackOfOtherWeightsOrADamagedOneIsNotUsed) {
  ASSERT_TRUE(LoadAndAnswer(dir_, "int4", Use::kWrite).report.written != "");
  const std::string path = WeightPack::PathFor(dir_, Precision::kInt4, 128);
  const Loaded plain = LoadAndAnswer(dir_, "int4", Use::kIgnore);

  // Other weights: the pack's fingerprint names a folder that is not this one.
  ASSERT_OK_AND_ASSIGN(SafetensorsContents contents, ReadSafetensors(path));
  contents.metadata["folder_fingerprint"] = "0123456789abcdef";
  ASSERT_OK(WriteSafetensors(path, contents.tensors, contents.metadata));
  std::string why;
  EXPECT_EQ(WeightPack::Find(dir_, Precision::kInt4, 128, *FolderFingerprint(dir_), &why), nullptr);
  EXPECT_NE(why.find("folder_fingerprint"), std::string::npos) << why;
  Loaded stale = LoadAndAnswer(dir_, "int4", Use::kUse);
  EXPECT_EQ(stale.report.read, "");
  ExpectSameAnswer(plain, stale);
  // A writing load replaces it.
  EXPECT_EQ(LoadAndAnswer(dir_, "int4", Use::kWrite).report.written, path);
  EXPECT_EQ(LoadAndAnswer(dir_, "int4", Use::kUse).report.read, path);

  // Damaged: cut short.
  const auto size = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, size / 2);
  why.clear();
  EXPECT_EQ(WeightPack::Find(dir_, Precision::kInt4, 128, *FolderFingerprint(dir_), &why), nullptr);
  EXPECT_NE(why.find("truncated"), std::string::npos) << why;
  Loaded damaged = LoadAndAnswer(dir_, "int4", Use::kUse);
  EXPECT_EQ(damaged.report.read, "");
  ExpectSameAnswer(plain, damaged);

  // Another precision's pack is another file: an int8 load does not read the int4 one.
  EXPECT_EQ(LoadAndAnswer(dir_, "int8", Use::kUse).report.read, "");
}

INSTANTIATE_TEST_SUITE_P(Folders, WeightPackTest,
                         ::testing::Values("llava_clip_llama", "llava_siglip_qwen2", "blip2_llama",
                                           "instructblip_llama", "blip2_opt", "blip2_flan_t5",
                                           "instructblip_flan_t5"));

}  // namespace
}  // namespace cdcca::model
