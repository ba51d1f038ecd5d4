#include "model/family/token_probe.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "model/family/checkpoint.h"
#include "model/hub/safetensors.h"

namespace cdcca::model {

TokenProbeImpl::TokenProbeImpl(int64_t d_vis, int64_t hidden) : d_vis_(d_vis), hidden_(hidden) {
  fc1_ = register_module("fc1", torch::nn::Linear(d_vis, hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(hidden, kClasses));
}

torch::Tensor TokenProbeImpl::forward(const torch::Tensor& tokens, double dropout_p) {
  namespace F = torch::nn::functional;
  const bool drop = dropout_p > 0;
  auto dropout = [&](const torch::Tensor& x) {
    return drop ? F::dropout(x, F::DropoutFuncOptions().p(dropout_p).training(true)) : x;
  };
  return fc2_->forward(dropout(torch::relu(fc1_->forward(dropout(tokens)))));
}

torch::Tensor TokenProbeImpl::Uncertainty(const torch::Tensor& tokens, int passes,
                                          double dropout_p) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(tokens.dim() == 3 && tokens.size(2) == d_vis_, "tokens must be [B, N, d_vis]");
  TORCH_CHECK(passes >= 1, "passes must be positive");
  const int64_t b = tokens.size(0), n = tokens.size(1) - 1;  // patches after the class token
  int64_t grid = 1;
  while (grid * grid < n) ++grid;
  TORCH_CHECK(n >= 1 && grid * grid == n, "tokens must be a class token and a square grid");
  torch::Tensor patches = tokens.narrow(1, 1, n);
  torch::Tensor rep = patches.unsqueeze(0).expand({passes, b, n, d_vis_});
  torch::Tensor p = torch::softmax(forward(rep, dropout_p), -1).mean(0);  // [B, n, C]
  torch::Tensor h = -(p * torch::log(p.clamp_min(1e-12))).sum(-1);        // [B, n]
  // 3x3 mean over the grid, edges averaging only the positions they have.
  torch::Tensor map = h.view({b, 1, grid, grid});
  torch::Tensor sum = torch::avg_pool2d(map, 3, 1, 1, false, false);
  torch::Tensor cnt = torch::avg_pool2d(torch::ones_like(map), 3, 1, 1, false, false);
  torch::Tensor grid_scores = (sum / cnt).view({b, n});
  // The class token summarises the whole image: the mean of the map.
  return torch::cat({grid_scores.mean(1, /*keepdim=*/true), grid_scores}, 1);
}

torch::Tensor TokenProbeTargets(const torch::Tensor& cell_labels, int64_t grid) {
  const int64_t s = cell_labels.size(0), half = grid / 2;
  torch::Tensor labels = cell_labels.clone();
  labels.masked_fill_(labels < 0, TokenProbeImpl::kClasses - 1);
  torch::Tensor rows = torch::arange(grid, torch::kLong).div(half, "floor");
  torch::Tensor cell = (rows.view({grid, 1}) * 2 + rows.view({1, grid})).reshape(-1);  // [N]
  return labels.index_select(1, cell).view({s, grid * grid});
}

absl::Status SaveTokenProbe(const std::string& path, const TokenProbe& probe) {
  return WriteSafetensors(path, ModuleState(*probe),
                          {{"format", "cdcca-token-probe-v1"},
                           {"d_vis", std::to_string(probe->d_vis())},
                           {"hidden", std::to_string(probe->hidden())}});
}

absl::StatusOr<TokenProbe> LoadTokenProbe(const std::string& path) {
  if (!std::filesystem::exists(path)) {
    return absl::NotFoundError(absl::StrCat(path, " does not exist"));
  }
  absl::StatusOr<SafetensorsContents> file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  auto d = file->metadata.find("d_vis");
  auto h = file->metadata.find("hidden");
  if (d == file->metadata.end() || h == file->metadata.end()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a token probe (no d_vis/hidden)"));
  }
  try {
    TokenProbe probe(std::stoll(d->second), std::stoll(h->second));
    if (absl::Status s = LoadModuleState(*probe, file->tensors); !s.ok()) return s;
    probe->eval();
    return probe;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
}

}  // namespace cdcca::model
