// The token probe: what UTS stage 2 asks of each visual token on the device (paper Sec.
// 3.2, Eq. 3). A small MLP on one frozen-encoder token predicts the class of the scene cell
// the token lies in (or "empty"); it is trained once, after the vision stage, on the
// student's clean source domain (`cdcca pretrain`, stage "probe") and stored with the family
// as probe.safetensors.
//
// Its score per token is the predictive entropy of the probe's class distribution averaged
// over M passes with dropout on the token features (one batched forward), smoothed by a 3x3
// mean over the token grid: high where the device cannot tell what it is looking at. Unlike
// the attention statistics, which mostly track where the student reads, it rises on tokens
// that a corruption has made unfamiliar (docs/BENCHMARKS.md, "VIS diagnostic").
//
// Thread-safety: as torch modules; concurrent Uncertainty calls under NoGradGuard are fine
// (dropout is applied functionally, the module's mode is never changed).
#ifndef CDCCA_MODEL_FAMILY_TOKEN_PROBE_H_
#define CDCCA_MODEL_FAMILY_TOKEN_PROBE_H_

#include <torch/torch.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cdcca::model {

class TokenProbeImpl : public torch::nn::Module {
 public:
  static constexpr int64_t kClasses = 11;  // ten Fashion-MNIST classes + empty
  explicit TokenProbeImpl(int64_t d_vis, int64_t hidden = 128);

  // tokens [..., d_vis] -> class logits [..., kClasses]; dropout p on the input and the
  // hidden layer when p > 0 (training uses 0.1, the device its UTS dropout_p).
  torch::Tensor forward(const torch::Tensor& tokens, double dropout_p = 0.0);

  // Stage-2 score: tokens [B, N, d_vis] with N = 1 + grid * grid (the class token, then the
  // patches) -> [B, N]. M passes with dropout_p as one batched forward over the patches,
  // entropy (nats) of the mean softmax, 3x3 grid mean; the class token gets the map's mean.
  // No gradients.
  torch::Tensor Uncertainty(const torch::Tensor& tokens, int passes, double dropout_p);

  int64_t d_vis() const { return d_vis_; }
  int64_t hidden() const { return hidden_; }

 private:
  int64_t d_vis_, hidden_;
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(TokenProbe);

// Each token's target: the class of the 2x2-layout cell its grid position falls in, or
// kClasses - 1 (empty). cell_labels [S, 4] int64 (row-major cells, -1 or 10 = empty) ->
// [S, grid * grid] int64.
torch::Tensor TokenProbeTargets(const torch::Tensor& cell_labels, int64_t grid);

absl::Status SaveTokenProbe(const std::string& path, const TokenProbe& probe);
// NOT_FOUND when the file is missing (a family trained before the probe existed).
absl::StatusOr<TokenProbe> LoadTokenProbe(const std::string& path);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_TOKEN_PROBE_H_
