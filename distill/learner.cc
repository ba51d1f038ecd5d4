#include "distill/learner.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "distill/akd.h"
#include "distill/baselines/cotta.h"
#include "distill/baselines/tent.h"
#include "distill/greedy_answers.h"
#include "model/family/checkpoint.h"
#include "model/runtime/threads.h"

namespace cdcca::distill {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

absl::Status CheckOptions(const JobOptions& o) {
  if (o.max_steps < 0 || o.time_budget_s < 0) {
    return absl::InvalidArgumentError("max_steps and time_budget_s must be >= 0");
  }
  if (o.max_steps == 0 && o.time_budget_s <= 0) {
    return absl::InvalidArgumentError("a job needs a step or a time budget");
  }
  if (o.batch_size <= 0 || o.lr <= 0 || o.max_answer_tokens <= 0) {
    return absl::InvalidArgumentError("batch_size, lr and max_answer_tokens must be positive");
  }
  if (o.replay_fraction < 0 || o.replay_fraction >= 1) {
    return absl::InvalidArgumentError("replay_fraction must be in [0, 1)");
  }
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError("rank must be in [0, world_size)");
  }
  if (o.world_size > 1 && (o.reducer == nullptr || o.batch_size % o.world_size != 0)) {
    return absl::InvalidArgumentError(
        "world_size > 1 needs a reducer and a batch_size divisible by world_size");
  }
  return absl::OkStatus();
}

// Endless shuffled passes over [begin, end), reshuffled each pass from one generator.
class EpochSampler {
 public:
  EpochSampler(int64_t begin, int64_t end, std::mt19937_64* rng) : rng_(rng) {
    for (int64_t i = begin; i < end; ++i) order_.push_back(i);
    next_ = order_.size();
  }
  bool empty() const { return order_.empty(); }
  size_t size() const { return order_.size(); }
  int64_t Next() {
    if (next_ == order_.size()) {
      for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[(*rng_)() % i]);
      next_ = 0;
    }
    return order_[next_++];
  }

 private:
  std::mt19937_64* rng_;
  std::vector<int64_t> order_;
  size_t next_ = 0;
};

}  // namespace

LossTerm SummarizeLossTerm(const std::string& name, const std::vector<double>& per_step) {
  LossTerm term;
  term.name = name;
  term.first = per_step.front();
  const size_t tail = std::min<size_t>(10, per_step.size());
  for (size_t i = per_step.size() - tail; i < per_step.size(); ++i) {
    term.last += per_step[i] / tail;
  }
  for (double v : per_step) term.mean += v / per_step.size();
  return term;
}

torch::Device ModuleDevice(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) return p.device();
  return torch::kCPU;
}

std::vector<std::vector<int64_t>> GreedyAnswers(model::Blip2Tower& tower, const SamplePool& pool,
                                                const JobOptions& options) {
  const torch::Device device = ModuleDevice(*tower);
  tower->eval();
  torch::NoGradGuard no_grad;
  std::vector<std::vector<int64_t>> out;
  out.reserve(static_cast<size_t>(pool.size()));
  const int64_t chunk = std::max(1, options.batch_size);
  for (int64_t begin = 0; begin < pool.size(); begin += chunk) {
    std::vector<int64_t> idx;
    for (int64_t i = begin; i < std::min(pool.size(), begin + chunk); ++i) idx.push_back(i);
    std::vector<std::vector<int64_t>> prompts, empty(idx.size());
    for (int64_t i : idx) prompts.push_back(pool.prompts[i]);
    TextBatch prompt_only = CollateText(prompts, empty, options.pad_id);
    model::GenerateResult g = tower->Generate(
        SelectRows(pool.visual_tokens, idx).to(device),
        SelectRows(pool.visual_mask, idx).to(device), prompt_only.text_ids.to(device),
        prompt_only.text_valid.to(device), options.max_answer_tokens, options.eos_id);
    for (size_t r = 0; r < idx.size(); ++r) out.push_back(AnswerTokens(g.tokens, g.lengths, r));
  }
  return out;
}

absl::StatusOr<model::Blip2Tower> CopyMllm(model::Blip2Tower& source, torch::Device device) {
  try {
    absl::StatusOr<model::Blip2Tower> copy = model::CopyTower(source);
    if (!copy.ok()) return copy.status();
    (*copy)->to(device);
    return copy;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("copying the model: ", e.what_without_backtrace()));
  }
}

model::NamedTensors Learner::TrainedParameters(model::Blip2Tower& student) {
  return model::TrainableParameters(*student);
}

absl::StatusOr<JobResult> Learner::Run(const std::vector<compress::UplinkSample>& samples,
                                       ReplayBuffer* replay, model::Blip2Tower& student,
                                       const JobOptions& options) {
  if (absl::Status st = CheckOptions(options); !st.ok()) return st;
  if (samples.empty()) return absl::InvalidArgumentError("a job needs at least one sample");
  model::SetIntraOpThreads(options.num_threads);
  const auto prepare_start = Clock::now();
  JobResult result;
  JobStats& stats = result.stats;

  // The job's samples: this round's first, then the replayed ones. The replay share of the
  // pool matches the share of each batch, so both parts are visited at the same rate.
  std::vector<const compress::UplinkSample*> chosen;
  for (const auto& s : samples) chosen.push_back(&s);
  const int64_t num_current = static_cast<int64_t>(chosen.size());
  if (replay != nullptr && replay->size() > 0 && options.replay_fraction > 0) {
    const double f = options.replay_fraction;
    const auto want = static_cast<size_t>(std::ceil(num_current * f / (1.0 - f)));
    for (const auto* s : replay->Draw(want)) chosen.push_back(s);
  }
  const int64_t num_replay = static_cast<int64_t>(chosen.size()) - num_current;
  stats.current_samples = num_current;
  stats.replay_samples = num_replay;

  // What the model state looked like, to restore the bookkeeping of an in-place job.
  std::vector<std::pair<torch::Tensor, bool>> requires_grad_before;
  const bool was_training = student->is_training();
  try {
    const model::TowerConfig& cfg = student->config();
    absl::StatusOr<SamplePool> built = BuildSamplePool(chosen, cfg.num_visual_tokens, cfg.d_vis);
    if (!built.ok()) return built.status();
    SamplePool pool = *std::move(built);

    model::Blip2Tower work = student;
    torch::Device device = ModuleDevice(*student);
    if (!options.train_in_place) {
      device = options.use_cuda && torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0)
                                                               : torch::Device(torch::kCPU);
      absl::StatusOr<model::Blip2Tower> copy = CopyMllm(student, device);
      if (!copy.ok()) return copy.status();
      work = *copy;
    }
    stats.device = device.str();
    pool.visual_tokens = pool.visual_tokens.to(device);
    pool.visual_mask = pool.visual_mask.to(device);

    for (auto& p : work->parameters()) requires_grad_before.emplace_back(p, p.requires_grad());
    for (auto& p : work->parameters()) p.set_requires_grad(false);
    std::vector<torch::Tensor> params;
    for (auto& [name, p] : TrainedParameters(work)) {
      p.set_requires_grad(true);
      params.push_back(p);
    }
    work->train(options.student_dropout);
    torch::manual_seed(options.seed);

    if (absl::Status st = Prepare(pool, work, options); !st.ok()) return st;
    for (auto& p : ExtraParameters()) params.push_back(p);
    torch::optim::AdamW optimizer(
        params, torch::optim::AdamWOptions(options.lr).weight_decay(options.weight_decay));
    stats.prepare_seconds = Seconds(prepare_start);

    std::mt19937_64 rng(options.seed ^ 0x9e3779b97f4a7c15ull);
    EpochSampler current(0, num_current, &rng);
    EpochSampler replayed(num_current, num_current + num_replay, &rng);
    const int64_t global = std::min<int64_t>(options.batch_size, pool.size());
    const int64_t from_replay =
        replayed.empty()
            ? 0
            : std::min<int64_t>(static_cast<int64_t>(std::lround(global * options.replay_fraction)),
                                static_cast<int64_t>(replayed.size()));
    const int64_t from_current = std::min<int64_t>(global - from_replay, num_current);
    const int64_t batch = from_current + from_replay;
    if (options.world_size > 1 && batch % options.world_size != 0) {
      return absl::InvalidArgumentError("the pool is too small to split the batch over ranks");
    }
    const int64_t slice = batch / options.world_size;

    std::vector<std::string> names;
    std::vector<std::vector<double>> history;
    const auto train_start = Clock::now();
    while (true) {
      if (options.max_steps > 0 && stats.steps >= options.max_steps) break;
      if (options.time_budget_s > 0 && Seconds(train_start) >= options.time_budget_s) break;
      std::vector<int64_t> global_batch;
      for (int64_t i = 0; i < from_current; ++i) global_batch.push_back(current.Next());
      for (int64_t i = 0; i < from_replay; ++i) global_batch.push_back(replayed.Next());
      std::vector<int64_t> mine(global_batch.begin() + options.rank * slice,
                                global_batch.begin() + (options.rank + 1) * slice);
      optimizer.zero_grad();
      Terms terms = Loss(pool, mine, work, options);
      terms.front().second.backward();
      if (options.world_size > 1) {
        std::vector<torch::Tensor> grads;
        for (auto& p : params) {
          if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
          grads.push_back(p.grad());
        }
        if (absl::Status st = options.reducer->AllReduceMean(grads); !st.ok()) return st;
      }
      optimizer.step();
      AfterStep(work, options);
      if (names.empty()) {
        for (const auto& [name, value] : terms) names.push_back(name);
        history.resize(names.size());
      }
      for (size_t k = 0; k < terms.size() && k < history.size(); ++k) {
        history[k].push_back(terms[k].second.item<double>());
      }
      ++stats.steps;
      stats.samples_seen += static_cast<int64_t>(mine.size());
    }
    stats.train_seconds = Seconds(train_start);
    stats.samples_per_second =
        stats.train_seconds > 0 ? stats.samples_seen / stats.train_seconds : 0.0;
    for (size_t k = 0; k < names.size(); ++k) {
      stats.terms.push_back(SummarizeLossTerm(k == 0 ? "total" : names[k], history[k]));
    }

    torch::NoGradGuard no_grad;
    for (const auto& [name, p] : model::TrainableParameters(*work)) {
      result.trainable.emplace_back(name, p.detach().to(torch::kCPU).to(torch::kFloat).clone());
    }
    for (auto& [p, flag] : requires_grad_before) p.set_requires_grad(flag);
    work->train(was_training);
  } catch (const c10::Error& e) {
    for (auto& [p, flag] : requires_grad_before) p.set_requires_grad(flag);
    return absl::InternalError(absl::StrCat(name(), " job failed: ", e.what_without_backtrace()));
  }
  return result;
}

absl::StatusOr<std::unique_ptr<Learner>> MakeLearner(const std::string& name,
                                                     model::Blip2Tower teacher) {
  if (name == "tent") return std::unique_ptr<Learner>(new TentLearner());
  if (name == "cotta") return std::unique_ptr<Learner>(new CottaLearner(CottaConfig{}));
  absl::StatusOr<DistillConfig> config = PresetDistillConfig(name);
  if (!config.ok()) return config.status();
  if (teacher.is_empty()) {
    return absl::InvalidArgumentError(absl::StrCat("learner ", name, " needs a teacher"));
  }
  return std::unique_ptr<Learner>(new DistillLearner(teacher, *config));
}

}  // namespace cdcca::distill
