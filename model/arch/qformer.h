// The BERT-style Q-Former of BLIP-2 / InstructBLIP (transformers' Blip2QFormerModel and
// InstructBlipQFormerModel). The module tree mirrors the checkpoint names under `qformer.`:
//   layernorm                                         (BLIP-2: on the query embeddings)
//   embeddings.{word_embeddings, position_embeddings, layernorm}   (InstructBLIP instead)
//   encoder.layer.N.attention.{attention.{query,key,value}, output.{dense,LayerNorm}}
//   encoder.layer.N.crossattention.{...same...}       (iff N % cross_attention_frequency == 0;
//                                                      key/value read encoder_hidden_size)
//   encoder.layer.N.{intermediate_query.dense, output_query.{dense,LayerNorm}}  (queries)
//   encoder.layer.N.{intermediate.dense, output.{dense,LayerNorm}}  (text; iff the config's
//                                                      use_qformer_text_input / InstructBLIP)
// Sequence = [query tokens ; instruction tokens]; self-attention spans both, cross-attention
// to the image and the query feed-forward apply to the query part only, the text
// feed-forward to the rest. Post-norm (BERT): LayerNorm(dense(x) + residual).
//
// Precision: everything computes in fp32 (transformers keeps the Q-Former fp32); linear
// weights are held as precision.weights (int8 / int4 quantized at load). Parameters are
// placeholders until loaded.
//
// Not thread-safe for concurrent forward + mutation; concurrent forwards under NoGradGuard
// are fine.
#ifndef CDCCA_MODEL_ARCH_QFORMER_H_
#define CDCCA_MODEL_ARCH_QFORMER_H_

#include <torch/torch.h>

#include <string>
#include <vector>

#include "model/arch/layers.h"
#include "model/hub/blip2_config.h"

namespace cdcca::model {

class QFormerMultiHeadAttentionImpl : public torch::nn::Module {
 public:
  QFormerMultiHeadAttentionImpl(const QFormerConfig& config, bool is_cross_attention,
                                const WeightPrecision& precision);
  // hidden [B, T, H]; keys/values from `kv_source` [B, S, H or encoder_hidden_size];
  // additive_mask [B, 1, 1, S] (0 = attend, large negative = masked) or undefined.
  // allowed [B, 1, 1, S] bool (false = the key has weight exactly 0; a row with no allowed
  // key gets all-zero weights) or undefined; dropout_p > 0 drops attention weights;
  // probs_out (if non-null) receives the weights [B, heads, T, S] before dropout;
  // contributions_out (if non-null) receives each key's contribution to the attention output
  // summed over the T rows, [B, S, H]: per head sum_t w[t, s] * value(kv_source[s]) with the
  // weights w after dropout, heads concatenated (the output is the sum of these over s).
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& kv_source,
                        const torch::Tensor& additive_mask, const torch::Tensor& allowed = {},
                        double dropout_p = 0.0, torch::Tensor* probs_out = nullptr,
                        torch::Tensor* contributions_out = nullptr);

  Linear query{nullptr};
  Linear key{nullptr};
  Linear value{nullptr};

 private:
  int64_t heads_;
  int64_t hidden_;
};
TORCH_MODULE(QFormerMultiHeadAttention);

// dense, then LayerNorm(dense(x) + residual). Also the shape of BERT's "output" blocks.
class QFormerResidualOutputImpl : public torch::nn::Module {
 public:
  QFormerResidualOutputImpl(int64_t in_features, int64_t hidden, double eps,
                            const WeightPrecision& precision);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& residual);

  Linear dense{nullptr};
  LayerNormLayer LayerNorm{nullptr};  // NOLINT: the checkpoint's name
};
TORCH_MODULE(QFormerResidualOutput);

class QFormerAttentionImpl : public torch::nn::Module {
 public:
  QFormerAttentionImpl(const QFormerConfig& config, bool is_cross_attention,
                       const WeightPrecision& precision);
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& kv_source,
                        const torch::Tensor& additive_mask, const torch::Tensor& allowed = {},
                        double dropout_p = 0.0, torch::Tensor* probs_out = nullptr,
                        torch::Tensor* contributions_out = nullptr);

  QFormerMultiHeadAttention attention{nullptr};
  QFormerResidualOutput output{nullptr};
};
TORCH_MODULE(QFormerAttention);

class QFormerIntermediateImpl : public torch::nn::Module {
 public:
  QFormerIntermediateImpl(const QFormerConfig& config, const WeightPrecision& precision);
  torch::Tensor forward(const torch::Tensor& x);

  Linear dense{nullptr};

 private:
  std::string act_;
};
TORCH_MODULE(QFormerIntermediate);

class QFormerLayerImpl : public torch::nn::Module {
 public:
  QFormerLayerImpl(const QFormerConfig& config, int64_t layer_index,
                   const WeightPrecision& precision);
  // hidden [B, Q + T, H] with the Q query positions first; image [B, N, E].
  // image_allowed [B, 1, 1, N] bool or undefined, dropout_p, cross_probs and
  // cross_contributions as QFormerModelImpl::ForwardQueries and ForwardStochastic (both are
  // left alone without cross-attention).
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& self_mask,
                        const torch::Tensor& image, int64_t query_length,
                        const torch::Tensor& image_allowed = {}, double dropout_p = 0.0,
                        torch::Tensor* cross_probs = nullptr,
                        torch::Tensor* cross_contributions = nullptr);

  bool has_cross_attention() const { return !crossattention.is_empty(); }
  bool has_text_feed_forward() const { return !intermediate.is_empty(); }

  QFormerAttention attention{nullptr};
  QFormerAttention crossattention{nullptr};   // null unless layer_index % frequency == 0
  QFormerIntermediate intermediate{nullptr};  // null unless use_qformer_text_input
  QFormerResidualOutput output{nullptr};
  QFormerIntermediate intermediate_query{nullptr};
  QFormerResidualOutput output_query{nullptr};
};
TORCH_MODULE(QFormerLayer);

class QFormerEncoderImpl : public torch::nn::Module {
 public:
  QFormerEncoderImpl(const QFormerConfig& config, const WeightPrecision& precision);
  torch::nn::ModuleList layer{nullptr};  // the checkpoint's name ("encoder.layer.N")
};
TORCH_MODULE(QFormerEncoder);

// InstructBLIP's instruction embeddings: word + absolute position (positions count from 0
// at the first instruction token), concatenated after the query tokens, then layernorm.
class QFormerEmbeddingsImpl : public torch::nn::Module {
 public:
  explicit QFormerEmbeddingsImpl(const QFormerConfig& config);
  // query_embeds [B, Q, H]; input_ids [B, T] (T may be 0 or undefined) -> [B, Q + T, H].
  torch::Tensor forward(const torch::Tensor& query_embeds, const torch::Tensor& input_ids);

  Embedding word_embeddings{nullptr};
  Embedding position_embeddings{nullptr};
  LayerNormLayer layernorm{nullptr};
};
TORCH_MODULE(QFormerEmbeddings);

class QFormerModelImpl : public torch::nn::Module {
 public:
  // `with_instruction`: InstructBLIP layout (embeddings module, text feed-forward in every
  // layer); otherwise BLIP-2's (a layernorm on the query embeddings only).
  QFormerModelImpl(const QFormerConfig& config, bool with_instruction,
                   const WeightPrecision& precision = {});

  // query_embeds [B, Q, H] (the expanded query_tokens); image_embeds [B, N, E];
  // instruction_ids [B, T] int64 and instruction_mask [B, T] (1 = token, 0 = padding;
  // undefined = all ones) are InstructBLIP's and may be undefined. Returns the last hidden
  // state [B, Q + T, H]; the first Q rows are the query outputs.
  torch::Tensor forward(const torch::Tensor& query_embeds, const torch::Tensor& image_embeds,
                        const torch::Tensor& instruction_ids = {},
                        const torch::Tensor& instruction_mask = {});
  // forward() with an encoder key mask, in either layout: image_mask [B, N] bool (true =
  // present; a masked token has no effect on any output; undefined = all present); if
  // cross_probs is non-null it receives, per cross-attending layer, the weights
  // [B, heads, Q, N] (queries only). What UTS stage 2 runs on BLIP-2 / InstructBLIP folders.
  torch::Tensor ForwardMasked(const torch::Tensor& query_embeds, const torch::Tensor& image_embeds,
                              const torch::Tensor& instruction_ids,
                              const torch::Tensor& instruction_mask,
                              const torch::Tensor& image_mask,
                              std::vector<torch::Tensor>* cross_probs);

  // BLIP-2 layout with the hooks training and uncertainty need (transformers' forward with
  // an encoder_attention_mask, and dropout in train mode): image_mask [B, N] bool (true =
  // present; a masked token has no effect on any output; undefined = all present);
  // dropout_p on the embedding output, the cross-attention weights and the query
  // feed-forward outputs; if cross_probs is non-null it receives, per cross-attending layer,
  // the weights [B, heads, Q, N] before dropout, and cross_contributions as ForwardStochastic.
  // Returns the query outputs [B, Q, H].
  torch::Tensor ForwardQueries(const torch::Tensor& query_embeds, const torch::Tensor& image_embeds,
                               const torch::Tensor& image_mask, double dropout_p,
                               std::vector<torch::Tensor>* cross_probs,
                               std::vector<torch::Tensor>* cross_contributions = nullptr);

  // forward() in either layout with the model's dropout at dropout_p (as ForwardQueries) and
  // the hooks of UTS stage 2 (VIS, multimodal_model.h): per cross-attending layer, cross_probs (if
  // non-null) receives the weights [B, heads, Q, N] before dropout and cross_contributions
  // (if non-null) each image token's contribution to the query rows' cross-attention output
  // [B, N, H] (QFormerMultiHeadAttentionImpl::forward's contributions_out).
  torch::Tensor ForwardStochastic(const torch::Tensor& query_embeds,
                                  const torch::Tensor& image_embeds,
                                  const torch::Tensor& instruction_ids,
                                  const torch::Tensor& instruction_mask, double dropout_p,
                                  std::vector<torch::Tensor>* cross_probs,
                                  std::vector<torch::Tensor>* cross_contributions);

  const QFormerConfig& config() const { return config_; }
  bool with_instruction() const { return !embeddings.is_empty(); }

  LayerNormLayer layernorm{nullptr};           // BLIP-2 only
  QFormerEmbeddings embeddings{nullptr};  // InstructBLIP only
  QFormerEncoder encoder{nullptr};

 private:
  // What forward, ForwardMasked and ForwardQueries run: embeddings (or BLIP-2's layernorm),
  // the instruction's self-attention mask, the image key mask, then every layer.
  torch::Tensor Run(const torch::Tensor& query_embeds, const torch::Tensor& image_embeds,
                    const torch::Tensor& instruction_ids, const torch::Tensor& instruction_mask,
                    const torch::Tensor& image_mask, double dropout_p,
                    std::vector<torch::Tensor>* cross_probs,
                    std::vector<torch::Tensor>* cross_contributions);

  QFormerConfig config_;
};
TORCH_MODULE(QFormerModel);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_QFORMER_H_
