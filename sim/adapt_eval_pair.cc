#include "sim/adapt_eval_pair.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compress/named_tensors.h"
#include "compress/uplink_codec.h"
#include "datasets/metrics.h"
#include "device/sample_step.h"
#include "device/uts.h"
#include "distill/pair_distiller.h"
#include "distill/pair_side.h"
#include "model/arch/answerer.h"
#include "model/tokenizer/tokenizer.h"

namespace cdcca::sim {
namespace {

namespace ds = ::cdcca::datasets;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

constexpr char kPairScore[] = "vis";

// DA (%) of `answerer`'s greedy answers on every question of `scenes`.
absl::StatusOr<double> Accuracy(model::Answerer& answerer, const model::PromptFormat& format,
                                const std::vector<ds::Sample>& scenes, int max_answer_tokens,
                                int* questions) {
  ds::VqaAccumulator acc;
  for (size_t i = 0; i < scenes.size(); ++i) {
    const ds::Sample& s = scenes[i];
    for (const ds::VqaItem& q : s.questions) {
      absl::StatusOr<std::string> prompt = format.Apply(q.question);
      if (!prompt.ok()) return prompt.status();
      absl::StatusOr<model::GenerateReply> r =
          answerer.AnswerRgb(s.image.pixels.data(), s.image.width, s.image.height,
                             absl::StrCat("test scene ", i), *prompt, max_answer_tokens);
      if (!r.ok()) return r.status();
      acc.Add(ds::VqaAccuracy(r->text, q.direct_answers),
              std::string(ds::AnswerTypeName(q.answer_type)));
    }
  }
  if (questions != nullptr) *questions = acc.count();
  return acc.Overall();
}

}  // namespace

absl::StatusOr<AdaptReport> RunHubAdaptEval(const AdaptEvalOptions& o,
                                            const EvalPairOptions& pair) {
  auto say = [&](const std::string& line) {
    if (o.progress) {
      o.progress(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  };
  absl::StatusOr<std::vector<distill::DistillConfig>> parsed = CheckAdaptEvalOptions(o);
  if (!parsed.ok()) return parsed.status();
  const std::vector<distill::DistillConfig>& learners = *parsed;
  // One UTS arm per ratio: the Hub model's score is the attention-mass variance.
  std::vector<UplinkArm> arms;
  bool scores_needed = false;
  for (UplinkArm arm : o.arms) {
    if (arm.selection == TokenSelection::kUts) {
      arm.score = kPairScore;
      arm.name = absl::StrCat("uts-", kPairScore, "-", std::lround(100 * arm.token_ratio),
                              arm.teacher_all_tokens ? "+teacher-all" : "");
      scores_needed = true;
    }
    bool seen = false;
    for (const UplinkArm& a : arms) seen = seen || a.name == arm.name;
    if (!seen) arms.push_back(arm);
  }

  absl::StatusOr<uint64_t> teacher_tower = model::TowerFingerprint(pair.teacher_dir);
  if (!teacher_tower.ok()) return teacher_tower.status();
  absl::StatusOr<uint64_t> student_tower = model::TowerFingerprint(pair.student_base_dir);
  if (!student_tower.ok()) return student_tower.status();
  if (*teacher_tower != *student_tower) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the teacher ", pair.teacher_dir, " and the student ", pair.student_base_dir,
        " have different vision towers: a pair must share the tower whose tokens devices uplink"));
  }
  const bool cuda = pair.device == "cuda";
  std::string teacher_precision = pair.teacher_precision;
  if (teacher_precision.empty()) teacher_precision = cuda ? "bf16" : "fp32";
  absl::StatusOr<std::unique_ptr<model::Answerer>> teacher =
      model::Answerer::Load(pair.teacher_dir, teacher_precision, pair.device);
  if (!teacher.ok()) return teacher.status();
  absl::StatusOr<std::unique_ptr<model::Answerer>> student =
      model::Answerer::Load(pair.student_base_dir, o.precision, pair.device);
  if (!student.ok()) return student.status();
  if (absl::Status s = (*student)->model().AddAdapters(pair.adapters); !s.ok()) return s;
  absl::StatusOr<model::PromptFormat> teacher_template =
      model::ResolvePromptFormat(pair.teacher_template.empty() ? "auto" : pair.teacher_template,
                                 (*teacher)->model_type(), pair.teacher_dir);
  if (!teacher_template.ok()) return teacher_template.status();
  absl::StatusOr<model::PromptFormat> student_template =
      model::ResolvePromptFormat(pair.student_template.empty() ? "auto" : pair.student_template,
                                 (*student)->model_type(), pair.student_base_dir);
  if (!student_template.ok()) return student_template.status();
  const distill::PairSide teacher_side =
      distill::PairSideOf(**teacher, pair.teacher_dir, *teacher_template);
  distill::PairSide student_side =
      distill::PairSideOf(**student, pair.student_base_dir, *student_template);
  // A student that trains its vision side reads each sample's frame through its own tower.
  student_side.reads_pixels = pair.adapters.lora_vision;

  absl::StatusOr<AdaptScenes> scenes = GenerateAdaptScenes(o);
  if (!scenes.ok()) return scenes.status();
  // A ground-truth arm needs every stream question's answer: refused before any work.
  if (std::any_of(arms.begin(), arms.end(), [](const UplinkArm& a) { return a.ground_truth; })) {
    for (size_t si = 0; si < scenes->stream.size(); ++si) {
      for (size_t qi = 0; qi < scenes->stream[si].questions.size(); ++qi) {
        absl::StatusOr<std::string> answer =
            GroundTruthAnswer(scenes->stream[si].questions[qi].direct_answers,
                              absl::StrCat("question ", qi, " of stream scene ", si));
        if (!answer.ok()) return answer.status();
      }
    }
  }

  AdaptReport report;
  report.domain = o.domain.name;
  report.device = pair.device;
  try {
    const compress::NamedTensors start =
        compress::Fp32Clones((*student)->model().TrainableParameters());

    // ---- reference accuracies on the test scenes ----
    Clock::time_point t0 = Clock::now();
    absl::StatusOr<double> source = Accuracy(**student, *student_template, scenes->test,
                                             o.max_answer_tokens, &report.test_questions);
    if (!source.ok()) return source.status();
    absl::StatusOr<double> teacher_acc =
        Accuracy(**teacher, *teacher_template, scenes->test, o.max_answer_tokens, nullptr);
    if (!teacher_acc.ok()) return teacher_acc.status();
    report.source_accuracy = *source;
    report.teacher_accuracy = *teacher_acc;
    // The same questions on the clean renders: how much of the teacher's lead the shift makes.
    std::vector<ds::Sample> clean = scenes->test;
    for (ds::Sample& s : clean) s.image = s.scene.image;
    absl::StatusOr<double> clean_source =
        Accuracy(**student, *student_template, clean, o.max_answer_tokens, nullptr);
    if (!clean_source.ok()) return clean_source.status();
    absl::StatusOr<double> clean_teacher =
        Accuracy(**teacher, *teacher_template, clean, o.max_answer_tokens, nullptr);
    if (!clean_teacher.ok()) return clean_teacher.status();
    report.clean_source_accuracy = *clean_source;
    report.clean_teacher_accuracy = *clean_teacher;
    say(absl::StrFormat(
        "[adapt-eval] %s, Hugging Face pair on %s: %d test questions, student %.1f%%, teacher "
        "%.1f%% (%.1fs)",
        o.domain.name, pair.device, report.test_questions, *source, *teacher_acc, Seconds(t0)));

    // ---- the device on the stream ----
    t0 = Clock::now();
    StreamObservation obs;
    std::vector<torch::Tensor> frame_pixels;  // by sample id, with lora_vision
    if (scores_needed) obs.scene_scores.emplace_back(kPairScore, std::vector<std::vector<float>>());
    ds::VqaAccumulator device_acc;
    std::vector<const ds::VqaItem*> stream_items;  // by sample id
    for (size_t si = 0; si < scenes->stream.size(); ++si) {
      const ds::Sample& scene = scenes->stream[si];
      // The frame as the device uplinks it, which the student's tower trains on: once a scene.
      torch::Tensor scene_pixels;
      if (pair.adapters.lora_vision) {
        absl::StatusOr<std::string> jpeg =
            (*student)->TowerInputJpeg(scene.image.pixels.data(), scene.image.width,
                                       scene.image.height, device::kFrameJpegQuality);
        if (!jpeg.ok()) return jpeg.status();
        absl::StatusOr<torch::Tensor> px =
            distill::FramePixels(**student, *jpeg, absl::StrCat("stream scene ", si));
        if (!px.ok()) return px.status();
        scene_pixels = *std::move(px);
      }
      for (const ds::VqaItem& q : scene.questions) {
        absl::StatusOr<std::string> prompt = student_template->Apply(q.question);
        if (!prompt.ok()) return prompt.status();
        const std::string source_name = absl::StrCat("stream scene ", si);
        model::VisualTokenReply visual;
        absl::StatusOr<model::GenerateReply> answer = (*student)->AnswerRgbFromTokens(
            scene.image.pixels.data(), scene.image.width, scene.image.height, source_name, *prompt,
            o.max_answer_tokens, &visual);
        if (!answer.ok()) return answer.status();
        // The question alone in the student's ids, as a device uplinks it (each side of the
        // job applies its own template); the features fp16-rounded, as the device sends them.
        absl::StatusOr<std::vector<int32_t>> question =
            (*student)->tokenizer().Encode(q.question, /*add_special_tokens=*/false);
        if (!question.ok()) return question.status();
        const std::vector<uint32_t> question_ids(question->begin(), question->end());
        const std::vector<uint32_t> answer_ids(answer->tokens.begin(), answer->tokens.end());
        std::vector<float> features;
        features.reserve(visual.features.size());
        for (float f : visual.features)
          features.push_back(compress::HalfToFloat(compress::FloatToHalf(f)));
        device::AnsweredFrame frame;
        frame.entropy = static_cast<float>(answer->mean_entropy);
        frame.tokens = static_cast<int>(visual.tokens);
        frame.dim = static_cast<int>(visual.dim);
        frame.features = features;
        frame.question_ids = question_ids;
        frame.answer_ids = answer_ids;
        const uint64_t sample_id = obs.samples.size();
        // Every token: each arm's step (BuildArmUplink) chooses from the whole grid.
        absl::StatusOr<compress::UplinkSample> s =
            device::MakeUplinkSample(frame, device::EveryToken(frame.tokens),
                                     compress::FeaturePrecision::kFp16, "", sample_id);
        if (!s.ok()) return s.status();
        if (scores_needed) {
          absl::StatusOr<model::VisualTokenReply> v = (*student)->VisualTokenVarianceFromTokens(
              visual.features, visual.tokens, visual.dim, *prompt, o.mc_passes, o.dropout_p,
              o.seed * 1000003ULL + sample_id);
          if (!v.ok()) return v.status();
          obs.scene_scores[0].second.push_back(std::move(v->variance));
        }
        device_acc.Add(ds::VqaAccuracy(answer->text, q.direct_answers),
                       std::string(ds::AnswerTypeName(q.answer_type)));
        if (pair.adapters.lora_vision) frame_pixels.push_back(scene_pixels);
        obs.scene_of_sample.push_back(static_cast<int64_t>(obs.samples.size()));
        obs.num_tokens = visual.tokens;
        obs.samples.push_back(*std::move(s));
        stream_items.push_back(&q);
      }
    }
    std::vector<float> entropies;
    for (const compress::UplinkSample& s : obs.samples) entropies.push_back(s.entropy);
    const std::vector<bool> keep = device::KeepTopEntropies(entropies, o.keep_fraction);
    report.stream_samples = static_cast<int64_t>(obs.samples.size());
    report.stage1_samples = std::count(keep.begin(), keep.end(), true);
    report.device_accuracy_stream = device_acc.Overall();
    say(absl::StrFormat(
        "[adapt-eval] device on the stream: %d samples (student DA %.1f%%), %d pass stage 1 "
        "(%.1fs)",
        report.stream_samples, report.device_accuracy_stream, report.stage1_samples, Seconds(t0)));

    // ---- one job per (arm, learner), each from the same student state ----
    std::vector<double> all_gain(learners.size(), std::numeric_limits<double>::quiet_NaN());
    // The device's step for every arm: one generator of random tokens, drawn on from arm to
    // arm.
    device::SampleStepOptions step_options;
    step_options.token_seed = o.seed ^ 0x5deece66dull;
    device::SampleStep step(step_options);
    for (const UplinkArm& arm : arms) {
      absl::StatusOr<std::vector<compress::UplinkSample>> uplink =
          BuildArmUplink(obs, keep, arm, step);
      if (!uplink.ok()) return uplink.status();
      if (uplink->empty()) {
        return absl::InvalidArgumentError(absl::StrCat("arm ", arm.name, " uplinks nothing"));
      }
      std::vector<distill::PairSample> job_samples;
      double kept = 0;
      for (const compress::UplinkSample& u : *uplink) {
        kept += static_cast<double>(u.kept_indices.size()) / u.grid_tokens;
        // A teacher-all arm's sample carries every token, as the cloud recomputes them from an
        // uplinked frame, and the kept ones as present.
        absl::StatusOr<distill::PairSample> h =
            arm.teacher_all_tokens
                ? distill::CompleteHfSample(u, obs.samples[u.sample_id].features, student_side)
                : distill::SampleFromUplink(u, student_side);
        if (!h.ok()) return h.status();
        if (pair.adapters.lora_vision) h->pixels = frame_pixels[u.sample_id];
        if (arm.ground_truth) {
          absl::StatusOr<std::string> answer =
              GroundTruthAnswer(stream_items[u.sample_id]->direct_answers,
                                absl::StrCat("stream question ", u.sample_id));
          if (!answer.ok()) return answer.status();
          h->label = *std::move(answer);
        }
        job_samples.push_back(*std::move(h));
      }
      kept /= static_cast<double>(uplink->size());
      for (size_t li = 0; li < learners.size(); ++li) {
        t0 = Clock::now();
        if (absl::Status st = compress::CopyInto(start, (*student)->model().TrainableParameters());
            !st.ok()) {
          return st;
        }
        absl::StatusOr<std::unique_ptr<distill::PairDistiller>> distiller =
            distill::PairDistiller::Create(teacher_side, student_side, learners[li], o.job);
        if (!distiller.ok()) return distiller.status();
        absl::StatusOr<distill::PairJobResult> result = (*distiller)->Run(job_samples);
        if (!result.ok()) return result.status();
        // The teacher's DA on this uplink: its pseudo-labels against the questions' answers.
        ds::VqaAccumulator labels;
        for (size_t k = 0; k < uplink->size() && k < result->pseudo_labels.size(); ++k) {
          const ds::VqaItem* item = stream_items[(*uplink)[k].sample_id];
          labels.Add(ds::VqaAccuracy(result->pseudo_labels[k], item->direct_answers),
                     std::string(ds::AnswerTypeName(item->answer_type)));
        }
        absl::StatusOr<double> adapted =
            Accuracy(**student, *student_template, scenes->test, o.max_answer_tokens, nullptr);
        if (!adapted.ok()) return adapted.status();
        AdaptRow row;
        row.arm = arm.name;
        row.learner = learners[li].name;
        row.samples = static_cast<int64_t>(uplink->size());
        row.tokens_kept = kept;
        row.teacher_uplink_accuracy = labels.Overall();
        row.accuracy = *adapted;
        row.gain = *adapted - report.source_accuracy;
        if (arm.selection == TokenSelection::kAll) all_gain[li] = row.gain;
        row.recovered = 100.0 * row.gain / all_gain[li];
        row.terms = result->stats.terms;
        row.job_seconds = Seconds(t0);
        say(absl::StrFormat("[adapt-eval] %-28s %-24s DA %.1f%% (gain %+.1f) %d steps, %.1fs%s",
                            arm.name, row.learner, row.accuracy, row.gain, result->stats.steps,
                            row.job_seconds,
                            result->notes.empty() ? "" : absl::StrCat("; ", result->notes[0])));
        report.rows.push_back(std::move(row));
      }
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("adapt-eval: ", e.what_without_backtrace()));
  }
  return report;
}

}  // namespace cdcca::sim
