// fused_attention_check: on a CUDA device, a decoder LM's passes through LibTorch's fused
// attention kernel (decoder_lm.cc: training passes, passes inside a FusedAttentionScope)
// against the eager product (softmax in fp32, what the parity tests pin on the CPU): the
// logits, the gradients of a loss over LoRA on q and v and the RMSNorm weights, and what five
// AdamW steps on that loss change in the logits (the update), for
//   - an unpadded batch with autograd on: the kernel's causal flag, no mask;
//   - the same with the additive mask (CDCCA_ALWAYS_MASK=1, the memory-efficient kernel);
//   - a left-padded batch with autograd on (the mask, padded positions left out);
//   - the unpadded batch without autograd inside a FusedAttentionScope,
// each in fp32 and bf16, with grouped-query attention (8 query heads over 2 kv heads).
// Debian's LibTorch 1.13 has no fused kernel, so the CPU tests cannot compare these paths;
// this program is their check on the GPU machine (scripts/hf_akd_gpu.sh builds it).
//
// The paths are chosen by environment variables read once per process, so each runs in a
// process of its own (this program, --mode): "fused" (the defaults), "masked"
// (CDCCA_ALWAYS_MASK=1) and "eager" (CDCCA_EAGER_ATTENTION=1). The parent compares fused and
// masked with eager: relative L2 difference (|a - b| / |b|) of each tensor, within 1e-4 (fp32)
// or 3e-2 (bf16). The update is bounded by a control instead where that is larger: eager once
// more with every gradient perturbed at random by as much as the fused paths' gradients differ
// from eager's, since AdamW's first steps move each element by about lr whatever its
// gradient's size (the update may differ from eager's by twice the control's difference).
// Prints one line per comparison and a JSON summary; exit 0 when every one is within its
// bound, 1 otherwise, 77 where there is no CUDA device or LibTorch has no fused kernel.
//
//   fused_attention_check [--dir /tmp/fused_attention_check]
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/multimodal_model.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, mode, "", "internal: run one path (fused, masked, eager) into --out");
ABSL_FLAG(std::string, out, "", "internal: where --mode writes its tensors");
ABSL_FLAG(double, noise_fp32, 0,
          "internal: relative size of the random perturbation each fp32 gradient gets (the "
          "update's control)");
ABSL_FLAG(double, noise_bf16, 0, "internal: the same for bf16");
ABSL_FLAG(std::string, dir, "/tmp/fused_attention_check", "where the three paths' tensors go");
ABSL_FLAG(std::string, device, "cuda",
          "cuda; cpu runs the program's plumbing where every path is the eager product (all "
          "differences 0)");

namespace cdcca::model {
namespace {

constexpr int64_t kBatch = 3, kLength = 48, kVocab = 256;

DecoderLm MakeModel(torch::ScalarType dtype) {
  const nlohmann::json config = {{"model_type", "llama"},    {"vocab_size", kVocab},
                                 {"hidden_size", 256},       {"intermediate_size", 512},
                                 {"num_hidden_layers", 3},   {"num_attention_heads", 8},
                                 {"num_key_value_heads", 2}, {"rms_norm_eps", 1e-5},
                                 {"rope_theta", 10000.0},    {"tie_word_embeddings", false}};
  absl::StatusOr<DecoderConfig> c = ParseDecoderConfig(config, "fused_attention_check");
  TORCH_CHECK(c.ok(), std::string(c.status().message()));
  DecoderLm lm(*c, WeightPrecision{});
  torch::manual_seed(11);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : lm->named_parameters()) {
      const bool norm = absl::StrContains(p.key(), "norm");
      p.value().set_data(norm ? 1 + 0.1 * torch::randn(p.value().sizes())
                              : 0.06 * torch::randn(p.value().sizes()));
    }
  }
  AdapterOptions lora;
  lora.seed = 3;
  absl::Status s = AddDecoderLora(*lm, lora);
  TORCH_CHECK(s.ok(), std::string(s.message()));
  {
    // B starts at zero; drawn here so that every A gets a gradient.
    torch::NoGradGuard no_grad;
    torch::manual_seed(12);
    for (auto& p : lm->named_parameters()) {
      if (absl::EndsWith(p.key(), "lora_b")) p.value().normal_(0.0, 0.05);
    }
  }
  lm->to(torch::Device(absl::GetFlag(FLAGS_device)), dtype);
  return lm;
}

// The trainable set: the LoRA factors and the norm weights, in a fixed order.
std::vector<std::pair<std::string, torch::Tensor>> Trainable(DecoderLm& lm) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& p : lm->named_parameters()) {
    const bool train = absl::EndsWith(p.key(), "lora_a") || absl::EndsWith(p.key(), "lora_b") ||
                       absl::StrContains(p.key(), "norm");
    p.value().set_requires_grad(train);
    if (train) out.emplace_back(p.key(), p.value());
  }
  return out;
}

// One path's tensors for one dtype, under "<dtype>/<case>/<what>".
// `noise` > 0: every gradient gets a random perturbation of relative L2 size `noise` before
// each AdamW step (the control: what gradients that differ by that much do to the update).
void RunCases(torch::ScalarType dtype, const std::string& tag, double noise,
              torch::serialize::OutputArchive& archive) {
  torch::manual_seed(21);
  const torch::Device device(absl::GetFlag(FLAGS_device));
  const torch::Tensor ids = torch::randint(kVocab, {kBatch, kLength}, torch::kLong).to(device);
  // Left padding: row 0 by 5, row 1 none, row 2 by 11.
  torch::Tensor keep = torch::ones({kBatch, kLength}, torch::kLong);
  keep.index_put_({0, torch::indexing::Slice(0, 5)}, 0);
  keep.index_put_({2, torch::indexing::Slice(0, 11)}, 0);
  keep = keep.to(device);
  auto put = [&](const std::string& name, const torch::Tensor& t) {
    archive.write(absl::StrCat(tag, "/", name), t.detach().to(torch::kCPU, torch::kFloat));
  };
  torch::manual_seed(31);  // the control's perturbations
  for (const bool padded : {false, true}) {
    const std::string name = padded ? "padded" : "unpadded";
    DecoderLm lm = MakeModel(dtype);
    auto trainable = Trainable(lm);
    std::vector<torch::Tensor> params;
    for (auto& [n, t] : trainable) params.push_back(t);
    torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-2));
    const torch::Tensor mask = padded ? keep : torch::Tensor();
    const torch::Tensor counted = (padded ? keep : torch::ones_like(keep)).to(torch::kFloat);
    // Next-token CE over the positions that are tokens and predict one.
    const torch::Tensor use = counted.slice(1, 1) * counted.slice(1, 0, kLength - 1);
    auto forward = [&] {
      return lm->Forward(lm->EmbedTokens(ids), mask, nullptr).logits.to(torch::kFloat);
    };
    auto step = [&](const torch::Tensor& logits) {
      torch::Tensor lp = torch::log_softmax(logits.slice(1, 0, kLength - 1), -1);
      torch::Tensor nll = -lp.gather(-1, ids.slice(1, 1).unsqueeze(-1)).squeeze(-1);
      adamw.zero_grad();
      ((nll * use).sum() / use.sum()).backward();
      if (noise <= 0) return;
      torch::NoGradGuard no_grad;
      for (auto& [n, t] : trainable) {
        torch::Tensor g = t.grad();
        const double rms = g.to(torch::kFloat).norm().item<double>() / std::sqrt(g.numel());
        g.add_(torch::randn(g.sizes(), g.options()) * (noise * rms));
      }
    };
    auto kept = [&](const torch::Tensor& logits) {
      return logits.masked_fill(keep.unsqueeze(-1) == 0, 0);
    };
    const torch::Tensor logits = forward();
    step(logits);
    put(name + "/logits", kept(logits));
    for (auto& [n, t] : trainable) put(absl::StrCat(name, "/grad/", n), t.grad());
    // The update: five AdamW steps, compared by what they change in the logits. (The first
    // steps of AdamW move each element by about lr whatever its gradient's size, so the
    // tensors' own changes would count a sign flip of a negligible gradient as a full step.)
    adamw.step();
    for (int i = 1; i < 5; ++i) {
      step(forward());
      adamw.step();
    }
    put(name + "/update", kept(forward() - logits));
  }
  DecoderLm lm = MakeModel(dtype);
  torch::NoGradGuard no_grad;
  FusedAttentionScope fused;
  put("scope/logits", lm->Forward(lm->EmbedTokens(ids), torch::Tensor(), nullptr).logits);
}

int Child(const std::string& out) {
  torch::serialize::OutputArchive archive;
  RunCases(torch::kFloat, "fp32", absl::GetFlag(FLAGS_noise_fp32), archive);
  RunCases(torch::kBFloat16, "bf16", absl::GetFlag(FLAGS_noise_bf16), archive);
  archive.save_to(out);
  return 0;
}

std::map<std::string, torch::Tensor> Read(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  std::map<std::string, torch::Tensor> out;
  for (const std::string& key : archive.keys()) {
    torch::Tensor t;
    archive.read(key, t);
    out[key] = t;
  }
  return out;
}

int Parent(const char* self) {
  const bool cuda = absl::GetFlag(FLAGS_device) == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::printf("no CUDA device: nothing to check\n");
    return 77;
  }
#if !(TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1))
  if (cuda) {
    std::printf("LibTorch %d.%d has no fused attention kernel: nothing to check\n",
                TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);
    return 77;
  }
#endif
  const std::string dir = absl::GetFlag(FLAGS_dir);
  std::filesystem::create_directories(dir);
  const std::string device = absl::GetFlag(FLAGS_device);
  auto run = [&](const std::string& mode, const std::string& env, const std::string& extra) {
    const std::string cmd = absl::StrCat("env -u CDCCA_ALWAYS_MASK -u CDCCA_EAGER_ATTENTION ", env,
                                         self, " --mode=", mode, " --device=", device, extra,
                                         " --out=", dir, "/", mode, ".pt");
    const bool ran = std::system(cmd.c_str()) == 0;
    if (!ran) std::printf("the %s path failed: %s\n", mode.c_str(), cmd.c_str());
    return ran;
  };
  if (!run("fused", "", "") || !run("masked", "CDCCA_ALWAYS_MASK=1 ", "") ||
      !run("eager", "CDCCA_EAGER_ATTENTION=1 ", "")) {
    return 1;
  }
  const auto eager = Read(dir + "/eager.pt");
  // Per dtype and case: the largest relative difference of its logits, gradients, update
  // ("<dtype>/<case>/<what>").
  auto worst_of = [&](const std::map<std::string, torch::Tensor>& have, bool* complete) {
    std::map<std::string, double> worst;
    for (const auto& [key, want] : eager) {
      const auto it = have.find(key);
      if (it == have.end()) {
        std::printf("lacks %s\n", key.c_str());
        *complete = false;
        continue;
      }
      const double norm = want.norm().item<double>();
      const double diff = (it->second - want).norm().item<double>() / std::max(norm, 1e-30);
      const std::string group = key.substr(0, key.find('/', key.find('/') + 1)) + "/" +
                                (absl::StrContains(key, "/grad/") ? "grad"
                                 : absl::EndsWith(key, "/update") ? "update"
                                                                  : "logits");
      worst[group] = std::max(worst[group], diff);
    }
    return worst;
  };
  bool ok = true;
  std::map<std::string, std::map<std::string, double>> worst;
  std::map<std::string, double> gradient_gap;  // per dtype, over both fused paths
  for (const std::string mode : {"fused", "masked"}) {
    worst[mode] = worst_of(Read(absl::StrCat(dir, "/", mode, ".pt")), &ok);
    for (const auto& [group, diff] : worst[mode]) {
      if (absl::EndsWith(group, "/grad")) {
        const std::string dtype = group.substr(0, group.find('/'));
        gradient_gap[dtype] = std::max(gradient_gap[dtype], diff);
      }
    }
  }
  // The update's control: AdamW's first steps move each element by about lr whatever its
  // gradient's size, so gradients that differ by rounding alone give updates that differ by
  // more. The eager path once more, each gradient perturbed at random by as much as the fused
  // paths' gradients differ from eager's: an update within twice that control's difference
  // (or within the tolerance) is the eager update up to what those gradients allow.
  if (!run("control", "CDCCA_EAGER_ATTENTION=1 ",
           absl::StrCat(" --noise_fp32=", gradient_gap["fp32"],
                        " --noise_bf16=", gradient_gap["bf16"]))) {
    return 1;
  }
  const std::map<std::string, double> control = worst_of(Read(dir + "/control.pt"), &ok);
  nlohmann::json summary = nlohmann::json::object();
  for (const auto& [mode, groups] : worst) {
    for (const auto& [group, diff] : groups) {
      double bound = absl::StartsWith(group, "fp32") ? 1e-4 : 3e-2;
      const bool update = absl::EndsWith(group, "/update");
      if (update) bound = std::max(bound, 2 * control.at(group));
      const bool pass = diff <= bound;
      ok = ok && pass;
      std::printf("%-7s %-22s worst relative difference %.3e (bound %.2e%s) %s\n", mode.c_str(),
                  group.c_str(), diff, bound, update ? ", the control's twice or more" : "",
                  pass ? "ok" : "FAIL");
      summary[mode][group] = diff;
      if (update) summary["control"][group] = control.at(group);
    }
  }
  summary["gradient_gap"] = gradient_gap;
  summary["ok"] = ok;
  std::printf("%s\n", summary.dump().c_str());
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace cdcca::model

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (!mode.empty()) return cdcca::model::Child(absl::GetFlag(FLAGS_out));
  // This program's own path (the children are run through env, for which /proc/self/exe
  // would name env itself).
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  return cdcca::model::Parent(self.c_str());
}
