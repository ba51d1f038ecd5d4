#include "model/family/config.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

using nlohmann::json;

// Typed reads of one JSON value. A number is range-checked before it is converted: a
// double outside int's (or float's) range would convert with undefined behaviour.
const char* Read(const json& v, int* out) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
      return "integer out of range";
    }
    *out = static_cast<int>(v.get<uint64_t>());
    return nullptr;
  }
  int64_t x = 0;
  if (v.is_number_float()) {
    // 48.0 reads as 48; 48.5, 1e300 and NaN do not.
    const double d = v.get<double>();
    if (!(d >= std::numeric_limits<int>::min() && d <= std::numeric_limits<int>::max()) ||
        d != std::trunc(d)) {
      return "must be an integer in int's range";
    }
    x = static_cast<int64_t>(d);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    return "must be an integer";
  }
  if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max()) {
    return "integer out of range";
  }
  *out = static_cast<int>(x);
  return nullptr;
}
const char* Read(const json& v, float* out) {
  if (!v.is_number()) return "must be a number";
  const double x = v.get<double>();
  if (!std::isfinite(x) || std::fabs(x) > std::numeric_limits<float>::max()) {
    return "number out of range";
  }
  *out = static_cast<float>(x);
  return nullptr;
}
const char* Read(const json& v, std::string* out) {
  if (!v.is_string()) return "must be a string";
  *out = v.get<std::string>();
  return nullptr;
}
const char* Read(const json& v, std::vector<int>* out) {
  if (!v.is_array()) return "must be an array";
  std::vector<int> values(v.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (const char* why = Read(v[i], &values[i])) return why;
  }
  *out = std::move(values);
  return nullptr;
}

// Reads known keys out of one JSON object and reports any key nobody asked for.
class ObjectReader {
 public:
  ObjectReader(const json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  template <typename T>
  void Get(const char* key, T* out) {
    seen_.insert(key);
    if (!status_.ok() || !obj_.contains(key)) return;
    if (const char* why = Read(obj_.at(key), out)) {
      status_ = absl::InvalidArgumentError(absl::StrCat(where_, ".", key, ": ", why));
    }
  }
  void Skip(const char* key) { seen_.insert(key); }

  absl::Status Finish() {
    if (!status_.ok()) return status_;
    for (const auto& item : obj_.items()) {
      if (seen_.count(item.key()) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("unknown key ", where_, ".", item.key()));
      }
    }
    return absl::OkStatus();
  }

 private:
  const json& obj_;
  std::string where_;
  std::set<std::string> seen_;
  absl::Status status_;
};

absl::Status ReadVision(const json& j, VisionConfig* c) {
  if (!j.is_object()) return absl::InvalidArgumentError("vision must be an object");
  ObjectReader r(j, "vision");
  r.Get("image_size", &c->image_size);
  r.Get("patch_size", &c->patch_size);
  r.Get("d_vis", &c->d_vis);
  r.Get("layers", &c->layers);
  r.Get("heads", &c->heads);
  r.Get("mlp_hidden", &c->mlp_hidden);
  return r.Finish();
}

absl::Status ReadTower(const json& j, const std::string& where, TowerConfig* c) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, " must be an object"));
  ObjectReader r(j, where);
  r.Get("num_queries", &c->num_queries);
  r.Get("qa_dim", &c->qa_dim);
  r.Get("qa_heads", &c->qa_heads);
  r.Get("qa_layers", &c->qa_layers);
  r.Get("qa_mlp_hidden", &c->qa_mlp_hidden);
  r.Get("d_model", &c->d_model);
  r.Get("lm_layers", &c->lm_layers);
  r.Get("lm_heads", &c->lm_heads);
  r.Get("ffn_hidden", &c->ffn_hidden);
  r.Get("max_positions", &c->max_positions);
  r.Get("rope_theta", &c->rope_theta);
  r.Get("lora_rank", &c->lora_rank);
  r.Get("lora_alpha", &c->lora_alpha);
  r.Get("adapter_prompt_len", &c->adapter_prompt_len);
  r.Get("adapter_layers", &c->adapter_layers);
  r.Get("dropout", &c->dropout);
  std::string precision;
  r.Get("precision", &precision);
  r.Get("int4_group", &c->int4_group);
  r.Get("vocab_size", &c->vocab_size);
  r.Get("d_vis", &c->d_vis);
  r.Get("num_visual_tokens", &c->num_visual_tokens);
  r.Skip("vision");
  if (absl::Status s = r.Finish(); !s.ok()) return s;
  if (j.contains("vision")) {
    if (absl::Status s = ReadVision(j["vision"], &c->vision); !s.ok()) return s;
  }
  if (!precision.empty()) {
    absl::StatusOr<Precision> p = ParsePrecision(precision);
    if (!p.ok()) return p.status();
    c->precision = *p;
  }
  return absl::OkStatus();
}

json VisionToJson(const VisionConfig& c) {
  return json{{"image_size", c.image_size}, {"patch_size", c.patch_size},
              {"d_vis", c.d_vis},           {"layers", c.layers},
              {"heads", c.heads},           {"mlp_hidden", c.mlp_hidden}};
}

json TowerToJson(const TowerConfig& c) {
  return json{{"vision", VisionToJson(c.vision)},
              {"num_queries", c.num_queries},
              {"qa_dim", c.qa_dim},
              {"qa_heads", c.qa_heads},
              {"qa_layers", c.qa_layers},
              {"qa_mlp_hidden", c.qa_mlp_hidden},
              {"d_model", c.d_model},
              {"lm_layers", c.lm_layers},
              {"lm_heads", c.lm_heads},
              {"ffn_hidden", c.ffn_hidden},
              {"max_positions", c.max_positions},
              {"rope_theta", c.rope_theta},
              {"lora_rank", c.lora_rank},
              {"lora_alpha", c.lora_alpha},
              {"adapter_prompt_len", c.adapter_prompt_len},
              {"adapter_layers", c.adapter_layers},
              {"dropout", c.dropout},
              {"precision", std::string(PrecisionName(c.precision))},
              {"int4_group", c.int4_group},
              {"vocab_size", c.vocab_size},
              {"d_vis", c.d_vis},
              {"num_visual_tokens", c.num_visual_tokens}};
}

absl::StatusOr<json> ParseJson(absl::string_view text) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("bad JSON: ", e.what()));
  }
}

}  // namespace

absl::string_view PrecisionName(Precision p) {
  switch (p) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kInt8:
      return "int8";
    case Precision::kInt4:
      return "int4";
  }
  return "?";
}

absl::StatusOr<Precision> ParsePrecision(absl::string_view name) {
  if (name == "fp32") return Precision::kFp32;
  if (name == "int8") return Precision::kInt8;
  if (name == "int4") return Precision::kInt4;
  return absl::InvalidArgumentError(
      absl::StrCat("precision must be fp32, int8 or int4, not '", name, "'"));
}

int VisionConfig::GridSide() const { return patch_size > 0 ? image_size / patch_size : 0; }
int VisionConfig::NumPatches() const { return GridSide() * GridSide(); }
int VisionConfig::NumTokens() const { return 1 + NumPatches(); }

absl::Status ValidateVision(const VisionConfig& v) {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  // Bounded so that GridSide() and NumTokens() cannot overflow.
  if (v.image_size <= 0 || v.image_size > kMaxImageSize) {
    return bad(absl::StrCat("vision.image_size must be in 1-", kMaxImageSize));
  }
  if (v.patch_size <= 0 || v.patch_size > v.image_size || v.image_size % v.patch_size != 0) {
    return bad("vision.patch_size must divide vision.image_size");
  }
  if (v.NumTokens() > kMaxVisionTokens) {
    return bad(absl::StrCat("vision: more than ", kMaxVisionTokens,
                            " tokens (image_size / patch_size too large)"));
  }
  if (v.d_vis <= 0 || v.mlp_hidden <= 0) return bad("vision.d_vis and mlp_hidden must be positive");
  if (v.heads <= 0 || v.d_vis % v.heads != 0) return bad("vision.heads must divide vision.d_vis");
  if (v.layers <= 0 || v.layers > kMaxVisionLayers) {
    return bad(absl::StrCat("vision.layers must be in 1-", kMaxVisionLayers));
  }
  return absl::OkStatus();
}

absl::Status ValidateTower(const TowerConfig& c) {
  auto bad = [](const std::string& m) { return absl::InvalidArgumentError(m); };
  if (c.num_queries <= 0 || c.qa_dim <= 0 || c.qa_layers <= 0 || c.d_model <= 0 ||
      c.lm_layers <= 0 || c.ffn_hidden <= 0 || c.qa_mlp_hidden <= 0) {
    return bad("tower sizes must be positive");
  }
  if (c.qa_heads <= 0 || c.qa_dim % c.qa_heads != 0) return bad("qa_heads must divide qa_dim");
  if (c.lm_heads <= 0 || c.d_model % c.lm_heads != 0 || (c.d_model / c.lm_heads) % 2 != 0) {
    return bad("lm_heads must divide d_model into even head widths (RoPE)");
  }
  if (c.vocab_size <= 0) return bad("vocab_size must be positive");
  if (c.d_vis <= 0 || c.num_visual_tokens <= 0) return bad("d_vis/num_visual_tokens unset");
  if (c.d_vis != c.vision.d_vis || c.num_visual_tokens != c.vision.NumTokens()) {
    return bad("d_vis/num_visual_tokens disagree with the tower's vision config");
  }
  if (c.max_positions <= c.num_queries) return bad("max_positions must exceed num_queries");
  if (c.lora_rank < 0 || c.adapter_prompt_len < 0 || c.adapter_layers < 0 ||
      c.adapter_layers > c.lm_layers) {
    return bad("lora_rank/adapter_prompt_len/adapter_layers out of range");
  }
  if (c.int4_group <= 0 || c.int4_group % 2 != 0) return bad("int4_group must be even");
  if (c.dropout < 0.0f || c.dropout >= 1.0f) return bad("dropout must be in [0, 1)");
  return absl::OkStatus();
}

absl::StatusOr<FamilyConfig> ParseFamilyConfig(absl::string_view json_text) {
  absl::StatusOr<json> parsed = ParseJson(json_text);
  if (!parsed.ok()) return parsed.status();
  if (!parsed->is_object()) return absl::InvalidArgumentError("family config must be an object");
  // A family checkpoint's config.json is the student's Hugging Face config; the family sits
  // in its "cdcca" object (one level: the family itself has no model_type).
  const json* obj = &*parsed;
  if (obj->contains("model_type")) {
    const auto c = obj->find("cdcca");
    if (c == obj->end() || !c->is_object() || !c->contains("family") ||
        !c->at("family").is_object()) {
      return absl::InvalidArgumentError(
          "a Hugging Face config.json without a cdcca.family object is not a family checkpoint");
    }
    obj = &c->at("family");
  }
  const json& j = *obj;
  FamilyConfig f;
  ObjectReader r(j, "config");
  r.Get("name", &f.name);
  r.Get("architecture", &f.architecture);
  r.Get("vocabulary", &f.vocabulary);
  r.Get("vocab_size", &f.vocab_size);
  r.Skip("vision");
  r.Skip("teacher");
  r.Skip("student");
  r.Skip("pretrain");
  r.Skip("comment");
  r.Skip("fingerprints");  // written by SaveFamily into a checkpoint's config.json
  r.Skip("training");
  if (absl::Status s = r.Finish(); !s.ok()) return s;
  if (f.architecture != "blip-2" && f.architecture != "llava") {
    return absl::InvalidArgumentError(absl::StrCat("config.architecture: \"", f.architecture,
                                                   "\" is neither \"blip-2\" nor \"llava\""));
  }
  if (j.contains("vision")) {
    if (absl::Status s = ReadVision(j["vision"], &f.vision); !s.ok()) return s;
  }
  if (!j.contains("teacher") || !j.contains("student")) {
    return absl::InvalidArgumentError("config needs teacher and student sections");
  }
  if (absl::Status s = ReadTower(j["teacher"], "teacher", &f.teacher); !s.ok()) return s;
  if (absl::Status s = ReadTower(j["student"], "student", &f.student); !s.ok()) return s;
  if (j.contains("pretrain")) f.pretrain_json = j["pretrain"].dump();
  if (absl::Status s = ValidateVision(f.vision); !s.ok()) return s;
  for (TowerConfig* t : {&f.teacher, &f.student}) {
    t->vocab_size = f.vocab_size;
    t->d_vis = f.vision.d_vis;
    t->num_visual_tokens = f.vision.NumTokens();
    t->vision = f.vision;
    if (absl::Status s = ValidateTower(*t); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(t == &f.teacher ? "teacher: " : "student: ", s.message()));
    }
  }
  return f;
}

absl::StatusOr<FamilyConfig> LoadFamilyConfig(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open model config ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<FamilyConfig> f = ParseFamilyConfig(ss.str());
  if (!f.ok())
    return absl::Status(f.status().code(), absl::StrCat(path, ": ", f.status().message()));
  return f;
}

std::string TowerConfigToJson(const TowerConfig& c) { return TowerToJson(c).dump(); }

absl::StatusOr<TowerConfig> ParseTowerConfig(absl::string_view json_text) {
  absl::StatusOr<json> parsed = ParseJson(json_text);
  if (!parsed.ok()) return parsed.status();
  TowerConfig c;
  if (absl::Status s = ReadTower(*parsed, "tower", &c); !s.ok()) return s;
  if (absl::Status s = ValidateVision(c.vision); !s.ok()) return s;
  if (absl::Status s = ValidateTower(c); !s.ok()) return s;
  return c;
}

std::string VisionConfigToJson(const VisionConfig& c) { return VisionToJson(c).dump(); }

absl::StatusOr<VisionConfig> ParseVisionConfig(absl::string_view json_text) {
  absl::StatusOr<json> parsed = ParseJson(json_text);
  if (!parsed.ok()) return parsed.status();
  VisionConfig c;
  if (absl::Status s = ReadVision(*parsed, &c); !s.ok()) return s;
  if (absl::Status s = ValidateVision(c); !s.ok()) return s;
  return c;
}

}  // namespace cdcca::model
