// config.json sections of the Hugging Face `blip-2` and `instructblip` architectures: the
// ViT (`vision_config`), the Q-Former (`qformer_config`) and the top-level fields that join
// them to the decoder LM (`num_query_tokens`, `image_token_index` / `image_token_id`).
// Field names and defaults are transformers' (Blip2VisionConfig, Blip2QFormerConfig,
// InstructBlip*Config); a value the code does not support is an error naming the field.
//
// Torch-free. Plain values: copy freely, thread-safe.
#ifndef CDCCA_MODEL_HUB_BLIP2_CONFIG_H_
#define CDCCA_MODEL_HUB_BLIP2_CONFIG_H_

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace cdcca::model {

struct Blip2VisionConfig {
  int64_t hidden_size = 1408;
  int64_t intermediate_size = 6144;
  int64_t num_hidden_layers = 39;
  int64_t num_attention_heads = 16;
  int64_t num_channels = 3;
  int64_t image_size = 224;  // square input, pixels
  int64_t patch_size = 14;
  double layer_norm_eps = 1e-6;
  std::string hidden_act = "gelu";  // transformers' ACT2FN name (layers.h Activation)
  bool qkv_bias = true;             // q and v biases (k never has one)
  // Derived: (image_size / patch_size)^2 patches + the class token.
  int64_t NumPositions() const;
};

struct QFormerConfig {
  int64_t hidden_size = 768;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t intermediate_size = 3072;
  std::string hidden_act = "gelu";
  double layer_norm_eps = 1e-12;
  int64_t cross_attention_frequency = 2;  // layer i cross-attends iff i % frequency == 0
  int64_t encoder_hidden_size = 1408;     // width of the image embeddings (the ViT's)
  int64_t vocab_size = 30522;             // instruction embeddings (InstructBLIP)
  int64_t max_position_embeddings = 512;
  // Whether each layer also has the text feed-forward (intermediate / output). Always true
  // for InstructBLIP; for BLIP-2 the config's `use_qformer_text_input` (default false).
  bool use_qformer_text_input = false;
};

struct Blip2Config {
  bool instruct = false;  // model_type "instructblip" (the Q-Former also reads the prompt)
  Blip2VisionConfig vision;
  QFormerConfig qformer;
  int64_t num_query_tokens = 32;
  // LM token whose positions receive the projected queries (the processor puts
  // num_query_tokens of them before the prompt). nullopt: a checkpoint from before
  // transformers expanded image tokens; the queries are prepended to the prompt instead.
  std::optional<int64_t> image_token_id;
};

// Parses the blip-2 / instructblip parts of a whole config.json (the text_config is the
// decoder's and is parsed by ParseDecoderConfig). Errors name `file_for_errors` and the field.
absl::StatusOr<Blip2Config> ParseBlip2Config(const nlohmann::json& config,
                                             const std::string& file_for_errors);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_BLIP2_CONFIG_H_
