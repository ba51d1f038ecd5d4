#include "distill/akd.h"

#include <torch/torch.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "distill/losses.h"
#include "nlohmann/json.hpp"

namespace cdcca::distill {
namespace {

using Json = nlohmann::json;

absl::StatusOr<FeatureLoss> ParseFeatureLoss(const std::string& s) {
  if (s == "none") return FeatureLoss::kNone;
  if (s == "mse") return FeatureLoss::kMse;
  if (s == "pearson") return FeatureLoss::kPearson;
  if (s == "channel_wise") return FeatureLoss::kChannelWise;
  return absl::InvalidArgumentError(absl::StrCat("unknown feature_loss '", s, "'"));
}

absl::Status ReadLearner(const Json& j, DistillConfig& c) {
  for (const auto& [key, v] : j.items()) {
    if (key == "name") {
      absl::StatusOr<DistillConfig> preset = PresetDistillConfig(v.get<std::string>());
      if (!preset.ok()) return preset.status();
      // The preset is the base; keys after it (JSON object order is sorted) refine it.
    } else if (key == "feature_loss") {
      absl::StatusOr<FeatureLoss> f = ParseFeatureLoss(v.get<std::string>());
      if (!f.ok()) return f.status();
      c.feature_loss = *f;
    } else if (key == "l_ce") {
      c.l_ce = v.get<double>();
    } else if (key == "l_query") {
      c.l_query = v.get<double>();
    } else if (key == "l_repr") {
      c.l_repr = v.get<double>();
    } else if (key == "l_kl") {
      c.l_kl = v.get<double>();
    } else if (key == "temperature") {
      c.temperature = v.get<double>();
    } else if (key == "normalize") {
      c.normalize = v.get<bool>();
    } else if (key == "repr_answer_only") {
      c.repr_answer_only = v.get<bool>();
    } else if (key == "ridge_init") {
      c.ridge_init = v.get<bool>();
    } else if (key == "ridge_lambda") {
      c.ridge_lambda = v.get<double>();
    } else if (key == "cwd_tau") {
      c.cwd_tau = v.get<double>();
    } else if (key != "comment") {
      return absl::InvalidArgumentError(absl::StrCat("unknown learner key '", key, "'"));
    }
  }
  return absl::OkStatus();
}

absl::Status ReadJob(const Json& j, JobOptions& o) {
  for (const auto& [key, v] : j.items()) {
    if (key == "max_steps") {
      o.max_steps = v.get<int>();
    } else if (key == "time_budget_s") {
      o.time_budget_s = v.get<double>();
    } else if (key == "batch_size") {
      o.batch_size = v.get<int>();
    } else if (key == "lr") {
      o.lr = v.get<double>();
    } else if (key == "weight_decay") {
      o.weight_decay = v.get<double>();
    } else if (key == "seed") {
      o.seed = v.get<uint64_t>();
    } else if (key == "replay_fraction") {
      o.replay_fraction = v.get<double>();
    } else if (key == "num_threads") {
      o.num_threads = v.get<int>();
    } else if (key == "use_cuda") {
      o.use_cuda = v.get<bool>();
    } else if (key == "student_dropout") {
      o.student_dropout = v.get<bool>();
    } else if (key == "max_answer_tokens") {
      o.max_answer_tokens = v.get<int>();
    } else if (key != "comment") {
      return absl::InvalidArgumentError(absl::StrCat("unknown job key '", key, "'"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

void RidgeFit(const torch::Tensor& x, const torch::Tensor& y, double lambda,
              torch::nn::Linear& linear) {
  torch::NoGradGuard no_grad;
  torch::Tensor xd = x.to(torch::kDouble);
  torch::Tensor yd = y.to(torch::kDouble);
  torch::Tensor xa = torch::cat({xd, torch::ones({xd.size(0), 1}, xd.options())}, 1);
  torch::Tensor gram = xa.t().mm(xa);
  const double scale = gram.diagonal().mean().item<double>();
  gram = gram + torch::eye(gram.size(0), gram.options()) * (lambda * scale);
  torch::Tensor w = torch::linalg_solve(gram, xa.t().mm(yd));  // [in + 1, out]
  const int64_t in = x.size(1);
  linear->weight.copy_(w.narrow(0, 0, in).t().to(torch::kFloat));
  linear->bias.copy_(w.select(0, in).to(torch::kFloat));
}

absl::StatusOr<DistillConfig> PresetDistillConfig(const std::string& name) {
  DistillConfig c;
  c.name = name;
  if (name == "akd") {
    c.feature_loss = FeatureLoss::kMse;
  } else if (name == "pl") {
    c.feature_loss = FeatureLoss::kNone;
    c.l_query = c.l_repr = c.l_kl = 0.0;
  } else if (name == "pkd") {
    c.feature_loss = FeatureLoss::kPearson;
  } else if (name == "cwd") {
    c.feature_loss = FeatureLoss::kChannelWise;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown learner '", name, "'"));
  }
  return c;
}

absl::StatusOr<DistillConfig> WithFeatureTermOf(const std::string& name, DistillConfig shared) {
  absl::StatusOr<DistillConfig> preset = PresetDistillConfig(name);
  if (!preset.ok()) return preset.status();
  shared.name = name;
  shared.feature_loss = preset->feature_loss;
  if (shared.feature_loss == FeatureLoss::kNone) shared.l_query = shared.l_repr = 0.0;
  return shared;
}

absl::StatusOr<DistillSettings> ParseDistillSettings(absl::string_view json) {
  Json j = Json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("distill settings: not a JSON object");
  }
  DistillSettings s;
  try {
    for (const auto& [key, v] : j.items()) {
      if (key != "learner" && key != "job" && key != "comment") {
        return absl::InvalidArgumentError(absl::StrCat("unknown key '", key, "'"));
      }
    }
    if (j.contains("learner")) {
      const Json& l = j["learner"];
      absl::StatusOr<DistillConfig> base = PresetDistillConfig(l.value("name", std::string("akd")));
      if (!base.ok()) return base.status();
      s.learner = *base;
      if (absl::Status st = ReadLearner(l, s.learner); !st.ok()) return st;
    }
    if (j.contains("job")) {
      if (absl::Status st = ReadJob(j["job"], s.job); !st.ok()) return st;
    }
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("distill settings: ", e.what()));
  }
  return s;
}

absl::StatusOr<DistillSettings> LoadDistillSettings(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseDistillSettings(buffer.str());
}

DistillLearner::DistillLearner(model::Blip2Tower teacher, DistillConfig config)
    : teacher_(std::move(teacher)), config_(std::move(config)) {}

bool DistillLearner::UsesFeatures() const {
  return config_.feature_loss != FeatureLoss::kNone && (config_.l_query > 0 || config_.l_repr > 0);
}

std::vector<torch::Tensor> DistillLearner::ExtraParameters() {
  std::vector<torch::Tensor> out;
  if (!UsesFeatures()) return out;
  for (auto& p : phi_->parameters()) out.push_back(p);
  for (auto& p : psi_->parameters()) out.push_back(p);
  return out;
}

absl::Status DistillLearner::Prepare(const SamplePool& pool, model::Blip2Tower& student,
                                     const JobOptions& options) {
  const model::TowerConfig& t = teacher_->config();
  const model::TowerConfig& s = student->config();
  if (t.num_queries != s.num_queries || t.num_visual_tokens != s.num_visual_tokens ||
      t.d_vis != s.d_vis || t.vocab_size != s.vocab_size) {
    return absl::InvalidArgumentError(
        "teacher and student differ in queries, visual tokens or vocabulary");
  }
  const torch::Device job_device = pool.visual_tokens.device();
  const torch::Device teacher_device = ModuleDevice(*teacher_);
  teacher_->eval();
  torch::NoGradGuard no_grad;
  answers_.assign(pool.size(), {});
  representation_.assign(pool.size(), {});
  answer_logits_.assign(pool.size(), {});
  std::vector<torch::Tensor> queries;
  const int64_t chunk = std::max(1, options.batch_size);
  for (int64_t begin = 0; begin < pool.size(); begin += chunk) {
    std::vector<int64_t> idx;
    for (int64_t i = begin; i < std::min(pool.size(), begin + chunk); ++i) idx.push_back(i);
    torch::Tensor vis = SelectRows(pool.visual_tokens, idx).to(teacher_device);
    torch::Tensor mask = SelectRows(pool.visual_mask, idx).to(teacher_device);
    std::vector<std::vector<int64_t>> prompts, empty(idx.size());
    for (int64_t i : idx) prompts.push_back(pool.prompts[i]);
    TextBatch prompt_only = CollateText(prompts, empty, options.pad_id);
    model::GenerateResult g = teacher_->Generate(vis, mask, prompt_only.text_ids.to(teacher_device),
                                                 prompt_only.text_valid.to(teacher_device),
                                                 options.max_answer_tokens, options.eos_id);
    std::vector<std::vector<int64_t>> answers;
    for (size_t r = 0; r < idx.size(); ++r) answers.push_back(AnswerTokens(g.tokens, g.lengths, r));
    TextBatch text = CollateText(prompts, answers, options.pad_id);
    model::MllmOutput out = teacher_->Forward(
        {vis, mask, text.text_ids.to(teacher_device), text.text_valid.to(teacher_device)});
    queries.push_back(out.queries.to(job_device));
    for (size_t r = 0; r < idx.size(); ++r) {
      const int64_t i = idx[r];
      const int64_t pl = text.prompt_lengths[r], al = text.answer_lengths[r];
      representation_[i] =
          out.representation[r].narrow(0, text.prompt_width - pl, pl + al).to(job_device);
      if (config_.l_kl > 0) {
        answer_logits_[i] = out.logits[r].narrow(0, text.prompt_width - 1, al).to(job_device);
      }
      answers_[i] = std::move(answers[r]);
    }
  }
  queries_ = torch::cat(queries, 0);

  if (UsesFeatures() && phi_.is_empty()) {
    phi_ = torch::nn::Linear(s.qa_dim, t.qa_dim);
    psi_ = torch::nn::Linear(s.d_model, t.d_model);
    phi_->to(job_device);
    psi_->to(job_device);
    if (config_.ridge_init) FitProjections(pool, student, options);
  } else if (UsesFeatures()) {
    phi_->to(job_device);
    psi_->to(job_device);
  }
  return absl::OkStatus();
}

void DistillLearner::FitProjections(const SamplePool& pool, model::Blip2Tower& student,
                                    const JobOptions& options) {
  torch::NoGradGuard no_grad;
  const bool was_training = student->is_training();
  student->eval();
  std::vector<torch::Tensor> qs, qt, rs, rt;
  const int64_t chunk = std::max(1, options.batch_size);
  for (int64_t begin = 0; begin < pool.size(); begin += chunk) {
    std::vector<int64_t> idx;
    for (int64_t i = begin; i < std::min(pool.size(), begin + chunk); ++i) idx.push_back(i);
    std::vector<std::vector<int64_t>> prompts, answers;
    for (int64_t i : idx) {
      prompts.push_back(pool.prompts[i]);
      answers.push_back(answers_[i]);
    }
    TextBatch text = CollateText(prompts, answers, options.pad_id);
    const torch::Device d = pool.visual_tokens.device();
    model::MllmOutput out =
        student->Forward({SelectRows(pool.visual_tokens, idx), SelectRows(pool.visual_mask, idx),
                          text.text_ids.to(d), text.text_valid.to(d)});
    qs.push_back(out.queries.flatten(0, 1));
    qt.push_back(SelectRows(queries_, idx).flatten(0, 1));
    for (size_t r = 0; r < idx.size(); ++r) {
      const int64_t pl = text.prompt_lengths[r], al = text.answer_lengths[r];
      const int64_t from = config_.repr_answer_only ? pl : 0;
      rs.push_back(out.representation[r].narrow(0, text.prompt_width - pl + from, pl + al - from));
      rt.push_back(representation_[idx[r]].narrow(0, from, pl + al - from));
    }
  }
  // Fit to what the loss compares: layer-normed teacher features when normalising.
  auto target = [&](torch::Tensor y) {
    return config_.normalize && config_.feature_loss == FeatureLoss::kMse ? LayerNormFeatures(y)
                                                                          : y;
  };
  RidgeFit(torch::cat(qs), target(torch::cat(qt)), config_.ridge_lambda, phi_);
  RidgeFit(torch::cat(rs), target(torch::cat(rt)), config_.ridge_lambda, psi_);
  student->train(was_training);
}

torch::Tensor FeatureDistance(const DistillConfig& config, const torch::Tensor& teacher,
                              const torch::Tensor& student, const torch::Tensor& mask) {
  switch (config.feature_loss) {
    case FeatureLoss::kMse:
      return FeatureMse(teacher, student, mask, config.normalize);
    case FeatureLoss::kPearson:
      return PearsonDistance(teacher, student, mask);
    case FeatureLoss::kChannelWise:
      return ChannelWiseDivergence(teacher, student, mask, config.cwd_tau);
    case FeatureLoss::kNone:
      break;
  }
  return torch::zeros({}, teacher.options());
}

torch::Tensor DistillLearner::FeatureTerm(const torch::Tensor& teacher,
                                          const torch::Tensor& student,
                                          const torch::Tensor& mask) const {
  return FeatureDistance(config_, teacher, student, mask);
}

Learner::Terms DistillLearner::Loss(const SamplePool& pool, const std::vector<int64_t>& batch,
                                    model::Blip2Tower& student, const JobOptions& options) {
  const torch::Device d = pool.visual_tokens.device();
  std::vector<std::vector<int64_t>> prompts, answers;
  for (int64_t i : batch) {
    prompts.push_back(pool.prompts[i]);
    answers.push_back(answers_[i]);
  }
  TextBatch text = CollateText(prompts, answers, options.pad_id);
  model::MllmOutput out =
      student->Forward({SelectRows(pool.visual_tokens, batch), SelectRows(pool.visual_mask, batch),
                        text.text_ids.to(d), text.text_valid.to(d)});
  torch::Tensor targets = text.targets.to(d);
  Terms terms;
  torch::Tensor ce = TokenCrossEntropy(out.logits, targets);
  torch::Tensor total = config_.l_ce * ce;
  terms.emplace_back("ce", ce.detach());
  if (UsesFeatures() && config_.l_query > 0) {
    torch::Tensor q = FeatureTerm(SelectRows(queries_, batch), phi_->forward(out.queries), {});
    total = total + config_.l_query * q;
    terms.emplace_back("query", q.detach());
  }
  if (UsesFeatures() && config_.l_repr > 0) {
    const int64_t b = static_cast<int64_t>(batch.size());
    const int64_t t = text.text_ids.size(1);
    torch::Tensor rt = torch::zeros({b, t, teacher_->config().d_model}, out.logits.options());
    for (int64_t r = 0; r < b; ++r) {
      const int64_t pl = text.prompt_lengths[r];
      rt[r]
          .narrow(0, text.prompt_width - pl, representation_[batch[r]].size(0))
          .copy_(representation_[batch[r]]);
    }
    torch::Tensor mask = (config_.repr_answer_only ? text.answer_mask : text.text_valid).to(d);
    torch::Tensor rep = FeatureTerm(rt, psi_->forward(out.representation), mask);
    total = total + config_.l_repr * rep;
    terms.emplace_back("repr", rep.detach());
  }
  if (config_.l_kl > 0) {
    torch::Tensor tl = torch::zeros_like(out.logits);
    for (size_t r = 0; r < batch.size(); ++r) {
      const torch::Tensor& l = answer_logits_[batch[r]];
      tl[r].narrow(0, text.prompt_width - 1, l.size(0)).copy_(l);
    }
    torch::Tensor kl = TemperatureKl(tl, out.logits, targets >= 0, config_.temperature);
    total = total + config_.l_kl * kl;
    terms.emplace_back("kl", kl.detach());
  }
  terms.insert(terms.begin(), {"total", total});
  return terms;
}

}  // namespace cdcca::distill
