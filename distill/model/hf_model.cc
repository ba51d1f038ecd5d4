#include "distill/model/hf_model.h"

#include <cstdlib>  // defines __GLIBC__ where glibc is the C library
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <random>

#include "absl/strings/str_cat.h"
#include "distill/model/blip2.h"
#include "distill/model/hf_config.h"
#include "distill/model/llava.h"

namespace cdcca::model {
namespace {

struct HfModelType {
  const char* model_type;
  HfModelLoader load;
};
// config.json model_type -> loader. BLIP-2 and InstructBLIP register here.
const HfModelType kHfModelTypes[] = {
    {"llava", LoadLlavaModel},
    {"blip-2", LoadBlip2Model},
    {"instructblip", LoadBlip2Model},
};

}  // namespace

absl::StatusOr<HfPrecision> ResolveHfPrecision(const HfModelOptions& options) {
  HfPrecision p;
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

absl::StatusOr<std::unique_ptr<MultimodalModel>> LoadHfModel(const std::string& dir,
                                                             const HfModelOptions& options) {
  absl::StatusOr<HfPrecision> precision = ResolveHfPrecision(options);
  if (!precision.ok()) return precision.status();
  absl::StatusOr<HfFolder> folder = HfFolder::Open(dir);
  if (!folder.ok()) return folder.status();
  // HfFolder::Open checked it: a string, absent or null ("").
  const std::string type = ConfigModelType(folder->config(), folder->config_path()).value_or("");
  for (const HfModelType& t : kHfModelTypes) {
    if (type != t.model_type) continue;
    absl::StatusOr<std::unique_ptr<MultimodalModel>> model =
        t.load(*folder, *precision, options.device);
#ifdef __GLIBC__
    // Loading freed the checkpoint's float tensors (quantized or converted); hand the heap
    // pages back so the process's resident memory is what the model holds.
    malloc_trim(0);
#endif
    return model;
  }
  std::string known;
  for (const HfModelType& t : kHfModelTypes)
    absl::StrAppend(&known, known.empty() ? "" : ", ", t.model_type);
  return absl::InvalidArgumentError(absl::StrCat(folder->config_path(), ": field model_type = \"",
                                                 type, "\" is not supported (", known, ")"));
}

absl::StatusOr<torch::Tensor> VisualTokenMasks(const VisualTokenPassOptions& options, int64_t n) {
  if (options.present.defined()) {
    const torch::Tensor& p = options.present;
    if (p.dim() != 2 || p.size(1) != n || p.size(0) < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("present masks must be [M, ", n, "], got ", c10::str(p.sizes())));
    }
    return p.to(torch::kCPU, torch::kBool);
  }
  if (options.passes < 1 || options.passes > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("MC-dropout passes must be in 1-256, got ", options.passes));
  }
  if (!(options.dropout_p >= 0.0 && options.dropout_p < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("MC-dropout rate must be in [0, 1), got ", options.dropout_p));
  }
  std::mt19937_64 rng(options.seed);
  std::bernoulli_distribution keep(1.0 - options.dropout_p);
  torch::Tensor present = torch::empty({options.passes, n}, torch::kBool);
  bool* out = present.data_ptr<bool>();
  for (int64_t i = 0; i < present.numel(); ++i) out[i] = keep(rng);
  return present;
}

torch::Tensor PassVariance(const torch::Tensor& x) {
  // Shifted by the first pass so that identical passes give exactly zero (a plain mean can
  // round differently from the values it averages).
  torch::Tensor d = x - x.select(0, 0).unsqueeze(0);
  return (d.pow(2).mean(0) - d.mean(0).pow(2)).clamp_min(0.0);
}

}  // namespace cdcca::model
