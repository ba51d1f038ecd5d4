// config.json of a Hugging Face model folder as plain structs: the decoder LMs (`llama`,
// `qwen2`, `opt`; a top-level config or a LLaVA / BLIP-2 text_config), its rotary
// embedding settings, the CLIP / SigLIP vision tower, LLaVA's top level, and
// generation_config.json's eos ids. transformers 4.x and 5.x spellings; omitted fields take
// transformers' class defaults; a value the code does not support, of the wrong JSON type or
// out of range is InvalidArgument naming the file and the field. The modules that build
// from these structs (decoder_lm.h, rope.h, clip_vision.h, llava.h) include this header.
//
// Torch-free (Abseil and nlohmann_json only): fuzzed under model/fuzz/ with the
// committed fixtures as seeds. Plain values; all functions are thread-safe.
#ifndef CDCCA_MODEL_HUB_HF_CONFIG_H_
#define CDCCA_MODEL_HUB_HF_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

// The largest width, count or vocabulary a config may give (1 << 24 = 16,777,216): far above
// any published model (vocabularies ~256k, widths ~16k, ~100 layers), and small enough that
// the product of two such sizes (a weight matrix's element count) fits in int64_t. Larger
// values are InvalidArgument naming the field. Position counts may go to kMaxHfPositions.
inline constexpr int64_t kMaxHfConfigSize = int64_t{1} << 24;
inline constexpr int64_t kMaxHfPositions = int64_t{1} << 32;

// OK when `name` is an activation transformers' ACT2FN has and layers.h's Activation
// implements: silu (swish), gelu (erf), gelu_new / gelu_pytorch_tanh (tanh approximation),
// quick_gelu, relu. InvalidArgument naming `field` otherwise.
absl::Status CheckActivation(const std::string& name, const std::string& field);

// model_type of a whole config.json ("" when absent). InvalidArgument naming `file` when the
// config is not an object or model_type is not a string.
absl::StatusOr<std::string> ConfigModelType(const nlohmann::json& config, const std::string& file);

// The sub-config `key` of `config` (vision_config, text_config, ...): an absent or null one
// is an empty object (all defaults); any other non-object is InvalidArgument naming `file`
// and the field. `config` must be an object.
absl::StatusOr<nlohmann::json> ConfigSection(const nlohmann::json& config, const std::string& key,
                                             const std::string& file);

// Reads optional field `key` of `section` into *out when present and not null (else *out
// keeps its default). A value of the wrong JSON type (integers for int64_t, any number for
// double, true/false for bool) is InvalidArgument naming `file` and the field as
// `<where><key>` (where = "vision_config." or "").
absl::Status ReadConfigField(const nlohmann::json& section, const std::string& key,
                             const std::string& where, const std::string& file, bool* out);
absl::Status ReadConfigField(const nlohmann::json& section, const std::string& key,
                             const std::string& where, const std::string& file, int64_t* out);
absl::Status ReadConfigField(const nlohmann::json& section, const std::string& key,
                             const std::string& where, const std::string& file, double* out);
absl::Status ReadConfigField(const nlohmann::json& section, const std::string& key,
                             const std::string& where, const std::string& file, std::string* out);

struct RopeConfig {
  std::string type = "default";   // default | linear | dynamic | llama3 | yarn
  double theta = 10000.0;         // rope_theta
  double factor = 1.0;            // linear, dynamic, llama3, yarn
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  // llama3 and yarn: the pre-training context; dynamic: the length past which the base grows
  // (original_max_position_embeddings if given, else max_position_embeddings).
  int64_t original_max_position_embeddings = 0;
  // yarn: the rotation counts bounding the ramp between interpolated and extrapolated
  // dimensions, whether those bounds are rounded outwards to whole dimensions, and the
  // factor cos and sin are multiplied by (attention_factor, or derived from factor and
  // mscale / mscale_all_dim as transformers does). 1 for every other type.
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  double attention_factor = 1.0;
};

// Reads rope settings from a decoder config: transformers 5.x `rope_parameters`
// ({rope_type, rope_theta, factor, ...}) or 4.x `rope_theta` + `rope_scaling` ({type or
// rope_type, factor, ...} or null). InvalidArgument naming `file` and the field for an
// unsupported type (longrope, ...), a partial_rotary_factor other than 1, or a missing
// required field.
absl::StatusOr<RopeConfig> ParseRopeConfig(const nlohmann::json& text_config,
                                           const std::string& file);

struct DecoderConfig {
  std::string model_type;  // llama | qwen2 | opt
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // = num_attention_heads when the config omits it
  int64_t head_dim = 0;             // config head_dim, else hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  std::string hidden_act = "silu";  // the gate activation
  int64_t max_position_embeddings = 0;
  RopeConfig rope;
  bool qkv_bias = false;  // qwen2: true; llama: attention_bias
  bool o_bias = false;    // llama: attention_bias
  bool mlp_bias = false;  // llama: mlp_bias
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;  // may be empty
  int64_t bos_token_id = -1;           // -1 = none
  int64_t pad_token_id = -1;           // -1 = none

  // OPT only (model_type "opt"): LayerNorm with bias (eps layer_norm_eps) instead of RMSNorm,
  // learned positions instead of rotary ones, a non-gated MLP (fc1, fc2).
  double layer_norm_eps = 1e-5;
  // Pre-LayerNorm blocks (true: opt-125m and 1.3b up) or post-LayerNorm (opt-350m).
  bool do_layer_norm_before = true;
  // The final LayerNorm after the last block: with pre-LayerNorm blocks, unless the config's
  // _remove_final_layer_norm.
  bool final_layer_norm = false;
  // Width of the token embeddings and the LM head: hidden_size, or narrower with
  // project_in / project_out between them and the blocks (opt-350m).
  int64_t word_embed_proj_dim = 0;
  bool is_opt() const { return model_type == "opt"; }
  // OPT's learned positions start at this row of embed_positions (rows 0 and 1 are unused).
  static constexpr int64_t kOptPositionOffset = 2;
};

// Parses a decoder config (a top-level config.json or a LLaVA / BLIP-2 text_config), with
// 4.x and 5.x spellings; OPT's names (ffn_dim, activation_function, enable_bias, ...) fill the
// same fields. Errors are InvalidArgument naming `file_for_errors` and the field: unknown
// model_type, unsupported hidden_act or rope scaling, sliding-window attention, OPT's
// LayerNorm without affine parameters, bad sizes (non-positive, or above kMaxHfConfigSize).
absl::StatusOr<DecoderConfig> ParseDecoderConfig(const nlohmann::json& text_config,
                                                 const std::string& file_for_errors);

// T5's encoder-decoder (`t5`; the language model of BLIP-2's and InstructBLIP's Flan-T5
// checkpoints), transformers' T5Config names and class defaults.
struct T5Config {
  int64_t vocab_size = 32128;
  int64_t d_model = 512;
  int64_t d_kv = 64;  // per head
  int64_t d_ff = 2048;
  int64_t num_layers = 6;          // encoder blocks
  int64_t num_decoder_layers = 6;  // = num_layers when the config omits it
  int64_t num_heads = 8;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;
  // feed_forward_proj "gated-<act>" (wi_0, wi_1, wo) or "<act>" (wi, wo); "gated-gelu" is
  // gelu_new, as T5Config maps it.
  bool gated = false;
  std::string dense_act_fn = "relu";
  // The head: lm_head.weight when the checkpoint has one, else the shared embedding. The
  // decoder output is scaled by d_model^-0.5 before it when scale_decoder_outputs (configs
  // that predate the field: when tie_word_embeddings).
  bool tie_word_embeddings = true;
  bool scale_decoder_outputs = true;
  int64_t decoder_start_token_id = 0;  // = pad_token_id when the config omits it
  int64_t pad_token_id = 0;
  std::vector<int64_t> eos_token_ids{1};
};

// Parses a T5 config (a top-level config.json or a BLIP-2 text_config). InvalidArgument naming
// `file` and the field: another model_type, a feed_forward_proj other than [gated-]<act> with
// an activation CheckActivation accepts, is_decoder true, bad sizes.
absl::StatusOr<T5Config> ParseT5Config(const nlohmann::json& c, const std::string& file);

// The eos ids a checkpoint stops at: generation_config.json's eos_token_id (int or list)
// when the folder has one, else `fallback` (the config's).
std::vector<int64_t> ReadEosTokenIds(const std::string& dir, const std::vector<int64_t>& fallback);

// Helpers for config fields (errors name file and field).
absl::StatusOr<int64_t> ConfigInt(const nlohmann::json& c, const std::string& key,
                                  const std::string& file);
// An int or a list of ints (non-integer entries skipped); empty when absent.
std::vector<int64_t> ConfigIdList(const nlohmann::json& c, const std::string& key);

struct ClipVisionConfig {
  std::string model_type;  // clip_vision_model | siglip_vision_model
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t num_channels = 3;
  int64_t image_size = 224;
  int64_t patch_size = 32;
  std::string hidden_act = "quick_gelu";
  double layer_norm_eps = 1e-5;
  bool is_siglip() const { return model_type == "siglip_vision_model"; }
  int64_t num_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
  // Tokens per image: patches, plus the class token for CLIP.
  int64_t num_positions() const { return num_patches() + (is_siglip() ? 0 : 1); }
};

// Parses a LLaVA vision_config (or a standalone tower's config.json), filling omitted fields
// with transformers' class defaults. InvalidArgument naming `file` and the field otherwise.
absl::StatusOr<ClipVisionConfig> ParseClipVisionConfig(const nlohmann::json& c,
                                                       const std::string& file);

struct LlavaConfig {
  ClipVisionConfig vision;
  DecoderConfig text;
  std::vector<int64_t> vision_feature_layers{-2};          // indices into the tower's hidden states
  std::string vision_feature_select_strategy = "default";  // default | full
  std::string projector_hidden_act = "gelu";
  bool multimodal_projector_bias = true;
  int64_t image_token_id = 32000;
  // Image tokens per image: the tower's positions (patches + class token for CLIP), minus the
  // class token under `default`. Equals what LlavaProcessor inserts for a consistent
  // processor config (num_additional_image_tokens = 1 for CLIP, 0 for SigLIP).
  int64_t NumImageTokens() const;
};

// Parses a LLaVA config.json (4.x image_token_index or 5.x image_token_id; text_config /
// vision_config nested). InvalidArgument naming `file` and the field.
absl::StatusOr<LlavaConfig> ParseLlavaConfig(const nlohmann::json& c, const std::string& file);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_HF_CONFIG_H_
