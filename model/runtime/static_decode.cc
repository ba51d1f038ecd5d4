#include "model/runtime/static_decode.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <vector>

#if CDCCA_HAVE_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace cdcca::model {
namespace {

// Positions are allocated in blocks, so that prompts of similar length reuse one state
// (and its captured graph).
constexpr int64_t kCapacityBlock = 64;

// Buffers the fixed-shape step reads and writes, sized for `batch` rows of `capacity`
// positions. The rows are left-padded to one prompt length, so every row writes the same
// cache slot at a step; each keeps its own padding and positions.
struct StaticState {
  int64_t batch = 1;
  int64_t capacity = 0;
  torch::ScalarType dtype = torch::kFloat;
  torch::Device device = torch::kCPU;
  std::vector<torch::Tensor> keys, values;  // per layer [B, kv_heads, capacity, head_dim]
  torch::Tensor cos, sin;                   // [capacity, head_dim]
  torch::Tensor key_pos;                    // [capacity] int64: 0 .. capacity - 1
  torch::Tensor pad;                        // [B, capacity] bool: prompt padding, never attended
  torch::Tensor mask;                       // [B, 1, 1, capacity] additive
  torch::Tensor token;                      // [B, 1] int64: the tokens the next step reads
  torch::Tensor pos;                        // [1] int64: their cache slot
  torch::Tensor rope_pos;                   // [B] int64: their positions (slot - padding)
  torch::Tensor step;                       // [1] int64: where their successors go in `tokens`
  torch::Tensor tokens;                     // [B, capacity] int64: generated ids
#if CDCCA_HAVE_CUDA_GRAPHS
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

std::shared_ptr<StaticState> MakeState(const DecoderLmImpl& lm, int64_t batch, int64_t capacity,
                                       torch::ScalarType dtype, torch::Device device) {
  const DecoderConfig& c = lm.config();
  auto s = std::make_shared<StaticState>();
  s->batch = batch;
  s->capacity = capacity;
  s->dtype = dtype;
  s->device = device;
  const auto opts = torch::TensorOptions().dtype(dtype).device(device);
  const auto longs = torch::TensorOptions().dtype(torch::kLong).device(device);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    s->keys.push_back(torch::zeros({batch, c.num_key_value_heads, capacity, c.head_dim}, opts));
    s->values.push_back(torch::zeros({batch, c.num_key_value_heads, capacity, c.head_dim}, opts));
  }
  s->key_pos = torch::arange(capacity, longs);
  RopeCosSin(RopeInvFreq(c.rope, c.head_dim, capacity), s->key_pos.view({1, capacity}), dtype,
             &s->cos, &s->sin, c.rope.attention_factor);
  s->cos = s->cos[0];
  s->sin = s->sin[0];
  s->pad = torch::zeros({batch, capacity}, longs.dtype(torch::kBool));
  s->mask = torch::zeros({batch, 1, 1, capacity}, opts);
  s->token = torch::zeros({batch, 1}, longs);
  s->pos = torch::zeros({1}, longs);
  s->rope_pos = torch::zeros({batch}, longs);
  s->step = torch::zeros({1}, longs);
  s->tokens = torch::zeros({batch, capacity}, longs);
  return s;
}

// CDCCA_STATIC_EXACT_OPS set: the step uses the reference forward's operations one for one
// (separate scale and mask additions, residual additions, module RMSNorm) instead of the
// fused ones below, which round differently in bf16. For measuring that difference only.
bool ExactOps() {
  static const bool exact = std::getenv("CDCCA_STATIC_EXACT_OPS") != nullptr;
  return exact;
}

// RMSNorm as RmsNormLayerImpl::forward computes it (fp32 statistics, cast back, times the
// weight), in fewer kernels where LibTorch has rms_norm (2.4+).
torch::Tensor RmsNorm(RmsNormLayerImpl& norm, double eps, const torch::Tensor& x) {
  if (ExactOps()) return norm.forward(x);
#if (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)) && \
    !defined(CDCCA_NO_AT_RMS_NORM)
  torch::Tensor h = at::rms_norm(x.to(torch::kFloat), {x.size(-1)}, {}, eps);
  return norm.weight * h.to(x.scalar_type());
#else
  torch::Tensor h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return norm.weight * h.to(x.scalar_type());
#endif
}

// residual + linear(x) in one kernel where the layer has no bias and float weights.
torch::Tensor AddLinear(const torch::Tensor& residual, LinearImpl& linear, const torch::Tensor& x) {
  if (linear.bias.defined() || ExactOps()) return residual + linear.forward(x);
  const int64_t out = linear.weight.size(0);
  return torch::addmm(residual.view({-1, out}), x.view({-1, x.size(-1)}), linear.weight.t())
      .view(residual.sizes());
}

// One decode step on device tensors only: reads s.token at s.pos, appends its keys/values,
// writes the argmax into s.token and s.tokens[s.step], advances s.pos and s.step.
void RunStep(DecoderLmImpl& lm, StaticState& s) {
  const DecoderConfig& c = lm.config();
  const double eps = c.rms_norm_eps;
  const int64_t b = s.batch;
  torch::Tensor x = lm.EmbedTokens(s.token);                               // [B, 1, H]
  torch::Tensor cos = s.cos.index_select(0, s.rope_pos).view({b, 1, -1});  // [B, 1, head_dim]
  torch::Tensor sin = s.sin.index_select(0, s.rope_pos).view({b, 1, -1});
  s.mask.zero_();
  s.mask.view({b, s.capacity})
      .masked_fill_(s.key_pos.gt(s.pos).unsqueeze(0).logical_or(s.pad), LowestValue(s.dtype));
  const double scaling = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  for (size_t i = 0; i < lm.layers->size(); ++i) {
    auto* layer = lm.layers->ptr(i)->as<DecoderLayerImpl>();
    DecoderAttentionImpl& attn = *layer->self_attn;
    const int64_t heads = attn.heads(), kv = attn.kv_heads(), d = attn.head_dim();
    torch::Tensor qkv =
        torch::linear(RmsNorm(*layer->input_layernorm, eps, x), attn.qkv_weight, attn.qkv_bias);
    // RoPE on the query and key heads together (the same rotation per head).
    torch::Tensor qk = ApplyRope(
        qkv.narrow(-1, 0, (heads + kv) * d).view({b, 1, heads + kv, d}).transpose(1, 2), cos, sin);
    torch::Tensor q = qk.narrow(1, 0, heads);   // [B, heads, 1, d]
    torch::Tensor k = qk.narrow(1, heads, kv);  // [B, kv, 1, d]
    torch::Tensor v = qkv.narrow(-1, (heads + kv) * d, kv * d).view({b, 1, kv, d}).transpose(1, 2);
    s.keys[i].index_copy_(2, s.pos, k);
    s.values[i].index_copy_(2, s.pos, v);
    // Query head h reads kv head h / (heads / kv): group the query heads per row and kv head.
    const int64_t group = heads / kv;
    torch::Tensor grouped = q.reshape({b * kv, group, d});
    torch::Tensor keys = s.keys[i].view({b * kv, s.capacity, d});
    torch::Tensor mask = s.mask.view({b, 1, 1, s.capacity});
    torch::Tensor scores =
        ExactOps()
            ? (torch::matmul(grouped, keys.transpose(1, 2)).view({b, kv, group, s.capacity}) *
                   scaling +
               mask)
                  .view({b * kv, group, s.capacity})
            // One row's mask reshapes to a broadcast view; several rows' are copied out.
            : torch::baddbmm(
                  mask.expand({b, kv, group, s.capacity}).reshape({b * kv, group, s.capacity}),
                  grouped, keys.transpose(1, 2), 1.0, scaling);
    torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat).to(s.dtype);
    torch::Tensor out =
        torch::bmm(probs, s.values[i].view({b * kv, s.capacity, d})).reshape({b, 1, heads * d});
    torch::Tensor h = AddLinear(x, *attn.o_proj, out);
    DecoderMlpImpl& mlp = *layer->mlp;
    torch::Tensor gu = torch::linear(RmsNorm(*layer->post_attention_layernorm, eps, h),
                                     mlp.gate_up_weight, mlp.gate_up_bias);
    const int64_t inter = gu.size(-1) / 2;
    x = AddLinear(h, *mlp.down_proj,
                  Activation(mlp.act(), gu.narrow(-1, 0, inter)) * gu.narrow(-1, inter, inter));
  }
  x = RmsNorm(*lm.norm, eps, x);
  torch::Tensor logits = lm.lm_head ? lm.lm_head(x) : torch::linear(x, lm.embed_tokens->weight);
  torch::Tensor next = logits.to(torch::kFloat).argmax(-1);  // [B, 1]
  s.token.copy_(next);
  s.tokens.index_copy_(1, s.step, next);
  s.pos.add_(1);
  s.rope_pos.add_(1);
  s.step.add_(1);
}

bool IsEos(const GreedyOptions& options, int64_t id) {
  return std::find(options.eos_token_ids.begin(), options.eos_token_ids.end(), id) !=
         options.eos_token_ids.end();
}

}  // namespace

bool CudaGraphsCompiledIn() {
#if CDCCA_HAVE_CUDA_GRAPHS
  return true;
#else
  return false;
#endif
}

bool StaticDecodeApplies(const DecoderLmImpl& lm, const torch::Tensor& inputs_embeds,
                         const GreedyOptions& options) {
  if (inputs_embeds.dim() != 3 || inputs_embeds.size(0) < 1 || options.keep_step_logits) {
    return false;
  }
  // The static step is the Llama family's block (rotary positions, RMSNorm, gated MLP).
  if (lm.precision().weights != Precision::kFp32 || lm.config().rope.type == "dynamic" ||
      lm.config().is_opt()) {
    return false;
  }
  const auto* first = lm.layers->size() > 0 ? lm.layers->ptr(0)->as<DecoderLayerImpl>() : nullptr;
  if (first == nullptr || !first->self_attn->qkv_weight.defined() ||
      !first->mlp->gate_up_weight.defined()) {
    return false;
  }
  // The static step multiplies with the fused q/k/v and gate/up weights, which hold no LoRA.
  for (const auto& layer : *lm.layers) {
    const auto* l = layer->as<DecoderLayerImpl>();
    if (l->self_attn->q_proj->has_lora() || l->self_attn->k_proj->has_lora() ||
        l->self_attn->v_proj->has_lora() || l->mlp->gate_proj->has_lora() ||
        l->mlp->up_proj->has_lora()) {
      return false;
    }
  }
  return true;
}

GreedyResult StaticGreedyGenerate(DecoderLmImpl& lm, const torch::Tensor& inputs_embeds,
                                  const torch::Tensor& attention_mask, const GreedyOptions& options,
                                  bool use_graph) {
  torch::NoGradGuard no_grad;
  GreedyResult r;
  const int64_t n = options.max_new_tokens;
  if (n <= 0) return r;
  const int64_t b = inputs_embeds.size(0);
  const int64_t prompt = inputs_embeds.size(1);
  const torch::Device device = inputs_embeds.device();
  const torch::ScalarType dtype = inputs_embeds.scalar_type();

  // Prefill: the reference forward, with the mask the reference loop passes.
  DecoderKvCache cache;
  DecoderForwardOptions fo;
  fo.last_logits_only = true;
  torch::Tensor mask =
      attention_mask.defined()
          ? attention_mask.to(device, torch::kLong)
          : torch::ones({b, prompt}, torch::TensorOptions().dtype(torch::kLong).device(device));
  torch::Tensor logits = lm.Forward(inputs_embeds, mask, &cache, fo).logits.select(1, 0);
  r.first_logits = logits.to(torch::kCPU, torch::kFloat);
  torch::Tensor first = logits.argmax(-1);  // [B]
  r.tokens.assign(b, {});
  std::vector<bool> done(b, false);
  bool all_done = true;
  {
    const torch::Tensor ids = first.to(torch::kCPU);
    for (int64_t i = 0; i < b; ++i) {
      r.tokens[i].push_back(ids[i].item<int64_t>());
      done[i] = IsEos(options, r.tokens[i].back());
      all_done = all_done && done[i];
    }
  }
  if (n == 1 || all_done) return r;

  // Steps write positions prompt .. prompt + n - 2. A batch of one keeps its buffers (and
  // graph) on the model for the next call; a larger batch's are freed when the call ends
  // (a 13B teacher's at batch 8 take 4.6 GB, which a training step needs back).
  const int64_t needed = prompt + n - 1;
  std::shared_ptr<StaticState> state;
  if (b == 1) state = std::static_pointer_cast<StaticState>(lm.static_decode_state);
  if (!state || state->capacity < needed || state->dtype != dtype || state->device != device) {
    if (b == 1) lm.static_decode_state.reset();  // free the old buffers (and graph) first
    state.reset();
    const int64_t capacity = (needed + kCapacityBlock - 1) / kCapacityBlock * kCapacityBlock;
    state = MakeState(lm, b, capacity, dtype, device);
    if (b == 1) lm.static_decode_state = state;
  }
  StaticState& s = *state;
  for (size_t i = 0; i < s.keys.size(); ++i) {
    s.keys[i].narrow(2, 0, prompt).copy_(cache.keys[i]);
    s.values[i].narrow(2, 0, prompt).copy_(cache.values[i]);
  }
  cache.Clear();
  // Padded prompt slots stay masked; positions continue from the kept tokens' count, as the
  // reference loop's cumulative-sum positions do.
  s.pad.zero_();
  s.pad.narrow(1, 0, prompt).copy_(mask.eq(0));
  const torch::Tensor kept = mask.sum(1);
  auto reset = [&] {
    s.token.copy_(first.view({b, 1}));
    s.pos.fill_(prompt);
    s.rope_pos.copy_(kept);
    s.step.fill_(1);
  };
  reset();

  bool graph = false;
#if CDCCA_HAVE_CUDA_GRAPHS
  if (use_graph && device.is_cuda() && std::getenv("CDCCA_NO_CUDA_GRAPH") == nullptr) {
    if (!s.graph) {
      // Warm up (cuBLAS handles, workspaces) and capture on a side stream, as
      // torch.cuda.graph does; the warm-up step's writes are all overwritten by step 1.
      c10::cuda::device_synchronize();
      c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(false, device.index());
      {
        c10::cuda::CUDAStreamGuard guard(stream);
        RunStep(lm, s);
        reset();
        stream.synchronize();
        auto g = std::make_unique<at::cuda::CUDAGraph>();
        g->capture_begin();
        RunStep(lm, s);
        g->capture_end();
        s.graph = std::move(g);
      }
      c10::cuda::device_synchronize();
    }
    graph = true;
  }
#endif
  (void)use_graph;

  // Steps run back to back; the host reads the tokens every few steps only when it must
  // look for an eos id (steps past a row's eos are wasted, never returned).
  const int64_t check_every = options.eos_token_ids.empty() ? n : 8;
  int64_t produced = 1;
  while (!all_done && produced < n) {
    const int64_t burst = std::min(check_every, n - produced);
    for (int64_t j = 0; j < burst; ++j) {
#if CDCCA_HAVE_CUDA_GRAPHS
      if (graph) {
        s.graph->replay();
        continue;
      }
#endif
      RunStep(lm, s);
    }
    const torch::Tensor got = s.tokens.narrow(1, produced, burst).to(torch::kCPU).contiguous();
    const int64_t* ids = got.data_ptr<int64_t>();
    all_done = true;
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t j = 0; j < burst && !done[i]; ++j) {
        r.tokens[i].push_back(ids[i * burst + j]);
        done[i] = IsEos(options, ids[i * burst + j]);
      }
      all_done = all_done && done[i];
    }
    produced += burst;
  }
  (void)graph;
  return r;
}

}  // namespace cdcca::model
