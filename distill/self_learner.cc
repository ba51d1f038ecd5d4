#include "distill/self_learner.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "distill/greedy_answers.h"
#include "distill/losses.h"
#include "model/arch/multimodal_model.h"

namespace cdcca::distill {
namespace {

using Clock = std::chrono::steady_clock;

// One sample as a job reads it: its visual input and its prompt in the student's ids.
struct Row {
  PairSample sample;
  torch::Tensor tokens;   // [1, N, D] fp32 on the model's device
  torch::Tensor present;  // [1, N] bool
  std::vector<int64_t> prompt, qformer;
};

// The rows' prompts and `answers`, for ForwardTokens; targets >= 0 marks the answer's
// predictor positions.
TextBatch Collate(const std::vector<Row>& pool, const std::vector<int64_t>& rows,
                  const std::vector<std::vector<int64_t>>& answers, torch::Device device) {
  std::vector<TextRow> text;
  for (size_t r = 0; r < rows.size(); ++r) {
    const Row& x = pool[static_cast<size_t>(rows[r])];
    text.push_back({x.tokens, x.present, torch::Tensor(), &x.prompt, &answers[r], &x.qformer});
  }
  return CollateHfRows(text, device);
}

}  // namespace

bool IsNormParameterName(const std::string& name) {
  std::vector<absl::string_view> parts = absl::StrSplit(name, '.');
  return parts.size() >= 2 && absl::EndsWith(parts[parts.size() - 2], "norm");
}

struct SelfLearner::State {
  std::string name;
  PairSide student;
  JobOptions options;
  CottaConfig cotta;
  int64_t jobs = 0;
  // CoTTA: the EMA of the trainable set and the set before any adaptation, in its order.
  std::vector<torch::Tensor> ema, source;
  at::Generator draws;  // CoTTA's augmentations and restores (CPU), reseeded per job

  bool is_cotta() const { return name == "cotta"; }

  // The model's greedy answer (ids through EOS) to each row, from its current weights.
  absl::StatusOr<std::vector<std::vector<int64_t>>> Answers(const std::vector<Row>& pool,
                                                            const std::vector<int64_t>& rows) {
    std::vector<int64_t> eos = student.model->eos_token_ids();
    std::vector<std::vector<int64_t>> out;
    for (int64_t r : rows) {
      std::vector<int64_t> ids;
      absl::StatusOr<std::string> text = GreedyAnswer(student, pool[static_cast<size_t>(r)].sample,
                                                      options.max_answer_tokens, &ids);
      if (!text.ok()) return text.status();
      if (!eos.empty()) ids.push_back(eos[0]);
      out.push_back(std::move(ids));
    }
    return out;
  }

  // CoTTA's targets for a batch: the EMA's answers and its soft next-token distributions at
  // the answer's predictor positions [K, V], averaged over augmented views where it is unsure.
  // Runs with the EMA's values in the trainable tensors and puts the student's back.
  absl::StatusOr<std::pair<std::vector<std::vector<int64_t>>, torch::Tensor>> EmaTargets(
      const std::vector<Row>& pool, const std::vector<int64_t>& rows,
      const model::NamedTensors& trainable, torch::Tensor* confidence) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> live;
    for (const auto& [name, t] : trainable) live.push_back(t.detach().clone());
    for (size_t k = 0; k < trainable.size(); ++k) trainable[k].second.copy_(ema[k]);
    auto restore = [&] {
      for (size_t k = 0; k < trainable.size(); ++k) trainable[k].second.copy_(live[k]);
    };
    absl::StatusOr<std::vector<std::vector<int64_t>>> answers = Answers(pool, rows);
    if (!answers.ok()) {
      restore();
      return answers.status();
    }
    TextBatch batch = Collate(pool, rows, *answers, student.model->device());
    absl::StatusOr<model::TokenForward> f = student.model->ForwardTokens(batch.inputs);
    if (!f.ok()) {
      restore();
      return f.status();
    }
    torch::Tensor probs = torch::softmax(f->logits, -1);  // [B, T, V]
    const torch::Tensor pred = (batch.targets >= 0).to(torch::kFloat);
    *confidence = (std::get<0>(probs.max(-1)) * pred).sum(1) / pred.sum(1).clamp_min(1.0);
    const torch::Tensor unsure = *confidence < cotta.confidence_threshold;  // [B]
    if (cotta.augmentations > 0 && unsure.any().item<bool>()) {
      const torch::Tensor vis = batch.inputs.visual_tokens;
      const torch::Tensor rms = vis.pow(2).mean(-1, /*keepdim=*/true).sqrt();
      torch::Tensor sum = torch::zeros_like(probs);
      for (int a = 0; a < cotta.augmentations; ++a) {
        model::TokenInputs view = batch.inputs;
        view.visual_tokens =
            vis + torch::randn(vis.sizes(), draws).to(vis.device()) * rms * cotta.noise_std;
        view.visual_present =
            batch.inputs.visual_present &
            (torch::rand(batch.inputs.visual_present.sizes(), draws) >= cotta.token_drop)
                .to(vis.device());
        absl::StatusOr<model::TokenForward> v = student.model->ForwardTokens(view);
        if (!v.ok()) {
          restore();
          return v.status();
        }
        sum += torch::softmax(v->logits, -1);
      }
      probs = torch::where(unsure.view({-1, 1, 1}), sum / static_cast<double>(cotta.augmentations),
                           probs);
    }
    restore();
    return std::make_pair(*std::move(answers), probs.index({batch.targets >= 0}));
  }

  void AfterCottaStep(const model::NamedTensors& trainable) {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < trainable.size(); ++k) {
      const torch::Tensor& s = trainable[k].second;
      ema[k].mul_(cotta.ema_decay).add_(s, 1.0 - cotta.ema_decay);
      const torch::Tensor back = torch::rand(s.sizes(), draws).to(s.device()) < cotta.restore_prob;
      s.copy_(torch::where(back, source[k], s));
    }
  }
};

SelfLearner::SelfLearner(std::unique_ptr<State> state) : state_(std::move(state)) {}
SelfLearner::~SelfLearner() = default;

const std::string& SelfLearner::name() const { return state_->name; }

absl::StatusOr<std::unique_ptr<SelfLearner>> SelfLearner::Create(const std::string& name,
                                                                 PairSide student,
                                                                 const JobOptions& options,
                                                                 CottaConfig cotta) {
  if (name != "tent" && name != "cotta") {
    return absl::InvalidArgumentError(
        absl::StrCat("device learner '", name, "': known are tent and cotta"));
  }
  if (student.model == nullptr || !student.encode || !student.decode) {
    return absl::InvalidArgumentError("the student side needs a model and its codec");
  }
  if (student.model->TrainableParameters().empty()) {
    return absl::InvalidArgumentError("the student has no trainable set (add its adapters)");
  }
  if (options.max_steps < 1 || options.batch_size < 1) {
    return absl::InvalidArgumentError("a device learner needs max_steps and batch_size >= 1");
  }
  auto state = std::make_unique<State>();
  state->name = name;
  state->student = std::move(student);
  state->options = options;
  state->cotta = cotta;
  return std::unique_ptr<SelfLearner>(new SelfLearner(std::move(state)));
}

absl::StatusOr<PairJobResult> SelfLearner::Run(const std::vector<PairSample>& samples) {
  State& s = *state_;
  if (samples.empty()) return absl::InvalidArgumentError("a job needs at least one sample");
  model::MultimodalModel& model = *s.student.model;
  const torch::Device device = model.device();
  std::vector<Row> pool;
  for (size_t i = 0; i < samples.size(); ++i) {
    const PairSample& x = samples[i];
    if (!x.tokens.defined() || x.tokens.dim() != 2 ||
        (x.present.defined() && (x.present.dim() != 1 || x.present.size(0) != x.tokens.size(0)))) {
      return absl::InvalidArgumentError(
          absl::StrCat("sample ", i, ": tokens must be [N, D] and present [N]"));
    }
    Row row;
    row.sample = x;
    row.tokens = x.tokens.to(device, torch::kFloat).unsqueeze(0);
    row.present = x.present.defined()
                      ? x.present.to(device, torch::kBool).unsqueeze(0)
                      : torch::ones({1, x.tokens.size(0)},
                                    torch::TensorOptions().dtype(torch::kBool).device(device));
    absl::StatusOr<std::vector<int64_t>> prompt = SidePromptIds(s.student, x.prompt);
    if (!prompt.ok()) return prompt.status();
    absl::StatusOr<std::vector<int64_t>> qformer = SideQformerIds(s.student, x.prompt);
    if (!qformer.ok()) return qformer.status();
    row.prompt = *std::move(prompt);
    row.qformer = *std::move(qformer);
    pool.push_back(std::move(row));
  }

  torch::nn::Module& module = model.module();
  module.eval();
  for (auto& p : module.parameters()) p.set_requires_grad(false);
  const model::NamedTensors trainable = model.TrainableParameters();
  std::vector<torch::Tensor> params;
  for (const auto& [name, t] : trainable) {
    if (s.is_cotta() || IsNormParameterName(name)) {
      t.set_requires_grad(true);
      params.push_back(t);
    }
  }
  if (params.empty()) {
    return absl::InvalidArgumentError("tent: the student's trainable set holds no norm parameter");
  }
  if (s.is_cotta() && s.ema.empty()) {
    torch::NoGradGuard no_grad;
    for (const auto& [name, t] : trainable) {
      s.ema.push_back(t.detach().clone());
      s.source.push_back(t.detach().clone());
    }
  }
  torch::optim::AdamW optimizer(
      params, torch::optim::AdamWOptions(s.options.lr).weight_decay(s.options.weight_decay));
  s.draws = at::detail::createCPUGenerator(s.options.seed +
                                           0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(s.jobs));
  std::mt19937_64 rng(s.options.seed + static_cast<uint64_t>(s.jobs));
  std::vector<int64_t> order(pool.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  size_t cursor = order.size();
  PairJobResult result;
  LossTermHistory history;
  const Clock::time_point start = Clock::now();
  try {
    for (int step = 0; step < s.options.max_steps; ++step) {
      std::vector<int64_t> rows;
      while (rows.size() <
             std::min<size_t>(static_cast<size_t>(s.options.batch_size), pool.size())) {
        if (cursor == order.size()) {
          std::shuffle(order.begin(), order.end(), rng);
          cursor = 0;
        }
        rows.push_back(order[cursor++]);
      }
      std::vector<std::pair<std::string, torch::Tensor>> terms;
      torch::Tensor total;
      if (s.is_cotta()) {
        torch::Tensor confidence;
        auto targets = s.EmaTargets(pool, rows, trainable, &confidence);
        if (!targets.ok()) return targets.status();
        TextBatch batch = Collate(pool, rows, targets->first, device);
        absl::StatusOr<model::TokenForward> f = model.ForwardTokens(batch.inputs);
        if (!f.ok()) return f.status();
        const torch::Tensor logits = f->logits.index({batch.targets >= 0});  // [K, V]
        total = -(targets->second * torch::log_softmax(logits, -1)).sum(-1).mean();
        terms = {{"total", total}, {"soft_ce", total.detach()}, {"confidence", confidence.mean()}};
      } else {
        absl::StatusOr<std::vector<std::vector<int64_t>>> answers;
        {
          torch::NoGradGuard no_grad;
          answers = s.Answers(pool, rows);
        }
        if (!answers.ok()) return answers.status();
        TextBatch batch = Collate(pool, rows, *answers, device);
        absl::StatusOr<model::TokenForward> f = model.ForwardTokens(batch.inputs);
        if (!f.ok()) return f.status();
        total = MeanEntropy(f->logits, batch.targets >= 0);
        terms = {{"total", total}, {"entropy", total.detach()}};
      }
      optimizer.zero_grad();
      total.backward();
      optimizer.step();
      if (s.is_cotta()) s.AfterCottaStep(trainable);
      history.Add(terms);
      result.stats.steps = step + 1;
      result.stats.samples_seen += static_cast<int64_t>(rows.size());
      if (PastBudget(s.options, start) && step + 1 < s.options.max_steps) {
        result.stats.stopped_by_budget = true;
        break;
      }
    }
  } catch (const c10::Error& e) {
    for (const auto& [name, t] : trainable) t.set_requires_grad(false);
    return absl::InternalError(absl::StrCat(s.name, " step: ", e.what_without_backtrace()));
  }
  for (const auto& [name, t] : trainable) t.set_requires_grad(false);
  result.stats.train_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.stats.samples_per_second =
      result.stats.train_seconds > 0 ? result.stats.samples_seen / result.stats.train_seconds : 0;
  result.stats.current_samples = static_cast<int64_t>(samples.size());
  result.stats.device = device.str();
  result.stats.terms = history.Summaries();
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : trainable) {
    result.trainable.emplace_back(name,
                                  t.detach().to(torch::kCPU, torch::kFloat).contiguous().clone());
  }
  ++s.jobs;
  return result;
}

}  // namespace cdcca::distill
