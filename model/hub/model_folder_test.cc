#include "model/hub/model_folder.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "model/arch/layers.h"
#include "model/hub/safetensors.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::model {
namespace {

using ::testing::HasSubstr;

void WriteText(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(ModelFolderTest, LoadsSingleFileAndConvertsDtypes) {
  testing::TempDir dir;
  WriteText(dir.file("config.json"), R"({"model_type": "llama"})");
  torch::Tensor w = torch::arange(6, torch::kFloat).view({2, 3}) / 4;
  ASSERT_OK(WriteSafetensors(dir.file("model.safetensors"),
                             {{"model.a", w.to(torch::kBFloat16)}, {"model.b", w.to(torch::kHalf)}},
                             {}));
  ASSERT_OK_AND_ASSIGN(ModelFolder f, ModelFolder::Open(dir.path()));
  EXPECT_EQ(f.config()["model_type"], "llama");
  EXPECT_TRUE(f.Has("model.a"));
  EXPECT_FALSE(f.Has("model.c"));
  ASSERT_OK_AND_ASSIGN(torch::Tensor a, f.Load("model.a", torch::kFloat));
  EXPECT_EQ(a.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(a, w));  // quarters are exact in bf16
  ASSERT_OK_AND_ASSIGN(torch::Tensor b, f.Load("model.b", torch::kBFloat16));
  EXPECT_EQ(b.scalar_type(), torch::kBFloat16);
  EXPECT_THAT(f.Load("model.c", torch::kFloat).status(),
              testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.c")));
}

TEST(ModelFolderTest, ReadsShardsThroughTheIndexAndTranslatesOldLlavaNames) {
  testing::TempDir dir;
  WriteText(dir.file("config.json"), R"({"model_type": "llava"})");
  ASSERT_OK(WriteSafetensors(dir.file("model-00001-of-00002.safetensors"),
                             {{"language_model.model.norm.weight", torch::ones({4})},
                              {"vision_tower.vision_model.post_layernorm.bias", torch::ones({2})}},
                             {}));
  ASSERT_OK(WriteSafetensors(dir.file("model-00002-of-00002.safetensors"),
                             {{"language_model.lm_head.weight", torch::full({5, 4}, 2.0f)},
                              {"multi_modal_projector.linear_1.bias", torch::zeros({4})}},
                             {}));
  WriteText(dir.file("model.safetensors.index.json"), R"({"metadata": {}, "weight_map": {
      "language_model.model.norm.weight": "model-00001-of-00002.safetensors",
      "vision_tower.vision_model.post_layernorm.bias": "model-00001-of-00002.safetensors",
      "language_model.lm_head.weight": "model-00002-of-00002.safetensors",
      "multi_modal_projector.linear_1.bias": "model-00002-of-00002.safetensors"}})");
  ASSERT_OK_AND_ASSIGN(ModelFolder f, ModelFolder::Open(dir.path()));
  EXPECT_EQ(f.layout(), ModelFolder::NameLayout::kTransformers4);
  EXPECT_THAT(f.Names(),
              ::testing::ElementsAre("lm_head.weight", "model.language_model.norm.weight",
                                     "model.multi_modal_projector.linear_1.bias",
                                     "model.vision_tower.vision_model.post_layernorm.bias"));
  ASSERT_OK_AND_ASSIGN(torch::Tensor head, f.Load("lm_head.weight", torch::kFloat));
  EXPECT_EQ(head.sizes().vec(), (std::vector<int64_t>{5, 4}));
  EXPECT_FLOAT_EQ(head[4][3].item<float>(), 2.0f);
  EXPECT_THAT(f.FileOf("model.language_model.norm.weight"), HasSubstr("00001-of-00002"));
}

TEST(ModelFolderTest, ReadsTheNamesTransformers5Saves) {
  testing::TempDir dir;
  WriteText(dir.file("config.json"), R"({"model_type": "llava"})");
  ASSERT_OK(WriteSafetensors(dir.file("model.safetensors"),
                             {{"vision_tower.embeddings.class_embedding", torch::ones({4})},
                              {"language_model.model.norm.weight", torch::ones({4})}},
                             {}));
  ASSERT_OK_AND_ASSIGN(ModelFolder f, ModelFolder::Open(dir.path()));
  EXPECT_EQ(f.layout(), ModelFolder::NameLayout::kTransformers5);
  EXPECT_THAT(f.Names(),
              ::testing::ElementsAre("model.language_model.norm.weight",
                                     "model.vision_tower.vision_model.embeddings.class_embedding"));
}

TEST(ModelFolderTest, TruncatedFileIsDataLossNamingFileAndTensor) {
  testing::TempDir dir;
  WriteText(dir.file("config.json"), R"({"model_type": "llama"})");
  ASSERT_OK(WriteSafetensors(dir.file("model.safetensors"),
                             {{"x", torch::ones({8})}, {"y", torch::ones({16})}}, {}));
  std::filesystem::resize_file(dir.file("model.safetensors"),
                               std::filesystem::file_size(dir.file("model.safetensors")) - 10);
  absl::Status s = ModelFolder::Open(dir.path()).status();
  EXPECT_THAT(s, testing::StatusIs(absl::StatusCode::kDataLoss, HasSubstr("model.safetensors")));
  EXPECT_THAT(s.message(), HasSubstr("tensor y"));
}

TEST(ModelFolderTest, MissingConfigOrWeightsIsNotFound) {
  testing::TempDir dir;
  EXPECT_THAT(ModelFolder::Open(dir.path()).status(),
              testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("config.json")));
  WriteText(dir.file("config.json"), R"({"model_type": "llama"})");
  EXPECT_THAT(ModelFolder::Open(dir.path()).status(),
              testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.safetensors")));
}

// Found while moving the JSON readers torch-free (folder_json.h, folder_config.h): a non-string
// model_type threw nlohmann::type_error out of Open(), and a shard named ".." was opened.
TEST(ModelFolderTest, HostileConfigOrIndexIsInvalidArgumentNamingTheFile) {
  testing::TempDir dir;
  ASSERT_OK(WriteSafetensors(dir.file("model.safetensors"), {{"x", torch::ones({2})}}, {}));
  for (const char* config : {R"({"model_type": 3})", R"({"model_type": ["llava"]})"}) {
    WriteText(dir.file("config.json"), config);
    EXPECT_THAT(
        ModelFolder::Open(dir.path()).status(),
        testing::StatusIs(absl::StatusCode::kInvalidArgument,
                          ::testing::AllOf(HasSubstr("config.json"), HasSubstr("model_type"))));
  }
  WriteText(dir.file("config.json"), R"({"model_type": null})");
  EXPECT_OK(ModelFolder::Open(dir.path()).status());
  WriteText(dir.file("config.json"), std::string(100, '[') + std::string(100, ']'));
  EXPECT_THAT(ModelFolder::Open(dir.path()).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("deeper than")));
  WriteText(dir.file("config.json"), R"({"model_type": "llama"})");
  WriteText(dir.file("model.safetensors.index.json"), R"({"weight_map": {"x": ".."}})");
  EXPECT_THAT(ModelFolder::Open(dir.path()).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                ::testing::AllOf(HasSubstr("model.safetensors.index.json"),
                                                 HasSubstr("weight_map[x]"))));
}

TEST(ModelFolderTest, LoadIntoChecksShapesAndReportsUnused) {
  testing::TempDir dir;
  WriteText(dir.file("config.json"), R"({"model_type": "llama"})");
  ASSERT_OK(WriteSafetensors(dir.file("model.safetensors"),
                             {{"p.weight", torch::ones({3, 2})},
                              {"p.bias", torch::ones({4})},
                              {"p.extra", torch::ones({1})}},
                             {}));
  ASSERT_OK_AND_ASSIGN(ModelFolder f, ModelFolder::Open(dir.path()));
  Linear good(LinearOptions{2, 3, false, {}});
  std::vector<std::string> unused;
  LoadIntoOptions o;
  o.unused = &unused;
  ASSERT_OK(f.LoadInto(*good, "p.", o));
  EXPECT_TRUE(torch::equal(good->weight, torch::ones({3, 2})));
  EXPECT_THAT(unused, ::testing::ElementsAre("p.bias", "p.extra"));

  Linear misshaped(LinearOptions{2, 3, true, {}});  // bias [3], file has [4]
  absl::Status s = f.LoadInto(*misshaped, "p.");
  EXPECT_THAT(s, testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("p.bias")));
  EXPECT_THAT(s.message(), HasSubstr("[4]"));
  EXPECT_THAT(s.message(), HasSubstr("[3]"));
  EXPECT_THAT(s.message(), HasSubstr("model.safetensors"));

  Linear missing(LinearOptions{2, 3, false, {}});
  EXPECT_THAT(f.LoadInto(*missing, "q."),
              testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("q.weight")));
}

TEST(ModelFolderTest, QuantizedLinearKeepsNoFloatCopy) {
  testing::TempDir dir;
  WriteText(dir.file("config.json"), R"({"model_type": "llama"})");
  torch::manual_seed(1);
  torch::Tensor w = torch::randn({64, 128});
  ASSERT_OK(WriteSafetensors(dir.file("model.safetensors"), {{"l.weight", w}}, {}));
  ASSERT_OK_AND_ASSIGN(ModelFolder f, ModelFolder::Open(dir.path()));
  Linear fp32(LinearOptions{128, 64, false, {}});
  WeightPrecision int8;
  int8.weights = Precision::kInt8;
  Linear q8(LinearOptions{128, 64, false, int8});
  WeightPrecision int4;
  int4.weights = Precision::kInt4;
  int4.int4_group = 32;
  Linear q4(LinearOptions{128, 64, false, int4});
  ASSERT_OK(f.LoadInto(*fp32, "l."));
  ASSERT_OK(f.LoadInto(*q8, "l."));
  ASSERT_OK(f.LoadInto(*q4, "l."));
  const int64_t b32 = ResidentBytes(*fp32), b8 = ResidentBytes(*q8), b4 = ResidentBytes(*q4);
  EXPECT_EQ(b32, 64 * 128 * 4);
  EXPECT_LT(b8, b32 * 0.27);  // values + per-row scales
  EXPECT_LT(b4, b32 * 0.16);  // nibbles + per-group scales
  torch::Tensor x = torch::randn({5, 128});
  torch::NoGradGuard no_grad;
  torch::Tensor y = fp32(x);
  const float scale = y.abs().max().item<float>();
  EXPECT_LT((q8(x) - y).abs().max().item<float>(), 0.02 * scale);
  EXPECT_LT((q4(x) - y).abs().max().item<float>(), 0.2 * scale);
}

}  // namespace
}  // namespace cdcca::model
