// FamilyMirrorTrainer (cloud/internal/mirror_trainer.h): a cdcca family's teacher and
// student base, one DistillLearner per device; and the job settings both trainers share.
#include <torch/torch.h>

#include <algorithm>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "cloud/internal/mirror_trainer.h"
#include "distill/akd.h"
#include "distill/greedy_answers.h"
#include "model/family/checkpoint.h"
#include "model/family/trainable.h"

namespace cdcca::cloud::internal {

absl::StatusOr<distill::DistillSettings> JobSettings(const PerDeviceStrategyOptions& options) {
  distill::DistillSettings settings;
  if (!options.distill_config.empty()) {
    absl::StatusOr<distill::DistillSettings> s =
        distill::LoadDistillSettings(options.distill_config);
    if (!s.ok()) return s.status();
    settings = *std::move(s);
    if (!options.learner.empty()) {
      absl::StatusOr<distill::DistillConfig> c =
          distill::WithFeatureTermOf(options.learner, settings.learner);
      if (!c.ok()) return c.status();
      settings.learner = *std::move(c);
    }
  } else {
    absl::StatusOr<distill::DistillConfig> c =
        distill::PresetDistillConfig(options.learner.empty() ? "akd" : options.learner);
    if (!c.ok()) return c.status();
    settings.learner = *std::move(c);
  }
  if (options.max_steps > 0) settings.job.max_steps = options.max_steps;
  if (options.time_budget_s > 0) settings.job.time_budget_s = options.time_budget_s;
  if (options.batch_size > 0) settings.job.batch_size = options.batch_size;
  if (options.max_answer_tokens > 0) settings.job.max_answer_tokens = options.max_answer_tokens;
  if (options.torch_threads > 0) settings.job.num_threads = options.torch_threads;
  return settings;
}

namespace {

class FamilyMirrorTrainer final : public MirrorTrainer {
 public:
  static absl::StatusOr<std::unique_ptr<MirrorTrainer>> Create(
      const PerDeviceStrategyOptions& options) {
    auto t = std::unique_ptr<FamilyMirrorTrainer>(new FamilyMirrorTrainer());
    absl::StatusOr<distill::DistillSettings> settings = JobSettings(options);
    if (!settings.ok()) return settings.status();
    t->settings_ = *std::move(settings);
    absl::StatusOr<model::Precision> precision = model::ParsePrecision(options.student_precision);
    if (!precision.ok()) return precision.status();
    try {
      absl::StatusOr<model::FamilyCheckpoint> family =
          model::LoadFamily(options.checkpoint_dir, *precision);
      if (!family.ok()) return family.status();
      t->fingerprint_ = model::BaseFingerprint(family->student);
      t->vision_fingerprint_ = model::ModuleFingerprint(*family->encoder);
      // The mirror computes with the device's base exactly: its dequantized weights.
      absl::StatusOr<model::Blip2Tower> mirror =
          model::ConvertPrecision(family->student, model::Precision::kFp32);
      if (!mirror.ok()) return mirror.status();
      t->student_base_ = *mirror;
      t->student_base_->eval();
      t->teacher_ = family->teacher;
      t->teacher_->eval();
      if (options.train_device == "cuda" && torch::cuda::is_available()) {
        t->train_device_ = torch::Device(torch::kCUDA, 0);
        t->teacher_->to(t->train_device_);
      }
      for (const auto& [name, p] : model::TrainableParameters(*family->student)) {
        t->base_trainable_.emplace_back(name, p.detach().to(torch::kFloat).contiguous().clone());
      }
      const model::FamilyConfig& config = family->config;
      int text_budget = 1 << 30;
      for (const model::TowerConfig* tower : {&config.teacher, &config.student}) {
        text_budget = std::min(text_budget, tower->max_positions - tower->num_queries);
      }
      SampleSpec& spec = t->spec_;
      // What the learner's sample pool takes (distill/sample_batch.h): the student tower's
      // visual token count and width, which the family copies from its vision config.
      const model::TowerConfig& student = config.student;
      spec.grid_tokens = static_cast<uint32_t>(
          student.num_visual_tokens > 0 ? student.num_visual_tokens : config.vision.NumTokens());
      spec.feature_dim =
          static_cast<uint32_t>(student.d_vis > 0 ? student.d_vis : config.vision.d_vis);
      spec.vocab_size = static_cast<uint32_t>(std::max(0, config.vocab_size));
      // A prompt leaves room for the longest answer the teacher generates as a label.
      spec.max_answer_tokens = static_cast<uint32_t>(std::clamp(text_budget, 1, 128));
      spec.max_prompt_tokens = static_cast<uint32_t>(
          std::clamp(text_budget - t->settings_.job.max_answer_tokens, 1, 512));
      spec.max_samples_per_batch = options.max_samples_per_batch;
      spec.max_decoded_bytes_per_batch = options.max_decoded_bytes_per_batch;
    } catch (const c10::Error& e) {
      return absl::InternalError(
          absl::StrCat("loading ", options.checkpoint_dir, ": ", e.what_without_backtrace()));
    }
    return std::unique_ptr<MirrorTrainer>(std::move(t));
  }

  const compress::NamedTensors& base_trainable() const override { return base_trainable_; }
  uint64_t base_fingerprint() const override { return fingerprint_; }
  uint64_t vision_fingerprint() const override { return vision_fingerprint_; }
  const SampleSpec& spec() const override { return spec_; }

  absl::StatusOr<MirrorJob> Train(const std::string& device_id,
                                  const compress::NamedTensors& mirror,
                                  const std::vector<compress::UplinkSample>& samples,
                                  distill::ReplayBuffer* replay, uint64_t version) override {
    // The job's own student: the shared base plus this device's mirror.
    absl::StatusOr<model::Blip2Tower> work = distill::CopyMllm(student_base_, train_device_);
    if (!work.ok()) return work.status();
    if (absl::Status s = compress::CopyInto(mirror, model::TrainableParameters(**work)); !s.ok()) {
      return s;
    }
    distill::Learner* learner = nullptr;
    {
      absl::MutexLock lock(&mu_);
      std::unique_ptr<distill::Learner>& l = learners_[device_id];
      if (l == nullptr) l = std::make_unique<distill::DistillLearner>(teacher_, settings_.learner);
      learner = l.get();
    }
    distill::JobOptions job = settings_.job;
    job.train_in_place = true;
    job.use_cuda = train_device_.is_cuda();
    job.seed = settings_.job.seed ^ (version * 0x9e3779b97f4a7c15ull);
    absl::StatusOr<distill::JobResult> result = learner->Run(samples, replay, *work, job);
    if (!result.ok()) return result.status();
    MirrorJob out;
    out.trainable = std::move(result->trainable);
    out.stats = std::move(result->stats);
    return out;
  }

  void Forget(const std::string& device_id) override {
    absl::MutexLock lock(&mu_);
    learners_.erase(device_id);
  }

  absl::StatusOr<std::vector<std::string>> TeacherAnswers(
      const std::vector<const compress::UplinkSample*>& samples) override {
    return Answers(teacher_, samples);
  }

  absl::StatusOr<std::vector<std::string>> StudentAnswers(
      const compress::NamedTensors& mirror,
      const std::vector<const compress::UplinkSample*>& samples) override {
    try {
      absl::StatusOr<model::Blip2Tower> student = distill::CopyMllm(student_base_, train_device_);
      if (!student.ok()) return student.status();
      if (absl::Status s = compress::CopyInto(mirror, model::TrainableParameters(**student));
          !s.ok()) {
        return s;
      }
      return Answers(*student, samples);
    } catch (const c10::Error& e) {
      return absl::InternalError(
          absl::StrCat("the student's answers: ", e.what_without_backtrace()));
    }
  }

 private:
  FamilyMirrorTrainer() = default;

  // `tower`'s greedy answers as the job's labels are made (distill::GreedyAnswers on the
  // samples' kept tokens), each as its token ids in decimal.
  absl::StatusOr<std::vector<std::string>> Answers(
      model::Blip2Tower& tower, const std::vector<const compress::UplinkSample*>& samples) {
    std::vector<std::string> out;
    if (samples.empty()) return out;
    try {
      const model::TowerConfig& config = student_base_->config();
      absl::StatusOr<distill::SamplePool> pool =
          distill::BuildSamplePool(samples, config.num_visual_tokens, config.d_vis);
      if (!pool.ok()) return pool.status();
      for (const std::vector<int64_t>& ids : distill::GreedyAnswers(tower, *pool, settings_.job)) {
        out.push_back(absl::StrJoin(ids, " "));
      }
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("greedy answers: ", e.what_without_backtrace()));
    }
    return out;
  }

  distill::DistillSettings settings_;
  model::Blip2Tower teacher_{nullptr};
  model::Blip2Tower student_base_{nullptr};  // fp32 with the devices' dequantized base
  torch::Device train_device_{torch::kCPU};
  compress::NamedTensors base_trainable_;
  uint64_t fingerprint_ = 0;
  uint64_t vision_fingerprint_ = 0;
  SampleSpec spec_;
  absl::Mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<distill::Learner>> learners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<MirrorTrainer>> CreateFamilyMirrorTrainer(
    const PerDeviceStrategyOptions& options) {
  return FamilyMirrorTrainer::Create(options);
}

}  // namespace cdcca::cloud::internal
