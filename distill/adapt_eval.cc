#include "distill/adapt_eval.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "datasets/fashion_mnist.h"
#include "datasets/metrics.h"
#include "datasets/tokenizer.h"
#include "model/family/checkpoint.h"
#include "model/family/scene_eval.h"
#include "model/family/token_probe.h"
#include "model/family/token_scores.h"
#include "model/family/trainable.h"
#include "model/runtime/threads.h"
#include "nlohmann/json.hpp"

namespace cdcca::distill {
namespace {

namespace ds = ::cdcca::datasets;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

std::vector<ds::Sample> GenerateScenes(const ds::SampleGenerator& gen, int64_t n) {
  std::vector<ds::Sample> out(static_cast<size_t>(n));
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[static_cast<size_t>(i)] = gen.Generate(i);
  });
  return out;
}

// Copies an adapted trainable state (model::TrainableParameters order) into `model`.
absl::Status LoadTrainable(model::Blip2Tower& target, const model::NamedTensors& state) {
  model::NamedTensors live = model::TrainableParameters(*target);
  if (live.size() != state.size()) {
    return absl::InternalError("adapted state does not match the student's trainable set");
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < live.size(); ++i) {
    if (live[i].first != state[i].first || live[i].second.sizes() != state[i].second.sizes()) {
      return absl::InternalError(absl::StrCat("adapted tensor ", state[i].first, " does not fit"));
    }
    live[i].second.copy_(state[i].second);
  }
  return absl::OkStatus();
}

// DA of the teacher's greedy answers on an arm's uplink (every sample, or the first 1000),
// seeing only the kept tokens: the quality of the pseudo-labels that arm trains on.
double TeacherUplinkAccuracy(model::Blip2Tower& teacher,
                             const std::vector<compress::UplinkSample>& uplink,
                             const std::vector<const ds::VqaItem*>& items, const ds::Tokenizer& tok,
                             const model::TowerConfig& config, int max_answer_tokens,
                             torch::Device device) {
  torch::NoGradGuard no_grad;
  ds::VqaAccumulator acc;
  const size_t n = std::min<size_t>(uplink.size(), 1000);
  for (size_t b0 = 0; b0 < n; b0 += 256) {
    std::vector<const compress::UplinkSample*> part;
    for (size_t i = b0; i < std::min(n, b0 + 256); ++i) part.push_back(&uplink[i]);
    absl::StatusOr<SamplePool> pool = BuildSamplePool(part, config.num_visual_tokens, config.d_vis);
    if (!pool.ok()) return std::numeric_limits<double>::quiet_NaN();
    std::vector<std::vector<int64_t>> empty(part.size());
    TextBatch text = CollateText(pool->prompts, empty, ds::Tokenizer::kPad);
    model::GenerateResult g = teacher->Generate(
        pool->visual_tokens.to(device), pool->visual_mask.to(device), text.text_ids.to(device),
        text.text_valid.to(device), max_answer_tokens, ds::Tokenizer::kEos);
    torch::Tensor ids = g.tokens.cpu(), lengths = g.lengths.cpu();
    for (size_t r = 0; r < part.size(); ++r) {
      std::vector<int> words;
      for (int64_t t = 0; t < lengths[static_cast<int64_t>(r)].item<int64_t>(); ++t) {
        words.push_back(static_cast<int>(ids[static_cast<int64_t>(r)][t].item<int64_t>()));
      }
      const ds::VqaItem* item = items[part[r]->sample_id];
      acc.Add(ds::VqaAccuracy(tok.Decode(words), item->direct_answers),
              std::string(ds::AnswerTypeName(item->answer_type)));
    }
  }
  return acc.Overall();
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

absl::StatusOr<DistillConfig> ParseLearnerSpec(const std::string& spec) {
  std::vector<std::string> parts = absl::StrSplit(spec, '+');
  nlohmann::json learner = nlohmann::json::object();
  learner["name"] = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) {
    std::vector<std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2 || kv[0].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("learner spec '", spec, "': expected key=value, got '", parts[i], "'"));
    }
    nlohmann::json value = nlohmann::json::parse(kv[1], nullptr, /*allow_exceptions=*/false);
    learner[kv[0]] = value.is_discarded() ? nlohmann::json(kv[1]) : value;
  }
  nlohmann::json settings = {{"learner", learner}};
  absl::StatusOr<DistillSettings> s = ParseDistillSettings(settings.dump());
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("learner spec '", spec, "': ", s.status().message()));
  }
  s->learner.name = spec;
  return s->learner;
}

std::vector<uint16_t> TopTokens(const std::vector<float>& scores, float ratio) {
  std::vector<uint16_t> order(scores.size());
  for (size_t i = 0; i < scores.size(); ++i) order[i] = static_cast<uint16_t>(i);
  size_t n = static_cast<size_t>(std::lround(ratio * static_cast<float>(scores.size())));
  n = std::clamp<size_t>(n, 1, scores.size());
  std::stable_sort(order.begin(), order.end(),
                   [&](uint16_t a, uint16_t b) { return scores[a] > scores[b]; });
  order.resize(n);
  std::sort(order.begin(), order.end());
  return order;
}

std::vector<bool> Stage1Keep(const std::vector<compress::UplinkSample>& samples,
                             float keep_fraction) {
  std::vector<bool> keep(samples.size(), true);
  if (keep_fraction <= 0 || keep_fraction >= 1 || samples.empty()) return keep;
  std::vector<float> sorted;
  for (const auto& s : samples) sorted.push_back(s.entropy);
  std::sort(sorted.begin(), sorted.end());
  const size_t k =
      std::min(sorted.size() - 1, static_cast<size_t>((1.0f - keep_fraction) * sorted.size()));
  for (size_t i = 0; i < samples.size(); ++i) keep[i] = samples[i].entropy >= sorted[k];
  return keep;
}

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
    std::mt19937_64& rng) {
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
  const int tokens = static_cast<int>(observation.num_tokens);
  std::vector<compress::UplinkSample> out;
  for (size_t i = 0; i < observation.samples.size(); ++i) {
    if (!keep.empty() && !keep[i]) continue;
    const compress::UplinkSample& full = observation.samples[i];
    std::vector<uint16_t> kept;
    switch (arm.selection) {
      case TokenSelection::kAll:
        for (int k = 0; k < tokens; ++k) kept.push_back(static_cast<uint16_t>(k));
        break;
      case TokenSelection::kUts:
        kept = TopTokens((*scores)[static_cast<size_t>(observation.scene_of_sample[i])],
                         arm.token_ratio);
        break;
      case TokenSelection::kRandom: {
        // device::RandomTokenSelection's draw: a partial Fisher-Yates shuffle.
        std::vector<uint16_t> candidates(static_cast<size_t>(tokens));
        for (int k = 0; k < tokens; ++k)
          candidates[static_cast<size_t>(k)] = static_cast<uint16_t>(k);
        size_t n = static_cast<size_t>(std::lround(arm.token_ratio * static_cast<float>(tokens)));
        n = std::clamp<size_t>(n, 1, candidates.size());
        for (size_t j = 0; j < n; ++j) {
          std::uniform_int_distribution<size_t> pick(j, candidates.size() - 1);
          std::swap(candidates[j], candidates[pick(rng)]);
        }
        candidates.resize(n);
        std::sort(candidates.begin(), candidates.end());
        kept = std::move(candidates);
        break;
      }
    }
    compress::UplinkSample s = full;
    s.kept_indices = kept;
    s.features.clear();
    s.features.reserve(kept.size() * full.feature_dim);
    for (uint16_t k : kept) {
      const float* row = full.features.data() + static_cast<size_t>(k) * full.feature_dim;
      s.features.insert(s.features.end(), row, row + full.feature_dim);
    }
    out.push_back(std::move(s));
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
    absl::StatusOr<DistillConfig> c = ParseLearnerSpec(spec);
    if (!c.ok()) return c.status();
    learners.push_back(*c);
  }
  return learners;
}

absl::StatusOr<AdaptReport> RunAdaptEval(const AdaptEvalOptions& o) {
  auto say = [&](const std::string& line) {
    if (o.progress) {
      o.progress(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  };
  absl::StatusOr<std::vector<DistillConfig>> parsed = CheckAdaptEvalOptions(o);
  if (!parsed.ok()) return parsed.status();
  const std::vector<DistillConfig>& learners = *parsed;
  std::vector<std::string> score_kinds;
  for (const UplinkArm& arm : o.arms) {
    if (arm.teacher_all_tokens) {
      return absl::InvalidArgumentError(
          "a teacher that reads all tokens of a sample (--teacher_all_arms) runs on Hugging Face "
          "pairs (--teacher DIR --student_base DIR); a family's learner reads the kept tokens "
          "only");
    }
    if (arm.selection != TokenSelection::kUts) continue;
    if (!model::ParseTokenScore(arm.score).ok()) return model::ParseTokenScore(arm.score).status();
    if (std::find(score_kinds.begin(), score_kinds.end(), arm.score) == score_kinds.end()) {
      score_kinds.push_back(arm.score);
    }
  }
  absl::StatusOr<model::Precision> precision = model::ParsePrecision(o.precision);
  if (!precision.ok()) return precision.status();

  model::SetIntraOpThreads(o.threads);
  const torch::Device device = !o.force_cpu && torch::cuda::is_available()
                                   ? torch::Device(torch::kCUDA, 0)
                                   : torch::Device(torch::kCPU);
  absl::StatusOr<model::FamilyCheckpoint> family = model::LoadFamily(o.checkpoint_dir, *precision);
  if (!family.ok()) return family.status();
  // The token probe, when an arm scores with it (probe_entropy and the scores built on it).
  absl::StatusOr<model::TokenProbe> probe = absl::NotFoundError("no arm uses the probe");
  if (std::any_of(score_kinds.begin(), score_kinds.end(), [](const std::string& k) {
        return model::UsesProbe(*model::ParseTokenScore(k));
      })) {
    probe = model::LoadTokenProbe(o.checkpoint_dir + "/probe.safetensors");
    if (!probe.ok()) return probe.status();
    (*probe)->to(device);
  }
  // The cloud's mirror of the device student: its dequantized base, the same trainable set.
  absl::StatusOr<model::Blip2Tower> mirror =
      model::ConvertPrecision(family->student, model::Precision::kFp32);
  if (!mirror.ok()) return mirror.status();
  absl::StatusOr<ds::Tokenizer> loaded_tok =
      ds::Tokenizer::Load(o.checkpoint_dir + "/tokenizer.json");
  if (!loaded_tok.ok() && !absl::IsNotFound(loaded_tok.status())) return loaded_tok.status();
  const ds::Tokenizer tok = loaded_tok.ok() ? *loaded_tok : ds::Tokenizer::SceneLanguage();
  absl::StatusOr<AdaptScenes> scenes = GenerateAdaptScenes(o);
  if (!scenes.ok()) return scenes.status();

  AdaptReport report;
  report.domain = o.domain.name;
  report.device = device.str();
  try {
    model::VisionEncoder encoder = family->encoder;
    encoder->to(device);
    model::Blip2Tower student = family->student;  // the device's model (its stored precision)
    student->to(device);
    student->eval();
    model::Blip2Tower teacher = family->teacher;
    teacher->to(device);
    teacher->eval();

    // ---- the test scenes, and the reference accuracies ------------------------------------
    auto t0 = Clock::now();
    const std::vector<ds::Sample>& test = scenes->test;
    torch::Tensor test_tokens = model::EncodeAll(encoder, test, device);
    model::EvalResult source =
        model::ScoreAnswers(student, test_tokens, test, tok, o.max_answer_tokens, device);
    model::EvalResult teacher_eval =
        model::ScoreAnswers(teacher, test_tokens, test, tok, o.max_answer_tokens, device);
    report.source_accuracy = source.accuracy;
    report.teacher_accuracy = teacher_eval.accuracy;
    report.test_questions = source.questions;
    say(absl::StrFormat(
        "[adapt-eval] %s on %s: %d test questions, student %.1f%%, teacher %.1f%% (%.1fs)",
        o.domain.name, report.device, source.questions, source.accuracy, teacher_eval.accuracy,
        Seconds(t0)));

    // ---- the device on the stream --------------------------------------------------------
    t0 = Clock::now();
    const std::vector<ds::Sample>& stream = scenes->stream;
    torch::Tensor stream_tokens = model::EncodeAll(encoder, stream, device);
    StreamObservation obs;
    obs.num_tokens = stream_tokens.size(1);
    const int64_t dim = stream_tokens.size(2);
    // The device uplinks fp16 features: round them here once, for every arm.
    torch::Tensor sent = stream_tokens.to(torch::kHalf).to(torch::kFloat).cpu().contiguous();
    for (const std::string& kind : score_kinds)
      obs.scene_scores.emplace_back(kind, std::vector<std::vector<float>>());
    torch::manual_seed(o.seed);
    ds::VqaAccumulator device_acc;
    std::vector<const ds::VqaItem*> stream_items;  // by sample id
    const int64_t chunk = 64;
    for (int64_t s0 = 0; s0 < o.stream_scenes; s0 += chunk) {
      const int64_t n = std::min<int64_t>(chunk, o.stream_scenes - s0);
      torch::NoGradGuard no_grad;
      torch::Tensor vis = stream_tokens.narrow(0, s0, n);
      // Stage 2 scores, one batched set of M passes per chunk of scenes (the device runs one
      // frame at a time; the passes do not interact across the batch).
      if (!score_kinds.empty()) {
        model::StochasticStats stats =
            student->StochasticAttention(vis, torch::Tensor(), o.mc_passes, o.dropout_p);
        for (auto& [kind, per_scene] : obs.scene_scores) {
          const model::TokenScoreKind k = *model::ParseTokenScore(kind);
          torch::Tensor probe_entropy;
          if (model::UsesProbe(k)) {
            probe_entropy = model::ProbeEntropyFor(**probe, vis, k, o.mc_passes, o.dropout_p);
          }
          torch::Tensor sc = model::VisualTokenScores(&stats, probe_entropy, k).cpu().contiguous();
          for (int64_t r = 0; r < n; ++r) {
            const float* p = sc[r].data_ptr<float>();
            per_scene.emplace_back(p, p + obs.num_tokens);
          }
        }
      }
      // Answers and entropies, as InferenceRuntime::Answer computes them.
      std::vector<std::vector<int>> prompts;
      std::vector<int64_t> scene;
      std::vector<const ds::VqaItem*> items;
      for (int64_t r = 0; r < n; ++r) {
        for (const ds::VqaItem& q : stream[static_cast<size_t>(s0 + r)].questions) {
          prompts.push_back(tok.Encode(q.question, /*add_bos=*/true));
          scene.push_back(s0 + r);
          items.push_back(&q);
        }
      }
      int64_t longest = 1;
      for (const auto& p : prompts)
        longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
      const int64_t b = static_cast<int64_t>(prompts.size());
      torch::Tensor ids = torch::zeros({b, longest}, torch::kLong);
      torch::Tensor valid = torch::zeros({b, longest}, torch::kBool);
      for (int64_t i = 0; i < b; ++i) {
        const auto& p = prompts[static_cast<size_t>(i)];
        const int64_t off = longest - static_cast<int64_t>(p.size());
        for (size_t j = 0; j < p.size(); ++j) {
          ids[i][off + static_cast<int64_t>(j)] = p[j];
          valid[i][off + static_cast<int64_t>(j)] = true;
        }
      }
      torch::Tensor rows = torch::tensor(scene, torch::kLong).to(device);
      model::GenerateResult g =
          student->Generate(stream_tokens.index_select(0, rows), torch::Tensor(), ids.to(device),
                            valid.to(device), o.max_answer_tokens, ds::Tokenizer::kEos);
      torch::Tensor entropy = model::MeanTokenEntropy(g).cpu();
      torch::Tensor gen_tokens = g.tokens.cpu(), lengths = g.lengths.cpu();
      for (int64_t i = 0; i < b; ++i) {
        compress::UplinkSample s;
        s.sample_id = static_cast<uint64_t>(obs.samples.size());
        s.entropy = entropy[i].item<float>();
        s.grid_tokens = static_cast<uint32_t>(obs.num_tokens);
        s.feature_dim = static_cast<uint32_t>(dim);
        for (int64_t k = 0; k < obs.num_tokens; ++k)
          s.kept_indices.push_back(static_cast<uint16_t>(k));
        for (int t : prompts[static_cast<size_t>(i)])
          s.prompt_tokens.push_back(static_cast<uint32_t>(t));
        std::vector<int> answer;
        for (int64_t t = 0; t < lengths[i].item<int64_t>(); ++t) {
          answer.push_back(static_cast<int>(gen_tokens[i][t].item<int64_t>()));
          s.answer_tokens.push_back(static_cast<uint32_t>(answer.back()));
        }
        const float* f = sent[scene[static_cast<size_t>(i)]].data_ptr<float>();
        s.features.assign(f, f + obs.num_tokens * dim);
        device_acc.Add(
            ds::VqaAccuracy(tok.Decode(answer), items[static_cast<size_t>(i)]->direct_answers),
            std::string(ds::AnswerTypeName(items[static_cast<size_t>(i)]->answer_type)));
        stream_items.push_back(items[static_cast<size_t>(i)]);
        obs.samples.push_back(std::move(s));
        obs.scene_of_sample.push_back(scene[static_cast<size_t>(i)]);
      }
    }
    const std::vector<bool> keep = Stage1Keep(obs.samples, o.keep_fraction);
    report.stream_samples = static_cast<int64_t>(obs.samples.size());
    report.stage1_samples = std::count(keep.begin(), keep.end(), true);
    report.device_accuracy_stream = device_acc.Overall();
    say(absl::StrFormat(
        "[adapt-eval] device on the stream: %d samples (student DA %.1f%%), %d pass stage 1 "
        "(%.1fs)",
        report.stream_samples, report.device_accuracy_stream, report.stage1_samples, Seconds(t0)));

    // ---- one job per (arm, learner), from the same mirror --------------------------------
    JobOptions job = o.job;
    job.use_cuda = device.is_cuda();
    job.num_threads = o.threads;
    job.train_in_place = false;
    std::vector<double> all_gain(learners.size(), std::numeric_limits<double>::quiet_NaN());
    std::mt19937_64 rng(o.seed ^ 0x5deece66dull);
    for (const UplinkArm& arm : o.arms) {
      absl::StatusOr<std::vector<compress::UplinkSample>> uplink =
          BuildArmUplink(obs, keep, arm, rng);
      if (!uplink.ok()) return uplink.status();
      if (uplink->empty())
        return absl::InvalidArgumentError(absl::StrCat("arm ", arm.name, " uplinks nothing"));
      double kept = 0;
      for (const auto& s : *uplink)
        kept += static_cast<double>(s.kept_indices.size()) / s.grid_tokens;
      kept /= static_cast<double>(uplink->size());
      const double teacher_uplink = TeacherUplinkAccuracy(
          teacher, *uplink, stream_items, tok, teacher->config(), o.max_answer_tokens, device);
      say(absl::StrFormat(
          "[adapt-eval] arm %s: %d samples, %.0f%% of tokens, teacher DA on them %.1f%%", arm.name,
          uplink->size(), 100 * kept, teacher_uplink));
      for (size_t li = 0; li < learners.size(); ++li) {
        t0 = Clock::now();
        DistillLearner learner(teacher, learners[li]);
        absl::StatusOr<JobResult> result = learner.Run(*uplink, nullptr, *mirror, job);
        if (!result.ok()) return result.status();
        absl::StatusOr<model::Blip2Tower> adapted = CopyMllm(student, device);
        if (!adapted.ok()) return adapted.status();
        if (absl::Status st = LoadTrainable(*adapted, result->trainable); !st.ok()) return st;
        model::EvalResult r =
            model::ScoreAnswers(*adapted, test_tokens, test, tok, o.max_answer_tokens, device);
        AdaptRow row;
        row.arm = arm.name;
        row.learner = learners[li].name;
        row.samples = static_cast<int64_t>(uplink->size());
        row.tokens_kept = kept;
        row.teacher_uplink_accuracy = teacher_uplink;
        row.accuracy = r.accuracy;
        row.gain = r.accuracy - report.source_accuracy;
        if (arm.selection == TokenSelection::kAll) all_gain[li] = row.gain;
        row.recovered = 100.0 * row.gain / all_gain[li];
        row.terms = result->stats.terms;
        row.job_seconds = Seconds(t0);
        say(
            absl::StrFormat("[adapt-eval] %-28s %-24s DA %.1f%% (gain %+.1f, %.0f%% of all-tokens) "
                            "%d steps, %.1fs; %s",
                            arm.name, row.learner, row.accuracy, row.gain, row.recovered,
                            result->stats.steps, row.job_seconds, TermsText(row.terms)));
        report.rows.push_back(std::move(row));
      }
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("adapt-eval: ", e.what_without_backtrace()));
  }
  return report;
}

std::string AdaptReport::Markdown() const {
  std::string out = absl::StrFormat(
      "Domain: %s (%s). Test: %d questions. Source student %.1f%%, teacher %.1f%% (all tokens). "
      "Stream: %d samples (device DA %.1f%%), %d uplinked after stage 1.\n\n",
      domain, device, test_questions, source_accuracy, teacher_accuracy, stream_samples,
      device_accuracy_stream, stage1_samples);
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

}  // namespace cdcca::distill
