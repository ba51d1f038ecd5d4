// T5 as transformers defines it (modeling_t5.py): the encoder-decoder language model of the
// Flan-T5 checkpoints of BLIP-2 and InstructBLIP. Both stacks: RMSNorm without bias before each
// sublayer, attention without biases and without the 1/sqrt(d) scale, positions as a learned
// bias per head over relative-position buckets (the first block's table, bidirectional in the
// encoder, causal in the decoder), a [gated-]activation MLP. The decoder also cross-attends to
// the encoder's output. Eager attention, softmax in fp32.
//
// Module tree (the checkpoint's names under a prefix such as "language_model."): shared,
// encoder.{block.N.layer.{0.SelfAttention, 0.layer_norm, 1.DenseReluDense, 1.layer_norm},
// final_layer_norm}, decoder.{block.N.layer.{0.SelfAttention, 0.layer_norm, 1.EncDecAttention,
// 1.layer_norm, 2.DenseReluDense, 2.layer_norm}, final_layer_norm}, and lm_head (absent when the
// head is the shared embedding). Attention: q, k, v, o, and relative_attention_bias in block 0;
// the MLP: wi_0, wi_1, wo (gated) or wi, wo.
//
// Thread-safety: concurrent calls with distinct caches are fine under NoGradGuard.
#ifndef CDCCA_MODEL_ARCH_T5_LM_H_
#define CDCCA_MODEL_ARCH_T5_LM_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/layers.h"
#include "model/hub/folder_config.h"
#include "model/hub/model_folder.h"
#include "model/runtime/generation.h"

namespace cdcca::model {

// The decoder's state between steps: its self-attention keys and values (as DecoderKvCache),
// and per layer the cross-attention keys and values of the encoder output, computed once.
struct T5DecoderCache {
  DecoderKvCache self;
  std::vector<torch::Tensor> cross_keys, cross_values;  // [B, heads, S, d_kv]
};

// transformers' T5Attention._relative_position_bucket: the bucket of each relative position
// (key - query), int64 like `relative_position`.
torch::Tensor T5RelativeBucket(const torch::Tensor& relative_position, bool bidirectional,
                               int64_t num_buckets, int64_t max_distance);

class T5AttentionImpl : public torch::nn::Module {
 public:
  T5AttentionImpl(const T5Config& c, bool relative_bias, const WeightPrecision& p);
  // x [B, T, D]. kv: the cross-attention source [B, S, D] (undefined for self-attention).
  // bias [B or 1, heads, T, keys] additive (positions and mask). Self-attention appends to
  // cache->self (nullptr = no cache); cross-attention computes its keys and values into
  // cross_keys/values[layer] once and reuses them.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& kv, const torch::Tensor& bias,
                        T5DecoderCache* cache, size_t layer);
  // The position bias [1, heads, T, keys] for queries at positions past..past+T-1 against keys
  // 0..keys-1 (the table of the block that has one).
  torch::Tensor PositionBias(int64_t past, int64_t t, int64_t keys, bool bidirectional,
                             torch::Device device);

  Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  Embedding relative_attention_bias{nullptr};  // [buckets, heads]; block 0 only

 private:
  int64_t heads_, d_kv_, buckets_, max_distance_;
};
TORCH_MODULE(T5Attention);

class T5DenseImpl : public torch::nn::Module {
 public:
  T5DenseImpl(const T5Config& c, const WeightPrecision& p);
  torch::Tensor forward(const torch::Tensor& x);  // wo(act(wi_0 x) * wi_1 x) or wo(act(wi x))
  Linear wi_0{nullptr}, wi_1{nullptr}, wi{nullptr}, wo{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(T5Dense);

// One sublayer of a block: layer_norm and its attention (SelfAttention or EncDecAttention)
// or MLP (DenseReluDense), added to the residual stream.
class T5SublayerImpl : public torch::nn::Module {
 public:
  enum class Kind { kSelfAttention, kCrossAttention, kFeedForward };
  T5SublayerImpl(const T5Config& c, Kind kind, bool relative_bias, const WeightPrecision& p);
  Kind kind() const { return kind_; }
  RmsNormLayer layer_norm{nullptr};
  T5Attention attention{nullptr};  // registered as SelfAttention or EncDecAttention
  T5Dense DenseReluDense{nullptr};

 private:
  Kind kind_;
};
TORCH_MODULE(T5Sublayer);

// The encoder's or the decoder's stack of blocks.
class T5StackImpl : public torch::nn::Module {
 public:
  T5StackImpl(const T5Config& c, bool decoder, const WeightPrecision& p);
  // Encoder: embeds [B, S, D] and mask [B, S] (1 = token) -> hidden [B, S, D] after the final
  // norm. Decoder: embeds [B, T, D] (the new positions), their key mask [B, past + T] (1 =
  // attend; undefined = all), the encoder's output and mask, and a cache (appended to;
  // nullptr = none) -> hidden [B, T, D]. captured (non-null): the hidden state after
  // capture_block blocks.
  torch::Tensor forward(const torch::Tensor& embeds, const torch::Tensor& mask,
                        const torch::Tensor& encoder_hidden = {},
                        const torch::Tensor& encoder_mask = {}, T5DecoderCache* cache = nullptr,
                        int64_t capture_block = -1, torch::Tensor* captured = nullptr);
  // block.N.layer.M.
  T5SublayerImpl& Sublayer(size_t block_index, size_t m);
  size_t num_blocks() const { return sublayers_.size(); }
  size_t num_sublayers() const { return sublayers_.empty() ? 0 : sublayers_[0].size(); }

  // Per block a module holding the ModuleList "layer" of its sublayers (checkpoint names).
  torch::nn::ModuleList block{nullptr};
  RmsNormLayer final_layer_norm{nullptr};

 private:
  bool decoder_;
  std::vector<std::vector<T5Sublayer>> sublayers_;  // [block][m], the modules of `block`
};
TORCH_MODULE(T5Stack);

class T5ForConditionalGenerationImpl : public torch::nn::Module {
 public:
  // tie_word_embeddings in `config` decides whether an lm_head is built (false) or the head
  // is the shared embedding (true).
  T5ForConditionalGenerationImpl(const T5Config& config, const WeightPrecision& precision);

  // Fills the weights under `prefix` ("language_model."). Errors as ModelFolder::LoadInto. With
  // int8/int4 weights the shared embedding is packed too (a tied head shares its rows).
  absl::Status Load(const ModelFolder& folder, const std::string& prefix, torch::Device device);

  torch::Tensor EmbedTokens(const torch::Tensor& ids);  // [B, T] -> [B, T, D]
  // Encoder output [B, S, D] for input embeddings and mask [B, S] (undefined = all tokens).
  torch::Tensor Encode(const torch::Tensor& inputs_embeds, const torch::Tensor& mask);
  // Logits [B, T, V] fp32 of decoder ids [B, T] (the new positions after the cache's), with
  // their key mask [B, past + T] (undefined = all). captured (non-null): the decoder's hidden
  // state after capture_block blocks [B, T, D].
  torch::Tensor DecodeLogits(const torch::Tensor& decoder_ids, const torch::Tensor& encoder_hidden,
                             const torch::Tensor& encoder_mask, T5DecoderCache* cache,
                             const torch::Tensor& decoder_mask = {}, int64_t capture_block = -1,
                             torch::Tensor* captured = nullptr);

  const T5Config& config() const { return config_; }
  const WeightPrecision& precision() const { return precision_; }

  Embedding shared{nullptr};
  T5Stack encoder{nullptr}, decoder{nullptr};
  Linear lm_head{nullptr};  // null when the head is the shared embedding
  // Quantized weights with the shared head: the head over the embedding's packed rows
  // (registered as "tied_head" after Load), as DecoderLmImpl::tied_head.
  Linear tied_head{nullptr};

 private:
  T5Config config_;
  WeightPrecision precision_;
};
TORCH_MODULE(T5ForConditionalGeneration);

// Greedy decoding as transformers' generate for an encoder-decoder: the encoder reads
// inputs_embeds [B, S, D] (mask [B, S], undefined = all), the decoder starts from
// decoder_start_token_id and keeps a KV cache. The tokens exclude the start token.
GreedyResult T5GreedyGenerate(T5ForConditionalGenerationImpl& lm,
                              const torch::Tensor& inputs_embeds,
                              const torch::Tensor& attention_mask, const GreedyOptions& options);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_T5_LM_H_
