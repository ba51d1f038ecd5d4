#include "model/arch/decoder_lm.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"
#include "model/runtime/batched_matmul.h"
#include "model/runtime/fused_ops.h"

namespace cdcca::model {

double LowestValue(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf:
      return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    case torch::kBFloat16:
      return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    default:
      return static_cast<double>(std::numeric_limits<float>::lowest());
  }
}

namespace {

// Positions a cache buffer is allocated in multiples of.
constexpr int64_t kCacheBlock = 256;

// Whether `view` is the first `length` positions of `buffer` and `buffer` can take `add`'s
// positions after them.
bool ExtendsInPlace(const torch::Tensor& buffer, const torch::Tensor& view,
                    const torch::Tensor& add, int64_t length) {
  if (!buffer.defined() || buffer.size(2) < length + add.size(2) || buffer.size(0) != add.size(0) ||
      buffer.size(1) != add.size(1) || buffer.size(3) != add.size(3) ||
      buffer.scalar_type() != add.scalar_type() || buffer.device() != add.device()) {
    return false;
  }
  return length == 0 || (view.data_ptr() == buffer.data_ptr() &&
                         view.strides() == buffer.strides() && view.size(2) == length);
}

}  // namespace

void DecoderKvCache::Append(size_t layer, const torch::Tensor& k, const torch::Tensor& v) {
  if (keys.size() <= layer) {
    keys.resize(layer + 1);
    values.resize(layer + 1);
  }
  if (key_buffers.size() < keys.size()) {
    key_buffers.resize(keys.size());
    value_buffers.resize(keys.size());
  }
  torch::Tensor& kc = keys[layer];
  torch::Tensor& vc = values[layer];
  const int64_t past = kc.defined() ? kc.size(2) : 0;
  const int64_t total = past + k.size(2);
  // Autograd needs the concatenation (a write into a buffer would not be differentiable).
  const bool grad = torch::GradMode::is_enabled() &&
                    (k.requires_grad() || v.requires_grad() ||
                     (kc.defined() && (kc.requires_grad() || vc.requires_grad())));
  if (grad) {
    kc = past > 0 ? torch::cat({kc, k}, 2) : k;
    vc = past > 0 ? torch::cat({vc, v}, 2) : v;
    key_buffers[layer] = torch::Tensor();
    value_buffers[layer] = torch::Tensor();
    return;
  }
  torch::NoGradGuard no_grad;
  torch::Tensor& kb = key_buffers[layer];
  torch::Tensor& vb = value_buffers[layer];
  if (!ExtendsInPlace(kb, kc, k, past) || !ExtendsInPlace(vb, vc, v, past)) {
    const int64_t grown = std::max(total, past + past / 2);
    const int64_t capacity = (grown + kCacheBlock - 1) / kCacheBlock * kCacheBlock;
    torch::Tensor nk = torch::empty({k.size(0), k.size(1), capacity, k.size(3)}, k.options());
    torch::Tensor nv = torch::empty({v.size(0), v.size(1), capacity, v.size(3)}, v.options());
    if (past > 0) {
      nk.narrow(2, 0, past).copy_(kc);
      nv.narrow(2, 0, past).copy_(vc);
    }
    kb = nk;
    vb = nv;
  }
  kb.narrow(2, past, k.size(2)).copy_(k);
  vb.narrow(2, past, v.size(2)).copy_(v);
  kc = kb.narrow(2, 0, total);
  vc = vb.narrow(2, 0, total);
}

DecoderAttentionImpl::DecoderAttentionImpl(const DecoderConfig& c, const WeightPrecision& p)
    : heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      hidden_(c.hidden_size) {
  auto linear = [&](int64_t in, int64_t out, bool bias) {
    return Linear(LinearOptions{in, out, bias, p});
  };
  q_proj = register_module("q_proj", linear(c.hidden_size, heads_ * head_dim_, c.qkv_bias));
  k_proj = register_module("k_proj", linear(c.hidden_size, kv_heads_ * head_dim_, c.qkv_bias));
  v_proj = register_module("v_proj", linear(c.hidden_size, kv_heads_ * head_dim_, c.qkv_bias));
  o_proj = register_module(c.is_opt() ? "out_proj" : "o_proj",
                           linear(heads_ * head_dim_, c.hidden_size, c.o_bias));
}

namespace {

// LibTorch's fused attention with an explicit scale (2.1+).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define CDCCA_FUSED_ATTENTION 1
#else
#define CDCCA_FUSED_ATTENTION 0
#endif

thread_local bool fused_scope_open = false;

// A CUDA pass with autograd on (training) attends through LibTorch's fused kernel, which keeps
// no [B, heads, T, T] probabilities for the backward pass: at 16 rows of 648 tokens a 7B LM's
// eager attention would hold about 28 GB of fp32 probabilities until the backward. So does a
// CUDA pass inside a FusedAttentionScope. Other inference and CPU keep the eager product,
// which the transformers-parity tests pin.
// CDCCA_EAGER_ATTENTION=1 forces the eager product everywhere (to compare).
bool FusedTrainingAttention(const torch::Tensor& q, const torch::Tensor* last_query_probs) {
#if CDCCA_FUSED_ATTENTION
  static const bool eager = std::getenv("CDCCA_EAGER_ATTENTION") != nullptr;
  return !eager && q.is_cuda() && (torch::GradMode::is_enabled() || fused_scope_open) &&
         last_query_probs == nullptr;
#else
  (void)q;
  (void)last_query_probs;
  return false;
#endif
}

// An undefined `mask` is the causal mask over keys and queries of one length (no cache, no
// padding: DecoderLmImpl::Forward passes none then): the kernel's is_causal, which selects the
// flash kernel where an additive mask selects the memory-efficient one.
torch::Tensor FusedAttention(const torch::Tensor& q, torch::Tensor k, torch::Tensor v,
                             const torch::Tensor& mask, int64_t group, double scaling) {
#if CDCCA_FUSED_ATTENTION
  if (group > 1) {
    k = k.repeat_interleave(group, 1);
    v = v.repeat_interleave(group, 1);
  }
  if (!mask.defined()) {
    TORCH_CHECK(q.size(2) == k.size(2),
                "a causal pass without a mask needs as many keys as queries");
    return at::scaled_dot_product_attention(q, k, v, c10::nullopt, /*dropout_p=*/0.0,
                                            /*is_causal=*/true, scaling);
  }
  return at::scaled_dot_product_attention(q, k, v,
                                          c10::optional<torch::Tensor>(mask.to(q.scalar_type())),
                                          /*dropout_p=*/0.0, /*is_causal=*/false, scaling);
#else
  (void)q;
  (void)mask;
  (void)group;
  (void)scaling;
  TORCH_CHECK(false, "fused attention needs LibTorch 2.1+");
  return k;
#endif
}

// softmax(q k^T * scaling + mask) v, softmax in fp32, as transformers' eager attention.
// Grouped-query attention: query head h reads kv head h / group. The group's query heads
// are stacked as rows of one product with their kv head, so keys and values are read in
// place, never repeated per query head.
torch::Tensor EagerAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& mask, int64_t group, double scaling,
                             torch::Tensor* last_query_probs) {
  const int64_t b = q.size(0), heads = q.size(1), t = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = k.size(1), total = k.size(2);
  torch::Tensor scores =
      BatchedMatmul(q.reshape({b, kv_heads, group * t, head_dim}), k.transpose(2, 3))
          .view({b, heads, t, total}) *
      scaling;
  if (mask.defined()) scores = scores + mask;
  torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat);
  if (last_query_probs != nullptr) *last_query_probs = probs.select(2, t - 1);
  probs = probs.to(q.scalar_type());
  return BatchedMatmul(probs.view({b, kv_heads, group * t, total}), v)
      .view({b, heads, t, head_dim});  // [B, heads, T, head_dim]
}

}  // namespace

FusedAttentionScope::FusedAttentionScope() : previous_(fused_scope_open) {
  static const bool off = std::getenv("CDCCA_EAGER_PREPARE") != nullptr;
  if (!off) fused_scope_open = true;
}

FusedAttentionScope::~FusedAttentionScope() { fused_scope_open = previous_; }

bool FusedAttentionScope::Open() { return fused_scope_open; }

void DecoderAttentionImpl::AddAdapterPrompt(int64_t length) {
  if (length <= 0 || adapter_prompt.defined()) return;
  const auto options = q_proj->weight.options();
  adapter_prompt = register_parameter(
      "adapter_prompt", torch::randn({length, hidden_}, options.requires_grad(false)) * 0.02);
  adapter_gate = register_parameter("adapter_gate", torch::zeros({heads_}, options));
}

torch::Tensor DecoderAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                            const torch::Tensor& sin, const torch::Tensor& mask,
                                            DecoderKvCache* cache, size_t layer,
                                            torch::Tensor* last_query_probs) {
  const int64_t b = x.size(0), t = x.size(1);
  torch::Tensor q, k, v;
  if (packed_qkv.Serves(x)) {
    torch::Tensor qkv = packed_qkv.forward(x);  // [B, T, (heads + 2 kv_heads) head_dim]
    const int64_t nq = heads_ * head_dim_, nkv = kv_heads_ * head_dim_;
    q = qkv.narrow(-1, 0, nq).view({b, t, heads_, head_dim_}).transpose(1, 2);
    k = qkv.narrow(-1, nq, nkv).view({b, t, kv_heads_, head_dim_}).transpose(1, 2);
    v = qkv.narrow(-1, nq + nkv, nkv).view({b, t, kv_heads_, head_dim_}).transpose(1, 2);
  } else {
    const std::vector<torch::Tensor> qkv = SharedInputForward({q_proj, k_proj, v_proj}, x);
    q = qkv[0].view({b, t, heads_, head_dim_}).transpose(1, 2);
    k = qkv[1].view({b, t, kv_heads_, head_dim_}).transpose(1, 2);
    v = qkv[2].view({b, t, kv_heads_, head_dim_}).transpose(1, 2);
  }
  if (cos.defined()) {  // rotary positions (OPT adds learned ones to the embeddings instead)
    q = ApplyRope(q, cos, sin);
    k = ApplyRope(k, cos, sin);
  }
  if (cache != nullptr) {
    cache->Append(layer, k, v);
    k = cache->keys[layer];
    v = cache->values[layer];
  }
  const int64_t group = heads_ / kv_heads_;
  const double scaling = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  torch::Tensor heads_out;
  if (FusedTrainingAttention(q, last_query_probs)) {
    heads_out = FusedAttention(q, k, v, mask, group, scaling);
  } else {
    TORCH_CHECK(mask.defined(), "eager attention needs its mask");
    heads_out = EagerAttention(q, k, v, mask, group, scaling, last_query_probs);
  }
  if (adapter_prompt.defined()) {
    torch::Tensor prompt = adapter_prompt.to(x.scalar_type()).unsqueeze(0);  // [1, P, H]
    const int64_t p = prompt.size(1);
    torch::Tensor pk = k_proj(prompt).view({1, p, kv_heads_, head_dim_}).transpose(1, 2);
    torch::Tensor pv = v_proj(prompt).view({1, p, kv_heads_, head_dim_}).transpose(1, 2);
    if (kv_heads_ != heads_) {
      pk = pk.repeat_interleave(heads_ / kv_heads_, 1);
      pv = pv.repeat_interleave(heads_ / kv_heads_, 1);
    }
    torch::Tensor pp =
        torch::softmax(torch::matmul(q, pk.transpose(2, 3)) * scaling, -1, torch::kFloat)
            .to(q.scalar_type());
    heads_out = heads_out +
                adapter_gate.to(q.scalar_type()).view({1, heads_, 1, 1}) * torch::matmul(pp, pv);
  }
  torch::Tensor out = heads_out.transpose(1, 2).reshape({b, t, heads_ * head_dim_});
  return o_proj(out);
}

DecoderMlpImpl::DecoderMlpImpl(const DecoderConfig& c, const WeightPrecision& p)
    : act_(c.hidden_act) {
  if (c.is_opt()) {  // registered by the layer, under OPT's names
    up_proj = Linear(LinearOptions{c.hidden_size, c.intermediate_size, c.mlp_bias, p});
    down_proj = Linear(LinearOptions{c.intermediate_size, c.hidden_size, c.mlp_bias, p});
    return;
  }
  gate_proj = register_module(
      "gate_proj", Linear(LinearOptions{c.hidden_size, c.intermediate_size, c.mlp_bias, p}));
  up_proj = register_module(
      "up_proj", Linear(LinearOptions{c.hidden_size, c.intermediate_size, c.mlp_bias, p}));
  down_proj = register_module(
      "down_proj", Linear(LinearOptions{c.intermediate_size, c.hidden_size, c.mlp_bias, p}));
}

torch::Tensor DecoderMlpImpl::forward(const torch::Tensor& x) {
  if (!gate_proj) return down_proj(Activation(act_, up_proj(x)));
  if (packed_gate_up.Serves(x)) {
    torch::Tensor gu = packed_gate_up.forward(x);  // [..., 2 intermediate]
    const int64_t inter = gu.size(-1) / 2;
    return down_proj(Activation(act_, gu.narrow(-1, 0, inter)) * gu.narrow(-1, inter, inter));
  }
  const std::vector<torch::Tensor> gate_up = SharedInputForward({gate_proj, up_proj}, x);
  if (act_ == "silu" || act_ == "swish") return down_proj(SiluMul(gate_up[0], gate_up[1]));
  return down_proj(Activation(act_, gate_up[0]) * gate_up[1]);
}

DecoderLayerImpl::DecoderLayerImpl(const DecoderConfig& c, const WeightPrecision& p)
    : norm_before_(c.do_layer_norm_before) {
  if (c.is_opt()) {
    self_attn = register_module("self_attn", DecoderAttention(c, p));
    self_attn_layer_norm = register_module(
        "self_attn_layer_norm", LayerNormLayer(c.hidden_size, c.layer_norm_eps, p.dtype));
    mlp = DecoderMlp(c, p);
    register_module("fc1", mlp->up_proj);
    register_module("fc2", mlp->down_proj);
    final_layer_norm = register_module("final_layer_norm",
                                       LayerNormLayer(c.hidden_size, c.layer_norm_eps, p.dtype));
    return;
  }
  input_layernorm =
      register_module("input_layernorm", RmsNormLayer(c.hidden_size, c.rms_norm_eps, p.dtype));
  self_attn = register_module("self_attn", DecoderAttention(c, p));
  post_attention_layernorm = register_module("post_attention_layernorm",
                                             RmsNormLayer(c.hidden_size, c.rms_norm_eps, p.dtype));
  mlp = register_module("mlp", DecoderMlp(c, p));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                        const torch::Tensor& sin, const torch::Tensor& mask,
                                        DecoderKvCache* cache, size_t layer, double dropout_p,
                                        torch::Tensor* last_query_probs) {
  if (self_attn_layer_norm) {  // OPT: LayerNorm before each sublayer, or after its residual add
    torch::Tensor a = self_attn->forward(norm_before_ ? self_attn_layer_norm(x) : x, cos, sin, mask,
                                         cache, layer, last_query_probs);
    torch::Tensor h = x + TrainingDropout(a, dropout_p);
    if (!norm_before_) h = self_attn_layer_norm(h);
    torch::Tensor f = TrainingDropout(mlp(norm_before_ ? final_layer_norm(h) : h), dropout_p);
    h = h + f;
    return norm_before_ ? h : final_layer_norm(h);
  }
  const Residual r = ForwardResidual(x, torch::Tensor(), cos, sin, mask, cache, layer, dropout_p,
                                     last_query_probs);
  return r.h + r.f;
}

DecoderLayerImpl::Residual DecoderLayerImpl::ForwardResidual(
    const torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& cos,
    const torch::Tensor& sin, const torch::Tensor& mask, DecoderKvCache* cache, size_t layer,
    double dropout_p, torch::Tensor* last_query_probs) {
  TORCH_CHECK(input_layernorm, "ForwardResidual is for pre-norm (RMSNorm) layers");
  Residual r;
  auto [input, normed] = input_layernorm->AddForward(x, delta);
  r.input = input;
  torch::Tensor a = self_attn->forward(normed, cos, sin, mask, cache, layer, last_query_probs);
  a = TrainingDropout(a, dropout_p);
  auto [h, normed_h] = post_attention_layernorm->AddForward(r.input, a);
  r.h = h;
  r.f = TrainingDropout(mlp(normed_h), dropout_p);
  return r;
}

DecoderLmImpl::DecoderLmImpl(const DecoderConfig& config, const WeightPrecision& precision)
    : config_(config), precision_(precision) {
  const int64_t embed_dim = EmbedDim();
  embed_tokens =
      register_module("embed_tokens", Embedding(config.vocab_size, embed_dim, precision.dtype));
  if (config.is_opt()) {
    embed_positions = register_module(
        "embed_positions",
        Embedding(config.max_position_embeddings + DecoderConfig::kOptPositionOffset,
                  config.hidden_size, precision.dtype));
    if (embed_dim != config.hidden_size) {
      project_in = register_module(
          "project_in", Linear(LinearOptions{embed_dim, config.hidden_size, false, precision}));
      project_out = register_module(
          "project_out", Linear(LinearOptions{config.hidden_size, embed_dim, false, precision}));
    }
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers->push_back(DecoderLayer(config, precision));
  }
  if (!config.is_opt()) {
    norm = register_module("norm",
                           RmsNormLayer(config.hidden_size, config.rms_norm_eps, precision.dtype));
  } else if (config.final_layer_norm) {
    final_layer_norm =
        register_module("final_layer_norm",
                        LayerNormLayer(config.hidden_size, config.layer_norm_eps, precision.dtype));
  }
  if (!config.tie_word_embeddings) {
    lm_head = register_module(
        "lm_head", Linear(LinearOptions{embed_dim, config.vocab_size, false, precision}));
  }
}

int64_t DecoderLmImpl::EmbedDim() const {
  return config_.is_opt() ? config_.word_embed_proj_dim : config_.hidden_size;
}

absl::Status DecoderLmImpl::Load(const ModelFolder& folder, const std::string& body_prefix,
                                 const std::string& lm_head_prefix, torch::Device device) {
  LoadIntoOptions o;
  o.device = device;
  // The embedding's rows packed as a linear weight [vocab, hidden] would be (at int8/int4):
  // the lookup dequantizes the rows it gathers and a tied head multiplies with the same bytes.
  if (absl::Status s = LoadTokenEmbedding(*embed_tokens, folder, body_prefix + "embed_tokens.",
                                          precision_, device);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = folder.LoadInto(*layers, body_prefix + "layers.", o); !s.ok()) return s;
  // The parts a config may not have (null holders) are skipped.
  auto get = [](auto& holder) -> torch::nn::Module* { return holder ? holder.get() : nullptr; };
  for (const auto& [module, name] : std::vector<std::pair<torch::nn::Module*, std::string>>{
           {get(norm), "norm."},
           {get(final_layer_norm), "final_layer_norm."},
           {get(embed_positions), "embed_positions."},
           {get(project_in), "project_in."},
           {get(project_out), "project_out."}}) {
    if (module == nullptr) continue;
    if (absl::Status s = folder.LoadInto(*module, body_prefix + name, o); !s.ok()) return s;
  }
  if (lm_head) {
    if (absl::Status s = folder.LoadInto(*lm_head, lm_head_prefix, o); !s.ok()) return s;
  }
  if (precision_.weights != Precision::kFp32) {
    if (!lm_head) {
      if (!tied_head) {
        tied_head = register_module(
            "tied_head", Linear(LinearOptions{EmbedDim(), config_.vocab_size, false, precision_}));
      }
      if (absl::Status s = tied_head->AdoptQuantized(embed_tokens->quantized_weight()); !s.ok()) {
        return s;
      }
    }
  }
  FuseProjections();
  return absl::OkStatus();
}

namespace {

// Concatenates `parts`' weights (and biases) along the output dimension into *weight
// (*bias) and points each part at its slice.
void FuseLinears(const std::vector<Linear>& parts, torch::Tensor* weight, torch::Tensor* bias) {
  std::vector<torch::Tensor> ws, bs;
  for (const Linear& p : parts) {
    ws.push_back(p->weight);
    if (p->bias.defined()) bs.push_back(p->bias);
  }
  *weight = torch::cat(ws, 0);
  if (bs.size() == parts.size()) *bias = torch::cat(bs, 0);
  int64_t offset = 0;
  for (const Linear& p : parts) {
    const int64_t n = p->weight.size(0);
    p->weight.set_data(weight->narrow(0, offset, n));
    if (bias->defined()) p->bias.set_data(bias->narrow(0, offset, n));
    offset += n;
  }
}

}  // namespace

void DecoderLmImpl::FuseProjections() {
  torch::NoGradGuard no_grad;
  if (precision_.weights != Precision::kFp32) {
    for (size_t i = 0; i < layers->size(); ++i) {
      auto* layer = layers->ptr(i)->as<DecoderLayerImpl>();
      DecoderAttentionImpl& attn = *layer->self_attn;
      if (!attn.packed_qkv.Intact()) {
        attn.packed_qkv.Fuse({attn.q_proj, attn.k_proj, attn.v_proj});
      }
      DecoderMlpImpl& mlp = *layer->mlp;
      if (mlp.gate_proj && !mlp.packed_gate_up.Intact()) {
        mlp.packed_gate_up.Fuse({mlp.gate_proj, mlp.up_proj});
      }
    }
    return;
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    auto* layer = layers->ptr(i)->as<DecoderLayerImpl>();
    DecoderAttentionImpl& attn = *layer->self_attn;
    if (!attn.qkv_weight.defined()) {
      FuseLinears({attn.q_proj, attn.k_proj, attn.v_proj}, &attn.qkv_weight, &attn.qkv_bias);
    }
    DecoderMlpImpl& mlp = *layer->mlp;
    if (mlp.gate_proj && !mlp.gate_up_weight.defined()) {
      FuseLinears({mlp.gate_proj, mlp.up_proj}, &mlp.gate_up_weight, &mlp.gate_up_bias);
    }
  }
}

torch::Tensor DecoderLmImpl::EmbedTokens(const torch::Tensor& ids) { return embed_tokens(ids); }

DecoderOutput DecoderLmImpl::Forward(const torch::Tensor& inputs_embeds,
                                     const torch::Tensor& attention_mask, DecoderKvCache* cache,
                                     const DecoderForwardOptions& options) {
  const int64_t b = inputs_embeds.size(0), t = inputs_embeds.size(1);
  const int64_t past = cache != nullptr ? cache->length() : 0;
  const int64_t total = past + t;
  const torch::Device device = inputs_embeds.device();
  const auto long_opts = torch::TensorOptions().dtype(torch::kLong).device(device);
  torch::Tensor keep = attention_mask.defined() ? attention_mask.to(device, torch::kLong)
                                                : torch::ones({b, total}, long_opts);
  TORCH_CHECK(keep.size(0) == b && keep.size(1) == total, "attention_mask must be [B, past + T]");
  torch::Tensor positions = options.position_ids;
  if (!positions.defined() && config_.is_opt()) {
    // OPTLearnedPositionalEmbedding: cumsum(mask) * mask - 1, padding at -1.
    positions = (keep.cumsum(-1) * keep - 1).narrow(1, past, t);
  } else if (!positions.defined()) {
    if (attention_mask.defined()) {
      positions = (keep.cumsum(-1) - 1).masked_fill(keep == 0, 1).narrow(1, past, t);
    } else {
      positions = torch::arange(past, total, long_opts).unsqueeze(0).expand({b, t});
    }
  }
  positions = positions.to(device, torch::kLong);
  torch::Tensor cos, sin;  // undefined for OPT
  torch::Tensor h = inputs_embeds;
  if (config_.is_opt()) {
    if (project_in) h = project_in(h);
    h = h + embed_positions(positions + DecoderConfig::kOptPositionOffset);
  } else {
    const int64_t seq_len = positions.max().item<int64_t>() + 1;
    RopeCosSin(RopeInvFreq(config_.rope, config_.head_dim, seq_len), positions,
               inputs_embeds.scalar_type(), &cos, &sin, config_.rope.attention_factor);
  }

  // Additive mask [B, 1, T, past + T]: query i (absolute past + i) sees key j <= past + i
  // that the padding mask keeps; the rest gets the dtype's lowest value, as transformers.
  // Where every layer attends through the fused kernel and the pass is causal over its own
  // tokens alone (no cache before them, no padding), no mask: the kernel's causal flag.
  torch::Tensor mask;
  const bool fused =
      FusedTrainingAttention(inputs_embeds, nullptr) && options.last_query_attention == nullptr;
  static const bool always_mask = std::getenv("CDCCA_ALWAYS_MASK") != nullptr;  // to compare
  const bool causal_only = fused && !always_mask && past == 0 &&
                           (!attention_mask.defined() || !(keep == 0).any().item<bool>());
  if (!causal_only) {
    torch::Tensor query_pos = torch::arange(past, total, long_opts).view({t, 1});
    torch::Tensor key_pos = torch::arange(0, total, long_opts).view({1, total});
    torch::Tensor allowed = (key_pos <= query_pos).unsqueeze(0) & (keep != 0).unsqueeze(1);
    const torch::ScalarType dtype = inputs_embeds.scalar_type();
    mask = torch::zeros({b, t, total}, torch::TensorOptions().dtype(dtype).device(device))
               .masked_fill(allowed.logical_not(), LowestValue(dtype))
               .unsqueeze(1);
  }

  if (cache != nullptr && cache->keys.size() != layers->size()) {
    cache->Clear();
    cache->keys.assign(layers->size(), torch::Tensor());
    cache->values.assign(layers->size(), torch::Tensor());
  }
  DecoderOutput out;
  // Pre-norm layers hand on their output as h + delta, the addition done by the next norm
  // (DecoderLayerImpl::ForwardResidual).
  torch::Tensor delta;
  const int64_t n_layers = static_cast<int64_t>(layers->size());
  for (int64_t i = 0; i < n_layers; ++i) {
    auto* layer = layers->ptr(i)->as<DecoderLayerImpl>();
    torch::Tensor probs;
    torch::Tensor* probs_out = options.last_query_attention != nullptr ? &probs : nullptr;
    if (layer->input_layernorm) {
      const DecoderLayerImpl::Residual r =
          layer->ForwardResidual(h, delta, cos, sin, mask, cache, i, options.dropout_p, probs_out);
      if (options.capture_layer == i) out.captured = r.input;
      h = r.h;
      delta = r.f;
    } else {
      if (options.capture_layer == i) out.captured = h;
      h = layer->forward(h, cos, sin, mask, cache, i, options.dropout_p, probs_out);
    }
    if (options.last_query_attention != nullptr) options.last_query_attention->push_back(probs);
  }
  if (delta.defined() && (options.capture_layer == n_layers || !norm)) {
    h = h + delta;
    delta = torch::Tensor();
  }
  if (options.capture_layer == n_layers) out.captured = h;
  if (norm) h = norm->AddForward(h, delta).second;
  if (final_layer_norm) h = final_layer_norm(h);
  out.hidden = h;
  const int64_t tail = options.last_logits_only  ? 1
                       : options.logits_tail > 0 ? std::min(options.logits_tail, t)
                                                 : t;
  torch::Tensor last = tail < t ? h.narrow(1, t - tail, tail) : h;
  if (project_out) last = project_out(last);
  torch::Tensor logits = lm_head     ? lm_head(last)
                         : tied_head ? tied_head(last)
                                     : torch::linear(last, embed_tokens->weight);
  out.logits = logits.to(torch::kFloat);
  return out;
}

}  // namespace cdcca::model
