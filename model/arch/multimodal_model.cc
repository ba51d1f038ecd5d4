#include "model/arch/multimodal_model.h"

#include <cstdlib>  // defines __GLIBC__ where glibc is the C library
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "model/arch/blip2.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/llava.h"
#include "model/hub/adapter_state.h"
#include "model/hub/fnv.h"
#include "model/hub/folder_config.h"
#include "model/hub/weight_pack.h"

namespace cdcca::model {
namespace {

struct ModelTypeEntry {
  const char* model_type;
  ModelLoader load;
};
// config.json model_type -> loader. BLIP-2 and InstructBLIP register here.
const ModelTypeEntry kModelTypes[] = {
    {"llava", LoadLlavaModel},
    {"blip-2", LoadBlip2Model},
    {"instructblip", LoadBlip2Model},
};

}  // namespace

absl::StatusOr<WeightPrecision> ResolveHfPrecision(const ModelOptions& options) {
  WeightPrecision p;
  const bool cuda = options.device.is_cuda();
  if (options.precision == "fp32") {
    p.dtype = torch::kFloat;
  } else if (options.precision == "bf16") {
    p.dtype = torch::kBFloat16;
  } else if (options.precision == "fp16") {
    p.dtype = torch::kHalf;
  } else if (options.precision == "int8" || options.precision == "int4") {
    p.weights = options.precision == "int8" ? Precision::kInt8 : Precision::kInt4;
    p.dtype = cuda ? torch::kBFloat16 : torch::kFloat;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "precision \"", options.precision, "\" is not one of fp32, bf16, fp16, int8, int4"));
  }
  if (options.int4_group != 32 && options.int4_group != 64 && options.int4_group != 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("int4 group ", options.int4_group, " is not 32, 64 or 128"));
  }
  p.int4_group = options.int4_group;
  return p;
}

absl::StatusOr<std::unique_ptr<MultimodalModel>> LoadModel(const std::string& dir,
                                                           const ModelOptions& options) {
  absl::StatusOr<WeightPrecision> precision = ResolveHfPrecision(options);
  if (!precision.ok()) return precision.status();
  absl::StatusOr<ModelFolder> folder = ModelFolder::Open(dir);
  if (!folder.ok()) return folder.status();
  // ModelFolder::Open checked it: a string, absent or null ("").
  const std::string type = ConfigModelType(folder->config(), folder->config_path()).value_or("");
  for (const ModelTypeEntry& t : kModelTypes) {
    if (type != t.model_type) continue;
    std::unique_ptr<WeightPack> pack;
    WeightPackWriter writer;
    uint64_t fingerprint = 0;
    using Use = ModelOptions::WeightPackUse;
    if (precision->weights != Precision::kFp32 && options.weight_pack != Use::kIgnore) {
      absl::StatusOr<uint64_t> f = FolderFingerprint(dir);
      if (!f.ok()) return f.status();
      fingerprint = *f;
      std::string why;
      pack = WeightPack::Find(dir, precision->weights, precision->int4_group, fingerprint, &why);
      if (!why.empty()) std::fprintf(stderr, "not using a weight pack: %s\n", why.c_str());
      folder->UsePack(pack.get(),
                      options.weight_pack == Use::kWrite && pack == nullptr ? &writer : nullptr);
    }
    absl::StatusOr<std::unique_ptr<MultimodalModel>> model =
        t.load(*folder, *precision, options.device);
    if (model.ok() && writer.tensors() > 0) {
      if (absl::Status s =
              writer.Write(dir, precision->weights, precision->int4_group, fingerprint);
          !s.ok()) {
        return s;
      }
    }
    if (options.weight_pack_report != nullptr) {
      *options.weight_pack_report = {
          pack ? pack->path() : "", pack ? pack->loads() : 0,
          writer.tensors() > 0 ? WeightPack::PathFor(dir, precision->weights, precision->int4_group)
                               : "",
          writer.tensors(), writer.bytes()};
    }
#ifdef __GLIBC__
    // Loading freed the checkpoint's float tensors (quantized or converted); hand the heap
    // pages back so the process's resident memory is what the model holds.
    malloc_trim(0);
#endif
    return model;
  }
  std::string known;
  for (const ModelTypeEntry& t : kModelTypes)
    absl::StrAppend(&known, known.empty() ? "" : ", ", t.model_type);
  return absl::InvalidArgumentError(absl::StrCat(folder->config_path(), ": field model_type = \"",
                                                 type, "\" is not supported (", known, ")"));
}

absl::StatusOr<uint64_t> TowerFingerprint(const std::string& dir) {
  absl::StatusOr<ModelFolder> folder = ModelFolder::Open(dir);
  if (!folder.ok()) return folder.status();
  const std::string type = ConfigModelType(folder->config(), folder->config_path()).value_or("");
  // The tower's canonical prefixes (model_folder.h) per architecture.
  std::vector<std::string> prefixes;
  if (type == "llava") {
    prefixes = {"model.vision_tower."};
  } else if (type == "blip-2" || type == "instructblip") {
    prefixes = {"vision_model.", "model.vision_model."};
  } else {
    return absl::InvalidArgumentError(absl::StrCat(folder->config_path(), ": field model_type = \"",
                                                   type, "\" has no vision tower known"));
  }
  // FNV-1a 64 over (name below the prefix, shape, fp32 values), names sorted.
  uint64_t h = kFnvOffset;
  auto mix = [&h](const void* data, size_t n) { h = Fnv1a(h, data, n); };
  std::vector<std::pair<std::string, std::string>> names;  // (local, canonical)
  for (const std::string& name : folder->Names()) {
    for (const std::string& prefix : prefixes) {
      if (absl::StartsWith(name, prefix)) {
        names.emplace_back(name.substr(prefix.size()), name);
        break;
      }
    }
  }
  if (names.empty()) {
    return absl::NotFoundError(absl::StrCat(dir, ": no vision tower tensors (", prefixes[0], "*)"));
  }
  std::sort(names.begin(), names.end());
  try {
    for (const auto& [local, canonical] : names) {
      mix(local.c_str(), local.size() + 1);
      absl::StatusOr<torch::Tensor> t = folder->Load(canonical, torch::kFloat);
      if (!t.ok()) return t.status();
      for (int64_t s : t->sizes()) mix(&s, sizeof(s));
      torch::Tensor c = t->to(torch::kFloat).contiguous();
      mix(c.data_ptr(), static_cast<size_t>(c.numel()) * sizeof(float));
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(dir, ": vision fingerprint: ", e.what_without_backtrace()));
  }
  if (type == "llava") {
    // Which hidden states are the tokens is part of what the teacher reads.
    const nlohmann::json& c = folder->config();
    for (const char* key : {"vision_feature_layer", "vision_feature_select_strategy"}) {
      const std::string v = c.contains(key) ? c[key].dump() : std::string("null");
      mix(key, std::strlen(key) + 1);
      mix(v.c_str(), v.size() + 1);
    }
  }
  return h;
}

absl::StatusOr<torch::Tensor> VisInputMasks(const VisualTokenPassOptions& options, int64_t n,
                                            int64_t d) {
  if (options.input_masks.defined()) {
    const torch::Tensor& m = options.input_masks;
    if (m.dim() != 3 || m.size(0) < 1 || m.size(1) != n || m.size(2) != d) {
      return absl::InvalidArgumentError(
          absl::StrCat("VIS input masks must be [M, ", n, ", ", d, "], got ", c10::str(m.sizes())));
    }
    return m.to(torch::kCPU, torch::kFloat);
  }
  if (options.passes < 1 || options.passes > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("VIS: MC-dropout passes M must be in 1-256, got ", options.passes));
  }
  if (!(options.dropout_p > 0.0 && options.dropout_p < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("VIS: MC-dropout rate p must be in (0, 1), got ", options.dropout_p));
  }
  at::Generator gen = at::detail::createCPUGenerator(options.seed);
  torch::Tensor keep = torch::empty({options.passes, n, d}, torch::kFloat);
  keep.bernoulli_(1.0 - options.dropout_p, gen);
  return keep / (1.0 - options.dropout_p);
}

struct ScopedTorchSeed::State {
  std::unique_lock<std::mutex> lock;
  at::Generator gen;
  at::Tensor saved;
};

ScopedTorchSeed::ScopedTorchSeed(uint64_t seed) : state_(std::make_unique<State>()) {
  static std::mutex mu;
  state_->lock = std::unique_lock<std::mutex>(mu);
  state_->gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> gen_lock(state_->gen.mutex());
  state_->saved = state_->gen.get_state();
  state_->gen.set_current_seed(seed);
}

ScopedTorchSeed::~ScopedTorchSeed() {
  std::lock_guard<std::mutex> gen_lock(state_->gen.mutex());
  state_->gen.set_state(state_->saved);
}

torch::Tensor PassVariance(const torch::Tensor& x) {
  // Shifted by the first pass so that identical passes give exactly zero (a plain mean can
  // round differently from the values it averages).
  torch::Tensor d = x - x.select(0, 0).unsqueeze(0);
  return (d.pow(2).mean(0) - d.mean(0).pow(2)).clamp_min(0.0);
}

namespace {

// vis_relative from F and its per-feature pass variance.
torch::Tensor RelativeOf(const torch::Tensor& f, const torch::Tensor& pass_variance) {
  const torch::Tensor spread = pass_variance.sum(-1);
  const torch::Tensor size = f.mean(0).pow(2).sum(-1);
  return torch::where(size > 0, spread / size.clamp_min(1e-30), torch::zeros_like(size));
}

}  // namespace

torch::Tensor VisVariance(const torch::Tensor& features) {
  return PassVariance(features.to(torch::kFloat)).mean(-1);
}

torch::Tensor VisRelativeVariance(const torch::Tensor& features) {
  const torch::Tensor f = features.to(torch::kFloat);
  return RelativeOf(f, PassVariance(f));
}

void SetVisScores(const torch::Tensor& features, VisualTokenPasses* out) {
  const torch::Tensor f = features.to(torch::kFloat);
  const torch::Tensor pass_variance = PassVariance(f);
  out->variance = pass_variance.mean(-1).cpu();
  out->relative_variance = RelativeOf(f, pass_variance).cpu();
}

NamedTensors SelectHfTrainable(const torch::nn::Module& model, const std::string& lm_prefix,
                               const std::function<bool(const std::string&)>& extra,
                               const std::function<std::string(const std::string&)>& rename) {
  NamedTensors out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    bool take = extra(name);
    if (!take && absl::StartsWith(name, lm_prefix)) {
      std::vector<std::string> parts = absl::StrSplit(name, '.');
      const std::string& leaf = parts.back();
      const std::string owner = parts.size() >= 2 ? parts[parts.size() - 2] : "";
      // Embeddings and the head have no bias or norm in the Llama family; the rule still
      // names them out so a checkpoint with an lm_head bias keeps it frozen.
      const bool head = absl::StrContains(name, "lm_head") || absl::StrContains(name, "embed");
      take = !head && (leaf == "lora_a" || leaf == "lora_b" || leaf == "bias" ||
                       absl::StrContains(owner, "norm"));
    }
    if (take) out.emplace_back(rename(name), item.value());
  }
  return out;
}

absl::Status CheckTokenInputs(const TokenInputs& in, int64_t b, int64_t n) {
  if (!in.input_ids.defined() || in.input_ids.dim() != 2 || in.input_ids.size(0) != b) {
    return absl::InvalidArgumentError(absl::StrCat("input_ids must be [", b, ", T]"));
  }
  if (in.visual_present.defined() &&
      (in.visual_present.dim() != 2 || in.visual_present.size(0) != b ||
       in.visual_present.size(1) != n)) {
    return absl::InvalidArgumentError(absl::StrCat("visual_present must be [", b, ", ", n,
                                                   "], got ", c10::str(in.visual_present.sizes())));
  }
  return absl::OkStatus();
}

absl::StatusOr<GreedyResult> GreedyFromTokenEmbeds(DecoderLmImpl& lm, const torch::Tensor& embeds,
                                                   const torch::Tensor& mask,
                                                   const GreedyOptions& options,
                                                   const std::string& what) {
  torch::NoGradGuard no_grad;
  try {
    GreedyOptions o = options;
    o.decode_path = GreedyOptions::DecodePath::kReference;
    return GreedyGenerateFromEmbeds(lm, embeds, mask, o);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what_without_backtrace()));
  }
}

void AddLinearLora(Linear& linear, const AdapterOptions& options, at::Generator& gen) {
  torch::NoGradGuard no_grad;
  linear->AddLora(options.lora_rank, options.lora_alpha);
  const double bound = 1.0 / std::sqrt(static_cast<double>(linear->options().in_features));
  torch::Tensor a = torch::empty(linear->lora_a.sizes(), torch::kFloat);
  a.uniform_(-bound, bound, gen);
  linear->lora_a.copy_(a);
}

absl::Status CheckVisionMlp(const AdapterOptions& options) {
  if (options.lora_vision_mlp && !options.lora_vision) {
    return absl::InvalidArgumentError(
        "lora_vision_mlp adds LoRA to the MLP of the vision tower's trainable layers: it needs "
        "lora_vision");
  }
  return absl::OkStatus();
}

absl::Status AddDecoderLora(DecoderLmImpl& lm, const AdapterOptions& options) {
  if (options.lora_rank <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA rank must be > 0, got ", options.lora_rank));
  }
  if (!(options.lora_alpha > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoRA alpha must be > 0, got ", options.lora_alpha));
  }
  for (const auto& layer : *lm.layers) {
    const auto* l = layer->as<DecoderLayerImpl>();
    if (l->self_attn->q_proj->has_lora()) {
      return absl::InvalidArgumentError("the model already has LoRA adapters");
    }
  }
  // A is drawn on the CPU from a generator of its own, whatever device the model is on, so a
  // device and its mirror start equal and nobody else's random stream moves.
  at::Generator gen = at::detail::createCPUGenerator(options.seed);
  auto add = [&](Linear& linear) { AddLinearLora(linear, options, gen); };
  for (const auto& layer : *lm.layers) {
    auto* l = layer->as<DecoderLayerImpl>();
    add(l->self_attn->q_proj);
    add(l->self_attn->v_proj);
    if (options.lora_mlp) {
      if (l->mlp->gate_proj) add(l->mlp->gate_proj);  // OPT has none
      add(l->mlp->up_proj);
      add(l->mlp->down_proj);
    }
  }
  return absl::OkStatus();
}

}  // namespace cdcca::model
