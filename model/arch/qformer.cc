#include "model/arch/qformer.h"

#include <cmath>
#include <limits>
#include <string>

#include "model/runtime/batched_matmul.h"
#include "model/runtime/fused_ops.h"

namespace cdcca::model {
namespace {

Linear MakeLinear(int64_t in, int64_t out, const WeightPrecision& precision) {
  LinearOptions o;
  o.in_features = in;
  o.out_features = out;
  o.bias = true;
  o.precision = precision;
  o.precision.dtype = torch::kFloat;
  return Linear(o);
}

LayerNormLayer MakeLayerNorm(int64_t dim, double eps) { return LayerNormLayer(dim, eps, torch::kFloat); }

}  // namespace

QFormerMultiHeadAttentionImpl::QFormerMultiHeadAttentionImpl(const QFormerConfig& config,
                                                             bool is_cross_attention,
                                                             const WeightPrecision& precision)
    : heads_(config.num_attention_heads), hidden_(config.hidden_size) {
  const int64_t h = config.hidden_size;
  const int64_t kv_in = is_cross_attention ? config.encoder_hidden_size : h;
  query = register_module("query", MakeLinear(h, h, precision));
  key = register_module("key", MakeLinear(kv_in, h, precision));
  value = register_module("value", MakeLinear(kv_in, h, precision));
}

torch::Tensor QFormerMultiHeadAttentionImpl::forward(const torch::Tensor& hidden,
                                                     const torch::Tensor& kv_source,
                                                     const torch::Tensor& additive_mask,
                                                     const torch::Tensor& allowed, double dropout_p,
                                                     torch::Tensor* probs_out,
                                                     torch::Tensor* contributions_out) {
  const int64_t b = hidden.size(0);
  const int64_t t = hidden.size(1);
  const int64_t s = kv_source.size(1);
  const int64_t h = hidden_;
  const int64_t head_dim = h / heads_;
  auto split = [&](const torch::Tensor& x, int64_t len) {
    return x.view({b, len, heads_, head_dim}).permute({0, 2, 1, 3});
  };
  torch::Tensor q = split(query->forward(hidden), t);
  torch::Tensor k = split(key->forward(kv_source), s);
  torch::Tensor v = split(value->forward(kv_source), s);
  torch::Tensor scores = BatchedMatmul(q, k.transpose(-1, -2)) / std::sqrt(double(head_dim));
  if (additive_mask.defined()) scores = scores + additive_mask;
  if (allowed.defined()) {
    scores = scores.masked_fill(allowed.logical_not(), std::numeric_limits<float>::lowest());
  }
  torch::Tensor probs = torch::softmax(scores, -1);
  // Exactly 0 for a disallowed key, also in a row that allows none (softmax made it uniform).
  if (allowed.defined()) probs = probs * allowed.to(probs.scalar_type());
  if (probs_out != nullptr) *probs_out = probs;
  if (dropout_p > 0.0) probs = TrainingDropout(probs, dropout_p);
  if (contributions_out != nullptr) {
    // [B, heads, S, 1] * [B, heads, S, head_dim] -> [B, S, H]
    *contributions_out = (probs.sum(2).unsqueeze(-1) * v).permute({0, 2, 1, 3}).reshape({b, s, h});
  }
  return BatchedMatmul(probs, v).permute({0, 2, 1, 3}).reshape({b, t, h});
}

QFormerResidualOutputImpl::QFormerResidualOutputImpl(int64_t in_features, int64_t hidden,
                                                     double eps, const WeightPrecision& precision) {
  dense = register_module("dense", MakeLinear(in_features, hidden, precision));
  LayerNorm = register_module("LayerNorm", MakeLayerNorm(hidden, eps));
}

torch::Tensor QFormerResidualOutputImpl::forward(const torch::Tensor& x,
                                                 const torch::Tensor& residual) {
  return LayerNorm->forward(dense->forward(x) + residual);
}

QFormerAttentionImpl::QFormerAttentionImpl(const QFormerConfig& config, bool is_cross_attention,
                                           const WeightPrecision& precision) {
  attention = register_module("attention",
                              QFormerMultiHeadAttention(config, is_cross_attention, precision));
  output = register_module("output", QFormerResidualOutput(config.hidden_size, config.hidden_size,
                                                           config.layer_norm_eps, precision));
}

torch::Tensor QFormerAttentionImpl::forward(const torch::Tensor& hidden,
                                            const torch::Tensor& kv_source,
                                            const torch::Tensor& additive_mask,
                                            const torch::Tensor& allowed, double dropout_p,
                                            torch::Tensor* probs_out,
                                            torch::Tensor* contributions_out) {
  return output->forward(attention->forward(hidden, kv_source, additive_mask, allowed, dropout_p,
                                            probs_out, contributions_out),
                         hidden);
}

QFormerIntermediateImpl::QFormerIntermediateImpl(const QFormerConfig& config,
                                                 const WeightPrecision& precision)
    : act_(config.hidden_act) {
  dense =
      register_module("dense", MakeLinear(config.hidden_size, config.intermediate_size, precision));
}

torch::Tensor QFormerIntermediateImpl::forward(const torch::Tensor& x) {
  return Activation(act_, dense->forward(x));
}

QFormerLayerImpl::QFormerLayerImpl(const QFormerConfig& config, int64_t layer_index,
                                   const WeightPrecision& precision) {
  attention = register_module("attention",
                              QFormerAttention(config, /*is_cross_attention=*/false, precision));
  if (layer_index % config.cross_attention_frequency == 0) {
    crossattention = register_module(
        "crossattention", QFormerAttention(config, /*is_cross_attention=*/true, precision));
  }
  if (config.use_qformer_text_input) {
    intermediate = register_module("intermediate", QFormerIntermediate(config, precision));
    output = register_module("output",
                             QFormerResidualOutput(config.intermediate_size, config.hidden_size,
                                                   config.layer_norm_eps, precision));
  }
  intermediate_query =
      register_module("intermediate_query", QFormerIntermediate(config, precision));
  output_query = register_module("output_query",
                                 QFormerResidualOutput(config.intermediate_size, config.hidden_size,
                                                       config.layer_norm_eps, precision));
}

torch::Tensor QFormerLayerImpl::forward(const torch::Tensor& hidden, const torch::Tensor& self_mask,
                                        const torch::Tensor& image, int64_t query_length,
                                        const torch::Tensor& image_allowed, double dropout_p,
                                        torch::Tensor* cross_probs,
                                        torch::Tensor* cross_contributions) {
  torch::Tensor attended = attention->forward(hidden, hidden, self_mask);
  if (query_length == 0) {
    // Text only (not used by the generation path, kept for completeness).
    TORCH_CHECK(has_text_feed_forward(), "Q-Former layer has no text feed-forward");
    return output->forward(intermediate->forward(attended), attended);
  }
  torch::Tensor queries = attended.slice(1, 0, query_length);
  if (has_cross_attention()) {
    queries = crossattention->forward(queries, image, /*additive_mask=*/{}, image_allowed,
                                      dropout_p, cross_probs, cross_contributions);
  }
  torch::Tensor ff = intermediate_query->forward(queries);
  if (dropout_p > 0.0) ff = TrainingDropout(ff, dropout_p);
  torch::Tensor out = output_query->forward(ff, queries);
  if (attended.size(1) > query_length) {
    TORCH_CHECK(has_text_feed_forward(),
                "Q-Former got instruction tokens but its layers have no text feed-forward");
    torch::Tensor text = attended.slice(1, query_length);
    out = torch::cat({out, output->forward(intermediate->forward(text), text)}, 1);
  }
  return out;
}

QFormerEncoderImpl::QFormerEncoderImpl(const QFormerConfig& config,
                                       const WeightPrecision& precision) {
  layer = register_module("layer", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layer->push_back(QFormerLayer(config, i, precision));
  }
}

QFormerEmbeddingsImpl::QFormerEmbeddingsImpl(const QFormerConfig& config) {
  word_embeddings = register_module(
      "word_embeddings", Embedding(config.vocab_size, config.hidden_size, torch::kFloat));
  position_embeddings =
      register_module("position_embeddings",
                      Embedding(config.max_position_embeddings, config.hidden_size, torch::kFloat));
  layernorm =
      register_module("layernorm", MakeLayerNorm(config.hidden_size, config.layer_norm_eps));
}

torch::Tensor QFormerEmbeddingsImpl::forward(const torch::Tensor& query_embeds,
                                             const torch::Tensor& input_ids) {
  torch::Tensor embeddings = query_embeds;
  if (input_ids.defined() && input_ids.size(1) > 0) {
    const int64_t t = input_ids.size(1);
    TORCH_CHECK(t <= position_embeddings->weight.size(0), "Q-Former instruction has ", t,
                " tokens, more than max_position_embeddings ", position_embeddings->weight.size(0));
    torch::Tensor positions =
        torch::arange(t, torch::TensorOptions().dtype(torch::kLong).device(input_ids.device()));
    torch::Tensor text =
        word_embeddings->forward(input_ids) + position_embeddings->forward(positions).unsqueeze(0);
    embeddings = torch::cat({query_embeds.to(text.scalar_type()), text}, 1);
  }
  return layernorm->forward(embeddings.to(layernorm->weight.scalar_type()));
}

namespace {

// image_mask [B, N] as the cross-attention's key mask [B, 1, 1, N] (undefined stays so).
torch::Tensor ImageAllowed(const torch::Tensor& image_mask, const torch::Tensor& image) {
  if (!image_mask.defined()) return {};
  TORCH_CHECK(image_mask.dim() == 2 && image_mask.size(0) == image.size(0) &&
                  image_mask.size(1) == image.size(1),
              "Q-Former image_mask must be [B, N]");
  return image_mask.to(image.device(), torch::kBool).view({image.size(0), 1, 1, image.size(1)});
}

}  // namespace

QFormerModelImpl::QFormerModelImpl(const QFormerConfig& config, bool with_instruction,
                                   const WeightPrecision& precision)
    : config_(config) {
  if (with_instruction) {
    config_.use_qformer_text_input = true;
    embeddings = register_module("embeddings", QFormerEmbeddings(config_));
  } else {
    layernorm =
        register_module("layernorm", MakeLayerNorm(config.hidden_size, config.layer_norm_eps));
  }
  encoder = register_module("encoder", QFormerEncoder(config_, precision));
}

torch::Tensor QFormerModelImpl::forward(const torch::Tensor& query_embeds,
                                        const torch::Tensor& image_embeds,
                                        const torch::Tensor& instruction_ids,
                                        const torch::Tensor& instruction_mask) {
  return Run(query_embeds, image_embeds, instruction_ids, instruction_mask, {}, 0.0, nullptr,
             nullptr);
}

torch::Tensor QFormerModelImpl::ForwardMasked(const torch::Tensor& query_embeds,
                                              const torch::Tensor& image_embeds,
                                              const torch::Tensor& instruction_ids,
                                              const torch::Tensor& instruction_mask,
                                              const torch::Tensor& image_mask,
                                              std::vector<torch::Tensor>* cross_probs) {
  return Run(query_embeds, image_embeds, instruction_ids, instruction_mask, image_mask, 0.0,
             cross_probs, nullptr);
}

torch::Tensor QFormerModelImpl::ForwardQueries(const torch::Tensor& query_embeds,
                                               const torch::Tensor& image_embeds,
                                               const torch::Tensor& image_mask, double dropout_p,
                                               std::vector<torch::Tensor>* cross_probs,
                                               std::vector<torch::Tensor>* cross_contributions) {
  TORCH_CHECK(!with_instruction(), "ForwardQueries needs the BLIP-2 layout");
  return Run(query_embeds, image_embeds, {}, {}, image_mask, dropout_p, cross_probs,
             cross_contributions);
}

torch::Tensor QFormerModelImpl::ForwardStochastic(
    const torch::Tensor& query_embeds, const torch::Tensor& image_embeds,
    const torch::Tensor& instruction_ids, const torch::Tensor& instruction_mask, double dropout_p,
    std::vector<torch::Tensor>* cross_probs, std::vector<torch::Tensor>* cross_contributions) {
  return Run(query_embeds, image_embeds, instruction_ids, instruction_mask, {}, dropout_p,
             cross_probs, cross_contributions);
}

torch::Tensor QFormerModelImpl::Run(const torch::Tensor& query_embeds,
                                    const torch::Tensor& image_embeds,
                                    const torch::Tensor& instruction_ids,
                                    const torch::Tensor& instruction_mask,
                                    const torch::Tensor& image_mask, double dropout_p,
                                    std::vector<torch::Tensor>* cross_probs,
                                    std::vector<torch::Tensor>* cross_contributions) {
  const int64_t query_length = query_embeds.size(1);
  const bool has_text = instruction_ids.defined() && instruction_ids.size(1) > 0;
  TORCH_CHECK(!has_text || with_instruction(),
              "this Q-Former (BLIP-2 layout) takes no instruction tokens");
  torch::Tensor hidden = with_instruction()
                             ? embeddings->forward(query_embeds, instruction_ids)
                             : layernorm->forward(query_embeds.to(layernorm->weight.scalar_type()));
  // transformers' Q-Former drops out its embedding output (after the layer norm) too: with
  // one cross-attending layer this is what makes MC-dropout passes attend differently.
  if (dropout_p > 0.0) hidden = TrainingDropout(hidden, dropout_p);
  // Self-attention mask over [queries ; instruction]: queries always attend, so no row is
  // fully masked and -inf gives the same softmax as transformers' finfo.min.
  torch::Tensor self_mask;
  if (has_text && instruction_mask.defined()) {
    torch::Tensor keep =
        torch::cat({torch::ones({hidden.size(0), query_length}, instruction_mask.options()),
                    instruction_mask},
                   1)
            .to(torch::kBool);
    self_mask = torch::zeros(keep.sizes(), hidden.options())
                    .masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity())
                    .unsqueeze(1)
                    .unsqueeze(2);
  }
  torch::Tensor image = image_embeds.to(hidden.scalar_type());
  torch::Tensor allowed = ImageAllowed(image_mask, image);
  for (const auto& layer : *encoder->layer) {
    torch::Tensor probs, contributions;
    hidden = layer->as<QFormerLayerImpl>()->forward(
        hidden, self_mask, image, query_length, allowed, dropout_p,
        cross_probs != nullptr ? &probs : nullptr,
        cross_contributions != nullptr ? &contributions : nullptr);
    if (cross_probs != nullptr && probs.defined()) cross_probs->push_back(probs);
    if (cross_contributions != nullptr && contributions.defined()) {
      cross_contributions->push_back(contributions);
    }
  }
  return hidden;
}

}  // namespace cdcca::model
