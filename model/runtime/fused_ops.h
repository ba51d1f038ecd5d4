// Element-wise parts of a decoder layer as single CPU kernels, forward and backward.
//
// Training the project's towers on the CPU runs the decoder on ~2,000 rows of 160 features.
// There the products take under half of a step; the rest is element-wise work that LibTorch
// does one operator at a time: RMSNorm is five passes forward and about ten backward, the
// rotary embedding a negation, a concatenation and three products, the SwiGLU gate three
// passes backward, each with its own allocation. The functions here compute the same values
// in one pass each way. Each takes its kernel for float32 CPU tensors and falls back to the
// plain LibTorch formula elsewhere (other devices and dtypes), so callers need not choose.
// In training off that kernel (a GPU), RMSNorm takes LibTorch's own at::rms_norm, and the
// rotary embedding, the SwiGLU gate and the residual addition with its norm (AddRmsNorm)
// cdcca's CUDA kernels where the build has them (cuda_kernels.h; else the rotary embedding a
// three-pass form of the same formula); inference
// there keeps the plain formulas, which transformers computes (CDCCA_PLAIN_GPU_OPS=1 keeps them
// in training too).
// Results equal the plain formulas up to float rounding (fused_ops_test.cc).
#ifndef CDCCA_MODEL_RUNTIME_FUSED_OPS_H_
#define CDCCA_MODEL_RUNTIME_FUSED_OPS_H_

#include <torch/types.h>

#include <utility>

namespace cdcca::model {

// RMSNorm as Llama/Qwen2 compute it: x / sqrt(mean(x^2, -1) + eps) in float32, cast back to
// x's dtype, times weight [D]. Differentiable in x and weight.
torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// The residual addition of a pre-norm decoder and the RMSNorm of its result: {h, y} with
// h = x + a and y = RmsNorm(h, weight, eps). In training on a GPU cdcca's kernel computes both
// in one pass each way (the backward pass adds the gradient h receives along the residual
// stream in the same pass); elsewhere the addition and RmsNorm, the same values.
std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(const torch::Tensor& x, const torch::Tensor& a,
                                                   const torch::Tensor& weight, double eps);

// silu(gate) * up (the SwiGLU gate), same shapes. Differentiable in both. The fused kernel
// runs where autograd records the product (training); inference keeps LibTorch's silu.
torch::Tensor SiluMul(const torch::Tensor& gate, const torch::Tensor& up);

// The rotary embedding as transformers applies it: x * cos + rotate_half(x) * sin, for x
// [B, H, T, D] (any strides) and cos, sin [B, T, D]; rotate_half(x) = cat(-x2, x1) of x's
// halves. Differentiable in x (cos and sin are constants). The fused result is contiguous on
// the CPU; on a GPU its memory is [B, T, H, D] (the projections' layout).
torch::Tensor RotaryEmbedding(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin);

// Inverted dropout in training: each element kept with probability 1 - p and scaled by
// 1 / (1 - p), else zero. The CPU kernel draws its mask from one 64-bit seed taken from
// LibTorch's default generator (so torch::manual_seed makes it reproducible, whatever the
// thread count) and recomputes the mask in the backward pass instead of storing it. p <= 0
// returns x.
torch::Tensor TrainingDropout(const torch::Tensor& x, double p);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_FUSED_OPS_H_
