#include "distill/baselines/cotta.h"

#include <torch/torch.h>

#include "distill/losses.h"

namespace cdcca::distill {

absl::Status CottaLearner::Prepare(const SamplePool& pool, model::Blip2Tower& student,
                                   const JobOptions&) {
  const torch::Device d = pool.visual_tokens.device();
  if (ema_.is_empty()) {
    absl::StatusOr<model::Blip2Tower> copy = CopyMllm(student, d);
    if (!copy.ok()) return copy.status();
    ema_ = *copy;
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : model::TrainableParameters(*student)) {
      source_.emplace_back(name, p.detach().clone());
    }
  }
  ema_->to(d);
  ema_->eval();
  for (auto& p : ema_->parameters()) p.set_requires_grad(false);
  for (auto& [name, t] : source_) t = t.to(d);
  return absl::OkStatus();
}

Learner::Terms CottaLearner::Loss(const SamplePool& pool, const std::vector<int64_t>& batch,
                                  model::Blip2Tower& student, const JobOptions& options) {
  const torch::Device d = pool.visual_tokens.device();
  torch::Tensor vis = SelectRows(pool.visual_tokens, batch);
  torch::Tensor mask = SelectRows(pool.visual_mask, batch);
  std::vector<std::vector<int64_t>> prompts, empty(batch.size()), answers;
  for (int64_t i : batch) prompts.push_back(pool.prompts[i]);
  torch::Tensor probs, confidence;
  TextBatch text;
  {
    torch::NoGradGuard no_grad;
    TextBatch prompt_only = CollateText(prompts, empty, options.pad_id);
    model::GenerateResult g =
        ema_->Generate(vis, mask, prompt_only.text_ids.to(d), prompt_only.text_valid.to(d),
                       options.max_answer_tokens, options.eos_id);
    for (size_t r = 0; r < batch.size(); ++r) {
      answers.push_back(AnswerTokens(g.tokens, g.lengths, r));
    }
    text = CollateText(prompts, answers, options.pad_id);
    torch::Tensor ids = text.text_ids.to(d), valid = text.text_valid.to(d);
    torch::Tensor target_mask = (text.targets.to(d) >= 0).to(torch::kFloat);  // [B, T]
    probs = torch::softmax(ema_->Forward({vis, mask, ids, valid}).logits, -1);
    confidence = (std::get<0>(probs.max(-1)) * target_mask).sum(1) /
                 target_mask.sum(1).clamp_min(1.0);  // [B]
    torch::Tensor unsure = confidence < config_.confidence_threshold;
    if (config_.augmentations > 0 && unsure.any().item<bool>()) {
      torch::Tensor sum = torch::zeros_like(probs);
      torch::Tensor rms = vis.pow(2).mean(-1, /*keepdim=*/true).sqrt();
      for (int a = 0; a < config_.augmentations; ++a) {
        torch::Tensor noisy = vis + torch::randn_like(vis) * rms * config_.noise_std;
        torch::Tensor keep = torch::rand(mask.sizes(), vis.options()) >= config_.token_drop;
        torch::Tensor view_mask = mask & keep;
        sum += torch::softmax(ema_->Forward({noisy, view_mask, ids, valid}).logits, -1);
      }
      torch::Tensor averaged = sum / static_cast<double>(config_.augmentations);
      probs = torch::where(unsure.view({-1, 1, 1}), averaged, probs);
    }
  }
  model::MllmOutput out = student->Forward({vis, mask, text.text_ids.to(d), text.text_valid.to(d)});
  torch::Tensor loss = SoftCrossEntropy(out.logits, probs, text.targets.to(d) >= 0);
  return {{"total", loss}, {"soft_ce", loss.detach()}, {"confidence", confidence.mean()}};
}

void CottaLearner::AfterStep(model::Blip2Tower& student, const JobOptions&) {
  torch::NoGradGuard no_grad;
  model::NamedTensors student_set = model::TrainableParameters(*student);
  model::NamedTensors teacher_set = model::TrainableParameters(*ema_);
  for (size_t k = 0; k < student_set.size(); ++k) {
    torch::Tensor& s = student_set[k].second;
    teacher_set[k].second.mul_(config_.ema_decay).add_(s, 1.0 - config_.ema_decay);
    torch::Tensor restore = torch::rand(s.sizes(), s.options()) < config_.restore_prob;
    s.copy_(torch::where(restore, source_[k].second, s));
  }
}

}  // namespace cdcca::distill
