#include "sim/experiment.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/flags_help.h"
#include "cli/print_config.h"
#include "compress/uplink_codec.h"
#include "datasets/language.h"
#include "datasets/shifts.h"
#include "model/family/token_score_kind.h"
#include "nlohmann/json.hpp"

namespace cdcca::sim {

namespace {

using json = nlohmann::json;

// Reads optional field `key` of `obj` into `out`; INVALID_ARGUMENT naming it on a type error.
template <typename T>
absl::Status ReadField(const json& obj, const char* key, const std::string& where, T* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  try {
    *out = it->get<T>();
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": field \"", key, "\": ", e.what()));
  }
  return absl::OkStatus();
}

// The fields of one JSON object as the parser reads them: every Read records its key, and
// OnlyKnown refuses the first key of the object that no Read or Known named, listing those
// that were (a misspelt key would otherwise be ignored and the run would use the default
// without a word). Each level calls OnlyKnown after its reads, before checking the values.
class Fields {
 public:
  Fields(const json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  template <typename T>
  absl::Status Read(const char* key, T* out) {
    known_.push_back(key);
    return ReadField(obj_, key, where_, out);
  }
  // A key this level accepts but reads elsewhere (an array or object parsed on its own).
  void Known(const char* key) { known_.push_back(key); }

  absl::Status OnlyKnown() const {
    if (!obj_.is_object()) return absl::OkStatus();
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (std::find(known_.begin(), known_.end(), it.key()) != known_.end()) continue;
      if (it.key() == "uts" || it.key() == "job") {
        return absl::InvalidArgumentError(absl::StrCat(
            where_, ": the \"", it.key(),
            "\" object is gone: its settings are top-level keys "
            "named as the programs' flags (docs/SETTINGS.md), e.g. \"uts_keep_fraction\", "
            "\"uplink_precision\", \"max_steps\", \"guard_measure\""));
      }
      // Keys whose setting has the programs' name now.
      static const std::map<std::string, std::string> kRenamed = {
          {"checkpoint", "checkpoint_dir"},
          {"precision", "student_precision"},
          {"downlink_bits_per_param", "bits_per_param"},
          {"threads", "torch_threads"},
          {"workers", "trainer_threads"}};
      const auto renamed = kRenamed.find(it.key());
      const std::string nearest =
          renamed != kRenamed.end() ? renamed->second : cli::NearestName(it.key(), known_);
      return absl::InvalidArgumentError(
          absl::StrCat(where_, ": unknown key \"", it.key(), "\"; did you mean \"", nearest,
                       "\"? (known: ", absl::StrJoin(known_, ", "), ")"));
    }
    return absl::OkStatus();
  }

 private:
  const json& obj_;
  std::string where_;
  std::vector<std::string> known_;
};

#define CDCCA_RETURN_IF_ERROR(expr)           \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (false)

absl::Status Check(bool ok, const std::string& where, const std::string& field,
                   const std::string& why) {
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(where, ": field \"", field, "\" ", why));
}

}  // namespace

const std::vector<std::string>& KnownMethods() {
  static const std::vector<std::string> kMethods = {
      "source-only", "tent",   "cotta",          "pl",         "pkd",        "cwd",
      "akd",         "cd-cca", "akd-all-tokens", "akd-no-uts", "akd-random", "teacher"};
  return kMethods;
}

MethodName ParseMethodName(const std::string& method) {
  MethodName n;
  const size_t at = method.find('@');
  n.base = method.substr(0, at);
  if (at != std::string::npos) {
    char* end = nullptr;
    const std::string ratio = method.substr(at + 1);
    n.token_ratio = std::strtof(ratio.c_str(), &end);
    if (ratio.empty() || end != ratio.c_str() + ratio.size() || n.token_ratio <= 0)
      n.token_ratio = -1;
  }
  return n;
}

RoundDomain Experiment::DomainFor(int device, int round) const {
  int step = round + (stagger ? device : 0);
  if (schedule.empty()) return RoundDomain{};
  return schedule[static_cast<size_t>(std::min<int>(step, static_cast<int>(schedule.size()) - 1))];
}

int Experiment::AnswerTokens() const {
  return captioning() ? datasets::kMaxCaptionTokens : settings::kMaxAnswerTokens;
}

absl::StatusOr<Experiment> ParseExperiment(const std::string& json_text,
                                           const std::string& source_name) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": not JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(source_name + ": not a JSON object");
  const std::string& w = source_name;
  Experiment e;
  Fields top(j, w);
  CDCCA_RETURN_IF_ERROR(top.Read("name", &e.name));
  CDCCA_RETURN_IF_ERROR(top.Read("task", &e.task));
  CDCCA_RETURN_IF_ERROR(top.Read("title", &e.title));
  CDCCA_RETURN_IF_ERROR(top.Read("paper_table", &e.paper_table));
  CDCCA_RETURN_IF_ERROR(top.Read("description", &e.description));
  CDCCA_RETURN_IF_ERROR(top.Read("checkpoint_dir", &e.checkpoint));
  CDCCA_RETURN_IF_ERROR(top.Read("teacher", &e.teacher));
  CDCCA_RETURN_IF_ERROR(top.Read("student_base", &e.student_base));
  CDCCA_RETURN_IF_ERROR(top.Read("lora_rank", &e.lora_rank));
  CDCCA_RETURN_IF_ERROR(top.Read("lora_alpha", &e.lora_alpha));
  CDCCA_RETURN_IF_ERROR(top.Read("lora_mlp", &e.lora_mlp));
  CDCCA_RETURN_IF_ERROR(top.Read("lora_qformer", &e.lora_qformer));
  CDCCA_RETURN_IF_ERROR(top.Read("lora_projector", &e.lora_projector));
  CDCCA_RETURN_IF_ERROR(top.Read("lora_vision", &e.lora_vision));
  CDCCA_RETURN_IF_ERROR(top.Read("profile", &e.profile));
  e.lora_projector_given = j.contains("lora_projector");
  e.uplink_precision_given = j.contains("uplink_precision");
  CDCCA_RETURN_IF_ERROR(top.Read("student_precision", &e.precision));
  CDCCA_RETURN_IF_ERROR(top.Read("devices", &e.devices));
  CDCCA_RETURN_IF_ERROR(top.Read("rounds", &e.rounds));
  CDCCA_RETURN_IF_ERROR(top.Read("stream_frames", &e.stream_frames));
  CDCCA_RETURN_IF_ERROR(top.Read("eval_scenes", &e.eval_scenes));
  CDCCA_RETURN_IF_ERROR(top.Read("stagger", &e.stagger));
  CDCCA_RETURN_IF_ERROR(top.Read("methods", &e.methods));
  CDCCA_RETURN_IF_ERROR(top.Read("bits_per_param", &e.downlink_bits_per_param));
  CDCCA_RETURN_IF_ERROR(top.Read("torch_threads", &e.threads));
  CDCCA_RETURN_IF_ERROR(top.Read("distill_config", &e.distill_config));
  // UTS, the job and the guard: the programs' flag names (docs/SETTINGS.md).
  CDCCA_RETURN_IF_ERROR(top.Read("uts_keep_fraction", &e.uts.keep_fraction));
  CDCCA_RETURN_IF_ERROR(top.Read("uts_token_ratio", &e.uts.token_ratio));
  CDCCA_RETURN_IF_ERROR(top.Read("uts_mc_passes", &e.uts.mc_passes));
  CDCCA_RETURN_IF_ERROR(top.Read("uts_dropout", &e.uts.dropout_p));
  CDCCA_RETURN_IF_ERROR(top.Read("uts_random_share", &e.uts.random_share));
  CDCCA_RETURN_IF_ERROR(top.Read("uplink_precision", &e.uts.precision));
  CDCCA_RETURN_IF_ERROR(top.Read("uts_score", &e.uts.score));
  CDCCA_RETURN_IF_ERROR(top.Read("max_steps", &e.job.max_steps));
  CDCCA_RETURN_IF_ERROR(top.Read("batch_size", &e.job.batch_size));
  CDCCA_RETURN_IF_ERROR(top.Read("lr", &e.job.lr));
  CDCCA_RETURN_IF_ERROR(top.Read("trainer_threads", &e.job.workers));
  CDCCA_RETURN_IF_ERROR(top.Read("device", &e.job.device));
  CDCCA_RETURN_IF_ERROR(top.Read("guard", &e.job.guard));
  CDCCA_RETURN_IF_ERROR(top.Read("guard_holdout_fraction", &e.job.guard_holdout_fraction));
  CDCCA_RETURN_IF_ERROR(top.Read("guard_z", &e.job.guard_z));
  CDCCA_RETURN_IF_ERROR(top.Read("guard_min_pool", &e.job.guard_min_pool));
  CDCCA_RETURN_IF_ERROR(top.Read("guard_pool", &e.job.guard_pool));
  CDCCA_RETURN_IF_ERROR(top.Read("guard_confident_fraction", &e.job.guard_confident_fraction));
  CDCCA_RETURN_IF_ERROR(top.Read("guard_restore_base", &e.job.guard_restore_base));
  CDCCA_RETURN_IF_ERROR(top.Read("guard_measure", &e.job.guard_measure));
  CDCCA_RETURN_IF_ERROR(top.Read("pool_samples", &e.job.pool_samples));
  json fp8_base = e.job.fp8_base;  // "native", "on", "off", or true / false for on / off
  CDCCA_RETURN_IF_ERROR(top.Read("fp8_base", &fp8_base));
  if (fp8_base.is_boolean()) fp8_base = fp8_base.get<bool>() ? "on" : "off";
  for (const char* parsed_below : {"schedule", "cloud", "link"}) top.Known(parsed_below);
  CDCCA_RETURN_IF_ERROR(top.OnlyKnown());
  CDCCA_RETURN_IF_ERROR(Check(e.task == "vqa" || e.task == "caption", w, "task",
                              absl::StrCat("must be vqa or caption, not \"", e.task, "\"")));
  CDCCA_RETURN_IF_ERROR(
      Check(e.lora_rank >= 1 && e.lora_rank <= 1024, w, "lora_rank", "must be 1-1024"));
  CDCCA_RETURN_IF_ERROR(Check(e.lora_alpha > 0, w, "lora_alpha", "must be > 0"));
  CDCCA_RETURN_IF_ERROR(Check(!e.name.empty(), w, "name", "is required"));
  CDCCA_RETURN_IF_ERROR(Check(e.devices >= 1 && e.devices <= 64, w, "devices", "must be 1-64"));
  CDCCA_RETURN_IF_ERROR(Check(e.rounds >= 1 && e.rounds <= 100, w, "rounds", "must be 1-100"));
  CDCCA_RETURN_IF_ERROR(Check(e.stream_frames >= 1 && e.stream_frames <= 100000, w, "stream_frames",
                              "must be 1-100000"));
  CDCCA_RETURN_IF_ERROR(
      Check(e.eval_scenes >= 1 && e.eval_scenes <= 100000, w, "eval_scenes", "must be 1-100000"));
  CDCCA_RETURN_IF_ERROR(Check(!e.methods.empty(), w, "methods", "must name at least one method"));
  for (const std::string& m : e.methods) {
    const auto& known = KnownMethods();
    const MethodName parsed = ParseMethodName(m);
    CDCCA_RETURN_IF_ERROR(Check(parsed.token_ratio >= 0 && parsed.token_ratio <= 1, w, "methods",
                                absl::StrCat("has a bad token ratio in \"", m, "\"")));
    CDCCA_RETURN_IF_ERROR(Check(
        std::find(known.begin(), known.end(), parsed.base) != known.end(), w, "methods",
        absl::StrCat("has unknown method \"", m, "\" (known: ", absl::StrJoin(known, ", "), ")")));
  }
  if (e.captioning()) {
    CDCCA_RETURN_IF_ERROR(Check(!j.contains("schedule"), w, "schedule",
                                "must be left out of a caption experiment (every round streams "
                                "in-, near- and out-of-domain scenes)"));
    e.schedule = {RoundDomain{}};
  }
  if (auto it = j.find("schedule"); it != j.end()) {
    CDCCA_RETURN_IF_ERROR(Check(it->is_array(), w, "schedule", "must be an array"));
    for (size_t i = 0; i < it->size(); ++i) {
      const json& s = (*it)[i];
      const std::string where = absl::StrCat(w, ": schedule[", i, "]");
      CDCCA_RETURN_IF_ERROR(Check(s.is_object(), where, "", "must be an object"));
      RoundDomain d;
      Fields entry(s, where);
      CDCCA_RETURN_IF_ERROR(entry.Read("shift", &d.shift));
      CDCCA_RETURN_IF_ERROR(entry.Read("severity", &d.severity));
      CDCCA_RETURN_IF_ERROR(entry.Read("text", &d.text));
      CDCCA_RETURN_IF_ERROR(entry.Read("continual", &d.continual));
      CDCCA_RETURN_IF_ERROR(entry.OnlyKnown());
      CDCCA_RETURN_IF_ERROR(Check(datasets::ImageShiftFromName(d.shift).ok(), where, "shift",
                                  absl::StrCat("names no image shift: \"", d.shift, "\"")));
      CDCCA_RETURN_IF_ERROR(Check(d.severity >= 0 && d.severity <= datasets::kMaxSeverity, where,
                                  "severity", "must be 0-5"));
      CDCCA_RETURN_IF_ERROR(
          Check(d.shift == "none" || d.severity > 0, where, "severity", "must be 1-5 for a shift"));
      e.schedule.push_back(d);
    }
  }
  CDCCA_RETURN_IF_ERROR(Check(!e.schedule.empty(), w, "schedule", "must hold at least one round"));
  if (absl::StatusOr<model::TokenScoreKind> score = model::ParseTokenScore(e.uts.score);
      !score.ok()) {
    CDCCA_RETURN_IF_ERROR(Check(false, w, "uts_score", std::string(score.status().message())));
  }
  CDCCA_RETURN_IF_ERROR(Check(e.uts.keep_fraction > 0 && e.uts.keep_fraction <= 1, w,
                              "uts_keep_fraction", "must be in (0, 1]"));
  CDCCA_RETURN_IF_ERROR(Check(e.uts.token_ratio > 0 && e.uts.token_ratio <= 1, w, "uts_token_ratio",
                              "must be in (0, 1]"));
  CDCCA_RETURN_IF_ERROR(
      Check(e.uts.mc_passes >= 1 && e.uts.mc_passes <= 64, w, "uts_mc_passes", "must be 1-64"));
  CDCCA_RETURN_IF_ERROR(
      Check(e.uts.dropout_p >= 0 && e.uts.dropout_p < 1, w, "uts_dropout", "must be in [0, 1)"));
  CDCCA_RETURN_IF_ERROR(Check(compress::ParseFeaturePrecision(e.uts.precision).ok(), w,
                              "uplink_precision", "must be fp16, int8, int4 or jpeg"));
  // distill::CheckFp8BaseMode's names (this library does not link the distiller).
  CDCCA_RETURN_IF_ERROR(Check(fp8_base == "native" || fp8_base == "on" || fp8_base == "off", w,
                              "fp8_base", "must be native, on or off (or true / false)"));
  e.job.fp8_base = fp8_base.get<std::string>();
  // cloud::ParseGuardMeasure's names (this library does not link the cloud).
  CDCCA_RETURN_IF_ERROR(
      Check(e.job.guard_measure == "agreement" || e.job.guard_measure == "teacher_probability" ||
                e.job.guard_measure == "teacher_and_base",
            w, "guard_measure", "must be agreement, teacher_probability or teacher_and_base"));
  CDCCA_RETURN_IF_ERROR(
      Check(e.job.guard_confident_fraction > 0 && e.job.guard_confident_fraction <= 1, w,
            "guard_confident_fraction", "must be in (0, 1]"));
  CDCCA_RETURN_IF_ERROR(Check(e.job.guard_min_pool >= 0, w, "guard_min_pool", "must be >= 0"));
  CDCCA_RETURN_IF_ERROR(Check(e.job.guard_pool >= 1, w, "guard_pool", "must be >= 1"));
  CDCCA_RETURN_IF_ERROR(Check(e.uts.random_share >= 0 && e.uts.random_share < 1, w,
                              "uts_random_share", "must be in [0, 1)"));
  CDCCA_RETURN_IF_ERROR(Check(e.job.pool_samples >= 0 && e.job.pool_samples <= (1 << 20), w,
                              "pool_samples", "must be 0-1048576"));
  CDCCA_RETURN_IF_ERROR(Check(e.job.guard_holdout_fraction >= 0 && e.job.guard_holdout_fraction < 1,
                              w, "guard_holdout_fraction", "must be in [0, 1)"));
  CDCCA_RETURN_IF_ERROR(Check(e.job.device == "cpu" || e.job.device == "cuda", w, "device",
                              absl::StrCat("must be cpu or cuda, not \"", e.job.device, "\"")));
  CDCCA_RETURN_IF_ERROR(
      Check(e.job.workers >= 1 && e.job.workers <= 64, w, "trainer_threads", "must be 1-64"));
  CDCCA_RETURN_IF_ERROR(
      Check(e.job.max_steps >= 1 && e.job.max_steps <= 100000, w, "max_steps", "must be 1-100000"));
  CDCCA_RETURN_IF_ERROR(
      Check(e.job.batch_size >= 1 && e.job.batch_size <= 4096, w, "batch_size", "must be 1-4096"));
  if (auto it = j.find("cloud"); it != j.end()) {
    const std::string where = w + ": cloud";
    Fields f(*it, where);
    CDCCA_RETURN_IF_ERROR(f.Read("store", &e.cloud.store));
    CDCCA_RETURN_IF_ERROR(f.Read("fronts", &e.cloud.fronts));
    CDCCA_RETURN_IF_ERROR(f.Read("trainers", &e.cloud.trainers));
    CDCCA_RETURN_IF_ERROR(f.OnlyKnown());
    CDCCA_RETURN_IF_ERROR(
        Check(e.cloud.store == "files" || e.cloud.store == "postgresql", where, "store",
              absl::StrCat("must be files or postgresql, not \"", e.cloud.store, "\"")));
    CDCCA_RETURN_IF_ERROR(
        Check(e.cloud.fronts >= 1 && e.cloud.fronts <= 16, where, "fronts", "must be 1-16"));
    CDCCA_RETURN_IF_ERROR(
        Check(e.cloud.trainers >= 1 && e.cloud.trainers <= 16, where, "trainers", "must be 1-16"));
  }
  if (auto it = j.find("link"); it != j.end()) {
    const std::string where = w + ": link";
    Fields f(*it, where);
    CDCCA_RETURN_IF_ERROR(f.Read("up_mbit_s", &e.link.up_mbit_s));
    CDCCA_RETURN_IF_ERROR(f.Read("down_mbit_s", &e.link.down_mbit_s));
    CDCCA_RETURN_IF_ERROR(f.Read("latency_ms", &e.link.latency_ms));
    CDCCA_RETURN_IF_ERROR(f.Read("loss", &e.link.loss));
    CDCCA_RETURN_IF_ERROR(f.OnlyKnown());
    CDCCA_RETURN_IF_ERROR(Check(e.link.up_mbit_s >= 0 && e.link.down_mbit_s >= 0, where,
                                "up_mbit_s", "and down_mbit_s must be >= 0 (0 = unlimited)"));
    CDCCA_RETURN_IF_ERROR(
        Check(e.link.loss >= 0 && e.link.loss < 1, where, "loss", "must be in [0, 1)"));
    CDCCA_RETURN_IF_ERROR(Check(e.link.latency_ms >= 0, where, "latency_ms", "must be >= 0"));
  }
  CDCCA_RETURN_IF_ERROR(
      Check(settings::IsProfile(e.profile), w, "profile", "must be measured or paper"));
  CDCCA_RETURN_IF_ERROR(ApplyProfile(&e));
  CDCCA_RETURN_IF_ERROR(CheckExperiment(e, w));
  return e;
}

absl::Status ApplyProfile(Experiment* e) {
  if (!settings::IsProfile(e->profile)) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile must be measured or paper, not '", e->profile, "'"));
  }
  const std::string student = e->student_base.empty() ? e->checkpoint : e->student_base;
  const settings::ProfileSettings p =
      settings::ProfileDefaults(e->profile, cli::FolderModelType(student));
  if (!e->uplink_precision_given) e->uts.precision = p.uplink_precision;
  if (!e->lora_projector_given) e->lora_projector = p.lora_projector;
  return absl::OkStatus();
}

absl::Status CheckExperiment(const Experiment& e, const std::string& source_name) {
  const std::string& w = source_name;
  if (e.lora_vision && e.uts.precision != "jpeg") {
    return Check(false, w, "lora_vision",
                 absl::StrCat("trains the vision tower from the frames: it needs "
                              "\"uplink_precision\": \"jpeg\", not \"",
                              e.uts.precision, "\""));
  }
  if (e.teacher.empty() != e.student_base.empty()) {
    return Check(false, w, e.teacher.empty() ? "teacher" : "student_base",
                 "is required with the other: a Hugging Face pair names the teacher's folder and "
                 "the devices' student folder");
  }
  const std::string& score = e.uts.score;
  const absl::StatusOr<model::TokenScoreKind> kind = model::ParseTokenScore(score);
  CDCCA_RETURN_IF_ERROR(
      Check(kind.ok() && model::DeviceComputes(*kind), w, "uts_score",
            absl::StrCat("\"", score, "\": the device scores its visual tokens by ",
                         model::DeviceScoreNames())));
  return absl::OkStatus();
}

absl::StatusOr<Experiment> LoadExperiment(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read experiment file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseExperiment(ss.str(), path);
}

Experiment Shrink(Experiment e) {
  e.stream_frames = std::min(e.stream_frames, 64);
  e.eval_scenes = std::min(e.eval_scenes, 48);
  e.job.max_steps = std::min(e.job.max_steps, 20);
  e.devices = std::min(e.devices, 2);
  return e;
}

}  // namespace cdcca::sim
