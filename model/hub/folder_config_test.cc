// The torch-free config.json / index / generation_config readers: what a user's hostile or
// broken model folder gets (an error naming the file and field, never an exception or
// undefined behaviour). Each case below was an uncaught nlohmann exception, a signed
// overflow or an unchecked float-to-int cast before the readers moved here.
#include "model/hub/folder_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "model/hub/blip2_config.h"
#include "model/hub/folder_json.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::model {
namespace {

using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

MATCHER_P2(IsInvalidNaming, file, field, "") {
  return arg.code() == absl::StatusCode::kInvalidArgument &&
         absl::StrContains(arg.message(), file) && absl::StrContains(arg.message(), field);
}

json Llama() {
  return json{{"model_type", "llama"},    {"hidden_size", 64}, {"num_attention_heads", 4},
              {"intermediate_size", 128}, {"vocab_size", 100}, {"num_hidden_layers", 2}};
}

TEST(FolderConfigTest, FieldsOfTheWrongJsonTypeAreErrorsNamingTheField) {
  // Each threw nlohmann::type_error out of the loader (json::value with a wrong-typed value).
  for (const char* field : {"model_type", "rms_norm_eps", "hidden_act", "attention_bias",
                            "mlp_bias", "tie_word_embeddings", "partial_rotary_factor"}) {
    json c = Llama();
    c[field] = json::array({1});
    EXPECT_THAT(ParseDecoderConfig(c, "m/config.json").status(),
                IsInvalidNaming("m/config.json", field))
        << field;
  }
  json qwen = Llama();
  qwen["model_type"] = "qwen2";
  qwen["use_sliding_window"] = "no";
  EXPECT_THAT(ParseDecoderConfig(qwen, "c").status(), IsInvalidNaming("c", "use_sliding_window"));
  EXPECT_THAT(ParseClipVisionConfig(json{{"model_type", 7}}, "c").status(),
              IsInvalidNaming("c", "vision_config.model_type"));
  EXPECT_THAT(ConfigModelType(json{{"model_type", 1.5}}, "d/config.json").status(),
              IsInvalidNaming("d/config.json", "model_type"));
  EXPECT_THAT(ParseLlavaConfig(json{{"projector_hidden_act", false}}, "c").status(),
              IsInvalidNaming("c", "projector_hidden_act"));
}

// The text_configs of the BLIP-2 OPT and Flan-T5 fixtures (transformers 5 wrote them).
json FixtureTextConfig(const std::string& variant) {
  absl::StatusOr<json> c = ReadJsonFile(std::string(CDCCA_SOURCE_DIR) +
                                        "/tests/fixtures/hf/models/" + variant + "/config.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? (*c)["text_config"] : json::object();
}

TEST(FolderConfigTest, OptAndT5ConfigsReadAsTransformersWroteThem) {
  absl::StatusOr<DecoderConfig> opt = ParseDecoderConfig(FixtureTextConfig("blip2_opt_proj"), "c");
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_TRUE(opt->is_opt());
  EXPECT_EQ(opt->intermediate_size, 112);  // ffn_dim
  EXPECT_EQ(opt->word_embed_proj_dim, 48);
  EXPECT_FALSE(opt->do_layer_norm_before);
  EXPECT_FALSE(opt->final_layer_norm);  // post-LayerNorm blocks have none
  EXPECT_TRUE(opt->qkv_bias && opt->o_bias && opt->mlp_bias);
  EXPECT_EQ(opt->hidden_act, "relu");
  EXPECT_TRUE(opt->tie_word_embeddings);
  absl::StatusOr<T5Config> t5 = ParseT5Config(FixtureTextConfig("blip2_flan_t5"), "c");
  ASSERT_TRUE(t5.ok()) << t5.status();
  EXPECT_TRUE(t5->gated);
  EXPECT_EQ(t5->dense_act_fn, "gelu_new");
  EXPECT_EQ(t5->d_kv, 16);
  EXPECT_EQ(t5->num_decoder_layers, 2);
  EXPECT_FALSE(t5->scale_decoder_outputs);
  EXPECT_EQ(t5->decoder_start_token_id, 0);
  EXPECT_EQ(t5->eos_token_ids, std::vector<int64_t>{1});
  // A config from before scale_decoder_outputs: a tied head scales, as transformers 4 did.
  json old = FixtureTextConfig("blip2_flan_t5");
  old.erase("scale_decoder_outputs");
  absl::StatusOr<T5Config> t5_old = ParseT5Config(old, "c");
  ASSERT_TRUE(t5_old.ok()) << t5_old.status();
  EXPECT_TRUE(t5_old->scale_decoder_outputs);
}

TEST(FolderConfigTest, OptAndT5FieldsTheCodeDoesNotSupportAreErrorsNamingThem) {
  json opt = FixtureTextConfig("blip2_opt");
  opt["layer_norm_elementwise_affine"] = false;
  EXPECT_THAT(ParseDecoderConfig(opt, "m/config.json").status(),
              IsInvalidNaming("m/config.json", "layer_norm_elementwise_affine"));
  json opt_act = FixtureTextConfig("blip2_opt");
  opt_act["activation_function"] = "swiglu";
  EXPECT_THAT(ParseDecoderConfig(opt_act, "c").status(),
              IsInvalidNaming("c", "activation_function"));
  json t5 = FixtureTextConfig("blip2_flan_t5");
  t5["feed_forward_proj"] = "gated-mish";
  EXPECT_THAT(ParseT5Config(t5, "m/config.json").status(),
              IsInvalidNaming("m/config.json", "feed_forward_proj"));
  json decoder_only = FixtureTextConfig("blip2_flan_t5");
  decoder_only["is_decoder"] = true;
  EXPECT_THAT(ParseT5Config(decoder_only, "c").status(), IsInvalidNaming("c", "is_decoder"));
  json start = FixtureTextConfig("blip2_flan_t5");
  start["decoder_start_token_id"] = 100000;
  EXPECT_THAT(ParseT5Config(start, "c").status(), IsInvalidNaming("c", "decoder_start_token_id"));
  json width = FixtureTextConfig("blip2_flan_t5");
  width["d_kv"] = 0;
  EXPECT_THAT(ParseT5Config(width, "c").status(), IsInvalidNaming("c", "d_kv"));
}

TEST(FolderConfigTest, NullMeansTheDefaultAsTransformersReadsNone) {
  json c = Llama();
  c["attention_bias"] = nullptr;
  c["rms_norm_eps"] = nullptr;
  c["use_sliding_window"] = nullptr;
  c["rope_scaling"] = nullptr;
  ASSERT_OK_AND_ASSIGN(DecoderConfig d, ParseDecoderConfig(c, "c"));
  EXPECT_FALSE(d.qkv_bias);
  EXPECT_EQ(d.rms_norm_eps, 1e-6);
  EXPECT_EQ(d.rope.type, "default");
  ASSERT_OK_AND_ASSIGN(std::string type, ConfigModelType(json{{"model_type", nullptr}}, "c"));
  EXPECT_EQ(type, "");
}

TEST(FolderConfigTest, LlavaSubConfigsMustBeObjects) {
  // An array or string vision_config / text_config threw (operator[] on a non-object).
  for (const char* key : {"vision_config", "text_config"}) {
    EXPECT_THAT(ParseLlavaConfig(json{{key, json::array()}}, "l/config.json").status(),
                IsInvalidNaming("l/config.json", key));
    EXPECT_THAT(ParseLlavaConfig(json{{key, "x"}}, "c").status(), IsInvalidNaming("c", key));
  }
  EXPECT_THAT(ParseLlavaConfig(json::array(), "c").status(), IsInvalidNaming("c", "object"));
  // null: all defaults (a CLIP ViT-B/32 and LlamaConfig's sizes).
  ASSERT_OK_AND_ASSIGN(
      LlavaConfig l,
      ParseLlavaConfig(json{{"vision_config", nullptr}, {"text_config", nullptr}}, "c"));
  EXPECT_EQ(l.vision.image_size, 224);
  EXPECT_EQ(l.text.hidden_size, 4096);
  EXPECT_EQ(l.NumImageTokens(), 49);
}

TEST(FolderConfigTest, HugeSizesAreRejectedBeforeAnyProductOverflows) {
  json c = Llama();
  c["hidden_size"] = int64_t{1} << 40;
  EXPECT_THAT(ParseDecoderConfig(c, "c").status(), IsInvalidNaming("c", "hidden_size"));
  c = Llama();
  c["head_dim"] = int64_t{1} << 40;
  EXPECT_THAT(ParseDecoderConfig(c, "c").status(), IsInvalidNaming("c", "head_dim"));
  c = Llama();
  c["max_position_embeddings"] = -5;
  EXPECT_THAT(ParseDecoderConfig(c, "c").status(), IsInvalidNaming("c", "max_position_embeddings"));
  // (image_size / patch_size)^2 overflowed int64_t in num_patches().
  json v = {
      {"model_type", "clip_vision_model"}, {"image_size", int64_t{1} << 40}, {"patch_size", 1}};
  EXPECT_THAT(ParseClipVisionConfig(v, "c").status(), IsInvalidNaming("c", "image_size"));
  json blip = {{"model_type", "blip-2"},
               {"vision_config", {{"image_size", int64_t{1} << 40}, {"patch_size", 1}}}};
  EXPECT_THAT(ParseBlip2Config(blip, "b").status(),
              IsInvalidNaming("b", "vision_config.image_size"));
  // The largest accepted size still parses.
  c = Llama();
  c["vocab_size"] = kMaxHfConfigSize;
  EXPECT_OK(ParseDecoderConfig(c, "c").status());
}

TEST(FolderConfigTest, RopePositionCountsAreCheckedBeforeTheCast) {
  // 1e300 cast to int64_t was undefined behaviour; a string threw.
  json llama3 = {{"rope_scaling",
                  {{"rope_type", "llama3"},
                   {"factor", 8.0},
                   {"low_freq_factor", 1.0},
                   {"high_freq_factor", 4.0},
                   {"original_max_position_embeddings", 1e300}}}};
  EXPECT_THAT(ParseRopeConfig(llama3, "c").status(),
              IsInvalidNaming("c", "rope_scaling.original_max_position_embeddings"));
  json yarn = {
      {"rope_parameters",
       {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 0.5}}}};
  EXPECT_THAT(ParseRopeConfig(yarn, "c").status(),
              IsInvalidNaming("c", "original_max_position_embeddings"));
  json dynamic = {
      {"rope_scaling",
       {{"type", "dynamic"}, {"factor", 2.0}, {"original_max_position_embeddings", "4096"}}}};
  EXPECT_THAT(ParseRopeConfig(dynamic, "c").status(),
              IsInvalidNaming("c", "original_max_position_embeddings"));
  json partial = {{"rope_parameters", {{"rope_type", "default"}, {"partial_rotary_factor", "1"}}}};
  EXPECT_THAT(ParseRopeConfig(partial, "c").status(),
              IsInvalidNaming("c", "partial_rotary_factor"));
  dynamic["rope_scaling"]["original_max_position_embeddings"] = 4096;
  ASSERT_OK_AND_ASSIGN(RopeConfig r, ParseRopeConfig(dynamic, "c"));
  EXPECT_EQ(r.original_max_position_embeddings, 4096);
}

TEST(FolderJsonTest, NestingAndSizeAreBounded) {
  auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_OK(ParseHfJson(nested(kMaxHfJsonDepth), "f.json").status());
  EXPECT_THAT(ParseHfJson(nested(kMaxHfJsonDepth + 1), "f.json").status(),
              IsInvalidNaming("f.json", "deeper than 64"));
  // A million levels: rejected without recursion (and without a deep value to destroy).
  EXPECT_THAT(ParseHfJson(std::string(1 << 20, '['), "f.json").status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseHfJson("{\"a\": ", "dir/config.json").status(),
              IsInvalidNaming("dir/config.json", "bad JSON"));
  // A big file is refused from its size, before it is read.
  testing::TempDir dir;
  const std::string big = dir.file("config.json");
  std::ofstream(big) << "{}";
  std::filesystem::resize_file(big, kMaxHfJsonBytes + 1);
  EXPECT_THAT(ReadJsonFile(big).status(), IsInvalidNaming(big, "more than"));
  EXPECT_THAT(ReadJsonFile(dir.file("missing.json")).status(),
              testing::StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.json")));
}

TEST(FolderJsonTest, IndexNamesOnlyFilesOfTheFolder) {
  const std::string f = "m/model.safetensors.index.json";
  ASSERT_OK_AND_ASSIGN(
      auto map, ParseSafetensorsIndex(json{{"metadata", {{"total_size", 8}}},
                                           {"weight_map", {{"a.weight", "model-1.safetensors"}}}},
                                      f));
  EXPECT_EQ(map.at("a.weight"), "model-1.safetensors");
  for (const std::string& shard :
       {std::string(""), std::string("."), std::string(".."), std::string("../x.safetensors"),
        std::string("sub/x.safetensors"), std::string("x\0y", 3)}) {
    EXPECT_THAT(ParseSafetensorsIndex(json{{"weight_map", {{"a", shard}}}}, f).status(),
                IsInvalidNaming(f, "weight_map[a]"))
        << shard;
  }
  EXPECT_THAT(ParseSafetensorsIndex(json{{"weight_map", {{"a", 3}}}}, f).status(),
              IsInvalidNaming(f, "weight_map[a]"));
  EXPECT_THAT(ParseSafetensorsIndex(json{{"weight_map", json::array()}}, f).status(),
              IsInvalidNaming(f, "weight_map"));
  EXPECT_THAT(ParseSafetensorsIndex(json::array(), f).status(), IsInvalidNaming(f, "object"));
}

TEST(FolderConfigTest, EosIdsComeFromGenerationConfigElseTheFallback) {
  testing::TempDir dir;
  EXPECT_THAT(ReadEosTokenIds(dir.path(), {2}), ::testing::ElementsAre(2));
  std::ofstream(dir.file("generation_config.json")) << R"({"eos_token_id": [5, "x", 6]})";
  EXPECT_THAT(ReadEosTokenIds(dir.path(), {2}), ::testing::ElementsAre(5, 6));
  std::ofstream(dir.file("generation_config.json")) << std::string(100, '[');
  EXPECT_THAT(ReadEosTokenIds(dir.path(), {2}), ::testing::ElementsAre(2));
}

}  // namespace
}  // namespace cdcca::model
