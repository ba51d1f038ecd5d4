#include "model/runtime/generation.h"

#include <algorithm>
#include <cstdlib>

#include "model/runtime/static_decode.h"

namespace cdcca::model {
namespace {

class DecoderStepper : public GreedyStepper {
 public:
  DecoderStepper(DecoderLmImpl& lm, const torch::Tensor& embeds, const torch::Tensor& mask)
      : lm_(lm), embeds_(embeds) {
    mask_ = mask.defined()
                ? mask.to(embeds.device(), torch::kLong)
                : torch::ones({embeds.size(0), embeds.size(1)},
                              torch::TensorOptions().dtype(torch::kLong).device(embeds.device()));
  }

  torch::Tensor Prefill() override { return Run(embeds_); }

  torch::Tensor Step(const torch::Tensor& ids) override {
    mask_ = torch::cat({mask_, torch::ones({mask_.size(0), 1}, mask_.options())}, 1);
    return Run(lm_.EmbedTokens(ids.to(embeds_.device())));
  }

 private:
  torch::Tensor Run(const torch::Tensor& embeds) {
    DecoderForwardOptions o;
    o.last_logits_only = true;
    return lm_.Forward(embeds, mask_, &cache_, o).logits.select(1, 0);
  }

  DecoderLmImpl& lm_;
  torch::Tensor embeds_;
  torch::Tensor mask_;
  DecoderKvCache cache_;
};

}  // namespace

std::vector<int64_t> AnswerIds(const std::vector<int64_t>& generated,
                               const std::vector<int64_t>& eos_token_ids) {
  auto end = std::find_first_of(generated.begin(), generated.end(), eos_token_ids.begin(),
                                eos_token_ids.end());
  return std::vector<int64_t>(generated.begin(), end);
}

double MeanStepEntropy(const GreedyResult& result, size_t row) {
  if (row >= result.tokens.size()) return 0.0;
  // step_logits[i] is what token i was chosen from; one per generated token.
  const size_t steps = std::min(result.step_logits.size(), result.tokens[row].size());
  double sum = 0;
  for (size_t i = 0; i < steps; ++i) {
    const torch::Tensor logp =
        torch::log_softmax(result.step_logits[i][static_cast<int64_t>(row)].to(torch::kDouble), -1);
    sum -= (logp.exp() * logp).sum().item<double>();
  }
  return steps > 0 ? sum / static_cast<double>(steps) : 0.0;
}

GreedyResult GreedyGenerate(GreedyStepper& model, const GreedyOptions& options) {
  torch::NoGradGuard no_grad;
  GreedyResult r;
  if (options.max_new_tokens <= 0) return r;
  torch::Tensor logits = model.Prefill();
  const int64_t b = logits.size(0);
  r.tokens.assign(b, {});
  r.first_logits = logits.to(torch::kCPU, torch::kFloat);
  std::vector<bool> done(b, false);
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    if (options.keep_step_logits) r.step_logits.push_back(logits.to(torch::kCPU, torch::kFloat));
    torch::Tensor next = logits.argmax(-1).to(torch::kCPU);  // [B]
    bool all_done = true;
    for (int64_t i = 0; i < b; ++i) {
      if (done[i]) continue;
      const int64_t id = next[i].item<int64_t>();
      r.tokens[i].push_back(id);
      done[i] = std::find(options.eos_token_ids.begin(), options.eos_token_ids.end(), id) !=
                options.eos_token_ids.end();
      all_done = all_done && done[i];
    }
    if (all_done || step + 1 == options.max_new_tokens) break;
    logits = model.Step(next.view({b, 1}));
  }
  return r;
}

GreedyResult GreedyGenerateFromEmbeds(DecoderLmImpl& lm, const torch::Tensor& inputs_embeds,
                                      const torch::Tensor& attention_mask,
                                      const GreedyOptions& options) {
  torch::NoGradGuard no_grad;
  using Path = GreedyOptions::DecodePath;
  // CDCCA_NO_STATIC_DECODE set: kAuto takes the reference loop (for measuring the difference).
  static const bool no_static = std::getenv("CDCCA_NO_STATIC_DECODE") != nullptr;
  const bool want_static =
      options.decode_path == Path::kStatic ||
      (options.decode_path == Path::kAuto && inputs_embeds.is_cuda() && !no_static);
  if (want_static && StaticDecodeApplies(lm, inputs_embeds, options)) {
    return StaticGreedyGenerate(lm, inputs_embeds, attention_mask, options);
  }
  DecoderStepper stepper(lm, inputs_embeds, attention_mask);
  return GreedyGenerate(stepper, options);
}

}  // namespace cdcca::model
