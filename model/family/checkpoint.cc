#include "model/family/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/arch/hf_linear.h"
#include "model/hub/fnv.h"
#include "model/hub/safetensors.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

using nlohmann::json;

std::string ShapeString(const torch::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes().vec(), ", "), "]");
}

// Every HfLinear in `module`, by its name prefix.
std::vector<std::pair<std::string, HfLinearImpl*>> Linears(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, HfLinearImpl*>> out;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    if (auto* lin = dynamic_cast<HfLinearImpl*>(item.value().get())) {
      out.emplace_back(item.key(), lin);
    }
  }
  return out;
}

// Strict copy of `state` into `module`, except targets named in `skip` (filled elsewhere)
// and sources named in `ignore`.
absl::Status LoadStateExcept(torch::nn::Module& module, const NamedTensors& state,
                             const std::set<std::string>& skip) {
  std::unordered_map<std::string, torch::Tensor> targets;
  for (auto& [name, t] : ModuleState(module)) {
    if (skip.count(name) == 0) targets.emplace(name, t);
  }
  std::set<std::string> seen;
  for (const auto& [name, src] : state) {
    if (skip.count(name) != 0) continue;
    auto it = targets.find(name);
    if (it == targets.end()) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected tensor ", name));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " given twice"));
    }
    if (src.sizes() != it->second.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has shape ",
                                                     ShapeString(src), ", expected ",
                                                     ShapeString(it->second)));
    }
    if (src.scalar_type() != it->second.scalar_type()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", name, " has dtype ", c10::toString(src.scalar_type()),
                       ", expected ", c10::toString(it->second.scalar_type())));
    }
  }
  for (const auto& [name, t] : targets) {
    if (seen.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("missing tensor ", name));
    }
  }
  torch::NoGradGuard no_grad;
  for (const auto& [name, src] : state) {
    if (skip.count(name) != 0) continue;
    targets.at(name).copy_(src);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Seed of the adaptation parameters (LoRA, adapter prompts) a family starts from.
constexpr uint64_t kAdaptationSeed = 0x63646363;  // "cdcc"

template <typename F>
auto CatchTorch(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  }
}

}  // namespace

NamedTensors ModuleState(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& item : module.named_parameters(true)) out.emplace_back(item.key(), item.value());
  for (const auto& item : module.named_buffers(true)) out.emplace_back(item.key(), item.value());
  return out;
}

absl::Status LoadModuleState(torch::nn::Module& module, const NamedTensors& state) {
  return CatchTorch("LoadModuleState", [&] { return LoadStateExcept(module, state, {}); });
}

NamedTensors DequantizedState(const Blip2Tower& model) {
  torch::NoGradGuard no_grad;
  std::unordered_map<std::string, torch::Tensor> base;  // "<prefix>.weight" -> fp32 weight
  for (const auto& [prefix, lin] : Linears(*model)) {
    if (lin->quantized())
      base.emplace(prefix + ".weight", lin->EffectiveWeight().to(torch::kFloat));
  }
  NamedTensors out;
  for (auto& [name, t] : ModuleState(*model)) {
    auto it = base.find(name);
    out.emplace_back(name, it != base.end() ? it->second : t);
  }
  return out;
}

absl::StatusOr<Blip2Tower> ConvertPrecision(const Blip2Tower& model, Precision precision) {
  return CatchTorch("ConvertPrecision", [&]() -> absl::StatusOr<Blip2Tower> {
    torch::NoGradGuard no_grad;
    const auto params = model->parameters();
    if (!params.empty() && !params.front().device().is_cpu()) {
      return absl::FailedPreconditionError("ConvertPrecision: the tower must be on the CPU");
    }
    // Modules are const only in name here: conversion reads the source.
    Blip2Tower dst = ConvertTowerPrecision(*model.ptr(), precision);
    dst->train(model->is_training());
    return dst;
  });
}

absl::StatusOr<Blip2Tower> CopyTower(const Blip2Tower& model) {
  return CatchTorch("CopyTower", [&]() -> absl::StatusOr<Blip2Tower> {
    Blip2Tower copy(model->config());
    const auto params = model->parameters();
    if (!params.empty()) copy->to(params.front().device());
    // A quantized layer's "weight" is a one-element placeholder: the layer adopts the
    // source's packed weight instead, and the state copy skips the placeholder.
    std::map<std::string, HfLinearImpl*> sources;
    for (const auto& [name, lin] : Linears(*model)) sources.emplace(name, lin);
    std::set<std::string> packed;
    for (const auto& [name, lin] : Linears(*copy)) {
      if (!lin->quantized()) continue;
      if (absl::Status s = lin->AdoptQuantized(sources.at(name)->quantized_weight()); !s.ok()) {
        return absl::InternalError(absl::StrCat("copying ", name, ": ", s.message()));
      }
      packed.insert(name + ".weight");
    }
    if (absl::Status s = LoadStateExcept(*copy, ModuleState(*model), packed); !s.ok()) return s;
    copy->train(model->is_training());
    return copy;
  });
}

namespace {

// FNV-1a 64 over `state` sorted by name: each name, shape and fp32 value bytes.
uint64_t StateFingerprint(NamedTensors state) {
  std::sort(state.begin(), state.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  uint64_t h = kFnvOffset;
  for (const auto& [name, t] : state) {
    h = Fnv1a(h, name.data(), name.size() + 1);
    for (int64_t s : t.sizes()) h = Fnv1a(h, &s, sizeof(s));
    torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat).contiguous();
    h = Fnv1a(h, c.data_ptr(), c.numel() * sizeof(float));
  }
  return h;
}

}  // namespace

uint64_t BaseFingerprint(const Blip2Tower& model) {
  NamedTensors frozen;
  for (auto& [name, t] : DequantizedState(model)) {
    if (!IsTrainableName(name)) frozen.emplace_back(name, t);
  }
  return StateFingerprint(std::move(frozen));
}

uint64_t ModuleFingerprint(const torch::nn::Module& module) {
  return StateFingerprint(ModuleState(module));
}

std::string FingerprintHex(uint64_t fingerprint) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(fingerprint));
  return buf;
}

int64_t LinearBaseBytes(const Blip2Tower& model) { return TowerLinearWeightBytes(*model.ptr()); }

absl::Status SaveTower(const std::string& path, const Blip2Tower& model, const std::string& role) {
  return CatchTorch("SaveTower", [&] {
    std::map<std::string, std::string> meta{
        {"format", "cdcca-tower-v1"},
        {"role", role},
        {"tower_config", TowerConfigToJson(model->config())},
        {"fingerprint", FingerprintHex(BaseFingerprint(model))}};
    return WriteSafetensors(path, DequantizedState(model), meta);
  });
}

absl::StatusOr<Blip2Tower> LoadTower(const std::string& path) {
  absl::StatusOr<SafetensorsContents> file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  auto it = file->metadata.find("tower_config");
  if (it == file->metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no tower_config in metadata"));
  }
  absl::StatusOr<TowerConfig> config = ParseTowerConfig(it->second);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(path, ": tower_config: ", config.status().message()));
  }
  return CatchTorch("LoadTower", [&]() -> absl::StatusOr<Blip2Tower> {
    TowerConfig fp32 = *config;
    fp32.precision = Precision::kFp32;
    Blip2Tower model(fp32);
    if (absl::Status s = LoadStateExcept(*model, file->tensors, {}); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
    }
    if (config->precision != Precision::kFp32) {
      model = ConvertTowerPrecision(*model, config->precision);
    }
    auto fp = file->metadata.find("fingerprint");
    if (fp != file->metadata.end() && fp->second != FingerprintHex(BaseFingerprint(model))) {
      return absl::DataLossError(
          absl::StrCat(path, ": frozen base does not match its fingerprint"));
    }
    model->eval();
    return model;
  });
}

absl::StatusOr<Blip2Tower> LoadTower(const std::string& path, Precision precision) {
  absl::StatusOr<Blip2Tower> model = LoadTower(path);
  if (!model.ok() || (*model)->config().precision == precision) return model;
  absl::StatusOr<Blip2Tower> converted = ConvertPrecision(*model, precision);
  if (converted.ok()) (*converted)->eval();
  return converted;
}

absl::Status SaveVisionEncoder(const std::string& path, const VisionEncoder& encoder) {
  return CatchTorch("SaveVisionEncoder", [&] {
    return WriteSafetensors(
        path, ModuleState(*encoder),
        {{"format", "cdcca-vision-v1"}, {"vision_config", VisionConfigToJson(encoder->config())}});
  });
}

absl::StatusOr<VisionEncoder> LoadVisionEncoder(const std::string& path) {
  absl::StatusOr<SafetensorsContents> file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  auto it = file->metadata.find("vision_config");
  if (it == file->metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no vision_config in metadata"));
  }
  absl::StatusOr<VisionConfig> config = ParseVisionConfig(it->second);
  if (!config.ok()) return config.status();
  return CatchTorch("LoadVisionEncoder", [&]() -> absl::StatusOr<VisionEncoder> {
    VisionEncoder enc(*config);
    if (absl::Status s = LoadStateExcept(*enc, file->tensors, {}); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
    }
    enc->eval();
    return enc;
  });
}

namespace {

// While alive, torch's default CPU generator is seeded with kAdaptationSeed; the caller's
// random stream is restored afterwards. What LoadFamily builds (fresh LoRA and adapter
// prompts, the encoder's placeholder init) is then the same on every machine.
class FixedSeedScope {
 public:
  FixedSeedScope() : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    saved_ = gen_.get_state();
    gen_.set_current_seed(kAdaptationSeed);
  }
  ~FixedSeedScope() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(saved_);
  }
  FixedSeedScope(const FixedSeedScope&) = delete;
  FixedSeedScope& operator=(const FixedSeedScope&) = delete;

 private:
  at::Generator gen_;
  torch::Tensor saved_;
};

absl::StatusOr<LoadedFamilyTower> LoadFamilyTower(const std::string& dir,
                                                  const VisionConfig& vision,
                                                  const TowerConfig& tower) {
  FixedSeedScope seeded;
  return LoadBlip2FamilyFolder(dir, vision, tower);
}

json FamilyJson(const FamilyConfig& config, const VisionConfig& vision, const TowerConfig& teacher,
                const TowerConfig& student) {
  json j;
  j["name"] = config.name;
  j["vocabulary"] = config.vocabulary;
  j["vocab_size"] = config.vocab_size;
  j["vision"] = json::parse(VisionConfigToJson(vision));
  j["teacher"] = json::parse(TowerConfigToJson(teacher));
  j["student"] = json::parse(TowerConfigToJson(student));
  if (!config.pretrain_json.empty()) j["pretrain"] = json::parse(config.pretrain_json);
  return j;
}

}  // namespace

absl::Status SaveFamily(const std::string& dir, const FamilyConfig& config,
                        const VisionEncoder& encoder, const Blip2Tower& teacher,
                        const Blip2Tower& student, const std::string& extra_json,
                        const std::vector<std::string>& vocabulary) {
  json family = FamilyJson(config, encoder->config(), teacher->config(), student->config());
  if (!extra_json.empty()) {
    try {
      family["training"] = json::parse(extra_json);
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("extra_json: ", e.what()));
    }
  }
  return CatchTorch("SaveFamily", [&]() -> absl::Status {
    Blip2VisionModelImpl& vit = *encoder.ptr()->vision_model.ptr();
    const std::string teacher_dir = dir + "/teacher";
    if (absl::Status s =
            SaveBlip2FamilyFolder(teacher_dir, vit, *teacher.ptr(), encoder->config(), vocabulary);
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            SaveBlip2FamilyFolder(dir, vit, *student.ptr(), encoder->config(), vocabulary);
        !s.ok()) {
      return s;
    }
    // The fingerprints of what LoadFamily will build (LoRA folded into the weights).
    json fingerprints;
    for (const auto& [role, folder, tower] :
         {std::tuple<std::string, std::string, TowerConfig>{"teacher", teacher_dir,
                                                            teacher->config()},
          std::tuple<std::string, std::string, TowerConfig>{"student", dir, student->config()}}) {
      absl::StatusOr<LoadedFamilyTower> loaded = LoadFamilyTower(folder, encoder->config(), tower);
      if (!loaded.ok()) return loaded.status();
      fingerprints[role] = FingerprintHex(BaseFingerprint(loaded->tower));
    }
    family["fingerprints"] = fingerprints;
    json student_config = FamilyHfConfigJson(encoder->config(), student->config());
    student_config["cdcca"]["role"] = "student";
    student_config["cdcca"]["family"] = family;
    json teacher_config = FamilyHfConfigJson(encoder->config(), teacher->config());
    teacher_config["cdcca"]["role"] = "teacher";
    if (absl::Status s =
            WriteFileAtomically(teacher_dir + "/config.json", teacher_config.dump(2) + "\n");
        !s.ok()) {
      return s;
    }
    return WriteFileAtomically(dir + "/config.json", student_config.dump(2) + "\n");
  });
}

absl::StatusOr<FamilyCheckpoint> LoadFamily(const std::string& dir, Precision student_precision) {
  absl::StatusOr<std::string> text = ReadText(dir + "/config.json");
  if (!text.ok()) return text.status();
  FamilyCheckpoint out;
  absl::StatusOr<FamilyConfig> config = ParseFamilyConfig(*text);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(dir, "/config.json: ", config.status().message()));
  }
  out.config = *config;
  const json fingerprints =
      json::parse(*text)["cdcca"]["family"].value("fingerprints", json::object());
  absl::StatusOr<LoadedFamilyTower> teacher =
      LoadFamilyTower(dir + "/teacher", config->vision, config->teacher);
  if (!teacher.ok()) return teacher.status();
  absl::StatusOr<LoadedFamilyTower> student = LoadFamilyTower(dir, config->vision, config->student);
  if (!student.ok()) return student.status();
  return CatchTorch("LoadFamily", [&]() -> absl::StatusOr<FamilyCheckpoint> {
    for (const auto& [role, m] : {std::pair<std::string, Blip2Tower>{"teacher", teacher->tower},
                                  std::pair<std::string, Blip2Tower>{"student", student->tower}}) {
      if (fingerprints.contains(role) && fingerprints[role].is_string() &&
          fingerprints[role].get<std::string>() != FingerprintHex(BaseFingerprint(m))) {
        return absl::DataLossError(
            absl::StrCat(dir, ": the ", role, " does not match its fingerprint in config.json"));
      }
    }
    // A pair shares one vision tower: the teacher reads the tokens of the student's (which
    // the devices run and uplink from), so the two folders must hold the same ViT.
    const uint64_t teacher_vit = ModuleFingerprint(*teacher->vit);
    const uint64_t student_vit = ModuleFingerprint(*student->vit);
    if (teacher_vit != student_vit) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir, ": the teacher's vision tower (", dir, "/teacher, fingerprint ",
          FingerprintHex(teacher_vit), ") is not the student's (", FingerprintHex(student_vit),
          "): a teacher-student pair must share one vision tower"));
    }
    {
      FixedSeedScope seeded;
      out.encoder = VisionEncoder(config->vision);
    }
    out.encoder->vision_model = student->vit;
    out.encoder->replace_module("vision_model", student->vit);
    SetAllTrainable(*out.encoder, false);
    out.encoder->eval();
    out.teacher = teacher->tower;
    out.teacher->eval();
    out.student = student->tower;
    if (config->student.precision != student_precision) {
      out.student = ConvertTowerPrecision(*out.student, student_precision);
    }
    out.student->eval();
    out.config.student.precision = student_precision;
    return out;
  });
}

}  // namespace cdcca::model
