// Decoder-only LMs as transformers defines them (modeling_llama.py, modeling_qwen2.py,
// modeling_opt.py), with a KV cache for decoding and eager attention (softmax in fp32):
//   `llama` (Vicuna, LLaMA 2/3) and `qwen2`: RMSNorm, RoPE (rope.h), grouped-query attention,
//   optional attention/MLP biases, SiLU-gated MLP, tied or untied LM head.
//   `opt` (the LM of BLIP-2's OPT checkpoints): learned positions (row position + 2 of
//   embed_positions), LayerNorm with bias before each sublayer (do_layer_norm_before) or after
//   its residual add, biased projections, non-gated MLP (fc1, activation, fc2), a final
//   LayerNorm with pre-LayerNorm blocks, project_in / project_out around the blocks where the
//   embeddings are narrower (word_embed_proj_dim), and a head tied to embed_tokens.
//
// Module tree (the checkpoint's names under a body prefix such as "model.",
// "model.language_model." or, for OPT, "model.decoder."):
//   llama/qwen2: embed_tokens, layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
//     post_attention_layernorm, mlp.{gate,up,down}_proj}, norm;
//   opt: embed_tokens, embed_positions, [project_in, project_out], layers.N.{self_attn.{q,k,v,
//     out}_proj, self_attn_layer_norm, fc1, fc2, final_layer_norm}, [final_layer_norm];
// and lm_head (own prefix, e.g. "lm_head."), absent when tied to embed_tokens. (OPT's fc1 and
// fc2 are the MLP's up_proj and down_proj members, registered in the layer.)
//
// Thread-safety: concurrent Forward calls with distinct caches are fine under NoGradGuard.
#ifndef CDCCA_MODEL_ARCH_DECODER_LM_H_
#define CDCCA_MODEL_ARCH_DECODER_LM_H_

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/arch/layers.h"
#include "model/arch/rope.h"
#include "model/hub/folder_config.h"
#include "model/hub/model_folder.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

// DecoderConfig, ParseDecoderConfig, ReadEosTokenIds and the config field helpers
// (config.json's side, torch-free) are in folder_config.h.

// While one lives, this thread's CUDA passes without autograd attend through LibTorch's fused
// kernel, as its passes with autograd always do: a distillation job's teacher-forced pass
// and its ridge fit's student passes, whose digits no parity test pins. Scopes nest. CPU passes, a
// pass that asks for the last query's probabilities, and inference outside a scope keep the
// eager product (softmax in fp32, transformers' eager attention). A fused pass over its own
// tokens alone (no cache, no padding) gives the kernel its causal flag and no mask, which
// selects the flash kernel on CUDA. CDCCA_EAGER_PREPARE=1 makes a scope do nothing (to
// measure what it saves). The fused kernel needs LibTorch 2.1+; with an older one (Debian's
// 1.13) every pass is eager.
class FusedAttentionScope {
 public:
  FusedAttentionScope();
  ~FusedAttentionScope();
  FusedAttentionScope(const FusedAttentionScope&) = delete;
  FusedAttentionScope& operator=(const FusedAttentionScope&) = delete;
  // Whether a scope is open on this thread.
  static bool Open();

 private:
  bool previous_;
};

// Per layer, keys and values [B, kv_heads, past, head_dim] of every position seen so far.
// Without autograd (NoGradGuard, or nothing that needs a gradient) they are views of buffers
// with room for more positions, so a decode step writes its keys in place instead of copying
// the whole cache; the buffers grow by half when full. Copies of a cache share its buffers:
// extend only one of them (or Clear the others).
struct DecoderKvCache {
  std::vector<torch::Tensor> keys, values;
  // [B, kv_heads, capacity, head_dim] storage that keys[i] / values[i] view (undefined where
  // a layer's cache was concatenated or set from elsewhere).
  std::vector<torch::Tensor> key_buffers, value_buffers;
  int64_t length() const { return keys.empty() || !keys[0].defined() ? 0 : keys[0].size(2); }
  void Clear() {
    keys.clear();
    values.clear();
    key_buffers.clear();
    value_buffers.clear();
  }
  // Appends k, v [B, kv_heads, T, head_dim] to layer `layer`'s keys and values. Keys set
  // from elsewhere (keys[i] not a view of key_buffers[i]) are copied into a fresh buffer.
  void Append(size_t layer, const torch::Tensor& k, const torch::Tensor& v);
};

struct DecoderForwardOptions {
  // Only the last position's logits ([B, 1, V]): what generation needs. Default: all.
  bool last_logits_only = false;
  // > 0: only the last N positions' logits ([B, min(N, T), V]), the LM head run on those
  // alone: what a training step whose loss reads a left-padded answer needs. 0 = all.
  int64_t logits_tail = 0;
  // [B, T] int64 positions; undefined = from the attention mask (cumsum - 1, as
  // transformers' generate) or past + arange(T) without a mask.
  torch::Tensor position_ids;
  // >= 0: DecoderOutput::captured receives the hidden state after this many layers (0 = the
  // input embeddings, num_hidden_layers = before the final norm). Default: none.
  int64_t capture_layer = -1;
  // Dropout on the attention and MLP outputs before each residual add (training only; 0 =
  // none, which is what transformers' Llama computes).
  double dropout_p = 0.0;
  // Non-null: receives, per layer, the last position's attention weights [B, heads, past + T]
  // (fp32, masked keys at 0): what UTS stage 2 reads on LLaVA (multimodal_model.h).
  std::vector<torch::Tensor>* last_query_attention = nullptr;
};

struct DecoderOutput {
  torch::Tensor logits;    // [B, T (or 1, or logits_tail), V], fp32
  torch::Tensor hidden;    // [B, T, H] after the final norm
  torch::Tensor captured;  // [B, T, H] see DecoderForwardOptions::capture_layer
};

class DecoderAttentionImpl : public torch::nn::Module {
 public:
  DecoderAttentionImpl(const DecoderConfig& c, const WeightPrecision& p);
  // LLaMA-Adapter (Zhang et al., 2023): registers "adapter_prompt" [length, hidden]
  // (normal, std 0.02) and "adapter_gate" [heads] (zero). Every query then also attends, in
  // a softmax of its own, to the prompt's keys and values (k_proj / v_proj of the prompt, no
  // rotary position), scaled per head by the gate: with the gate at zero the layer computes
  // exactly what it did. Not part of the architecture (a checkpoint has no such tensors):
  // call after loading. length <= 0 does nothing.
  void AddAdapterPrompt(int64_t length);
  torch::Tensor adapter_prompt, adapter_gate;  // undefined until AddAdapterPrompt
  // x [B, T, H]; cos/sin [B, T, head_dim]; mask additive [B, 1, T, past + T] (0 / -inf-like).
  // cache: the layer's keys and values are appended to cache->keys[layer] / values[layer]
  // and attended to (nullptr = none). last_query_probs (non-null): the last position's
  // attention weights [B, heads, past + T] in fp32.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask, DecoderKvCache* cache, size_t layer,
                        torch::Tensor* last_query_probs = nullptr);
  // o_proj is registered as "out_proj" for OPT.
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  // [q; k; v] weights (and biases) in one tensor once DecoderLmImpl::FuseProjections ran;
  // q/k/v_proj's weights are then views of it. Undefined before or for quantized weights.
  torch::Tensor qkv_weight, qkv_bias;
  // Quantized weights on CPU: q/k/v's packed weights as one product, after FuseProjections.
  FusedLinear packed_qkv;
  int64_t heads() const { return heads_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }

 private:
  int64_t heads_, kv_heads_, head_dim_, hidden_;
};
TORCH_MODULE(DecoderAttention);

class DecoderMlpImpl : public torch::nn::Module {
 public:
  DecoderMlpImpl(const DecoderConfig& c, const WeightPrecision& p);
  // down(act(gate(x)) * up(x)); OPT: down(act(up(x))).
  torch::Tensor forward(const torch::Tensor& x);
  // OPT: no gate_proj (null); up_proj and down_proj are its fc1 and fc2.
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  // [gate; up] in one tensor after FuseProjections (see DecoderAttentionImpl::qkv_weight).
  torch::Tensor gate_up_weight, gate_up_bias;
  FusedLinear packed_gate_up;  // as DecoderAttentionImpl::packed_qkv
  const std::string& act() const { return act_; }

 private:
  std::string act_;
};
TORCH_MODULE(DecoderMlp);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const DecoderConfig& c, const WeightPrecision& p);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask, DecoderKvCache* cache, size_t layer,
                        double dropout_p = 0.0, torch::Tensor* last_query_probs = nullptr);
  // A pre-norm (RMSNorm) layer on a residual stream held as x + delta, the addition left to
  // the layer's first norm (RmsNormLayerImpl::AddForward), so that each addition runs in the
  // pass of the norm that reads its result: `input` is the layer's input x + delta (delta
  // undefined: x), and its output is h + f, f (the MLP's output) not yet added. Not for OPT.
  struct Residual {
    torch::Tensor input, h, f;
  };
  Residual ForwardResidual(const torch::Tensor& x, const torch::Tensor& delta,
                           const torch::Tensor& cos, const torch::Tensor& sin,
                           const torch::Tensor& mask, DecoderKvCache* cache, size_t layer,
                           double dropout_p = 0.0, torch::Tensor* last_query_probs = nullptr);
  RmsNormLayer input_layernorm{nullptr}, post_attention_layernorm{nullptr};  // null for OPT
  DecoderAttention self_attn{nullptr};
  // The MLP. For OPT it is not a registered module: its fc1 and fc2 are registered in this
  // layer, where the checkpoint has them (layers.N.fc1, not layers.N.mlp.fc1).
  DecoderMlp mlp{nullptr};
  // OPT only (null otherwise): the LayerNorms around attention and the MLP.
  LayerNormLayer self_attn_layer_norm{nullptr}, final_layer_norm{nullptr};

 private:
  bool norm_before_;  // OPT: do_layer_norm_before
};
TORCH_MODULE(DecoderLayer);

class DecoderLmImpl : public torch::nn::Module {
 public:
  DecoderLmImpl(const DecoderConfig& config, const WeightPrecision& precision);

  // Fills the weights: body tensors under `body_prefix` ("model."), the head under
  // `lm_head_prefix` ("lm_head."; ignored when tied). Errors as ModelFolder::LoadInto. With
  // int8/int4 weights the token embedding is packed too (EmbeddingImpl::Quantize; a tied
  // head shares its rows) and no float embedding matrix stays resident.
  absl::Status Load(const ModelFolder& folder, const std::string& body_prefix,
                    const std::string& lm_head_prefix, torch::Device device);

  // [B, T] -> [B, T, E], E = EmbedDim().
  torch::Tensor EmbedTokens(const torch::Tensor& ids);
  // The width of the token embeddings (what EmbedTokens gives and Forward takes): hidden_size,
  // or OPT's word_embed_proj_dim.
  int64_t EmbedDim() const;

  // inputs_embeds [B, T, E]; attention_mask [B, past + T] (1 = attend) or undefined (all);
  // cache: appended to when given (nullptr = none).
  DecoderOutput Forward(const torch::Tensor& inputs_embeds, const torch::Tensor& attention_mask,
                        DecoderKvCache* cache, const DecoderForwardOptions& options = {});

  const DecoderConfig& config() const { return config_; }
  const WeightPrecision& precision() const { return precision_; }

  // Concatenates each layer's q/k/v and gate/up weights (and biases) into one tensor and
  // makes the separate weights views of it: the same values and memory, one matrix product
  // instead of three (two) where a caller wants it (float: static_decode.h; packed weights on
  // CPU: packed_qkv / packed_gate_up, which Forward uses). Load() calls it; a no-op when
  // already fused.
  void FuseProjections();

  // State kept between generations by static_decode.cc (buffers, captured graph).
  std::shared_ptr<void> static_decode_state;

  Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RmsNormLayer norm{nullptr};  // null for OPT
  // OPT only: learned positions [max_position_embeddings + 2, H]; the final LayerNorm (null
  // with post-LayerNorm blocks); project_in [E -> H] and project_out [H -> E] where E != H.
  Embedding embed_positions{nullptr};
  LayerNormLayer final_layer_norm{nullptr};
  Linear project_in{nullptr}, project_out{nullptr};
  Linear lm_head{nullptr};  // null when tied
  // Tied embeddings with quantized weights: the LM head over the embedding's packed rows
  // (shared, not copied; registered as "tied_head" after Load), so the largest matrix product
  // of a step runs on packed weights too. Null otherwise.
  Linear tied_head{nullptr};

 private:
  DecoderConfig config_;
  WeightPrecision precision_;
};
TORCH_MODULE(DecoderLm);

// The most negative finite value of a float dtype: what masked attention scores get, as in
// transformers.
double LowestValue(torch::ScalarType dtype);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_DECODER_LM_H_
