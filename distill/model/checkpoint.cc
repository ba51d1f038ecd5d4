#include "distill/model/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "distill/model/layers.h"
#include "distill/model/safetensors.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

using nlohmann::json;

std::string ShapeString(const torch::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.sizes().vec(), ", "), "]");
}

// Every AdaptedLinear in `module`, by its name prefix.
std::vector<std::pair<std::string, std::shared_ptr<AdaptedLinearImpl>>> AdaptedLinears(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, std::shared_ptr<AdaptedLinearImpl>>> out;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    auto lin = std::dynamic_pointer_cast<AdaptedLinearImpl>(item.value());
    if (lin) out.emplace_back(item.key(), std::move(lin));
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

uint64_t Fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ULL;
  }
  return h;
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteTextAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    out << text;
    if (!out) return absl::UnavailableError(absl::StrCat("write failed: ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp));
  }
  return absl::OkStatus();
}

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

NamedTensors DequantizedState(const Mllm& model) {
  std::unordered_map<std::string, torch::Tensor> base;  // "<prefix>.qweight" -> fp32 weight
  for (const auto& [prefix, lin] : AdaptedLinears(*model)) {
    if (lin->options().precision != Precision::kFp32) {
      base.emplace(prefix + ".qweight", lin->BaseWeight().detach());
    }
  }
  NamedTensors out;
  for (auto& [name, t] : ModuleState(*model)) {
    auto it = base.find(name);
    if (it != base.end()) {
      out.emplace_back(name.substr(0, name.size() - 8) + ".weight", it->second);
    } else if (name.size() > 7 && name.compare(name.size() - 7, 7, ".qscale") == 0) {
      continue;
    } else {
      out.emplace_back(name, t);
    }
  }
  return out;
}

absl::StatusOr<Mllm> ConvertPrecision(const Mllm& model, Precision precision) {
  return CatchTorch("ConvertPrecision", [&]() -> absl::StatusOr<Mllm> {
    torch::NoGradGuard no_grad;
    TowerConfig c = model->config();
    c.precision = precision;
    Mllm dst(c);
    NamedTensors state = DequantizedState(model);
    std::unordered_map<std::string, torch::Tensor> by_name(state.begin(), state.end());
    std::set<std::string> skip;
    for (const auto& [prefix, lin] : AdaptedLinears(*dst)) {
      auto it = by_name.find(prefix + ".weight");
      if (it == by_name.end()) {
        return absl::InvalidArgumentError(absl::StrCat("missing tensor ", prefix, ".weight"));
      }
      lin->SetBaseWeight(it->second.to(torch::kCPU));
      skip.insert(prefix + ".weight");
      skip.insert(prefix + ".qweight");
      skip.insert(prefix + ".qscale");
    }
    if (absl::Status s = LoadStateExcept(*dst, state, skip); !s.ok()) return s;
    const auto params = model->parameters();
    if (!params.empty()) dst->to(params.front().device());
    dst->train(model->is_training());
    return dst;
  });
}

uint64_t BaseFingerprint(const Mllm& model) {
  NamedTensors state = DequantizedState(model);
  std::sort(state.begin(), state.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  uint64_t h = 14695981039346656037ULL;
  for (const auto& [name, t] : state) {
    if (IsTrainableName(name)) continue;
    h = Fnv1a(h, name.data(), name.size() + 1);
    for (int64_t s : t.sizes()) h = Fnv1a(h, &s, sizeof(s));
    torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat).contiguous();
    h = Fnv1a(h, c.data_ptr(), c.numel() * sizeof(float));
  }
  return h;
}

std::string FingerprintHex(uint64_t fingerprint) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(fingerprint));
  return buf;
}

int64_t LinearBaseBytes(const Mllm& model) {
  int64_t n = 0;
  for (const auto& [prefix, lin] : AdaptedLinears(*model)) n += lin->BaseBytes();
  return n;
}

void SetDequantCache(Mllm& model, bool on) {
  for (const auto& [prefix, lin] : AdaptedLinears(*model)) lin->set_cache_dequantized(on);
}

absl::Status SaveMllm(const std::string& path, const Mllm& model, const std::string& role) {
  return CatchTorch("SaveMllm", [&] {
    std::map<std::string, std::string> meta{
        {"format", "cdcca-mllm-v1"},
        {"role", role},
        {"tower_config", TowerConfigToJson(model->config())},
        {"fingerprint", FingerprintHex(BaseFingerprint(model))}};
    return WriteSafetensors(path, ModuleState(*model), meta);
  });
}

absl::StatusOr<Mllm> LoadMllm(const std::string& path) {
  absl::StatusOr<SafetensorsContents> file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  auto it = file->metadata.find("tower_config");
  if (it == file->metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no tower_config in metadata"));
  }
  absl::StatusOr<TowerConfig> config = ParseTowerConfig(it->second);
  if (!config.ok()) return config.status();
  return CatchTorch("LoadMllm", [&]() -> absl::StatusOr<Mllm> {
    Mllm model(*config);
    if (absl::Status s = LoadStateExcept(*model, file->tensors, {}); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
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

absl::StatusOr<Mllm> LoadMllm(const std::string& path, Precision precision) {
  absl::StatusOr<Mllm> model = LoadMllm(path);
  if (!model.ok() || (*model)->config().precision == precision) return model;
  absl::StatusOr<Mllm> converted = ConvertPrecision(*model, precision);
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

absl::Status SaveFamily(const std::string& dir, const FamilyConfig& config,
                        const VisionEncoder& encoder, const Mllm& teacher, const Mllm& student,
                        const std::string& extra_json) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  if (absl::Status s = SaveVisionEncoder(dir + "/encoder.safetensors", encoder); !s.ok()) return s;
  if (absl::Status s = SaveMllm(dir + "/teacher.safetensors", teacher, "teacher"); !s.ok())
    return s;
  if (absl::Status s = SaveMllm(dir + "/student.safetensors", student, "student"); !s.ok())
    return s;
  json j;
  j["name"] = config.name;
  j["vocabulary"] = config.vocabulary;
  j["vocab_size"] = config.vocab_size;
  j["vision"] = json::parse(VisionConfigToJson(encoder->config()));
  j["teacher"] = json::parse(TowerConfigToJson(teacher->config()));
  j["student"] = json::parse(TowerConfigToJson(student->config()));
  if (!config.pretrain_json.empty()) j["pretrain"] = json::parse(config.pretrain_json);
  j["fingerprints"] = {{"teacher", FingerprintHex(BaseFingerprint(teacher))},
                       {"student", FingerprintHex(BaseFingerprint(student))}};
  if (!extra_json.empty()) {
    try {
      j["training"] = json::parse(extra_json);
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("extra_json: ", e.what()));
    }
  }
  return WriteTextAtomically(dir + "/config.json", j.dump(2) + "\n");
}

absl::StatusOr<FamilyCheckpoint> LoadFamily(const std::string& dir, Precision student_precision) {
  absl::StatusOr<std::string> text = ReadText(dir + "/config.json");
  if (!text.ok()) return text.status();
  FamilyCheckpoint out;
  absl::StatusOr<FamilyConfig> config = ParseFamilyConfig(*text);
  if (!config.ok()) return config.status();
  out.config = *config;
  json j = json::parse(*text);
  absl::StatusOr<VisionEncoder> enc = LoadVisionEncoder(dir + "/encoder.safetensors");
  if (!enc.ok()) return enc.status();
  out.encoder = *enc;
  absl::StatusOr<Mllm> teacher = LoadMllm(dir + "/teacher.safetensors");
  if (!teacher.ok()) return teacher.status();
  absl::StatusOr<Mllm> student = LoadMllm(dir + "/student.safetensors");
  if (!student.ok()) return student.status();
  for (const auto& [role, m] : {std::pair<std::string, Mllm>{"teacher", *teacher},
                                std::pair<std::string, Mllm>{"student", *student}}) {
    if (j.contains("fingerprints") && j["fingerprints"].contains(role) &&
        j["fingerprints"][role].get<std::string>() != FingerprintHex(BaseFingerprint(m))) {
      return absl::DataLossError(
          absl::StrCat(dir, ": ", role, " does not match the fingerprint in config.json"));
    }
  }
  out.teacher = *teacher;
  out.student = *student;
  if ((*student)->config().precision != student_precision) {
    absl::StatusOr<Mllm> converted = ConvertPrecision(*student, student_precision);
    if (!converted.ok()) return converted.status();
    out.student = *converted;
    out.student->eval();
  }
  out.config.student.precision = student_precision;
  return out;
}

}  // namespace cdcca::model
