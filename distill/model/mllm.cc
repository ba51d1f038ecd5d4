#include "distill/model/mllm.h"

namespace cdcca::model {
namespace {

// Population variance over dim 0, shifted by the first pass so that identical passes give
// exactly zero (a plain mean can round differently from the values it averages).
torch::Tensor ShiftedVariance(const torch::Tensor& x) {
  torch::Tensor d = x - x.select(0, 0).unsqueeze(0);
  torch::Tensor mean = d.mean(0);
  return (d.pow(2).mean(0) - mean.pow(2)).clamp_min(0.0);
}

}  // namespace

MllmImpl::MllmImpl(const TowerConfig& config) : config_(config) {
  TORCH_CHECK(ValidateTower(config).ok(),
              "invalid tower config: ", std::string(ValidateTower(config).message()));
  qa_ = register_module("qa", QueryAdapter(config));
  lm_ = register_module("lm", LanguageModel(config));
}

MllmOutput MllmImpl::Forward(const MllmInput& input) {
  if (input.scene_index.defined()) {
    return ForwardGroups(input.visual_tokens, input.visual_mask,
                         {{input.text_ids, input.text_valid, input.scene_index}})
        .front();
  }
  const double p = is_training() ? config_.dropout : 0.0;
  QueryAdapterOutput q = qa_->forward(input.visual_tokens, input.visual_mask, p);
  const int64_t b = input.text_ids.size(0);
  const int64_t t = input.text_ids.size(1);
  const int64_t l = config_.num_queries;
  torch::Tensor text_valid =
      input.text_valid.defined()
          ? input.text_valid.to(torch::kBool)
          : torch::ones({b, t}, torch::dtype(torch::kBool).device(input.text_ids.device()));
  torch::Tensor embeds = torch::cat({q.prefix, lm_->Embed(input.text_ids)}, 1);
  torch::Tensor valid = torch::cat({torch::ones({b, l}, text_valid.options()), text_valid}, 1);
  torch::Tensor captured;
  torch::Tensor hidden = lm_->forward(embeds, valid, nullptr, p, representation_layer(), &captured);
  MllmOutput out;
  out.logits = lm_->Logits(hidden.narrow(1, l, t));
  out.queries = q.queries;
  out.representation = captured.narrow(1, l, t);
  out.attention_mass = q.attention_mass;
  return out;
}

std::vector<MllmOutput> MllmImpl::ForwardGroups(const torch::Tensor& visual_tokens,
                                                const torch::Tensor& visual_mask,
                                                const std::vector<QuestionGroup>& groups) {
  const double p = is_training() ? config_.dropout : 0.0;
  QueryAdapterOutput q = qa_->forward(visual_tokens, visual_mask, p);
  const int64_t s = q.prefix.size(0);
  const int64_t l = config_.num_queries;
  KvCache prefix;
  lm_->forward(q.prefix, torch::ones({s, l}, torch::dtype(torch::kBool).device(q.prefix.device())),
               &prefix, p, -1, nullptr);
  std::vector<MllmOutput> outs;
  outs.reserve(groups.size());
  for (const QuestionGroup& g : groups) {
    const torch::Tensor& idx = g.scene_index;
    KvCache cache;
    for (size_t i = 0; i < prefix.k.size(); ++i) {
      cache.k.push_back(prefix.k[i].index_select(0, idx));
      cache.v.push_back(prefix.v[i].index_select(0, idx));
    }
    cache.key_valid = prefix.key_valid.index_select(0, idx);
    cache.next_position = prefix.next_position.index_select(0, idx);
    torch::Tensor valid =
        g.text_valid.defined()
            ? g.text_valid.to(torch::kBool)
            : torch::ones(g.text_ids.sizes(), torch::dtype(torch::kBool).device(idx.device()));
    MllmOutput out;
    torch::Tensor hidden =
        lm_->forward(lm_->Embed(g.text_ids), valid, &cache, p, representation_layer(),
                     &out.representation, g.logit_first, g.logit_count);
    out.logits = lm_->Logits(hidden);
    out.queries = q.queries.index_select(0, idx);
    out.attention_mass = q.attention_mass.index_select(0, idx);
    outs.push_back(std::move(out));
  }
  return outs;
}

GenerateResult MllmImpl::Generate(const torch::Tensor& visual_tokens,
                                  const torch::Tensor& visual_mask, const torch::Tensor& prompt_ids,
                                  const torch::Tensor& prompt_valid, int max_new_tokens,
                                  int64_t eos_id) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(max_new_tokens > 0, "max_new_tokens must be positive");
  const int64_t b = prompt_ids.size(0);
  const int64_t l = config_.num_queries;
  QueryAdapterOutput q = qa_->forward(visual_tokens, visual_mask, 0.0);
  torch::Tensor pv =
      prompt_valid.defined()
          ? prompt_valid.to(torch::kBool)
          : torch::ones(prompt_ids.sizes(), torch::dtype(torch::kBool).device(prompt_ids.device()));
  torch::Tensor embeds = torch::cat({q.prefix, lm_->Embed(prompt_ids)}, 1);
  torch::Tensor valid = torch::cat({torch::ones({b, l}, pv.options()), pv}, 1);
  KvCache cache;
  torch::Tensor hidden = lm_->forward(embeds, valid, &cache, 0.0, -1, nullptr);
  torch::Tensor logits = lm_->Logits(hidden.select(1, hidden.size(1) - 1));  // [B, V]
  std::vector<torch::Tensor> tokens, step_logits;
  torch::Tensor done = torch::zeros({b}, torch::dtype(torch::kBool).device(prompt_ids.device()));
  torch::Tensor lengths = torch::zeros({b}, torch::dtype(torch::kLong).device(prompt_ids.device()));
  torch::Tensor eos = torch::full({b}, eos_id, lengths.options());
  for (int step = 0; step < max_new_tokens; ++step) {
    torch::Tensor next = logits.argmax(-1);
    next = torch::where(done, eos, next);
    step_logits.push_back(logits);
    tokens.push_back(next);
    lengths = lengths + (done.logical_not() & (next != eos_id)).to(torch::kLong);
    done = done | (next == eos_id);
    if (step + 1 == max_new_tokens || done.all().item<bool>()) break;
    torch::Tensor h = lm_->forward(lm_->Embed(next.unsqueeze(1)), torch::ones({b, 1}, pv.options()),
                                   &cache, 0.0, -1, nullptr);
    logits = lm_->Logits(h.select(1, 0));
  }
  GenerateResult r;
  r.tokens = torch::stack(tokens, 1);
  r.step_logits = torch::stack(step_logits, 1);
  r.lengths = lengths;
  return r;
}

StochasticStats MllmImpl::StochasticPasses(const torch::Tensor& visual_tokens,
                                           const torch::Tensor& visual_mask, int passes,
                                           double dropout_p) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(passes > 0, "StochasticPasses needs at least one pass");
  const int64_t b = visual_tokens.size(0);
  QueryAdapterOutput q;
  torch::Tensor mass, queries;
  if (dropout_p <= 0.0) {
    // Without dropout every pass is the same computation; run it once.
    q = qa_->forward(visual_tokens, visual_mask, 0.0);
    mass = q.attention_mass.unsqueeze(0).expand({passes, -1, -1}).contiguous();
    queries = q.queries.unsqueeze(0).expand({passes, -1, -1, -1}).contiguous();
  } else {
    torch::Tensor tokens = visual_tokens.repeat({passes, 1, 1});
    torch::Tensor mask = visual_mask.defined() ? visual_mask.repeat({passes, 1}) : torch::Tensor();
    q = qa_->forward(tokens, mask, dropout_p);
    mass = q.attention_mass.view({passes, b, -1});
    queries = q.queries.view({passes, b, q.queries.size(1), q.queries.size(2)});
  }
  StochasticStats s;
  s.attention_mass = mass;
  s.queries = queries;
  s.attention_mass_variance = ShiftedVariance(mass);
  s.query_variance = ShiftedVariance(queries).mean(-1);
  return s;
}

StochasticStats MllmImpl::StochasticAttention(const torch::Tensor& visual_tokens,
                                              const torch::Tensor& visual_mask, int passes,
                                              double dropout_p) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(passes > 0, "StochasticAttention needs at least one pass");
  StochasticStats s;
  if (dropout_p <= 0.0) {
    // Identical passes: run one and replicate it, so the variance is exactly zero (M rows of
    // one batched matmul may round differently).
    s.attention_mass = qa_->AttentionMassPasses(visual_tokens, visual_mask, 1, 0.0)
                           .expand({passes, -1, -1})
                           .contiguous();
  } else {
    s.attention_mass = qa_->AttentionMassPasses(visual_tokens, visual_mask, passes, dropout_p);
  }
  s.attention_mass_variance = ShiftedVariance(s.attention_mass);
  return s;
}

torch::Tensor MeanTokenEntropy(const GenerateResult& result) {
  torch::NoGradGuard no_grad;
  torch::Tensor logp = torch::log_softmax(result.step_logits.to(torch::kFloat), -1);
  torch::Tensor ent = -(logp.exp() * logp).sum(-1);  // [B, n]
  const int64_t n = ent.size(1);
  torch::Tensor count = (result.lengths + 1).clamp_max(n);
  torch::Tensor idx = torch::arange(n, count.options()).unsqueeze(0);
  torch::Tensor keep = (idx < count.unsqueeze(1)).to(ent.dtype());
  return (ent * keep).sum(1) / count.to(ent.dtype());
}

}  // namespace cdcca::model
