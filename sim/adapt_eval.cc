#include "sim/adapt_eval.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "datasets/fashion_mnist.h"
#include "nlohmann/json.hpp"

namespace cdcca::sim {
namespace {

namespace ds = ::cdcca::datasets;
using distill::DistillConfig;
using distill::LossTerm;

std::vector<ds::Sample> GenerateScenes(const ds::SampleGenerator& gen, int64_t n) {
  std::vector<ds::Sample> out(static_cast<size_t>(n));
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[static_cast<size_t>(i)] = gen.Generate(i);
  });
  return out;
}

std::string TermsText(const std::vector<LossTerm>& terms) {
  std::string out;
  for (const LossTerm& t : terms) {
    absl::StrAppend(&out, out.empty() ? "" : ", ",
                    absl::StrFormat("%s %.3f→%.3f", t.name, t.first, t.last));
  }
  return out;
}

}  // namespace

absl::StatusOr<AdaptScenes> GenerateAdaptScenes(const AdaptEvalOptions& o) {
  absl::StatusOr<ds::ImageSet> train_images =
      ds::LoadFashionMnist(ds::Split::kTrain, o.fashion_mnist_dir);
  if (!train_images.ok()) return train_images.status();
  absl::StatusOr<ds::ImageSet> test_images =
      ds::LoadFashionMnist(ds::Split::kTest, o.fashion_mnist_dir);
  if (!test_images.ok()) return test_images.status();
  ds::DomainSpec stream_spec = o.domain, test_spec = o.domain;
  stream_spec.split = ds::Split::kTrain;
  test_spec.split = ds::Split::kTest;
  absl::StatusOr<ds::SampleGenerator> stream_gen =
      ds::SampleGenerator::Create(&*train_images, stream_spec, o.seed);
  if (!stream_gen.ok()) return stream_gen.status();
  absl::StatusOr<ds::SampleGenerator> test_gen =
      ds::SampleGenerator::Create(&*test_images, test_spec, o.seed + 7919);
  if (!test_gen.ok()) return test_gen.status();
  AdaptScenes out;
  out.stream = GenerateScenes(*stream_gen, o.stream_scenes);
  out.test = GenerateScenes(*test_gen, o.test_scenes);
  return out;
}

absl::StatusOr<std::vector<compress::UplinkSample>> BuildArmUplink(
    const StreamObservation& observation, const std::vector<bool>& keep, const UplinkArm& arm,
    device::SampleStep& step) {
  if (arm.selection != TokenSelection::kAll && !(arm.token_ratio > 0 && arm.token_ratio <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("arm ", arm.name, ": ratio outside (0, 1]"));
  }
  const std::vector<std::vector<float>>* scores = nullptr;
  if (arm.selection == TokenSelection::kUts) {
    for (const auto& [name, s] : observation.scene_scores) {
      if (name == arm.score) scores = &s;
    }
    if (scores == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("arm ", arm.name, ": no token scores '", arm.score, "' observed"));
    }
  }
  device::UtsOptions uts = step.options().uts;
  device::KeepEverySample(&uts);  // `keep` is stage 1
  uts.random_tokens = arm.selection == TokenSelection::kRandom;
  uts.token_ratio = arm.selection == TokenSelection::kAll ? 1.0f : arm.token_ratio;
  step.Reconfigure(uts, /*holdout_fraction=*/0);
  std::vector<compress::UplinkSample> out;
  for (size_t i = 0; i < observation.samples.size(); ++i) {
    if (!keep.empty() && !keep[i]) continue;
    const compress::UplinkSample& full = observation.samples[i];
    device::AnsweredFrame frame;
    frame.entropy = full.entropy;
    frame.tokens = static_cast<int>(full.grid_tokens);
    frame.dim = static_cast<int>(full.feature_dim);
    frame.features = full.features;
    frame.question_ids = full.prompt_tokens;
    frame.answer_ids = full.answer_tokens;
    frame.model_version = full.model_version;
    // Stage 2's scores are the ones observed on the sample's scene.
    device::FrameModel observed;
    if (scores != nullptr) {
      const std::vector<float>& scene =
          (*scores)[static_cast<size_t>(observation.scene_of_sample[i])];
      observed.scores = [&scene](int, float, device::TokenScore, std::optional<uint64_t>) {
        return absl::StatusOr<std::vector<float>>(scene);
      };
    }
    device::SampleDecision d = step.Run(frame, observed, full.sample_id);
    if (!d.status.ok()) return d.status;
    out.push_back(std::move(d.sample));
  }
  return out;
}

absl::StatusOr<std::vector<DistillConfig>> CheckAdaptEvalOptions(const AdaptEvalOptions& o) {
  if (o.arms.empty() || o.learners.empty()) {
    return absl::InvalidArgumentError("adapt-eval needs at least one arm and one learner");
  }
  if (o.stream_scenes < 1 || o.test_scenes < 1) {
    return absl::InvalidArgumentError("stream_scenes and test_scenes must be >= 1");
  }
  if (o.mc_passes < 1 || o.mc_passes > 64 || o.dropout_p < 0 || o.dropout_p >= 1) {
    return absl::InvalidArgumentError("mc_passes must be in 1-64 and dropout_p in [0, 1)");
  }
  std::vector<DistillConfig> learners;
  for (const std::string& spec : o.learners) {
    absl::StatusOr<DistillConfig> c = distill::ParseLearnerSpec(spec);
    if (!c.ok()) return c.status();
    learners.push_back(*c);
  }
  return learners;
}

absl::StatusOr<std::string> GroundTruthAnswer(const std::vector<std::string>& direct_answers,
                                              const std::string& what) {
  if (direct_answers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        " has no answers: the ground-truth arm trains on the benchmark's answers, so it needs "
        "a benchmark that has them (leave the arm out for one without)"));
  }
  std::string best;
  int best_count = 0;
  for (const std::string& a : direct_answers) {
    const int n = static_cast<int>(std::count(direct_answers.begin(), direct_answers.end(), a));
    if (n > best_count) {
      best = a;
      best_count = n;
    }
  }
  return best;
}

std::string AdaptReport::Markdown() const {
  std::string out = absl::StrFormat(
      "Domain: %s (%s). Test: %d questions. Source student %.1f%%, teacher %.1f%% (all tokens). "
      "Stream: %d samples (device DA %.1f%%), %d uplinked after stage 1.\n\n",
      domain, device, test_questions, source_accuracy, teacher_accuracy, stream_samples,
      device_accuracy_stream, stage1_samples);
  const double lead = teacher_accuracy - source_accuracy;
  const double clean_lead = clean_teacher_accuracy - clean_source_accuracy;
  absl::StrAppend(
      &out, absl::StrFormat("The same questions on the clean images: student %.1f%%, teacher "
                            "%.1f%%. Teacher's lead %+.1f points under the shift, %+.1f clean: "
                            "the shift makes %+.1f of it.\n\n",
                            clean_source_accuracy, clean_teacher_accuracy, lead, clean_lead,
                            lead - clean_lead));
  out +=
      "| arm | learner | samples | tokens kept | teacher DA on uplink | DA % | gain | % of "
      "all-tokens gain |\n";
  out += "|---|---|---|---|---|---|---|---|\n";
  for (const AdaptRow& r : rows) {
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "| %s | %s | %d | %.0f%% | %.1f | %.1f | %+.1f | %s |\n", r.arm, r.learner, r.samples,
            100.0 * r.tokens_kept, r.teacher_uplink_accuracy, r.accuracy, r.gain,
            std::isnan(r.recovered) ? std::string("-") : absl::StrFormat("%.0f", r.recovered)));
  }
  out += "\nLoss terms per job (first step → mean of the last 10):\n\n";
  for (const AdaptRow& r : rows) {
    absl::StrAppend(&out, "- ", r.arm, " / ", r.learner, ": ", TermsText(r.terms), "\n");
  }
  return out;
}

std::string AdaptReport::Json() const {
  nlohmann::json j;
  j["domain"] = domain;
  j["device"] = device;
  j["source_accuracy"] = source_accuracy;
  j["teacher_accuracy"] = teacher_accuracy;
  j["clean_source_accuracy"] = clean_source_accuracy;
  j["clean_teacher_accuracy"] = clean_teacher_accuracy;
  j["shift_induced_lead"] =
      (teacher_accuracy - source_accuracy) - (clean_teacher_accuracy - clean_source_accuracy);
  j["device_accuracy_stream"] = device_accuracy_stream;
  j["stream_samples"] = stream_samples;
  j["stage1_samples"] = stage1_samples;
  j["test_questions"] = test_questions;
  j["rows"] = nlohmann::json::array();
  for (const AdaptRow& r : rows) {
    nlohmann::json row = {{"arm", r.arm},
                          {"learner", r.learner},
                          {"samples", r.samples},
                          {"tokens_kept", r.tokens_kept},
                          {"teacher_uplink_accuracy", r.teacher_uplink_accuracy},
                          {"accuracy", r.accuracy},
                          {"gain", r.gain},
                          {"job_seconds", r.job_seconds}};
    row["recovered"] =
        std::isnan(r.recovered) ? nlohmann::json(nullptr) : nlohmann::json(r.recovered);
    for (const LossTerm& t : r.terms)
      row["terms"][t.name] = {{"first", t.first}, {"last", t.last}, {"mean", t.mean}};
    j["rows"].push_back(row);
  }
  return j.dump(2);
}

}  // namespace cdcca::sim
