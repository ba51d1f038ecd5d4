#include "sim/inprocess_round.h"

#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "cloud/train_round.h"
#include "compress/named_tensors.h"
#include "compress/uplink_codec.h"
#include "device/sample_step.h"
#include "distill/pair_distiller.h"
#include "model/runtime/generation.h"
#include "nlohmann/json.hpp"

namespace cdcca::sim {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The tower's input, [C, H, W]: what the image processor gives the model (config.json's
// vision_config; 224 and 3 are transformers' defaults).
absl::StatusOr<std::vector<int64_t>> PixelShape(const std::string& dir) {
  std::ifstream in(dir + "/config.json");
  if (!in) return absl::NotFoundError(absl::StrCat("no config.json in ", dir));
  nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/config.json is not a JSON object"));
  }
  const nlohmann::json vision = config.value("vision_config", nlohmann::json::object());
  const int64_t size = vision.is_object() ? vision.value("image_size", 224) : 224;
  const int64_t channels = vision.is_object() ? vision.value("num_channels", 3) : 3;
  if (size <= 0 || channels <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/config.json: bad vision_config"));
  }
  return std::vector<int64_t>{channels, size, size};
}

absl::StatusOr<std::unique_ptr<model::MultimodalModel>> Load(const std::string& what,
                                                             const std::string& dir,
                                                             const std::string& precision,
                                                             torch::Device device) {
  model::ModelOptions o;
  o.precision = precision;
  o.device = device;
  absl::StatusOr<std::unique_ptr<model::MultimodalModel>> m = model::LoadModel(dir, o);
  if (!m.ok()) {
    return absl::Status(m.status().code(), absl::StrCat(what, ": ", m.status().message()));
  }
  return m;
}

std::vector<int64_t> Row(const torch::Tensor& ids, int64_t i) {
  const torch::Tensor r = ids[i].to(torch::kCPU, torch::kLong).contiguous();
  return std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
}

// Greedy answers as the device runtime gives them (device/internal/student.cc): from the vision
// tower's tokens, cut at the first eos.
struct Answerer {
  std::vector<int64_t> eos;
  int max_answer_tokens = 16;

  // One frame's inputs for `m`: pixels [1, C, H, W] and the expanded prompt.
  static model::MultimodalInputs Inputs(model::MultimodalModel& m, const torch::Tensor& pixels,
                                        const std::vector<int64_t>& prompt) {
    model::MultimodalInputs in;
    in.pixel_values = pixels.unsqueeze(0);
    in.input_ids = torch::tensor(m.ExpandImageTokens(prompt), torch::kLong).unsqueeze(0);
    return in;
  }

  // `m`'s answer from tokens [N, D] (present [N] or undefined = all) and expanded ids [1, T];
  // its mean token entropy into `entropy` when given.
  absl::StatusOr<std::vector<int64_t>> FromTokens(model::MultimodalModel& m,
                                                  const torch::Tensor& tokens,
                                                  const torch::Tensor& present,
                                                  const torch::Tensor& input_ids,
                                                  double* entropy) const {
    model::TokenInputs ti;
    ti.visual_tokens = tokens.unsqueeze(0);
    if (present.defined()) ti.visual_present = present.unsqueeze(0);
    ti.input_ids = input_ids;
    model::GreedyOptions g;
    g.max_new_tokens = max_answer_tokens;
    g.eos_token_ids = eos;
    g.keep_step_logits = entropy != nullptr;
    absl::StatusOr<model::GreedyResult> r = m.GenerateFromTokens(ti, g);
    if (!r.ok()) return r.status();
    if (entropy != nullptr) *entropy = model::MeanStepEntropy(*r, 0);
    return model::AnswerIds(r->tokens.at(0), eos);
  }
};

// The share of `label`'s tokens that `answer` repeats at the same position.
double Agreement(const std::vector<int64_t>& answer, const std::vector<int64_t>& label) {
  if (label.empty()) return answer.empty() ? 1.0 : 0.0;
  size_t same = 0;
  for (size_t i = 0; i < label.size() && i < answer.size(); ++i) same += answer[i] == label[i];
  return static_cast<double>(same) / static_cast<double>(label.size());
}

absl::Status Step(const absl::Status& s, const std::string& step) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(step, ": ", s.message()));
}

}  // namespace

absl::StatusOr<InProcessRoundReport> RunHubRound(const InProcessRoundOptions& options) {
  auto log = [&](const std::string& line) {
    if (options.log) options.log(line);
  };
  if (options.frames < 1) return absl::InvalidArgumentError("a round needs at least one frame");
  if (!options.prompt_ids.defined() || options.prompt_ids.dim() != 2 ||
      options.prompt_ids.size(0) < 1 || options.prompt_ids.size(1) < 1) {
    return absl::InvalidArgumentError("prompt_ids must be [S, P] with S, P >= 1");
  }
  if (absl::Status s = device::CheckUtsOptions(options.uts); !s.ok()) return s;
  if (options.uts.precision == compress::FeaturePrecision::kJpeg) {
    return absl::InvalidArgumentError(
        "the in-process round uplinks tokens (fp16, int8, int4); the jpeg uplink needs JPEG "
        "coding, which runs in cdcca-device and cdcca-cloud");
  }
  absl::StatusOr<uint64_t> teacher_tower = model::TowerFingerprint(options.teacher_dir);
  if (!teacher_tower.ok()) return Step(teacher_tower.status(), "teacher");
  absl::StatusOr<uint64_t> student_tower = model::TowerFingerprint(options.student_dir);
  if (!student_tower.ok()) return Step(student_tower.status(), "student");
  if (*teacher_tower != *student_tower) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the teacher ", options.teacher_dir, " and the student ", options.student_dir,
        " have different vision towers: a pair must share the tower whose tokens devices uplink"));
  }
  absl::StatusOr<std::vector<int64_t>> pixel_shape = PixelShape(options.student_dir);
  if (!pixel_shape.ok()) return pixel_shape.status();

  InProcessRoundReport report;
  report.frames = options.frames;
  try {
    // ---- load: the cloud's teacher and mirror, the device's student ----
    const Clock::time_point load_start = Clock::now();
    log("loading the teacher, the cloud's student mirror and the device's student");
    auto teacher = Load("teacher", options.teacher_dir, options.teacher_precision, options.device);
    if (!teacher.ok()) return teacher.status();
    auto mirror_model =
        Load("mirror", options.student_dir, options.student_precision, options.device);
    if (!mirror_model.ok()) return mirror_model.status();
    auto device_model =
        Load("device", options.student_dir, options.student_precision, options.device);
    if (!device_model.ok()) return device_model.status();
    if ((*device_model)->model_type() == "instructblip") {
      return absl::InvalidArgumentError(
          "an InstructBLIP round needs the Q-Former's tokenizer; this round reads prompts as "
          "the LM's ids only (LLaVA, BLIP-2)");
    }
    for (model::MultimodalModel* m : {mirror_model->get(), device_model->get()}) {
      if (absl::Status s = m->AddAdapters(options.adapters); !s.ok()) return Step(s, "adapters");
    }
    report.load_seconds = Since(load_start);
    (*device_model)->module().eval();

    // Version 0 on both sides: what Register compares (the base fingerprint holds its digest).
    // The device's digests are read off the live model that answers, never off a copy.
    compress::NamedTensors device_state =
        compress::Fp32Clones((*device_model)->TrainableParameters());
    compress::NamedTensors mirror = compress::Fp32Clones((*mirror_model)->TrainableParameters());
    for (const auto& [name, t] : mirror) report.trainable_parameters += t.numel();
    report.device_digest_before =
        compress::StateDigest(compress::Fp32Clones((*device_model)->TrainableParameters()));
    report.mirror_digest_before = compress::StateDigest(mirror);
    if (report.device_digest_before != report.mirror_digest_before) {
      return absl::InternalError("the device's and the mirror's version 0 differ");
    }
    const auto [n, d] = (*device_model)->VisualTokenShape();
    report.visual_tokens = n;
    report.feature_dim = d;

    // ---- device: answer every frame, UTS, uplink ----
    torch::manual_seed(options.seed);
    std::vector<int64_t> frame_shape = {options.frames};
    frame_shape.insert(frame_shape.end(), pixel_shape->begin(), pixel_shape->end());
    const torch::Tensor frames = torch::randn(frame_shape, torch::kFloat);
    model::MultimodalModel& dev = **device_model;
    Answerer answerer;
    answerer.eos = dev.eos_token_ids();
    answerer.max_answer_tokens = options.max_answer_tokens;
    // The device's step of a round (no update guard in process: nothing is held out). Stage
    // 2's draws come from the binding below; random tokens from one generator of the seed.
    device::SampleStepOptions step_options;
    step_options.uts = options.uts;
    step_options.token_seed = options.seed * 1000003ULL;
    device::SampleStep step(step_options);
    std::vector<compress::UplinkSample> uplink;
    // Per kept frame: the frame, its tokens and kept mask, the expanded prompt, and the
    // device's answers before the update from the whole frame and from the kept tokens.
    struct Kept {
      int frame = 0;
      torch::Tensor tokens, present, input_ids;
      std::vector<int64_t> answer, answer_on_kept;
    };
    std::vector<Kept> kept;
    double entropy_sum = 0;
    for (int i = 0; i < options.frames; ++i) {
      const std::vector<int64_t> prompt = Row(options.prompt_ids, i % options.prompt_ids.size(0));
      const model::MultimodalInputs in = Answerer::Inputs(dev, frames[i], prompt);
      Clock::time_point start = Clock::now();
      absl::StatusOr<torch::Tensor> encoded = dev.EncodeImages(in);
      if (!encoded.ok()) return Step(encoded.status(), absl::StrCat("device tower, frame ", i));
      const torch::Tensor tokens = encoded->select(0, 0).contiguous();
      double entropy = 0;
      absl::StatusOr<std::vector<int64_t>> answer =
          answerer.FromTokens(dev, tokens, torch::Tensor(), in.input_ids, &entropy);
      if (!answer.ok()) return Step(answer.status(), absl::StrCat("device answer, frame ", i));
      report.answer_seconds += Since(start);
      entropy_sum += entropy;
      const torch::Tensor features = tokens.to(torch::kCPU, torch::kFloat).contiguous();
      const std::vector<uint32_t> question_ids(prompt.begin(), prompt.end());
      const std::vector<uint32_t> answer_ids(answer->begin(), answer->end());
      device::AnsweredFrame frame;
      frame.entropy = static_cast<float>(entropy);
      frame.tokens = static_cast<int>(n);
      frame.dim = static_cast<int>(d);
      frame.features =
          absl::MakeConstSpan(features.data_ptr<float>(), static_cast<size_t>(features.numel()));
      frame.question_ids = question_ids;
      frame.answer_ids = answer_ids;
      device::FrameModel scorer;
      // VIS from the frame's pixels; the frame's own draw (seed and index) unless the step
      // fixes one.
      scorer.scores = [&, i](int passes, float dropout_p, device::TokenScore,
                             std::optional<uint64_t> seed) -> absl::StatusOr<std::vector<float>> {
        model::VisualTokenPassOptions o;
        o.passes = passes;
        o.dropout_p = dropout_p;
        o.seed = seed.value_or(options.seed * 1000003ULL + static_cast<uint64_t>(i));
        absl::StatusOr<model::VisualTokenPasses> v = dev.StochasticVisualTokens(in, o);
        if (!v.ok()) return v.status();
        const torch::Tensor var = v->variance.to(torch::kCPU, torch::kFloat).contiguous();
        return std::vector<float>(var.data_ptr<float>(), var.data_ptr<float>() + var.numel());
      };
      device::SampleDecision decision = step.Run(frame, scorer, static_cast<uint64_t>(i));
      log(absl::StrFormat("device: frame %d/%d, entropy %.3f nats, %s", i + 1, options.frames,
                          entropy, decision.stage1_kept ? "kept" : "passed over"));
      if (!decision.status.ok()) {
        return Step(decision.status, absl::StrCat("device step, frame ", i));
      }
      report.stage2_seconds += decision.stage2_seconds;
      if (!decision.uplinked()) continue;
      const std::vector<uint16_t> keep_tokens = decision.sample.kept_indices;
      uplink.push_back(std::move(decision.sample));
      report.kept_tokens += static_cast<int64_t>(keep_tokens.size());
      Kept k;
      k.frame = i;
      k.tokens = tokens;
      k.present = torch::zeros({n}, torch::kBool);
      for (uint16_t t : keep_tokens) k.present[t] = true;
      k.input_ids = in.input_ids;
      k.answer = *std::move(answer);
      // Not part of the device's work: the reference for the agreement after the update.
      absl::StatusOr<std::vector<int64_t>> on_kept =
          answerer.FromTokens(dev, k.tokens, k.present, k.input_ids, nullptr);
      if (!on_kept.ok()) return Step(on_kept.status(), absl::StrCat("device answer, frame ", i));
      k.answer_on_kept = *std::move(on_kept);
      kept.push_back(std::move(k));
    }
    report.mean_entropy = entropy_sum / options.frames;
    report.kept_samples = static_cast<int>(uplink.size());
    if (uplink.empty()) {
      return absl::FailedPreconditionError("UTS stage 1 kept no frame: nothing to uplink");
    }
    Clock::time_point start = Clock::now();
    absl::StatusOr<std::string> batch = compress::EncodeUplinkBatch(uplink, options.uts.precision);
    if (!batch.ok()) return Step(batch.status(), "uplink encode");
    report.uplink_encode_seconds = Since(start);
    report.uplink_bytes = batch->size();
    log(absl::StrFormat("device: %d of %d frames kept, %d tokens, %d uplink bytes",
                        report.kept_samples, report.frames, report.kept_tokens,
                        report.uplink_bytes));

    // ---- cloud: decode, AKD job from the mirror, DWC ----
    start = Clock::now();
    absl::StatusOr<std::vector<compress::UplinkSample>> received =
        compress::DecodeUplinkBatch(*batch);
    if (!received.ok()) return Step(received.status(), "uplink decode");
    report.uplink_decode_seconds = Since(start);
    const distill::PairSide student_side = distill::IdsAsTextSide(mirror_model->get());
    std::vector<distill::PairSample> job;
    for (const compress::UplinkSample& s : *received) {
      absl::StatusOr<distill::PairSample> h = distill::SampleFromUplink(s, student_side);
      if (!h.ok()) return Step(h.status(), "cloud");
      job.push_back(*std::move(h));
    }
    absl::StatusOr<std::unique_ptr<distill::PairDistiller>> distiller =
        distill::PairDistiller::Create(distill::IdsAsTextSide(teacher->get()), student_side,
                                       options.settings.learner, options.settings.job);
    if (!distiller.ok()) return Step(distiller.status(), "cloud job");
    log(absl::StrFormat("cloud: AKD job on %d samples, %d steps", job.size(),
                        options.settings.job.max_steps));
    // The cloud's step of the round (cloud/train_round.h), as a job of cdcca-cloud runs it:
    // the job from the mirror, checked, DWC-encoded against it and applied to its copy.
    std::vector<std::string> pseudo_labels;
    absl::StatusOr<cloud::TrainedRound> round = cloud::TrainRound(
        [&]() -> absl::StatusOr<cloud::TrainedSet> {
          absl::StatusOr<distill::PairJobResult> trained = (*distiller)->RunFrom(mirror, job);
          if (!trained.ok()) return trained.status();
          pseudo_labels = std::move(trained->pseudo_labels);
          report.kl_used = trained->kl_used;
          cloud::TrainedSet set;
          set.trainable = std::move(trained->trainable);
          set.stats = std::move(trained->stats);
          set.notes = std::move(trained->notes);
          return set;
        },
        mirror, /*version=*/0, compress::DeltaEncoder(options.dwc));
    if (!round.ok()) return Step(round.status(), "DWC encode");
    if (round->outcome != cloud::RoundOutcome::kTrained) {
      return Step(
          round->why.ok() ? absl::FailedPreconditionError("no sample was usable") : round->why,
          "cloud job");
    }
    report.job = round->job.stats;
    report.notes = round->job.notes;
    const cloud::NewVersion& update = round->next;
    report.dwc_encode_seconds = update.encode_seconds;
    report.dwc = update.update.stats;
    report.mirror_apply_seconds = update.apply_seconds;
    mirror = update.state;
    log(absl::StrFormat("cloud: update of %d bytes (%.2f bits/param, relative error %.3f)",
                        update.update.bytes.size(), update.update.stats.bits_per_param,
                        update.update.stats.relative_error));

    // ---- device: apply the same bytes, compare digests, answer again ----
    start = Clock::now();
    if (absl::StatusOr<uint64_t> v = compress::ApplyUpdate(update.update.bytes, 0, device_state);
        !v.ok()) {
      return Step(v.status(), "device apply");
    }
    if (absl::Status s = compress::CopyInto(device_state, dev.TrainableParameters()); !s.ok()) {
      return Step(s, "device apply");
    }
    report.device_apply_seconds = Since(start);
    report.device_digest_after =
        compress::StateDigest(compress::Fp32Clones(dev.TrainableParameters()));
    report.mirror_digest_after = compress::StateDigest(mirror);

    // The device's answers after the update, from each kept frame and from the tokens it
    // uplinked (what the job trained on); the cloud's trained student (the job's result before
    // DWC) on the same tokens, which bounds what the update could carry.
    start = Clock::now();
    double before = 0, after = 0, kept_before = 0, kept_after = 0, cloud_sum = 0;
    for (size_t k = 0; k < kept.size(); ++k) {
      const Kept& x = kept[k];
      absl::StatusOr<std::vector<int64_t>> label = student_side.encode(pseudo_labels.at(k), false);
      if (!label.ok()) return Step(label.status(), "pseudo-label");
      const std::vector<int64_t> teacher_answer = model::AnswerIds(*label, answerer.eos);
      absl::StatusOr<std::vector<int64_t>> now =
          answerer.FromTokens(dev, x.tokens, torch::Tensor(), x.input_ids, nullptr);
      if (!now.ok()) return Step(now.status(), "device answer after the update");
      before += Agreement(x.answer, teacher_answer);
      after += Agreement(*now, teacher_answer);
      report.answers_changed += *now != x.answer;
      report.answers.push_back({x.frame, x.answer, *now, teacher_answer});
      absl::StatusOr<std::vector<int64_t>> now_kept =
          answerer.FromTokens(dev, x.tokens, x.present, x.input_ids, nullptr);
      if (!now_kept.ok()) return Step(now_kept.status(), "device answer after the update");
      kept_after += Agreement(*now_kept, teacher_answer);
      absl::StatusOr<std::vector<int64_t>> cloud =
          answerer.FromTokens(**mirror_model, x.tokens, x.present, x.input_ids, nullptr);
      if (!cloud.ok()) return Step(cloud.status(), "trained student's answer");
      cloud_sum += Agreement(*cloud, teacher_answer);
      kept_before += Agreement(x.answer_on_kept, teacher_answer);
    }
    report.reanswer_seconds = Since(start);
    const double count = static_cast<double>(kept.size());
    report.agreement_before = before / count;
    report.agreement_after = after / count;
    report.agreement_kept_before = kept_before / count;
    report.agreement_kept_after = kept_after / count;
    report.agreement_kept_trained = cloud_sum / count;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("the round: ", e.what_without_backtrace()));
  }
  return report;
}

}  // namespace cdcca::sim
