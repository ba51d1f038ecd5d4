// LLaMA-style decoder LM (RMSNorm, RoPE, SwiGLU, causal attention) with a KV cache and
// optional zero-init gated adapter prompts (LLaMA-Adapter) in its top layers.
//
// Parameter names: "embed.weight" [V, d], "layers.<i>.{attn_norm,q,k,v,o,ffn_norm,gate,up,
// down}.*", "layers.<i>.adapter_prompt" [P, d] and "layers.<i>.adapter_gate" [H] (top
// `adapter_layers` layers, if adapter_prompt_len > 0), "final_norm.weight", "lm_head.*".
// LoRA sits on q and v. No biases (LLaMA).
#ifndef CDCCA_DISTILL_MODEL_LANGUAGE_MODEL_H_
#define CDCCA_DISTILL_MODEL_LANGUAGE_MODEL_H_

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "distill/model/config.h"
#include "distill/model/layers.h"

namespace cdcca::model {

// Keys and values of everything fed so far, per layer. Owned by the caller of one
// generation; not shared between threads.
struct KvCache {
  std::vector<torch::Tensor> k;  // per layer [B, H, T, D]
  std::vector<torch::Tensor> v;
  torch::Tensor key_valid;      // [B, T] bool: false for padding
  torch::Tensor next_position;  // [B] int64: RoPE position of the next real token
  int64_t length() const { return key_valid.defined() ? key_valid.size(1) : 0; }
};

class LmDecoderLayerImpl : public torch::nn::Module {
 public:
  LmDecoderLayerImpl(const TowerConfig& c, bool with_adapter_prompt);
  // x [B, T, d]; positions [B, T]; allowed [B, 1, T, P+T] (P = cached length). past_k/v are
  // [B, H, P, D] or undefined; *new_k / *new_v receive the full [B, H, P+T, D].
  // out_count >= 0 computes only the outputs of positions [out_first, out_first +
  // out_count) (keys and values still cover all T), returning [B, out_count, d].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions,
                        const torch::Tensor& allowed, const torch::Tensor& past_k,
                        const torch::Tensor& past_v, double dropout_p, const Rotary& rotary,
                        torch::Tensor* new_k, torch::Tensor* new_v, int64_t out_first = 0,
                        int64_t out_count = -1);

 private:
  torch::Tensor Heads(const torch::Tensor& x) const;
  int64_t heads_;
  RmsNorm attn_norm_{nullptr}, ffn_norm_{nullptr};
  AdaptedLinear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
  AdaptedLinear gate_{nullptr}, up_{nullptr}, down_{nullptr};
  torch::Tensor adapter_prompt_;  // [P, d] or undefined
  torch::Tensor adapter_gate_;    // [H], zero-init: the prompt starts with no effect
};
TORCH_MODULE(LmDecoderLayer);

class LanguageModelImpl : public torch::nn::Module {
 public:
  explicit LanguageModelImpl(const TowerConfig& c);

  torch::Tensor Embed(const torch::Tensor& ids);  // [B, T] int64 -> [B, T, d]

  // Runs the decoder over new positions. embeds [B, T, d]; valid [B, T] bool (false =
  // padding: gets no position and is never attended to). With a cache, the new positions
  // attend to the cached ones and are appended to it; without one (nullptr) they start
  // at position 0. If capture_layer >= 0, *captured receives the hidden state after that
  // many layers ([B, T, d]). Returns the final-normed hidden state [B, T, d].
  // out_count >= 0: only positions [out_first, out_first + out_count) are wanted; the last
  // layer then computes its outputs there alone (its keys and values, and every earlier
  // layer, still cover all T) and the result is [B, out_count, d]. A capture after the
  // last layer then holds those positions only.
  torch::Tensor forward(const torch::Tensor& embeds, const torch::Tensor& valid, KvCache* cache,
                        double dropout_p, int capture_layer, torch::Tensor* captured,
                        int64_t out_first = 0, int64_t out_count = -1);

  torch::Tensor Logits(const torch::Tensor& hidden);  // [.., d] -> [.., V]

  int num_layers() const { return static_cast<int>(layers_->size()); }

 private:
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList layers_;
  RmsNorm final_norm_{nullptr};
  AdaptedLinear lm_head_{nullptr};
  Rotary rotary_;
};
TORCH_MODULE(LanguageModel);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_LANGUAGE_MODEL_H_
