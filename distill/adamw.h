// AdamW over many small tensors in a few multi-tensor passes: the same update as
// torch::optim::AdamW (decoupled weight decay, bias-corrected moments, eps outside the square
// root), computed with LibTorch's _foreach_ operations over every tensor of one dtype and
// device at once instead of ~8 kernels per tensor. A job's trainable set is hundreds of
// small tensors (LoRA factors and norms per layer), where the per-tensor step costs more in
// launches than in arithmetic (docs/BENCHMARKS.md, the AKD job's profile).
//
// Not thread-safe; the tensors must outlive the optimizer.
#ifndef CDCCA_DISTILL_ADAMW_H_
#define CDCCA_DISTILL_ADAMW_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace cdcca::distill {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class MultiTensorAdamW {
 public:
  MultiTensorAdamW(std::vector<torch::Tensor> params, const AdamWOptions& options);

  // Drops every gradient (the next backward pass allocates them again): no pass over them.
  void zero_grad();
  // One update of every tensor that has a gradient; one without is left alone (its moments
  // and step count too), as torch::optim::AdamW leaves it.
  void step();

 private:
  struct State {
    torch::Tensor exp_avg, exp_avg_sq;
    int64_t steps = 0;
  };
  std::vector<torch::Tensor> params_;
  std::vector<State> state_;
  AdamWOptions options_;
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_ADAMW_H_
