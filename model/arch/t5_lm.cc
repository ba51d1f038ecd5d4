#include "model/arch/t5_lm.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "model/runtime/batched_matmul.h"

namespace cdcca::model {
namespace {

// T5 clamps fp16 activations after each sublayer so they stay finite (transformers does the
// same); a no-op in other dtypes.
torch::Tensor ClampHalf(const torch::Tensor& h) {
  if (h.scalar_type() != torch::kHalf) return h;
  const double limit = static_cast<double>(std::numeric_limits<c10::Half>::max()) - 1000.0;
  return torch::clamp(h, -limit, limit);
}

// Additive mask [B, 1, 1, S] from a key mask [B, S] (1 = attend).
torch::Tensor KeyMask(const torch::Tensor& mask, torch::ScalarType dtype) {
  return torch::zeros(mask.sizes(), mask.options().dtype(dtype))
      .masked_fill(mask == 0, LowestValue(dtype))
      .unsqueeze(1)
      .unsqueeze(1);
}

}  // namespace

torch::Tensor T5RelativeBucket(const torch::Tensor& relative_position, bool bidirectional,
                               int64_t num_buckets, int64_t max_distance) {
  torch::Tensor buckets = torch::zeros_like(relative_position);
  torch::Tensor rel = relative_position;
  if (bidirectional) {
    num_buckets /= 2;
    buckets = buckets + (rel > 0).to(torch::kLong) * num_buckets;
    rel = rel.abs();
  } else {
    rel = -torch::min(rel, torch::zeros_like(rel));
  }
  const int64_t max_exact = num_buckets / 2;
  torch::Tensor small = rel < max_exact;
  // The same fp32 operations as the reference, so the truncation lands on the same bucket.
  torch::Tensor large =
      max_exact + (torch::log(rel.to(torch::kFloat) / static_cast<double>(max_exact)) /
                   std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                   static_cast<double>(num_buckets - max_exact))
                      .to(torch::kLong);
  large = torch::min(large, torch::full_like(large, num_buckets - 1));
  return buckets + torch::where(small, rel, large);
}

T5AttentionImpl::T5AttentionImpl(const T5Config& c, bool relative_bias, const WeightPrecision& p)
    : heads_(c.num_heads),
      d_kv_(c.d_kv),
      buckets_(c.relative_attention_num_buckets),
      max_distance_(c.relative_attention_max_distance) {
  const int64_t inner = heads_ * d_kv_;
  q = register_module("q", Linear(LinearOptions{c.d_model, inner, false, p}));
  k = register_module("k", Linear(LinearOptions{c.d_model, inner, false, p}));
  v = register_module("v", Linear(LinearOptions{c.d_model, inner, false, p}));
  o = register_module("o", Linear(LinearOptions{inner, c.d_model, false, p}));
  if (relative_bias) {
    relative_attention_bias =
        register_module("relative_attention_bias", Embedding(buckets_, heads_, p.dtype));
  }
}

torch::Tensor T5AttentionImpl::PositionBias(int64_t past, int64_t t, int64_t keys,
                                            bool bidirectional, torch::Device device) {
  const auto longs = torch::TensorOptions().dtype(torch::kLong).device(device);
  torch::Tensor query = torch::arange(past, past + t, longs).view({t, 1});
  torch::Tensor key = torch::arange(0, keys, longs).view({1, keys});
  torch::Tensor buckets = T5RelativeBucket(key - query, bidirectional, buckets_, max_distance_);
  // [T, keys, heads] -> [1, heads, T, keys]
  return relative_attention_bias->forward(buckets).permute({2, 0, 1}).unsqueeze(0);
}

torch::Tensor T5AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& kv,
                                       const torch::Tensor& bias, T5DecoderCache* cache,
                                       size_t layer) {
  const int64_t b = x.size(0), t = x.size(1);
  auto split = [&](const torch::Tensor& y) {  // [B, L, heads d_kv] -> [B, heads, L, d_kv]
    return y.view({b, y.size(1), heads_, d_kv_}).transpose(1, 2);
  };
  torch::Tensor qh = split(q(x));
  torch::Tensor kh, vh;
  if (kv.defined()) {  // cross-attention: the encoder output's keys and values, once
    if (cache != nullptr && cache->cross_keys.size() > layer &&
        cache->cross_keys[layer].defined()) {
      kh = cache->cross_keys[layer];
      vh = cache->cross_values[layer];
    } else {
      kh = split(k(kv));
      vh = split(v(kv));
      if (cache != nullptr) {
        if (cache->cross_keys.size() <= layer) {
          cache->cross_keys.resize(layer + 1);
          cache->cross_values.resize(layer + 1);
        }
        cache->cross_keys[layer] = kh;
        cache->cross_values[layer] = vh;
      }
    }
  } else {
    kh = split(k(x));
    vh = split(v(x));
    if (cache != nullptr) {
      cache->self.Append(layer, kh, vh);
      kh = cache->self.keys[layer];
      vh = cache->self.values[layer];
    }
  }
  // No 1/sqrt(d_kv): T5 folds it into the initialization of q.
  torch::Tensor scores = BatchedMatmul(qh, kh.transpose(2, 3));
  if (bias.defined()) scores = scores + bias;
  torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat).to(qh.scalar_type());
  torch::Tensor out = BatchedMatmul(probs, vh).transpose(1, 2).reshape({b, t, heads_ * d_kv_});
  return o(out);
}

T5DenseImpl::T5DenseImpl(const T5Config& c, const WeightPrecision& p) : act_(c.dense_act_fn) {
  auto linear = [&](int64_t in, int64_t out) { return Linear(LinearOptions{in, out, false, p}); };
  if (c.gated) {
    wi_0 = register_module("wi_0", linear(c.d_model, c.d_ff));
    wi_1 = register_module("wi_1", linear(c.d_model, c.d_ff));
  } else {
    wi = register_module("wi", linear(c.d_model, c.d_ff));
  }
  wo = register_module("wo", linear(c.d_ff, c.d_model));
}

torch::Tensor T5DenseImpl::forward(const torch::Tensor& x) {
  if (wi) return wo(Activation(act_, wi(x)));
  return wo(Activation(act_, wi_0(x)) * wi_1(x));
}

T5SublayerImpl::T5SublayerImpl(const T5Config& c, Kind kind, bool relative_bias,
                               const WeightPrecision& p)
    : kind_(kind) {
  switch (kind) {
    case Kind::kSelfAttention:
      attention = register_module("SelfAttention", T5Attention(c, relative_bias, p));
      break;
    case Kind::kCrossAttention:
      attention = register_module("EncDecAttention", T5Attention(c, false, p));
      break;
    case Kind::kFeedForward:
      DenseReluDense = register_module("DenseReluDense", T5Dense(c, p));
      break;
  }
  layer_norm =
      register_module("layer_norm", RmsNormLayer(c.d_model, c.layer_norm_epsilon, p.dtype));
}

T5StackImpl::T5StackImpl(const T5Config& c, bool decoder, const WeightPrecision& p)
    : decoder_(decoder) {
  using Kind = T5SublayerImpl::Kind;
  block = register_module("block", torch::nn::ModuleList());
  const int64_t n = decoder ? c.num_decoder_layers : c.num_layers;
  for (int64_t i = 0; i < n; ++i) {
    std::vector<T5Sublayer> subs{T5Sublayer(c, Kind::kSelfAttention, /*relative_bias=*/i == 0, p)};
    if (decoder) subs.push_back(T5Sublayer(c, Kind::kCrossAttention, false, p));
    subs.push_back(T5Sublayer(c, Kind::kFeedForward, false, p));
    torch::nn::ModuleList layer;
    for (const T5Sublayer& s : subs) layer->push_back(s);
    auto blk = std::make_shared<torch::nn::Module>();
    blk->register_module("layer", layer);
    block->push_back(blk);
    sublayers_.push_back(std::move(subs));
  }
  final_layer_norm =
      register_module("final_layer_norm", RmsNormLayer(c.d_model, c.layer_norm_epsilon, p.dtype));
}

T5SublayerImpl& T5StackImpl::Sublayer(size_t block_index, size_t m) {
  return *sublayers_[block_index][m];
}

torch::Tensor T5StackImpl::forward(const torch::Tensor& embeds, const torch::Tensor& mask,
                                   const torch::Tensor& encoder_hidden,
                                   const torch::Tensor& encoder_mask, T5DecoderCache* cache,
                                   int64_t capture_block, torch::Tensor* captured) {
  const int64_t b = embeds.size(0), t = embeds.size(1);
  const torch::ScalarType dtype = embeds.scalar_type();
  const torch::Device device = embeds.device();
  const auto longs = torch::TensorOptions().dtype(torch::kLong).device(device);
  T5AttentionImpl& first = *Sublayer(0, 0).attention;
  torch::Tensor self_bias, cross_bias;
  if (!decoder_) {
    torch::Tensor keep =
        mask.defined() ? mask.to(device, torch::kLong) : torch::ones({b, t}, longs);
    self_bias = first.PositionBias(0, t, t, /*bidirectional=*/true, device).to(dtype) +
                KeyMask(keep, dtype);
  } else {
    const int64_t past = cache != nullptr ? cache->self.length() : 0;
    const int64_t total = past + t;
    torch::Tensor query = torch::arange(past, total, longs).view({t, 1});
    torch::Tensor key = torch::arange(0, total, longs).view({1, total});
    // Later keys and masked ones get the lowest value once (a row with every key masked stays
    // finite, as the padding rows of a teacher-forced batch are).
    torch::Tensor blocked = (key > query).view({1, t, total});
    if (mask.defined()) {
      blocked = blocked | (mask.to(device, torch::kLong) == 0).view({b, 1, total});
    }
    torch::Tensor additive =
        torch::zeros(blocked.sizes(), torch::TensorOptions().dtype(dtype).device(device))
            .masked_fill(blocked, LowestValue(dtype))
            .unsqueeze(1);
    self_bias =
        first.PositionBias(past, t, total, /*bidirectional=*/false, device).to(dtype) + additive;
    const int64_t s = encoder_hidden.size(1);
    torch::Tensor enc_keep =
        encoder_mask.defined() ? encoder_mask.to(device, torch::kLong) : torch::ones({b, s}, longs);
    cross_bias = KeyMask(enc_keep, dtype);
  }
  torch::Tensor h = embeds;
  for (size_t i = 0; i < block->size(); ++i) {
    if (captured != nullptr && capture_block == static_cast<int64_t>(i)) *captured = h;
    for (T5Sublayer& s : sublayers_[i]) {
      T5SublayerImpl& sub = *s;
      torch::Tensor normed = sub.layer_norm(h);
      switch (sub.kind()) {
        case T5SublayerImpl::Kind::kSelfAttention:
          h = h + sub.attention->forward(normed, {}, self_bias, cache, i);
          break;
        case T5SublayerImpl::Kind::kCrossAttention:
          h = h + sub.attention->forward(normed, encoder_hidden, cross_bias, cache, i);
          break;
        case T5SublayerImpl::Kind::kFeedForward:
          h = h + sub.DenseReluDense(normed);
          break;
      }
      h = ClampHalf(h);
    }
  }
  if (captured != nullptr && capture_block == static_cast<int64_t>(block->size())) *captured = h;
  return final_layer_norm(h);
}

T5ForConditionalGenerationImpl::T5ForConditionalGenerationImpl(const T5Config& config,
                                                               const WeightPrecision& precision)
    : config_(config), precision_(precision) {
  shared = register_module("shared", Embedding(config.vocab_size, config.d_model, precision.dtype));
  encoder = register_module("encoder", T5Stack(config, /*decoder=*/false, precision));
  decoder = register_module("decoder", T5Stack(config, /*decoder=*/true, precision));
  if (!config.tie_word_embeddings) {
    lm_head = register_module(
        "lm_head", Linear(LinearOptions{config.d_model, config.vocab_size, false, precision}));
  }
}

absl::Status T5ForConditionalGenerationImpl::Load(const ModelFolder& folder,
                                                  const std::string& prefix, torch::Device device) {
  LoadIntoOptions o;
  o.device = device;
  if (absl::Status s = LoadTokenEmbedding(*shared, folder, prefix + "shared.", precision_, device);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = folder.LoadInto(*encoder, prefix + "encoder.", o); !s.ok()) return s;
  if (absl::Status s = folder.LoadInto(*decoder, prefix + "decoder.", o); !s.ok()) return s;
  if (lm_head) {
    if (absl::Status s = folder.LoadInto(*lm_head, prefix + "lm_head.", o); !s.ok()) return s;
  }
  if (precision_.weights != Precision::kFp32) {
    if (!lm_head) {
      if (!tied_head) {
        tied_head = register_module(
            "tied_head",
            Linear(LinearOptions{config_.d_model, config_.vocab_size, false, precision_}));
      }
      if (absl::Status s = tied_head->AdoptQuantized(shared->quantized_weight()); !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

torch::Tensor T5ForConditionalGenerationImpl::EmbedTokens(const torch::Tensor& ids) {
  return shared(ids);
}

torch::Tensor T5ForConditionalGenerationImpl::Encode(const torch::Tensor& inputs_embeds,
                                                     const torch::Tensor& mask) {
  return encoder->forward(inputs_embeds, mask);
}

torch::Tensor T5ForConditionalGenerationImpl::DecodeLogits(
    const torch::Tensor& decoder_ids, const torch::Tensor& encoder_hidden,
    const torch::Tensor& encoder_mask, T5DecoderCache* cache, const torch::Tensor& decoder_mask,
    int64_t capture_block, torch::Tensor* captured) {
  torch::Tensor h = decoder->forward(shared(decoder_ids.to(encoder_hidden.device())), decoder_mask,
                                     encoder_hidden, encoder_mask, cache, capture_block, captured);
  if (config_.scale_decoder_outputs) h = h * std::pow(static_cast<double>(config_.d_model), -0.5);
  torch::Tensor logits = lm_head     ? lm_head(h)
                         : tied_head ? tied_head(h)
                                     : torch::linear(h, shared->weight);
  return logits.to(torch::kFloat);
}

namespace {

class T5Stepper : public GreedyStepper {
 public:
  T5Stepper(T5ForConditionalGenerationImpl& lm, const torch::Tensor& embeds,
            const torch::Tensor& mask)
      : lm_(lm), embeds_(embeds), mask_(mask) {}

  torch::Tensor Prefill() override {
    encoded_ = lm_.Encode(embeds_, mask_);
    torch::Tensor start =
        torch::full({embeds_.size(0), 1}, lm_.config().decoder_start_token_id,
                    torch::TensorOptions().dtype(torch::kLong).device(embeds_.device()));
    return Step(start);
  }

  torch::Tensor Step(const torch::Tensor& ids) override {
    return lm_.DecodeLogits(ids, encoded_, mask_, &cache_).select(1, -1);
  }

 private:
  T5ForConditionalGenerationImpl& lm_;
  torch::Tensor embeds_, mask_, encoded_;
  T5DecoderCache cache_;
};

}  // namespace

GreedyResult T5GreedyGenerate(T5ForConditionalGenerationImpl& lm,
                              const torch::Tensor& inputs_embeds,
                              const torch::Tensor& attention_mask, const GreedyOptions& options) {
  torch::NoGradGuard no_grad;
  T5Stepper stepper(lm, inputs_embeds, attention_mask);
  return GreedyGenerate(stepper, options);
}

}  // namespace cdcca::model
