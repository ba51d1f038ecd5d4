#include "model/hub/folder_config.h"

#include <cmath>
#include <set>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "model/hub/folder_json.h"

namespace cdcca::model {
namespace {

using nlohmann::json;

template <typename T>
absl::Status ReadTyped(const json& section, const std::string& key, const std::string& where,
                       const std::string& file, T* out) {
  if (!section.is_object()) return absl::OkStatus();
  auto it = section.find(key);
  if (it == section.end() || it->is_null()) return absl::OkStatus();
  bool ok = false;
  const char* kind = "";
  if constexpr (std::is_same_v<T, bool>) {
    ok = it->is_boolean();
    kind = "true or false";
  } else if constexpr (std::is_integral_v<T>) {
    ok = it->is_number_integer();
    kind = "an integer";
  } else if constexpr (std::is_floating_point_v<T>) {
    ok = it->is_number();
    kind = "a number";
  } else {
    ok = it->is_string();
    kind = "a string";
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, key, " must be ", kind, ", got ", it->dump()));
  }
  *out = it->get<T>();
  return absl::OkStatus();
}

// The class defaults of transformers' LlamaConfig / Qwen2Config, which fill every field a
// config.json leaves out (published LLaVA text_configs list only what differs).
struct DecoderDefaults {
  int64_t vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
      max_position_embeddings;
};
constexpr DecoderDefaults kLlamaDefaults{32000, 4096, 11008, 32, 32, 2048};
constexpr DecoderDefaults kQwen2Defaults{151936, 4096, 22016, 32, 32, 32768};
constexpr DecoderDefaults kOptDefaults{50272, 768, 3072, 12, 12, 2048};

// An integer field, `fallback` when absent or not an integer (transformers' defaults fill
// what a config leaves out).
int64_t IntOr(const json& c, const char* key, int64_t fallback) {
  return c.contains(key) && c[key].is_number_integer() ? c[key].get<int64_t>() : fallback;
}

absl::StatusOr<double> NumberField(const json& obj, const std::string& key,
                                   const std::string& where, const std::string& file) {
  if (!obj.contains(key) || !obj[key].is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".", key, " missing or not a number"));
  }
  return obj[key].get<double>();
}

// A number field that may be absent or null (then `fallback`).
absl::StatusOr<double> OptionalNumber(const json& obj, const std::string& key, double fallback,
                                      const std::string& where, const std::string& file) {
  if (!obj.contains(key) || obj[key].is_null()) return fallback;
  if (!obj[key].is_number()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".", key, " is not a number"));
  }
  return obj[key].get<double>();
}

// A position count read as a number: positive and at most kMaxHfPositions, so the cast is
// defined.
absl::StatusOr<int64_t> PositionCount(double value, const std::string& field,
                                      const std::string& file) {
  if (!(value >= 1 && value <= static_cast<double>(kMaxHfPositions))) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", field, " = ", value, " is not in 1..", kMaxHfPositions));
  }
  return static_cast<int64_t>(value);
}

// transformers' get_mscale: 1 up to scale 1, then 0.1 * mscale * ln(scale) + 1.
double YarnMscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// yarn: factor (or max_position_embeddings / original_max_position_embeddings when absent),
// the attention factor, beta_fast / beta_slow (a 0 or missing value takes the default, as
// transformers' `or`), truncate.
absl::StatusOr<RopeConfig> ParseYarn(const json& params, const std::string& where, int64_t max_pos,
                                     const std::string& file, RopeConfig r) {
  absl::StatusOr<double> orig = OptionalNumber(params, "original_max_position_embeddings",
                                               static_cast<double>(max_pos), where, file);
  if (!orig.ok()) return orig.status();
  if (!(*orig > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": field ", where,
        ".original_max_position_embeddings (or max_position_embeddings) missing; yarn needs it"));
  }
  absl::StatusOr<int64_t> orig_count =
      PositionCount(*orig, where + ".original_max_position_embeddings", file);
  if (!orig_count.ok()) return orig_count.status();
  r.original_max_position_embeddings = *orig_count;
  absl::StatusOr<double> factor = OptionalNumber(params, "factor", 0.0, where, file);
  if (!factor.ok()) return factor.status();
  r.factor =
      *factor > 0 ? *factor : static_cast<double>(max_pos) / r.original_max_position_embeddings;
  if (!(r.factor > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".factor must be > 0 for yarn"));
  }
  absl::StatusOr<double> fast = OptionalNumber(params, "beta_fast", 0.0, where, file);
  if (!fast.ok()) return fast.status();
  absl::StatusOr<double> slow = OptionalNumber(params, "beta_slow", 0.0, where, file);
  if (!slow.ok()) return slow.status();
  r.beta_fast = *fast != 0 ? *fast : 32.0;
  r.beta_slow = *slow != 0 ? *slow : 1.0;
  if (params.contains("truncate") && params["truncate"].is_boolean()) {
    r.truncate = params["truncate"].get<bool>();
  }
  absl::StatusOr<double> attention = OptionalNumber(params, "attention_factor", 0.0, where, file);
  if (!attention.ok()) return attention.status();
  absl::StatusOr<double> mscale = OptionalNumber(params, "mscale", 0.0, where, file);
  if (!mscale.ok()) return mscale.status();
  absl::StatusOr<double> mscale_all = OptionalNumber(params, "mscale_all_dim", 0.0, where, file);
  if (!mscale_all.ok()) return mscale_all.status();
  if (params.contains("attention_factor") && !params["attention_factor"].is_null()) {
    r.attention_factor = *attention;
  } else if (*mscale != 0 && *mscale_all != 0) {
    r.attention_factor = YarnMscale(r.factor, *mscale) / YarnMscale(r.factor, *mscale_all);
  } else {
    r.attention_factor = YarnMscale(r.factor, 1.0);
  }
  return r;
}

}  // namespace

namespace {

// The rest of an OPT config (OPTConfig's names and class defaults), after the sizes `d`
// already holds.
absl::StatusOr<DecoderConfig> ParseOptFields(const json& c, const std::string& file,
                                             DecoderConfig d) {
  d.hidden_act = "relu";
  if (absl::Status s = ReadConfigField(c, "activation_function", "", file, &d.hidden_act);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckActivation(d.hidden_act, "activation_function"); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", s.message()));
  }
  bool bias = true;
  if (absl::Status s = ReadConfigField(c, "enable_bias", "", file, &bias); !s.ok()) return s;
  d.qkv_bias = d.o_bias = d.mlp_bias = bias;
  bool affine = true;
  if (absl::Status s = ReadConfigField(c, "layer_norm_elementwise_affine", "", file, &affine);
      !s.ok()) {
    return s;
  }
  if (!affine) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field layer_norm_elementwise_affine = false is not supported"));
  }
  if (absl::Status s =
          ReadConfigField(c, "do_layer_norm_before", "", file, &d.do_layer_norm_before);
      !s.ok()) {
    return s;
  }
  bool remove_final = false;
  if (absl::Status s = ReadConfigField(c, "_remove_final_layer_norm", "", file, &remove_final);
      !s.ok()) {
    return s;
  }
  d.final_layer_norm = d.do_layer_norm_before && !remove_final;
  d.word_embed_proj_dim = d.hidden_size;
  if (absl::Status s = ReadConfigField(c, "word_embed_proj_dim", "", file, &d.word_embed_proj_dim);
      !s.ok()) {
    return s;
  }
  if (d.word_embed_proj_dim <= 0 || d.word_embed_proj_dim > kMaxHfConfigSize) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field word_embed_proj_dim = ", d.word_embed_proj_dim,
                     " is not in 1..", kMaxHfConfigSize));
  }
  if (d.hidden_size % d.num_attention_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field hidden_size = ", d.hidden_size,
                     " is not a multiple of num_attention_heads = ", d.num_attention_heads));
  }
  d.head_dim = d.hidden_size / d.num_attention_heads;
  d.num_key_value_heads = d.num_attention_heads;
  // OPTConfig leaves it to PretrainedConfig, whose default ties the head.
  d.tie_word_embeddings = true;
  if (absl::Status s = ReadConfigField(c, "tie_word_embeddings", "", file, &d.tie_word_embeddings);
      !s.ok()) {
    return s;
  }
  d.eos_token_ids = ConfigIdList(c, "eos_token_id");
  if (d.eos_token_ids.empty()) d.eos_token_ids = {2};
  d.bos_token_id = IntOr(c, "bos_token_id", 2);
  d.pad_token_id = IntOr(c, "pad_token_id", 1);
  return d;
}

}  // namespace

absl::Status CheckActivation(const std::string& name, const std::string& field) {
  static const std::set<std::string> kKnown = {
      "silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "relu"};
  if (kKnown.count(name) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("field ", field, " = \"", name, "\" is not a supported activation"));
  }
  return absl::OkStatus();
}

absl::StatusOr<json> ConfigSection(const json& c, const std::string& key, const std::string& file) {
  auto it = c.find(key);
  if (it == c.end() || it->is_null()) return json::object();
  if (!it->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field ", key, " must be an object"));
  }
  return *it;
}

absl::StatusOr<std::string> ConfigModelType(const json& config, const std::string& file) {
  if (!config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": not a JSON object"));
  }
  std::string type;
  if (absl::Status s = ReadConfigField(config, "model_type", "", file, &type); !s.ok()) return s;
  return type;
}

absl::Status ReadConfigField(const json& section, const std::string& key, const std::string& where,
                             const std::string& file, bool* out) {
  return ReadTyped(section, key, where, file, out);
}
absl::Status ReadConfigField(const json& section, const std::string& key, const std::string& where,
                             const std::string& file, int64_t* out) {
  return ReadTyped(section, key, where, file, out);
}
absl::Status ReadConfigField(const json& section, const std::string& key, const std::string& where,
                             const std::string& file, double* out) {
  return ReadTyped(section, key, where, file, out);
}
absl::Status ReadConfigField(const json& section, const std::string& key, const std::string& where,
                             const std::string& file, std::string* out) {
  return ReadTyped(section, key, where, file, out);
}

absl::StatusOr<RopeConfig> ParseRopeConfig(const json& c, const std::string& file) {
  RopeConfig r;
  if (!c.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": text config is not an object"));
  }
  json params;  // the scaling settings, whichever spelling holds them
  std::string where;
  if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
    params = c["rope_parameters"];
    where = "rope_parameters";
  } else if (c.contains("rope_scaling") && c["rope_scaling"].is_object()) {
    params = c["rope_scaling"];
    where = "rope_scaling";
  }
  if (params.is_object() && params.contains("rope_theta") && params["rope_theta"].is_number()) {
    r.theta = params["rope_theta"].get<double>();
  } else if (c.contains("rope_theta") && c["rope_theta"].is_number()) {
    r.theta = c["rope_theta"].get<double>();
  }
  double partial = 1.0;
  if (params.is_object() && params.contains("partial_rotary_factor")) {
    if (absl::Status s =
            ReadConfigField(params, "partial_rotary_factor", where + ".", file, &partial);
        !s.ok()) {
      return s;
    }
  } else {
    if (absl::Status s = ReadConfigField(c, "partial_rotary_factor", "", file, &partial); !s.ok()) {
      return s;
    }
  }
  if (partial != 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field partial_rotary_factor = ", partial, " is not supported"));
  }
  if (!params.is_object()) return r;
  if (params.contains("rope_type") && params["rope_type"].is_string()) {
    r.type = params["rope_type"].get<std::string>();
  } else if (params.contains("type") && params["type"].is_string()) {
    r.type = params["type"].get<std::string>();
  }
  const int64_t max_pos = IntOr(c, "max_position_embeddings", 0);
  if (r.type == "default") return r;
  if (r.type != "linear" && r.type != "dynamic" && r.type != "llama3" && r.type != "yarn") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", where, ".rope_type = \"", r.type,
                     "\" is not supported (supported: default, linear, dynamic, llama3, yarn)"));
  }
  if (r.type == "yarn") return ParseYarn(params, where, max_pos, file, r);
  absl::StatusOr<double> factor = NumberField(params, "factor", where, file);
  if (!factor.ok()) return factor.status();
  r.factor = *factor;
  if (r.type == "llama3") {
    absl::StatusOr<double> lo = NumberField(params, "low_freq_factor", where, file);
    if (!lo.ok()) return lo.status();
    absl::StatusOr<double> hi = NumberField(params, "high_freq_factor", where, file);
    if (!hi.ok()) return hi.status();
    absl::StatusOr<double> orig =
        NumberField(params, "original_max_position_embeddings", where, file);
    if (!orig.ok()) return orig.status();
    absl::StatusOr<int64_t> orig_count =
        PositionCount(*orig, where + ".original_max_position_embeddings", file);
    if (!orig_count.ok()) return orig_count.status();
    r.low_freq_factor = *lo;
    r.high_freq_factor = *hi;
    r.original_max_position_embeddings = *orig_count;
  } else if (r.type == "dynamic") {
    absl::StatusOr<double> orig = OptionalNumber(params, "original_max_position_embeddings",
                                                 static_cast<double>(max_pos), where, file);
    if (!orig.ok()) return orig.status();
    if (!(*orig > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": field max_position_embeddings missing (needed by dynamic rope)"));
    }
    absl::StatusOr<int64_t> orig_count =
        PositionCount(*orig, where + ".original_max_position_embeddings", file);
    if (!orig_count.ok()) return orig_count.status();
    r.original_max_position_embeddings = *orig_count;
  }
  return r;
}

absl::StatusOr<int64_t> ConfigInt(const json& c, const std::string& key, const std::string& file) {
  if (!c.contains(key) || !c[key].is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field ", key, " missing or not an integer"));
  }
  return c[key].get<int64_t>();
}

std::vector<int64_t> ConfigIdList(const json& c, const std::string& key) {
  std::vector<int64_t> out;
  if (!c.contains(key)) return out;
  const json& v = c[key];
  if (v.is_number_integer()) out.push_back(v.get<int64_t>());
  if (v.is_array()) {
    for (const json& x : v) {
      if (x.is_number_integer()) out.push_back(x.get<int64_t>());
    }
  }
  return out;
}

std::vector<int64_t> ReadEosTokenIds(const std::string& dir, const std::vector<int64_t>& fallback) {
  absl::StatusOr<json> g = ReadJsonFile(dir + "/generation_config.json");
  if (!g.ok() || !g->is_object() || !g->contains("eos_token_id")) return fallback;
  std::vector<int64_t> ids = ConfigIdList(*g, "eos_token_id");
  return ids.empty() ? fallback : ids;
}

absl::StatusOr<DecoderConfig> ParseDecoderConfig(const json& c, const std::string& file) {
  if (!c.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": text config is not an object"));
  }
  DecoderConfig d;
  if (absl::Status s = ReadConfigField(c, "model_type", "", file, &d.model_type); !s.ok()) return s;
  const DecoderDefaults* defaults = nullptr;
  if (d.model_type == "llama") {
    defaults = &kLlamaDefaults;
  } else if (d.model_type == "qwen2") {
    defaults = &kQwen2Defaults;
  } else if (d.model_type == "opt") {
    defaults = &kOptDefaults;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field model_type = \"", d.model_type,
                     "\" is not a supported decoder (llama, qwen2, opt)"));
  }
  d.vocab_size = IntOr(c, "vocab_size", defaults->vocab_size);
  d.hidden_size = IntOr(c, "hidden_size", defaults->hidden_size);
  d.intermediate_size =
      IntOr(c, d.is_opt() ? "ffn_dim" : "intermediate_size", defaults->intermediate_size);
  d.num_hidden_layers = IntOr(c, "num_hidden_layers", defaults->num_hidden_layers);
  d.num_attention_heads = IntOr(c, "num_attention_heads", defaults->num_attention_heads);
  d.num_key_value_heads = IntOr(c, "num_key_value_heads", d.num_attention_heads);
  d.max_position_embeddings =
      IntOr(c, "max_position_embeddings", defaults->max_position_embeddings);
  if (d.num_attention_heads <= 0 || d.hidden_size <= 0 || d.vocab_size <= 0 ||
      d.num_hidden_layers < 0 || d.intermediate_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": non-positive size in the decoder config"));
  }
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"vocab_size", d.vocab_size},
                                     {"hidden_size", d.hidden_size},
                                     {"intermediate_size", d.intermediate_size},
                                     {"num_hidden_layers", d.num_hidden_layers},
                                     {"num_attention_heads", d.num_attention_heads}}) {
    if (value > kMaxHfConfigSize) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": field ", field, " = ", value,
                                                     " is larger than ", kMaxHfConfigSize));
    }
  }
  if (d.max_position_embeddings < 0 || d.max_position_embeddings > kMaxHfPositions) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field max_position_embeddings = ", d.max_position_embeddings,
                     " is not in 0..", kMaxHfPositions));
  }
  d.head_dim = IntOr(c, "head_dim", d.hidden_size / d.num_attention_heads);
  if (d.num_key_value_heads <= 0 || d.num_attention_heads % d.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field num_key_value_heads = ", d.num_key_value_heads,
                     " does not divide num_attention_heads = ", d.num_attention_heads));
  }
  if (d.head_dim <= 0 || d.head_dim % 2 != 0 || d.head_dim > kMaxHfConfigSize) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field head_dim = ", d.head_dim,
                                                   " must be even, positive and at most ",
                                                   kMaxHfConfigSize));
  }
  if (d.is_opt()) return ParseOptFields(c, file, d);
  if (absl::Status s = ReadConfigField(c, "rms_norm_eps", "", file, &d.rms_norm_eps); !s.ok()) {
    return s;
  }
  if (absl::Status s = ReadConfigField(c, "hidden_act", "", file, &d.hidden_act); !s.ok()) return s;
  if (absl::Status s = CheckActivation(d.hidden_act, "hidden_act"); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", s.message()));
  }
  absl::StatusOr<RopeConfig> rope = ParseRopeConfig(c, file);
  if (!rope.ok()) return rope.status();
  d.rope = *rope;
  if (d.model_type == "qwen2") {
    d.qkv_bias = true;
    bool sliding = false;
    if (absl::Status s = ReadConfigField(c, "use_sliding_window", "", file, &sliding); !s.ok()) {
      return s;
    }
    if (sliding) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": field use_sliding_window = true is not supported"));
    }
  } else {
    if (absl::Status s = ReadConfigField(c, "attention_bias", "", file, &d.qkv_bias); !s.ok()) {
      return s;
    }
    d.o_bias = d.qkv_bias;
    if (absl::Status s = ReadConfigField(c, "mlp_bias", "", file, &d.mlp_bias); !s.ok()) return s;
  }
  if (absl::Status s = ReadConfigField(c, "tie_word_embeddings", "", file, &d.tie_word_embeddings);
      !s.ok()) {
    return s;
  }
  d.eos_token_ids = ConfigIdList(c, "eos_token_id");
  d.bos_token_id = IntOr(c, "bos_token_id", -1);
  d.pad_token_id = IntOr(c, "pad_token_id", -1);
  return d;
}

absl::StatusOr<T5Config> ParseT5Config(const json& c, const std::string& file) {
  if (!c.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": text config is not an object"));
  }
  T5Config t;
  std::string type;
  if (absl::Status s = ReadConfigField(c, "model_type", "", file, &type); !s.ok()) return s;
  if (type != "t5") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field model_type = \"", type, "\" is not t5"));
  }
  for (const auto& [key, out] : std::vector<std::pair<const char*, int64_t*>>{
           {"vocab_size", &t.vocab_size},
           {"d_model", &t.d_model},
           {"d_kv", &t.d_kv},
           {"d_ff", &t.d_ff},
           {"num_layers", &t.num_layers},
           {"num_heads", &t.num_heads},
           {"relative_attention_num_buckets", &t.relative_attention_num_buckets},
           {"relative_attention_max_distance", &t.relative_attention_max_distance}}) {
    if (absl::Status s = ReadConfigField(c, key, "", file, out); !s.ok()) return s;
    if (*out <= 0 || *out > kMaxHfConfigSize) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": field ", key, " = ", *out, " is not in 1..", kMaxHfConfigSize));
    }
  }
  t.num_decoder_layers = t.num_layers;
  if (absl::Status s = ReadConfigField(c, "num_decoder_layers", "", file, &t.num_decoder_layers);
      !s.ok()) {
    return s;
  }
  if (t.num_decoder_layers <= 0 || t.num_decoder_layers > kMaxHfConfigSize) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field num_decoder_layers = ", t.num_decoder_layers, " is not in 1..",
                     kMaxHfConfigSize));
  }
  if (t.relative_attention_num_buckets < 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": field relative_attention_num_buckets = ", t.relative_attention_num_buckets,
        " is below 4"));
  }
  if (absl::Status s = ReadConfigField(c, "layer_norm_epsilon", "", file, &t.layer_norm_epsilon);
      !s.ok()) {
    return s;
  }
  std::string proj = "relu";
  if (absl::Status s = ReadConfigField(c, "feed_forward_proj", "", file, &proj); !s.ok()) return s;
  t.gated = proj.rfind("gated-", 0) == 0;
  t.dense_act_fn = t.gated ? proj.substr(6) : proj;
  if (t.dense_act_fn == "gelu" && t.gated) t.dense_act_fn = "gelu_new";  // T5Config's mapping
  if (absl::Status s = CheckActivation(t.dense_act_fn, "feed_forward_proj"); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field feed_forward_proj = \"", proj,
                                                   "\" is not [gated-]<activation> with a "
                                                   "supported activation"));
  }
  bool is_decoder = false;
  if (absl::Status s = ReadConfigField(c, "is_decoder", "", file, &is_decoder); !s.ok()) return s;
  if (is_decoder) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field is_decoder = true is not supported (a T5 encoder-decoder)"));
  }
  if (absl::Status s = ReadConfigField(c, "tie_word_embeddings", "", file, &t.tie_word_embeddings);
      !s.ok()) {
    return s;
  }
  t.scale_decoder_outputs = t.tie_word_embeddings;
  if (absl::Status s =
          ReadConfigField(c, "scale_decoder_outputs", "", file, &t.scale_decoder_outputs);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ReadConfigField(c, "pad_token_id", "", file, &t.pad_token_id); !s.ok()) {
    return s;
  }
  t.decoder_start_token_id = t.pad_token_id;
  if (absl::Status s =
          ReadConfigField(c, "decoder_start_token_id", "", file, &t.decoder_start_token_id);
      !s.ok()) {
    return s;
  }
  if (t.decoder_start_token_id < 0 || t.decoder_start_token_id >= t.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field decoder_start_token_id = ", t.decoder_start_token_id,
                     " is not a token of the vocabulary"));
  }
  if (std::vector<int64_t> eos = ConfigIdList(c, "eos_token_id"); !eos.empty()) {
    t.eos_token_ids = eos;
  }
  return t;
}

absl::StatusOr<ClipVisionConfig> ParseClipVisionConfig(const json& c, const std::string& file) {
  if (!c.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": vision_config is not an object"));
  }
  ClipVisionConfig v;
  const std::string w = "vision_config.";
  if (absl::Status s = ReadConfigField(c, "model_type", w, file, &v.model_type); !s.ok()) return s;
  if (v.model_type == "siglip_vision_model") {
    v.patch_size = 16;
    v.hidden_act = "gelu_pytorch_tanh";
    v.layer_norm_eps = 1e-6;
  } else if (v.model_type != "clip_vision_model") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field vision_config.model_type = \"", v.model_type,
                     "\" is not supported (clip_vision_model, siglip_vision_model)"));
  }
  v.hidden_size = IntOr(c, "hidden_size", v.hidden_size);
  v.intermediate_size = IntOr(c, "intermediate_size", v.intermediate_size);
  v.num_hidden_layers = IntOr(c, "num_hidden_layers", v.num_hidden_layers);
  v.num_attention_heads = IntOr(c, "num_attention_heads", v.num_attention_heads);
  v.num_channels = IntOr(c, "num_channels", v.num_channels);
  v.image_size = IntOr(c, "image_size", v.image_size);
  v.patch_size = IntOr(c, "patch_size", v.patch_size);
  if (absl::Status s = ReadConfigField(c, "hidden_act", w, file, &v.hidden_act); !s.ok()) return s;
  if (absl::Status s = ReadConfigField(c, "layer_norm_eps", w, file, &v.layer_norm_eps); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckActivation(v.hidden_act, "vision_config.hidden_act"); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", s.message()));
  }
  const auto in_range = [](int64_t x) { return x > 0 && x <= kMaxHfConfigSize; };
  if (!in_range(v.hidden_size) || !in_range(v.num_attention_heads) ||
      v.hidden_size % v.num_attention_heads != 0 || !in_range(v.patch_size) ||
      !in_range(v.image_size) || v.image_size < v.patch_size || !in_range(v.num_hidden_layers) ||
      !in_range(v.intermediate_size) || !in_range(v.num_channels)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": vision_config sizes do not fit (hidden_size ", v.hidden_size,
                     ", num_attention_heads ", v.num_attention_heads, ", image_size ", v.image_size,
                     ", patch_size ", v.patch_size, ", num_hidden_layers ", v.num_hidden_layers,
                     ", intermediate_size ", v.intermediate_size, ", num_channels ", v.num_channels,
                     "; each in 1..", kMaxHfConfigSize, ")"));
  }
  return v;
}

int64_t LlavaConfig::NumImageTokens() const {
  return vision.num_positions() - (vision_feature_select_strategy == "default" ? 1 : 0);
}

absl::StatusOr<LlavaConfig> ParseLlavaConfig(const json& c, const std::string& file) {
  if (!c.is_object()) return absl::InvalidArgumentError(absl::StrCat(file, ": not a JSON object"));
  LlavaConfig l;
  absl::StatusOr<json> vision = ConfigSection(c, "vision_config", file);
  if (!vision.ok()) return vision.status();
  if (!vision->contains("model_type")) (*vision)["model_type"] = "clip_vision_model";
  absl::StatusOr<ClipVisionConfig> v = ParseClipVisionConfig(*vision, file);
  if (!v.ok()) return v.status();
  l.vision = *v;
  absl::StatusOr<json> text = ConfigSection(c, "text_config", file);
  if (!text.ok()) return text.status();
  if (!text->contains("model_type")) (*text)["model_type"] = "llama";
  // Tied embeddings: the text config says so, else the top level (transformers reads it
  // from the text config when present).
  if (!text->contains("tie_word_embeddings") && c.contains("tie_word_embeddings")) {
    (*text)["tie_word_embeddings"] = c["tie_word_embeddings"];
  }
  if (!text->contains("eos_token_id") && c.contains("eos_token_id")) {
    (*text)["eos_token_id"] = c["eos_token_id"];
  }
  absl::StatusOr<DecoderConfig> t = ParseDecoderConfig(*text, file);
  if (!t.ok()) return t.status();
  l.text = *t;
  if (c.contains("vision_feature_layer")) {
    const json& f = c["vision_feature_layer"];
    l.vision_feature_layers.clear();
    if (f.is_number_integer()) {
      l.vision_feature_layers.push_back(f.get<int64_t>());
    } else if (f.is_array()) {
      for (const json& x : f) {
        if (x.is_number_integer()) l.vision_feature_layers.push_back(x.get<int64_t>());
      }
    }
    if (l.vision_feature_layers.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": field vision_feature_layer is not an integer or a list of them"));
    }
  }
  const int64_t n = l.vision.num_hidden_layers;
  for (int64_t layer : l.vision_feature_layers) {
    if (layer < -(n + 1) || layer > n) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": field vision_feature_layer = ", layer,
                                                     " is outside the tower's ", n + 1,
                                                     " hidden states"));
    }
  }
  if (absl::Status s = ReadConfigField(c, "vision_feature_select_strategy", "", file,
                                       &l.vision_feature_select_strategy);
      !s.ok()) {
    return s;
  }
  if (l.vision_feature_select_strategy != "default" && l.vision_feature_select_strategy != "full") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field vision_feature_select_strategy = \"",
                     l.vision_feature_select_strategy, "\" is not default or full"));
  }
  if (absl::Status s =
          ReadConfigField(c, "projector_hidden_act", "", file, &l.projector_hidden_act);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckActivation(l.projector_hidden_act, "projector_hidden_act"); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", s.message()));
  }
  if (absl::Status s =
          ReadConfigField(c, "multimodal_projector_bias", "", file, &l.multimodal_projector_bias);
      !s.ok()) {
    return s;
  }
  if (c.contains("image_token_id") && c["image_token_id"].is_number_integer()) {
    l.image_token_id = c["image_token_id"].get<int64_t>();
  } else if (c.contains("image_token_index") && c["image_token_index"].is_number_integer()) {
    l.image_token_id = c["image_token_index"].get<int64_t>();
  }
  return l;
}

}  // namespace cdcca::model
