// Sizes and precision of the MLLM family (vision encoder, teacher, student), read from the
// JSON files under configs/models/ (tiny for tests, small by default, large for the GPU).
//
// Thread-safety: plain values, copy freely.
#ifndef CDCCA_MODEL_FAMILY_CONFIG_H_
#define CDCCA_MODEL_FAMILY_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::model {

// How the frozen linear weights above the vision encoder are stored. The trainable set
// (norms, biases, query tokens, LoRA, adapter prompts) is always fp32.
enum class Precision {
  kFp32,
  kInt8,  // symmetric, one scale per output channel
  kInt4,  // symmetric, one scale per group of `int4_group` input columns, two values a byte
};

absl::string_view PrecisionName(Precision p);  // "fp32", "int8", "int4"
absl::StatusOr<Precision> ParsePrecision(absl::string_view name);

// The shared vision encoder: a BLIP-2 ViT (blip2_vision.h) over image_size x image_size RGB
// in patches of patch_size pixels; its output tokens are the class token, then the patches
// in row-major order.
struct VisionConfig {
  int image_size = 64;   // square RGB input, pixels
  int patch_size = 8;    // square patches, image_size divisible by it
  int d_vis = 128;       // width of a visual token
  int layers = 2;        // transformer layers
  int heads = 4;         // attention heads (divide d_vis)
  int mlp_hidden = 256;  // MLP width
  // Derived: grid side = image_size / patch_size; tokens = 1 (class) + grid * grid.
  int GridSide() const;
  int NumPatches() const;
  int NumTokens() const;
};

// One MLLM above the shared vision encoder: Q-Former ("query adapter", qa_*) + decoder LM.
struct TowerConfig {
  // Query adapter (Q-Former-like).
  int num_queries = 16;  // L learnable queries = length of the LM's visual prefix
  int qa_dim = 128;
  int qa_heads = 4;
  int qa_layers = 2;
  int qa_mlp_hidden = 256;
  // Decoder LM (LLaMA-style).
  int d_model = 128;
  int lm_layers = 2;
  int lm_heads = 4;
  int ffn_hidden = 344;     // SwiGLU hidden width
  int max_positions = 128;  // RoPE table length (visual prefix + text)
  float rope_theta = 10000.0f;
  // Adaptation.
  int lora_rank = 8;  // 0 = no LoRA
  float lora_alpha = 16.0f;
  int adapter_prompt_len = 0;  // 0 = no gated adapter prompts
  int adapter_layers = 0;      // adapter prompts sit in the top `adapter_layers` LM layers
  float dropout = 0.1f;        // used while training (query adapter and LM residuals)
  // Storage of the frozen base.
  Precision precision = Precision::kFp32;
  int int4_group = 128;
  // Copied from the family so a tower is self-describing.
  VisionConfig vision;
  int vocab_size = 0;
  int d_vis = 0;
  int num_visual_tokens = 0;
};

struct FamilyConfig {
  std::string name;  // "tiny", "small", ...
  // How the towers read the image (family_model.h, llava_family.h): "blip-2" (a Q-Former's
  // query tokens; default) or "llava" (the ViT's patch tokens through an MLP projector; the
  // towers' num_queries and qa_* fields are unused).
  std::string architecture = "blip-2";
  std::string vocabulary;  // reference to the tokenizer vocabulary this family was built for
  int vocab_size = 0;
  VisionConfig vision;
  TowerConfig teacher;
  TowerConfig student;
  std::string pretrain_json;  // the raw "pretrain" section (owned by the pretraining code), or ""
};

// Parses a family config (see configs/models/small.json for the schema). Unknown keys are
// errors, so a typo never silently falls back to a default. Returns InvalidArgument with the
// offending key (also for a value of the wrong type or out of its type's range), or NotFound
// if the file is missing. Untrusted text is fine: the parser is fuzzed
// (model/fuzz/config_fuzzer.cc); memory is about 20 x the text's size.
absl::StatusOr<FamilyConfig> ParseFamilyConfig(absl::string_view json_text);
absl::StatusOr<FamilyConfig> LoadFamilyConfig(const std::string& path);

// JSON of one tower (all fields), used in checkpoint metadata; ParseTowerConfig inverts it.
std::string TowerConfigToJson(const TowerConfig& c);
absl::StatusOr<TowerConfig> ParseTowerConfig(absl::string_view json_text);
std::string VisionConfigToJson(const VisionConfig& c);
absl::StatusOr<VisionConfig> ParseVisionConfig(absl::string_view json_text);

// Checks divisibility and ranges (heads divide widths, positions cover the prefix, ...).
absl::Status ValidateTower(const TowerConfig& c);

// Bounds of a vision config, so that its derived sizes cannot overflow: image_size in
// 1-kMaxImageSize, patch_size in 1-image_size dividing it, at most kMaxVisionTokens tokens,
// heads dividing d_vis, layers in 1-kMaxVisionLayers, widths positive. ParseFamilyConfig and
// ParseVisionConfig apply it.
inline constexpr int kMaxImageSize = 8192;
inline constexpr int kMaxVisionTokens = 1 << 16;
inline constexpr int kMaxVisionLayers = 64;
absl::Status ValidateVision(const VisionConfig& v);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_CONFIG_H_
