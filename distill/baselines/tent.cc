#include "distill/baselines/tent.h"

#include <torch/torch.h>

#include "distill/losses.h"

namespace cdcca::distill {

model::NamedTensors TentLearner::TrainedParameters(model::Blip2Tower& student) {
  model::NamedTensors out;
  for (auto& [name, p] : model::TrainableParameters(*student)) {
    if (IsNormParameterName(name)) out.emplace_back(name, p);
  }
  return out;
}

absl::Status TentLearner::Prepare(const SamplePool&, model::Blip2Tower&, const JobOptions&) {
  return absl::OkStatus();
}

Learner::Terms TentLearner::Loss(const SamplePool& pool, const std::vector<int64_t>& batch,
                                 model::Blip2Tower& student, const JobOptions& options) {
  const torch::Device d = pool.visual_tokens.device();
  torch::Tensor vis = SelectRows(pool.visual_tokens, batch);
  torch::Tensor mask = SelectRows(pool.visual_mask, batch);
  std::vector<std::vector<int64_t>> prompts, empty(batch.size()), answers;
  for (int64_t i : batch) prompts.push_back(pool.prompts[i]);
  // The model's current answer: TENT adapts on its own predictions as they evolve.
  TextBatch prompt_only = CollateText(prompts, empty, options.pad_id);
  model::GenerateResult g =
      student->Generate(vis, mask, prompt_only.text_ids.to(d), prompt_only.text_valid.to(d),
                        options.max_answer_tokens, options.eos_id);
  for (size_t r = 0; r < batch.size(); ++r) answers.push_back(AnswerTokens(g.tokens, g.lengths, r));
  TextBatch text = CollateText(prompts, answers, options.pad_id);
  model::MllmOutput out = student->Forward({vis, mask, text.text_ids.to(d), text.text_valid.to(d)});
  torch::Tensor entropy = MeanEntropy(out.logits, text.targets.to(d) >= 0);
  return {{"total", entropy}, {"entropy", entropy.detach()}};
}

}  // namespace cdcca::distill
