#include "model/hub/blip2_config.h"

#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "model/hub/folder_config.h"

namespace cdcca::model {
namespace {

// A size: positive and at most kMaxHfConfigSize (so products of two sizes fit in int64_t).
absl::Status ReadPositive(const nlohmann::json& section, const std::string& key,
                          const std::string& where, const std::string& file, int64_t* out) {
  if (absl::Status s = ReadConfigField(section, key, where, file, out); !s.ok()) return s;
  if (*out <= 0 || *out > kMaxHfConfigSize) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field ", where, key, " must be in 1..",
                                                   kMaxHfConfigSize, ", got ", *out));
  }
  return absl::OkStatus();
}

// An activation name transformers' ACT2FN has and layers.h implements.
absl::Status ReadAct(const nlohmann::json& section, const std::string& key,
                     const std::string& where, const std::string& file, std::string* out) {
  std::string name = *out;
  if (absl::Status s = ReadConfigField(section, key, where, file, &name); !s.ok()) return s;
  if (absl::Status s = CheckActivation(name, absl::StrCat(where, key)); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", s.message()));
  }
  *out = name;
  return absl::OkStatus();
}

#define CDCCA_RETURN_IF_ERROR_(expr)          \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (0)

absl::Status ParseVision(const nlohmann::json& v, const std::string& file, Blip2VisionConfig* out) {
  const std::string w = "vision_config.";
  CDCCA_RETURN_IF_ERROR_(ReadPositive(v, "hidden_size", w, file, &out->hidden_size));
  CDCCA_RETURN_IF_ERROR_(ReadPositive(v, "intermediate_size", w, file, &out->intermediate_size));
  CDCCA_RETURN_IF_ERROR_(ReadPositive(v, "num_hidden_layers", w, file, &out->num_hidden_layers));
  CDCCA_RETURN_IF_ERROR_(
      ReadPositive(v, "num_attention_heads", w, file, &out->num_attention_heads));
  CDCCA_RETURN_IF_ERROR_(ReadPositive(v, "num_channels", w, file, &out->num_channels));
  CDCCA_RETURN_IF_ERROR_(ReadPositive(v, "image_size", w, file, &out->image_size));
  CDCCA_RETURN_IF_ERROR_(ReadPositive(v, "patch_size", w, file, &out->patch_size));
  CDCCA_RETURN_IF_ERROR_(ReadConfigField(v, "layer_norm_eps", w, file, &out->layer_norm_eps));
  CDCCA_RETURN_IF_ERROR_(ReadAct(v, "hidden_act", w, file, &out->hidden_act));
  CDCCA_RETURN_IF_ERROR_(ReadConfigField(v, "qkv_bias", w, file, &out->qkv_bias));
  if (out->hidden_size % out->num_attention_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": field ", w, "hidden_size (", out->hidden_size,
        ") is not a multiple of num_attention_heads (", out->num_attention_heads, ")"));
  }
  if (out->image_size % out->patch_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", w, "image_size (", out->image_size,
                     ") is not a multiple of patch_size (", out->patch_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status ParseQFormer(const nlohmann::json& q, const std::string& file, bool instruct,
                          QFormerConfig* out) {
  const std::string w = "qformer_config.";
  CDCCA_RETURN_IF_ERROR_(ReadPositive(q, "hidden_size", w, file, &out->hidden_size));
  CDCCA_RETURN_IF_ERROR_(ReadPositive(q, "num_hidden_layers", w, file, &out->num_hidden_layers));
  CDCCA_RETURN_IF_ERROR_(
      ReadPositive(q, "num_attention_heads", w, file, &out->num_attention_heads));
  CDCCA_RETURN_IF_ERROR_(ReadPositive(q, "intermediate_size", w, file, &out->intermediate_size));
  CDCCA_RETURN_IF_ERROR_(ReadAct(q, "hidden_act", w, file, &out->hidden_act));
  CDCCA_RETURN_IF_ERROR_(ReadConfigField(q, "layer_norm_eps", w, file, &out->layer_norm_eps));
  CDCCA_RETURN_IF_ERROR_(
      ReadPositive(q, "cross_attention_frequency", w, file, &out->cross_attention_frequency));
  CDCCA_RETURN_IF_ERROR_(ReadPositive(q, "vocab_size", w, file, &out->vocab_size));
  CDCCA_RETURN_IF_ERROR_(
      ReadPositive(q, "max_position_embeddings", w, file, &out->max_position_embeddings));
  CDCCA_RETURN_IF_ERROR_(
      ReadConfigField(q, "use_qformer_text_input", w, file, &out->use_qformer_text_input));
  if (instruct) out->use_qformer_text_input = true;
  if (out->hidden_size % out->num_attention_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": field ", w, "hidden_size (", out->hidden_size,
        ") is not a multiple of num_attention_heads (", out->num_attention_heads, ")"));
  }
  auto pe = q.find("position_embedding_type");
  if (pe != q.end() && !pe->is_null() && *pe != "absolute") {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field ", w, "position_embedding_type ",
                                                   pe->dump(),
                                                   " is not supported (only \"absolute\")"));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t Blip2VisionConfig::NumPositions() const {
  const int64_t side = image_size / patch_size;
  return side * side + 1;
}

absl::StatusOr<Blip2Config> ParseBlip2Config(const nlohmann::json& config,
                                             const std::string& file_for_errors) {
  const std::string& file = file_for_errors;
  if (!config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": not a JSON object"));
  }
  Blip2Config out;
  auto type = config.find("model_type");
  if (type == config.end() || !type->is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field model_type is missing"));
  }
  if (*type == "instructblip") {
    out.instruct = true;
  } else if (*type != "blip-2") {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field model_type ", type->dump(),
                                                   " is not \"blip-2\" or \"instructblip\""));
  }
  absl::StatusOr<nlohmann::json> vision = ConfigSection(config, "vision_config", file);
  if (!vision.ok()) return vision.status();
  CDCCA_RETURN_IF_ERROR_(ParseVision(*vision, file, &out.vision));
  absl::StatusOr<nlohmann::json> qformer = ConfigSection(config, "qformer_config", file);
  if (!qformer.ok()) return qformer.status();
  CDCCA_RETURN_IF_ERROR_(ParseQFormer(*qformer, file, out.instruct, &out.qformer));
  // transformers overwrites the Q-Former's encoder_hidden_size with the ViT's width.
  out.qformer.encoder_hidden_size = out.vision.hidden_size;
  CDCCA_RETURN_IF_ERROR_(ReadPositive(config, "num_query_tokens", "", file, &out.num_query_tokens));
  // transformers 4.4x writes image_token_index; 5.x may spell it image_token_id.
  for (const char* key : {"image_token_index", "image_token_id"}) {
    int64_t id = -1;
    CDCCA_RETURN_IF_ERROR_(ReadConfigField(config, key, "", file, &id));
    if (id >= 0) {
      out.image_token_id = id;
      break;
    }
  }
  return out;
}

#undef CDCCA_RETURN_IF_ERROR_

}  // namespace cdcca::model
