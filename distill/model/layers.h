// Building blocks shared by the query adapter and the LM: a linear layer whose frozen base
// may be quantized and which carries optional LoRA, RMSNorm, rotary embeddings and masked
// attention.
//
// Parameter names (stable, used by checkpoints and the trainable set):
//   AdaptedLinear: "weight" (fp32 base) or buffers "qweight" + "qscale" (int8/int4 base),
//                  "bias" (optional), "lora_a" [r, in], "lora_b" [out, r] (if rank > 0).
//   RmsNorm:       "weight".
// Modules are not thread-safe for concurrent forward + mutation; concurrent forwards under
// NoGradGuard are fine except that AdaptedLinear's optional dequant cache is filled lazily
// (fill it with WarmDequantCache() before sharing).
#ifndef CDCCA_DISTILL_MODEL_LAYERS_H_
#define CDCCA_DISTILL_MODEL_LAYERS_H_

#include <torch/torch.h>

#include <cstdint>

#include "distill/model/config.h"
#include "distill/model/quantize.h"

namespace cdcca::model {

struct AdaptedLinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = false;
  int lora_rank = 0;  // 0 = no LoRA parameters registered
  float lora_alpha = 16.0f;
  Precision precision = Precision::kFp32;
  int64_t int4_group = 128;
};

// y = x W^T + b + (alpha / r) (x A^T) B^T, with W frozen (possibly stored quantized and
// dequantized on the fly inside forward) and B zero-initialised, so a fresh LoRA is the
// identity change.
class AdaptedLinearImpl : public torch::nn::Module {
 public:
  explicit AdaptedLinearImpl(const AdaptedLinearOptions& options);

  torch::Tensor forward(const torch::Tensor& x);

  // The effective fp32 base weight [out, in] (the dequantized one for int8/int4). For fp32
  // it is the parameter itself (shared storage).
  torch::Tensor BaseWeight() const;
  // Sets the base from an fp32 [out, in] weight, quantizing it when this layer is int8/int4.
  void SetBaseWeight(const torch::Tensor& weight);

  // When on, the dequantized weight is kept (recomputed only when the stored base changes):
  // faster, at 4 bytes per weight. Default: off (dequantize on every call).
  void set_cache_dequantized(bool on) { cache_dequantized_ = on; }
  // Bytes of the stored base (quantized values + scales, or fp32), and of the dequant cache.
  int64_t BaseBytes() const;
  int64_t CacheBytes() const;

  const AdaptedLinearOptions& options() const { return options_; }
  bool has_lora() const { return options_.lora_rank > 0; }

 private:
  AdaptedLinearOptions options_;
  torch::Tensor weight_;   // fp32 base
  torch::Tensor qweight_;  // int8/int4 base
  torch::Tensor qscale_;
  torch::Tensor bias_;
  torch::Tensor lora_a_;
  torch::Tensor lora_b_;
  bool cache_dequantized_ = false;
  mutable torch::Tensor cache_;
  mutable int64_t cache_version_ = -1;
  mutable const void* cache_data_ = nullptr;
};
TORCH_MODULE(AdaptedLinear);

class RmsNormImpl : public torch::nn::Module {
 public:
  explicit RmsNormImpl(int64_t dim, double eps = 1e-5);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::Tensor weight_;
  double eps_;
};
TORCH_MODULE(RmsNorm);

// Rotary position embedding table, computed from the config (plain members, so not part of
// the module state or checkpoints). Follows its input to the input's device on first use.
class Rotary {
 public:
  Rotary(int64_t head_dim, int64_t max_positions, float theta);
  // x [B, H, T, D]; positions [B, T] int64 (absolute position of each token).
  torch::Tensor Apply(const torch::Tensor& x, const torch::Tensor& positions) const;

 private:
  mutable torch::Tensor cos_;  // [max_positions, D/2]
  mutable torch::Tensor sin_;
};

// softmax(q k^T / sqrt(D) + mask) for q [B, H, Tq, D], k [B, H, Tk, D]: the attention
// weights [B, H, Tq, Tk] of MaskedAttention below, with the same masking rules.
torch::Tensor AttentionProbs(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& allowed);

// softmax(q k^T / sqrt(D) + mask) v for q [B, H, Tq, D], k/v [B, H, Tk, D]. `allowed` is a
// bool mask broadcastable to [B, H, Tq, Tk] (true = may attend) or undefined. A query row
// with no allowed key gets all-zero weights (and output), never NaN; a disallowed key gets
// weight exactly 0, so its value has no effect. If `probs_out` is non-null it receives the
// weights [B, H, Tq, Tk] (before any dropout); `dropout_p` > 0 drops weights afterwards.
torch::Tensor MaskedAttention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, const torch::Tensor& allowed,
                              double dropout_p, torch::Tensor* probs_out);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_LAYERS_H_
