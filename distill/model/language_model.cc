#include "distill/model/language_model.h"

#include <cmath>

namespace cdcca::model {
namespace {

AdaptedLinear Linear(const TowerConfig& c, int64_t in, int64_t out, bool lora) {
  AdaptedLinearOptions o;
  o.in_features = in;
  o.out_features = out;
  o.bias = false;
  o.lora_rank = lora ? c.lora_rank : 0;
  o.lora_alpha = c.lora_alpha;
  o.precision = c.precision;
  o.int4_group = c.int4_group;
  return AdaptedLinear(o);
}

}  // namespace

LmDecoderLayerImpl::LmDecoderLayerImpl(const TowerConfig& c, bool with_adapter_prompt)
    : heads_(c.lm_heads) {
  const int64_t d = c.d_model;
  attn_norm_ = register_module("attn_norm", RmsNorm(d));
  q_ = register_module("q", Linear(c, d, d, true));
  k_ = register_module("k", Linear(c, d, d, false));
  v_ = register_module("v", Linear(c, d, d, true));
  o_ = register_module("o", Linear(c, d, d, false));
  ffn_norm_ = register_module("ffn_norm", RmsNorm(d));
  gate_ = register_module("gate", Linear(c, d, c.ffn_hidden, false));
  up_ = register_module("up", Linear(c, d, c.ffn_hidden, false));
  down_ = register_module("down", Linear(c, c.ffn_hidden, d, false));
  if (with_adapter_prompt) {
    adapter_prompt_ =
        register_parameter("adapter_prompt", torch::randn({c.adapter_prompt_len, d}) * 0.02);
    adapter_gate_ = register_parameter("adapter_gate", torch::zeros({c.lm_heads}));
  }
}

torch::Tensor LmDecoderLayerImpl::Heads(const torch::Tensor& x) const {
  return x.view({x.size(0), x.size(1), heads_, x.size(2) / heads_}).transpose(1, 2);
}

torch::Tensor LmDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& positions,
                                        const torch::Tensor& allowed, const torch::Tensor& past_k,
                                        const torch::Tensor& past_v, double dropout_p,
                                        const Rotary& rotary, torch::Tensor* new_k,
                                        torch::Tensor* new_v, int64_t out_first,
                                        int64_t out_count) {
  const int64_t b = x.size(0);
  const bool all = out_count < 0;
  const int64_t t = all ? x.size(1) : out_count;
  torch::Tensor h = attn_norm_->forward(x);
  torch::Tensor hq = all ? h : h.narrow(1, out_first, out_count);
  torch::Tensor q = rotary.Apply(Heads(q_->forward(hq)),
                                 all ? positions : positions.narrow(1, out_first, out_count));
  torch::Tensor k = rotary.Apply(Heads(k_->forward(h)), positions);
  torch::Tensor v = Heads(v_->forward(h));
  if (past_k.defined()) {
    k = torch::cat({past_k, k}, 2);
    v = torch::cat({past_v, v}, 2);
  }
  *new_k = k;
  *new_v = v;
  torch::Tensor attn = MaskedAttention(q, k, v, all ? allowed : allowed.narrow(2, out_first, t),
                                       0.0, nullptr);  // [B, H, T, D]
  if (adapter_prompt_.defined()) {
    // LLaMA-Adapter: a separate softmax over the prompt, scaled by a zero-init per-head gate.
    torch::Tensor pk = Heads(k_->forward(adapter_prompt_.unsqueeze(0))).expand({b, -1, -1, -1});
    torch::Tensor pv = Heads(v_->forward(adapter_prompt_.unsqueeze(0))).expand({b, -1, -1, -1});
    torch::Tensor pa = MaskedAttention(q, pk, pv, torch::Tensor(), 0.0, nullptr);
    attn = attn + adapter_gate_.view({1, heads_, 1, 1}) * pa;
  }
  torch::Tensor a = o_->forward(attn.transpose(1, 2).reshape({b, t, -1}));
  if (dropout_p > 0.0) a = torch::dropout(a, dropout_p, /*train=*/true);
  torch::Tensor y = (all ? x : x.narrow(1, out_first, out_count)) + a;
  h = ffn_norm_->forward(y);
  torch::Tensor f = down_->forward(torch::silu(gate_->forward(h)) * up_->forward(h));
  if (dropout_p > 0.0) f = torch::dropout(f, dropout_p, /*train=*/true);
  return y + f;
}

LanguageModelImpl::LanguageModelImpl(const TowerConfig& c)
    : rotary_(c.d_model / c.lm_heads, c.max_positions, c.rope_theta) {
  embed_ = register_module("embed", torch::nn::Embedding(c.vocab_size, c.d_model));
  torch::NoGradGuard no_grad;
  embed_->weight.normal_(0.0, 0.02);
  layers_ = register_module("layers", torch::nn::ModuleList());
  for (int i = 0; i < c.lm_layers; ++i) {
    const bool prompt = c.adapter_prompt_len > 0 && i >= c.lm_layers - c.adapter_layers;
    layers_->push_back(LmDecoderLayer(c, prompt));
  }
  final_norm_ = register_module("final_norm", RmsNorm(c.d_model));
  lm_head_ = register_module("lm_head", Linear(c, c.d_model, c.vocab_size, false));
}

torch::Tensor LanguageModelImpl::Embed(const torch::Tensor& ids) { return embed_->forward(ids); }

torch::Tensor LanguageModelImpl::Logits(const torch::Tensor& hidden) {
  return lm_head_->forward(hidden);
}

torch::Tensor LanguageModelImpl::forward(const torch::Tensor& embeds, const torch::Tensor& valid,
                                         KvCache* cache, double dropout_p, int capture_layer,
                                         torch::Tensor* captured, int64_t out_first,
                                         int64_t out_count) {
  const int64_t b = embeds.size(0);
  const int64_t t = embeds.size(1);
  const torch::Device device = embeds.device();
  torch::Tensor valid_b = valid.to(torch::kBool);
  const int64_t past = cache != nullptr ? cache->length() : 0;
  torch::Tensor start = (cache != nullptr && cache->next_position.defined())
                            ? cache->next_position
                            : torch::zeros({b}, torch::dtype(torch::kLong).device(device));
  // Padding takes no position: real tokens are numbered consecutively from `start`.
  torch::Tensor counts = valid_b.to(torch::kLong).cumsum(1);
  torch::Tensor positions = (start.unsqueeze(1) + counts - 1).clamp_min(0);
  torch::Tensor key_valid =
      past > 0 ? torch::cat({cache->key_valid, valid_b}, 1) : valid_b;  // [B, P+T]
  torch::Tensor qi = torch::arange(past, past + t, torch::dtype(torch::kLong).device(device));
  torch::Tensor kj = torch::arange(0, past + t, torch::dtype(torch::kLong).device(device));
  torch::Tensor causal = kj.unsqueeze(0) <= qi.unsqueeze(1);  // [T, P+T]
  torch::Tensor allowed = causal.unsqueeze(0).unsqueeze(0) & key_valid.view({b, 1, 1, past + t});

  torch::Tensor x = embeds;
  std::vector<torch::Tensor> new_k(layers_->size()), new_v(layers_->size());
  for (size_t i = 0; i < layers_->size(); ++i) {
    if (captured != nullptr && static_cast<int>(i) == capture_layer) *captured = x;
    torch::Tensor pk = past > 0 ? cache->k[i] : torch::Tensor();
    torch::Tensor pv = past > 0 ? cache->v[i] : torch::Tensor();
    const bool last = i + 1 == layers_->size();
    x = layers_[i]->as<LmDecoderLayer>()->forward(x, positions, allowed, pk, pv, dropout_p, rotary_,
                                                &new_k[i], &new_v[i], out_first,
                                                last ? out_count : -1);
  }
  if (captured != nullptr && capture_layer == static_cast<int>(layers_->size())) *captured = x;
  if (cache != nullptr) {
    cache->k = std::move(new_k);
    cache->v = std::move(new_v);
    cache->key_valid = key_valid;
    cache->next_position = start + valid_b.to(torch::kLong).sum(1);
  }
  return final_norm_->forward(x);
}

}  // namespace cdcca::model
