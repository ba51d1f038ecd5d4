#include "model/hub/adapter_state.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "model/hub/fnv.h"
#include "model/hub/folder_json.h"
#include "model/hub/safetensors.h"

namespace cdcca::model {
namespace {

constexpr char kStateJson[] = "adapter_state.json";
constexpr char kStateTensors[] = "adapter_state.safetensors";
constexpr char kFormat[] = "cdcca-hf-adapter-state";

absl::Status MakeDir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::Status SaveHfAdapterState(const AdapterState& state, const std::string& dir) {
  if (absl::Status s = MakeDir(dir); !s.ok()) return s;
  nlohmann::json j = {{"format", kFormat},
                      {"version", 1},
                      {"base_model", state.base_model},
                      {"precision", state.precision},
                      {"lora_rank", state.adapters.lora_rank},
                      {"lora_alpha", state.adapters.lora_alpha},
                      {"lora_mlp", state.adapters.lora_mlp},
                      {"lora_qformer", state.adapters.lora_qformer},
                      {"lora_projector", state.adapters.lora_projector},
                      {"lora_vision", state.adapters.lora_vision},
                      {"lora_vision_mlp", state.adapters.lora_vision_mlp},
                      {"seed", state.adapters.seed},
                      {"tensors", state.trainable.size()}};
  if (!state.info.is_null()) j["info"] = state.info;
  NamedTensors cpu;
  for (const auto& [name, t] : state.trainable) {
    cpu.emplace_back(name, t.detach().to(torch::kCPU, torch::kFloat).contiguous());
  }
  if (absl::Status s = WriteSafetensors(dir + "/" + kStateTensors, cpu, {{"format", kFormat}});
      !s.ok()) {
    return s;
  }
  return WriteFileAtomically(dir + "/" + kStateJson, j.dump(2) + "\n");
}

absl::StatusOr<AdapterState> LoadHfAdapterState(const std::string& dir) {
  const std::string path = dir + "/" + kStateJson;
  if (!std::filesystem::exists(path)) {
    return absl::NotFoundError(absl::StrCat(path,
                                            ": no adapter state here (write one with "
                                            "`cdcca adapt --out DIR`)"));
  }
  absl::StatusOr<nlohmann::json> j = ReadJsonFile(path);
  if (!j.ok()) return j.status();
  AdapterState state;
  try {
    if (!j->is_object() || j->value("format", "") != kFormat) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field format is not \"", kFormat, "\""));
    }
    if (j->value("version", 0) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": field version is not 1"));
    }
    state.base_model = j->at("base_model").get<std::string>();
    state.precision = j->at("precision").get<std::string>();
    state.adapters.lora_rank = j->at("lora_rank").get<int64_t>();
    state.adapters.lora_alpha = j->at("lora_alpha").get<double>();
    state.adapters.lora_mlp = j->at("lora_mlp").get<bool>();
    state.adapters.lora_qformer = j->value("lora_qformer", false);      // absent before it existed
    state.adapters.lora_projector = j->value("lora_projector", false);  // likewise
    state.adapters.lora_vision = j->value("lora_vision", false);        // likewise
    state.adapters.lora_vision_mlp = j->value("lora_vision_mlp", false);  // likewise
    state.adapters.seed = j->at("seed").get<uint64_t>();
    if (j->contains("info")) state.info = (*j)["info"];
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  absl::StatusOr<SafetensorsContents> tensors = ReadSafetensors(dir + "/" + kStateTensors);
  if (!tensors.ok()) return tensors.status();
  for (auto& [name, t] : tensors->tensors) {
    if (t.scalar_type() != torch::kFloat) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, "/", kStateTensors, ": tensor ", name, " is not float32"));
    }
    state.trainable.emplace_back(name, t);
  }
  return state;
}

absl::Status ApplyHfAdapterState(const AdapterState& state, MultimodalModel& model) {
  if (absl::Status s = model.AddAdapters(state.adapters); !s.ok()) return s;
  NamedTensors live = model.TrainableParameters();
  std::map<std::string, torch::Tensor> by_name(live.begin(), live.end());
  std::set<std::string> seen;
  // Check everything before writing anything.
  for (const auto& [name, t] : state.trainable) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("adapter state tensor ", name, " is not in the model's trainable set"));
    }
    if (it->second.sizes() != t.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat("adapter state tensor ", name, " has shape ",
                                                     c10::str(t.sizes()), ", the model's is ",
                                                     c10::str(it->second.sizes())));
    }
    seen.insert(name);
  }
  for (const auto& [name, t] : live) {
    if (!seen.count(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the model's trainable tensor ", name, " is missing from the state"));
    }
  }
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : state.trainable) by_name[name].copy_(t);
  return absl::OkStatus();
}

namespace {

// PEFT's target_modules as a regex over module names: the LM's adapted kinds, the Q-Former's
// where it has LoRA, and the modules targeted by their paths (PathTarget: the projector into
// the LM, the vision tower's attention), which name no LM or Q-Former kind.
std::string PeftTargetRegex(const std::set<std::string>& lm, const std::set<std::string>& qformer,
                            const std::set<std::string>& paths) {
  auto alternatives = [](const std::set<std::string>& kinds) {
    std::string alt;
    for (const std::string& t : kinds) absl::StrAppend(&alt, alt.empty() ? "" : "|", t);
    return alt;
  };
  std::string regex = absl::StrCat(".*language_model.*\\.(", alternatives(lm), ")");
  if (!qformer.empty()) {
    regex = absl::StrCat("(", regex, ")|(.*qformer.*\\.(", alternatives(qformer), "))");
  }
  if (!paths.empty()) {
    std::string alt;
    for (const std::string& m : paths) {
      absl::StrAppend(&alt, alt.empty() ? "" : "|", absl::StrReplaceAll(m, {{".", "\\."}}));
    }
    regex = absl::StrCat("(", regex, ")|(.*(", alt, "))");
  }
  return regex;
}

// A LoRA module PEFT targets by its path: on the projector into the LM (lora_projector) or
// in the vision tower (lora_vision), whose layers have q/v-like names the LM's kinds would
// also match. The module's path from the part on ("multi_modal_projector.linear_1",
// "vision_model.encoder.layers.0.self_attn.qkv"), or "" for a module targeted by its kind.
std::string PathTarget(const std::string& module) {
  for (const char* anchor :
       {"multi_modal_projector.", "language_projection", "vision_tower.", "vision_model."}) {
    if (const size_t at = module.find(anchor); at != std::string::npos) return module.substr(at);
  }
  return "";
}

// A canonical name as transformers 5 names the module: its LLaVA vision tower is the
// vision transformer itself (`model.vision_tower.encoder...`), where the canonical names keep
// transformers 4's `vision_model.` level (model/hub/model_folder.cc).
std::string PeftName(const std::string& name) {
  constexpr absl::string_view kTower = "model.vision_tower.vision_model.";
  if (absl::StartsWith(name, kTower)) {
    return absl::StrCat("model.vision_tower.", name.substr(kTower.size()));
  }
  return name;
}

}  // namespace

absl::Status ExportPeftAdapter(const AdapterState& state, const std::string& out_dir) {
  NamedTensors lora, rest;
  std::set<std::string> lm_targets, qformer_targets, path_targets;
  std::map<std::string, int> factors;  // module -> A and B seen
  for (const auto& [name, t] : state.trainable) {
    const bool a = absl::EndsWith(name, ".lora_a"), b = absl::EndsWith(name, ".lora_b");
    if (!a && !b) {
      rest.emplace_back(PeftName(name), t);
      continue;
    }
    const std::string module =
        PeftName(name.substr(0, name.size() - std::string(".lora_a").size()));
    factors[module] += a ? 1 : 2;
    if (const std::string path = PathTarget(module); !path.empty()) {
      path_targets.insert(path);
    } else {
      (absl::StrContains(module, "qformer.") ? qformer_targets : lm_targets)
          .insert(module.substr(module.rfind('.') + 1));
    }
    lora.emplace_back(
        absl::StrCat("base_model.model.", module, a ? ".lora_A" : ".lora_B", ".weight"), t);
  }
  for (const auto& [module, seen] : factors) {
    if (seen != 3) {
      return absl::InvalidArgumentError(
          absl::StrCat("LoRA of ", module, " lacks its ", seen == 1 ? "B" : "A", " factor"));
    }
  }
  if (absl::Status s = MakeDir(out_dir); !s.ok()) return s;
  nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", nullptr},
      {"base_model_name_or_path", state.base_model},
      {"r", state.adapters.lora_rank},
      {"lora_alpha", state.adapters.lora_alpha},
      {"lora_dropout", 0.0},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"use_rslora", false},
      {"use_dora", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
      {"modules_to_save", nullptr},
      // Names of the adapted linears, restricted to the language model (the Q-Former and the
      // vision tower also have q/v-like names in some architectures), and to the Q-Former's
      // query and value where it has LoRA (lora_qformer), and the projector's linears where
      // they have (lora_projector), and the vision tower's attention (lora_vision) and MLP
      // (lora_vision_mlp) where they have, by their paths.
      {"target_modules", PeftTargetRegex(lm_targets, qformer_targets, path_targets)}};
  if (absl::Status s = WriteFileAtomically(out_dir + "/adapter_config.json", config.dump(2) + "\n");
      !s.ok()) {
    return s;
  }
  for (const auto& [file, tensors] : {std::make_pair("adapter_model.safetensors", &lora),
                                      std::make_pair("non_lora.safetensors", &rest)}) {
    if (absl::Status s = WriteSafetensors(out_dir + "/" + file, *tensors, {{"format", "pt"}});
        !s.ok()) {
      return s;
    }
  }
  const std::string readme = absl::StrCat(
      "# cdcca adapter export\n\n"
      "The adapted student of `",
      state.base_model, "`: a PEFT LoRA adapter (LoRA on the language model's ", lm_targets.size(),
      " projection kinds) plus the other adapted tensors (norms, biases",
      ", query tokens or projector biases) in `non_lora.safetensors`.\n\n"
      "```python\n"
      "import safetensors.torch, transformers, peft\n"
      "model = transformers.AutoModelForImageTextToText.from_pretrained(BASE)\n"
      "model.load_state_dict(safetensors.torch.load_file(\"non_lora.safetensors\"), "
      "strict=False)\n"
      "model = peft.PeftModel.from_pretrained(model, THIS_FOLDER)\n"
      "```\n");
  return WriteFileAtomically(out_dir + "/README.md", readme);
}

absl::StatusOr<uint64_t> FolderFingerprint(const std::string& dir) {
  constexpr uint64_t kWindow = 64 << 10;
  constexpr uint64_t kWindows = 256;
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == "config.json" || absl::EndsWith(name, ".safetensors")) files.push_back(name);
  }
  if (ec) return absl::NotFoundError(absl::StrCat(dir, ": ", ec.message()));
  std::sort(files.begin(), files.end());
  uint64_t h = kFnvOffset;
  std::vector<char> buf(kWindow);
  for (const std::string& name : files) {
    const std::string path = dir + "/" + name;
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
    const uint64_t size = static_cast<uint64_t>(in.tellg());
    h = Fnv1a(h, name.c_str(), name.size() + 1);
    h = Fnv1a(h, &size, sizeof(size));
    const uint64_t step = std::max<uint64_t>(kWindow, size / kWindows);
    for (uint64_t off = 0; off < size; off += step) {
      const uint64_t n = std::min<uint64_t>(kWindow, size - off);
      in.seekg(static_cast<std::streamoff>(off));
      if (!in.read(buf.data(), static_cast<std::streamsize>(n))) {
        return absl::DataLossError(absl::StrCat("reading ", path, " at ", off));
      }
      h = Fnv1a(h, buf.data(), n);
    }
  }
  return h;
}

uint64_t StudentBaseFingerprint(uint64_t folder_fingerprint, const std::string& precision,
                                const AdapterOptions& adapters, uint64_t initial_trainable_digest) {
  uint64_t h = kFnvOffset;
  h = Fnv1a(h, &folder_fingerprint, sizeof(folder_fingerprint));
  h = Fnv1a(h, precision.c_str(), precision.size() + 1);
  h = Fnv1a(h, &adapters.lora_rank, sizeof(adapters.lora_rank));
  h = Fnv1a(h, &adapters.lora_alpha, sizeof(adapters.lora_alpha));
  const uint8_t mlp = adapters.lora_mlp ? 1 : 0;
  h = Fnv1a(h, &mlp, 1);
  // Hashed only when on, so every fingerprint without it stays what it was.
  if (adapters.lora_qformer) h = Fnv1a(h, "qformer", 7);
  if (adapters.lora_projector) h = Fnv1a(h, "projector", 9);
  if (adapters.lora_vision) h = Fnv1a(h, "vision", 6);
  if (adapters.lora_vision_mlp) h = Fnv1a(h, "vision_mlp", 10);
  h = Fnv1a(h, &adapters.seed, sizeof(adapters.seed));
  return Fnv1a(h, &initial_trainable_digest, sizeof(initial_trainable_digest));
}

}  // namespace cdcca::model
