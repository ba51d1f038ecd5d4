#include "distill/akd.h"

#include <torch/torch.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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
    } else if (key == "confidence_power") {
      c.confidence_power = v.get<double>();
      if (!(c.confidence_power >= 0) || c.confidence_power > 16) {
        return absl::InvalidArgumentError("confidence_power must be in [0, 16]");
      }
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
      return absl::InvalidArgumentError(
          "job key 'use_cuda' is not a setting: the program chooses where jobs train "
          "(cdcca-cloud's --device); remove it");
    } else if (key == "student_dropout") {
      return absl::InvalidArgumentError(
          "job key 'student_dropout' is not a setting: the student always trains in eval mode "
          "(no dropout); remove it");
    } else if (key == "max_answer_tokens") {
      o.max_answer_tokens = v.get<int>();
    } else if (key == "fp8_base") {
      if (v.is_boolean()) {
        o.fp8_base = v.get<bool>() ? "on" : "off";
      } else {
        o.fp8_base = v.get<std::string>();
        if (absl::Status s =
                CheckFp8BaseMode(o.fp8_base, "job key 'fp8_base' (a name or true / false)");
            !s.ok()) {
          return s;
        }
      }
    } else if (key == "prepare_batch") {
      o.prepare_batch = v.get<int>();
      if (o.prepare_batch < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "job key 'prepare_batch' must be >= 0 (0: twice batch_size), got ", o.prepare_batch));
      }
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
    c.l_query = c.l_repr = 0.0;
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

absl::StatusOr<DistillConfig> ParseLearnerSpec(const std::string& spec) {
  std::vector<std::string> parts = absl::StrSplit(spec, '+');
  Json learner = Json::object();
  learner["name"] = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) {
    std::vector<std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2 || kv[0].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("learner spec '", spec, "': expected key=value, got '", parts[i], "'"));
    }
    Json value = Json::parse(kv[1], nullptr, /*allow_exceptions=*/false);
    learner[kv[0]] = value.is_discarded() ? Json(kv[1]) : value;
  }
  Json settings = {{"learner", learner}};
  absl::StatusOr<DistillSettings> s = ParseDistillSettings(settings.dump());
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("learner spec '", spec, "': ", s.status().message()));
  }
  s->learner.name = spec;
  return s->learner;
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

}  // namespace cdcca::distill
