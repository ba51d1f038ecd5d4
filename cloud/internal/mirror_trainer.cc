// MirrorTrainer (cloud/internal/mirror_trainer.h): AKD on a teacher-student
// pair (distill/pair_distiller.h), one PairDistiller per device over one shared teacher and
// student.
#include "cloud/internal/mirror_trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <unordered_map>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "compress/named_tensors.h"
#include "distill/greedy_answers.h"
#include "distill/pair_distiller.h"
#include "distill/pair_side.h"
#include "model/arch/answerer.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/adapter_state.h"
#include "model/runtime/threads.h"
#include "model/tokenizer/tokenizer.h"

namespace cdcca::cloud::internal {
namespace {

// A sample of tokens where the student's vision tower trains (lora_vision): it cannot train
// the tower, and a batch feeds the student frames or tokens, not both.
absl::Status TokensCannotTrainTheTower(const compress::UplinkSample& s) {
  return absl::InvalidArgumentError(absl::StrCat(
      "sample ", s.sample_id,
      " carries tokens, but the cloud trains the student's vision tower (--lora_vision), which "
      "learns from frames: uplink frames (--uplink_precision=jpeg)"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MirrorTrainer>> MirrorTrainer::Create(
    const PerDeviceStrategyOptions& options) {
  if (options.teacher_dir.empty() || options.student_base_dir.empty()) {
    return absl::InvalidArgumentError(
        "a Hugging Face pair needs both the teacher's and the student's folder");
  }
  auto t = std::unique_ptr<MirrorTrainer>(new MirrorTrainer());
  absl::StatusOr<distill::DistillSettings> settings = JobSettings(options);
  if (!settings.ok()) return settings.status();
  t->settings_ = *std::move(settings);
  t->max_jobs_together_ = std::max<size_t>(1, options.max_jobs_together);
  const bool cuda = options.train_device == "cuda" && torch::cuda::is_available();
  const std::string device = cuda ? "cuda" : "cpu";
  // Process-wide: the program that trains sets its LibTorch threads here (docs/ARCHITECTURE.md,
  // "Threads"); the jobs' own CPU work runs on them.
  model::SetIntraOpThreads(t->settings_.job.num_threads);
  std::string teacher_precision = options.teacher_precision;
  if (teacher_precision.empty()) teacher_precision = cuda ? "bf16" : "fp32";
  t->adapters_.lora_rank = options.lora_rank;
  t->adapters_.lora_alpha = options.lora_alpha;
  t->adapters_.lora_mlp = options.lora_mlp;
  t->adapters_.lora_qformer = options.lora_qformer;
  t->adapters_.lora_projector = options.lora_projector;
  t->adapters_.lora_vision = options.lora_vision;
  try {
    // The teacher's tower must be the devices' (Register compares these).
    absl::StatusOr<uint64_t> teacher_vision = model::TowerFingerprint(options.teacher_dir);
    if (!teacher_vision.ok()) return teacher_vision.status();
    absl::StatusOr<uint64_t> student_vision = model::TowerFingerprint(options.student_base_dir);
    if (!student_vision.ok()) return student_vision.status();
    if (*teacher_vision != *student_vision) {
      return absl::FailedPreconditionError(
          absl::StrCat("the teacher ", options.teacher_dir, " and the student ",
                       options.student_base_dir, " have different vision towers (fingerprints ",
                       absl::Hex(*teacher_vision, absl::kZeroPad16), " and ",
                       absl::Hex(*student_vision, absl::kZeroPad16),
                       "): a pair must share the tower, whose tokens the devices uplink"));
    }
    t->vision_fingerprint_ = *teacher_vision;
    absl::StatusOr<std::unique_ptr<model::Answerer>> teacher =
        model::Answerer::Load(options.teacher_dir, teacher_precision, device);
    if (!teacher.ok()) return teacher.status();
    t->teacher_ = *std::move(teacher);
    absl::StatusOr<std::unique_ptr<model::Answerer>> student =
        model::Answerer::Load(options.student_base_dir, options.student_precision, device);
    if (!student.ok()) return student.status();
    t->student_ = *std::move(student);
    if (absl::Status s = t->student_->model().AddAdapters(t->adapters_); !s.ok()) return s;
    if (!cuda) {
      t->base_trainable_ = compress::Fp32Clones(t->student_->model().TrainableParameters());
    } else {
      // The devices run on the CPU in fp32: their version 0 is a CPU load's trainable set,
      // not the CUDA copy's (bf16) rounding of it.
      absl::StatusOr<std::unique_ptr<model::Answerer>> cpu =
          model::Answerer::Load(options.student_base_dir, "int4", "cpu");
      if (!cpu.ok()) return cpu.status();
      if (absl::Status s = (*cpu)->model().AddAdapters(t->adapters_); !s.ok()) return s;
      t->base_trainable_ = compress::Fp32Clones((*cpu)->model().TrainableParameters());
    }
    absl::StatusOr<uint64_t> folder = model::FolderFingerprint(options.student_base_dir);
    if (!folder.ok()) return folder.status();
    t->fingerprint_ =
        model::StudentBaseFingerprint(*folder, options.student_precision, t->adapters_,
                                      compress::StateDigest(t->base_trainable_));
    absl::StatusOr<model::PromptFormat> teacher_template = model::ResolvePromptFormat(
        options.teacher_template, t->teacher_->model_type(), options.teacher_dir);
    if (!teacher_template.ok()) return teacher_template.status();
    absl::StatusOr<model::PromptFormat> student_template = model::ResolvePromptFormat(
        options.student_template, t->student_->model_type(), options.student_base_dir);
    if (!student_template.ok()) return student_template.status();
    t->teacher_side_ = distill::PairSideOf(*t->teacher_, options.teacher_dir, *teacher_template);
    t->student_side_ =
        distill::PairSideOf(*t->student_, options.student_base_dir, *student_template);
    // A student that trains its vision side runs its tower on each frame; the teacher reads
    // its own tower's tokens (TokensOfFrame).
    t->student_side_.reads_pixels = options.lora_vision;
    const auto [n, d] = t->student_->model().VisualTokenShape();
    SampleSpec& spec = t->spec_;
    spec.grid_tokens = static_cast<uint32_t>(n);
    spec.feature_dim = static_cast<uint32_t>(d);
    // Frames (the jpeg uplink) where the processor's output size is fixed.
    if (absl::StatusOr<std::pair<int, int>> size = t->student_->TowerInputSize(); size.ok()) {
      spec.frame_width = static_cast<uint32_t>(size->first);
      spec.frame_height = static_cast<uint32_t>(size->second);
    }
    spec.frames_only = options.lora_vision;
    spec.vocab_size = static_cast<uint32_t>(t->student_->tokenizer().VocabSize());
    spec.max_answer_tokens = 128;
    // The question alone (no template); InstructBLIP's Q-Former reads it with absolute
    // positions, so a bound well inside those keeps every stored batch trainable.
    spec.max_prompt_tokens = 256;
    spec.max_samples_per_batch = options.max_samples_per_batch;
    spec.max_decoded_bytes_per_batch = options.max_decoded_bytes_per_batch;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("loading the pair ", options.teacher_dir, " / ",
                                            options.student_base_dir, ": ",
                                            e.what_without_backtrace()));
  }
  return t;
}

const compress::NamedTensors& MirrorTrainer::base_trainable() const { return base_trainable_; }
uint64_t MirrorTrainer::base_fingerprint() const { return fingerprint_; }
uint64_t MirrorTrainer::vision_fingerprint() const { return vision_fingerprint_; }
const SampleSpec& MirrorTrainer::spec() const { return spec_; }

absl::StatusOr<TrainedSet> MirrorTrainer::Train(const std::string& device_id,
                                                const compress::NamedTensors& mirror,
                                                const std::vector<compress::UplinkSample>& samples,
                                                distill::ReplayBuffer* replay, uint64_t version) {
  (void)version;
  TrainRequest me;
  me.job = {device_id, &mirror, &samples, replay};
  {
    absl::MutexLock queue(&queue_mu_);
    waiting_.push_back(&me);
  }
  // One student model serves every device: one group of jobs at a time. The call that gets
  // the model first runs its own job and those waiting behind it.
  absl::MutexLock lock(&mu_);
  std::vector<TrainRequest*> group;
  {
    absl::MutexLock queue(&queue_mu_);
    if (me.done) return std::move(me.result);
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &me));
    group.push_back(&me);
    while (group.size() < max_jobs_together_ && !waiting_.empty()) {
      group.push_back(waiting_.front());
      waiting_.pop_front();
    }
  }
  std::vector<DeviceJob> jobs;
  for (const TrainRequest* r : group) jobs.push_back(r->job);
  std::vector<absl::StatusOr<TrainedSet>> results = TrainGroup(jobs);
  {
    absl::MutexLock queue(&queue_mu_);
    for (size_t g = 0; g < group.size(); ++g) {
      group[g]->result = std::move(results[g]);
      group[g]->done = true;
    }
  }
  return std::move(me.result);
}

std::vector<absl::StatusOr<TrainedSet>> MirrorTrainer::TrainTogether(
    const std::vector<DeviceJob>& jobs) {
  absl::MutexLock lock(&mu_);
  return TrainGroup(jobs);
}

// Each device's job: its samples as the pair reads them (this round's, then replayed ones at
// the job's replay share), then one distill::PairDistiller::RunTogether over those with any.
std::vector<absl::StatusOr<TrainedSet>> MirrorTrainer::TrainGroup(
    const std::vector<DeviceJob>& group) {
  std::vector<absl::StatusOr<TrainedSet>> out(group.size(), absl::UnknownError("not run"));
  std::vector<std::vector<distill::PairSample>> jobs(group.size());
  std::vector<TrainedSet> sets(group.size());
  std::vector<int64_t> current(group.size(), 0);
  std::vector<distill::PairJobInput> inputs;
  std::vector<size_t> of_input;
  for (size_t g = 0; g < group.size(); ++g) {
    const DeviceJob& r = group[g];
    std::unique_ptr<distill::PairDistiller>& distiller = distillers_[r.device_id];
    if (distiller == nullptr) {
      absl::StatusOr<std::unique_ptr<distill::PairDistiller>> created =
          distill::PairDistiller::Create(teacher_side_, student_side_, settings_.learner,
                                         settings_.job);
      if (!created.ok()) {
        out[g] = created.status();
        continue;
      }
      distiller = *std::move(created);
    }
    const std::vector<compress::UplinkSample>& samples = *r.samples;
    std::vector<const compress::UplinkSample*> chosen;
    for (const compress::UplinkSample& s : samples) chosen.push_back(&s);
    const double f = settings_.job.replay_fraction;
    if (r.replay != nullptr && r.replay->size() > 0 && f > 0 && f < 1) {
      const auto want = static_cast<size_t>(std::ceil(samples.size() * f / (1.0 - f)));
      for (const compress::UplinkSample* s : r.replay->Draw(want)) chosen.push_back(s);
    }
    // A sample that does not become one the pair trains on (a frame that does not decode)
    // is left out: this round's are listed as rejected, replayed ones (used before) dropped.
    jobs[g].reserve(chosen.size());
    for (size_t i = 0; i < chosen.size(); ++i) {
      absl::StatusOr<distill::PairSample> h = JobSample(*chosen[i]);
      if (!h.ok()) {
        if (i < samples.size()) sets[g].rejected.emplace_back(i, h.status());
        continue;
      }
      if (i < samples.size()) ++current[g];
      jobs[g].push_back(*std::move(h));
    }
    if (current[g] == 0) {
      out[g] = std::move(sets[g]);
      continue;
    }
    inputs.push_back({distiller.get(), r.mirror, &jobs[g]});
    of_input.push_back(g);
  }
  if (inputs.empty()) return out;
  std::vector<absl::StatusOr<distill::PairJobResult>> results =
      distill::PairDistiller::RunTogether(inputs);
  for (size_t k = 0; k < results.size(); ++k) {
    const size_t g = of_input[k];
    if (!results[k].ok()) {
      out[g] = results[k].status();
      continue;
    }
    TrainedSet& set = sets[g];
    set.stats = std::move(results[k]->stats);
    set.stats.current_samples = current[g];
    set.stats.replay_samples = static_cast<int64_t>(jobs[g].size()) - current[g];
    set.notes = std::move(results[k]->notes);
    set.trainable = std::move(results[k]->trainable);
    out[g] = std::move(set);
  }
  return out;
}

// An uplinked sample as the job reads it. A jpeg sample is complete: the teacher labels it
// from every token of its frame, and the student trains on all of them too, since the
// device answers from all of them (a student taught all-token labels from only the kept
// tokens does worse: docs/RESULTS.md, "A teacher that sees what it labels").
// With the vision side trainable (lora_vision) the sample also carries the frame's pixel
// values, which the student's own tower reads, and a sample of tokens is refused: it cannot
// train the tower, and a batch feeds the student frames or tokens, not both.
absl::StatusOr<distill::PairSample> MirrorTrainer::JobSample(const compress::UplinkSample& s) {
  if (s.frame.empty()) {
    if (adapters_.lora_vision) return TokensCannotTrainTheTower(s);
    return distill::SampleFromUplink(s, student_side_);
  }
  absl::StatusOr<std::vector<float>> tokens = TokensOfFrame(s);
  if (!tokens.ok()) return tokens.status();
  compress::UplinkSample all = s;  // every token of the frame present
  all.frame.clear();
  all.kept_indices.resize(s.grid_tokens);
  std::iota(all.kept_indices.begin(), all.kept_indices.end(), uint16_t{0});
  all.features = *std::move(tokens);
  absl::StatusOr<distill::PairSample> h = distill::SampleFromUplink(all, student_side_);
  if (!h.ok()) return h;
  h->complete = true;
  if (adapters_.lora_vision) {
    absl::StatusOr<torch::Tensor> px =
        distill::FramePixels(*student_, s.frame, absl::StrCat("the frame of sample ", s.sample_id));
    if (!px.ok()) return px.status();
    h->pixels = *std::move(px);
  }
  return h;
}

absl::Status MirrorTrainer::CheckSample(const compress::UplinkSample& s) const {
  if (s.frame.empty()) {
    return adapters_.lora_vision ? TokensCannotTrainTheTower(s) : absl::OkStatus();
  }
  return student_->DecodeTowerFrame(s.frame, absl::StrCat("the frame of sample ", s.sample_id))
      .status();
}

absl::StatusOr<std::vector<std::string>> MirrorTrainer::TeacherAnswers(
    const std::vector<const compress::UplinkSample*>& samples, std::vector<double>* entropies) {
  absl::MutexLock lock(&mu_);
  return Answers(teacher_side_, samples, entropies);
}

absl::StatusOr<std::vector<std::string>> MirrorTrainer::StudentAnswers(
    const compress::NamedTensors& mirror,
    const std::vector<const compress::UplinkSample*>& samples) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = HoldStudentState(mirror, "the mirror"); !s.ok()) return s;
  return Answers(student_side_, samples);
}

// The shared student takes `state` as its trainable set (a job copies its own in).
absl::Status MirrorTrainer::HoldStudentState(const compress::NamedTensors& state,
                                             const char* what) {
  try {
    return compress::CopyInto(state, student_->model().TrainableParameters());
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what_without_backtrace()));
  }
}

absl::StatusOr<std::vector<double>> MirrorTrainer::TeacherProbabilities(
    const std::vector<const compress::UplinkSample*>& samples,
    const std::vector<std::string>& answers) {
  absl::MutexLock lock(&mu_);
  return Probabilities(teacher_side_, samples, answers, "the teacher's probabilities");
}

absl::StatusOr<std::vector<double>> MirrorTrainer::BaseProbabilities(
    const std::vector<const compress::UplinkSample*>& samples,
    const std::vector<std::string>& answers) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = HoldStudentState(base_trainable(), "the base"); !s.ok()) return s;
  return Probabilities(student_side_, samples, answers, "the base's probabilities");
}

absl::StatusOr<std::vector<double>> MirrorTrainer::Probabilities(
    const distill::PairSide& side, const std::vector<const compress::UplinkSample*>& samples,
    const std::vector<std::string>& answers, const char* what) {
  if (answers.size() != samples.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(answers.size(), " answers for ", samples.size(), " samples"));
  }
  std::vector<double> out;
  out.reserve(samples.size());
  try {
    side.model->module().eval();
    absl::Status st = InBatches(samples, [&](const std::vector<const distill::PairSample*>& part,
                                             size_t begin) {
      absl::StatusOr<std::vector<double>> p = distill::AnswerProbabilities(
          side, part,
          std::vector<std::string>(answers.begin() + begin, answers.begin() + begin + part.size()));
      if (!p.ok()) return p.status();
      out.insert(out.end(), p->begin(), p->end());
      return absl::OkStatus();
    });
    if (!st.ok()) return st;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what_without_backtrace()));
  }
  return out;
}

// `side`'s greedy answers to the samples as the job reads them (every token of a frame, as
// the device answered it): the decoded text, lower-cased (the teacher's and the
// student's tokenizers may differ in case handling); `entropies` (optional) receives each
// answer's mean token entropy.
absl::StatusOr<std::vector<std::string>> MirrorTrainer::Answers(
    const distill::PairSide& side, const std::vector<const compress::UplinkSample*>& samples,
    std::vector<double>* entropies) {
  std::vector<std::string> out;
  if (entropies != nullptr) entropies->clear();
  try {
    side.model->module().eval();
    absl::Status st =
        InBatches(samples, [&](const std::vector<const distill::PairSample*>& part, size_t) {
          std::vector<double> part_entropies;
          absl::StatusOr<std::vector<std::string>> texts =
              distill::GreedyAnswers(side, part, settings_.job.max_answer_tokens, nullptr,
                                     entropies != nullptr ? &part_entropies : nullptr);
          if (!texts.ok()) return texts.status();
          for (const std::string& text : *texts) out.push_back(absl::AsciiStrToLower(text));
          if (entropies != nullptr) {
            entropies->insert(entropies->end(), part_entropies.begin(), part_entropies.end());
          }
          return absl::OkStatus();
        });
    if (!st.ok()) return st;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("greedy answers: ", e.what_without_backtrace()));
  }
  return out;
}

// `run` over the samples as the job reads them (JobSample), a training batch's worth at a time,
// with the index of each batch's first sample in `samples`: the guard's greedy and
// teacher-forced passes take a batch each.
absl::Status MirrorTrainer::InBatches(
    const std::vector<const compress::UplinkSample*>& samples,
    const std::function<absl::Status(const std::vector<const distill::PairSample*>&, size_t)>&
        run) {
  const size_t chunk = static_cast<size_t>(std::max(1, settings_.job.batch_size));
  for (size_t begin = 0; begin < samples.size(); begin += chunk) {
    const size_t end = std::min(samples.size(), begin + chunk);
    std::vector<distill::PairSample> held;
    held.reserve(end - begin);
    for (size_t i = begin; i < end; ++i) {
      absl::StatusOr<distill::PairSample> h = JobSample(*samples[i]);
      if (!h.ok()) return h.status();
      held.push_back(*std::move(h));
    }
    std::vector<const distill::PairSample*> part;
    for (const distill::PairSample& h : held) part.push_back(&h);
    if (absl::Status st = run(part, begin); !st.ok()) return st;
  }
  return absl::OkStatus();
}

// A jpeg sample's tokens: the student's tower (the pair's, the devices') on the decoded
// frame, grid_tokens x feature_dim values row by row. Where the student's tower trains
// (lora_vision) it is the mirror's, not the pair's: the teacher's own tower gives them.
absl::StatusOr<std::vector<float>> MirrorTrainer::TokensOfFrame(const compress::UplinkSample& s) {
  const std::string source = absl::StrCat("the frame of sample ", s.sample_id);
  model::Answerer& tower = adapters_.lora_vision ? *teacher_ : *student_;
  absl::StatusOr<model::VisualTokenReply> tokens = tower.TowerTokensOfJpeg(s.frame, source);
  if (!tokens.ok()) return tokens.status();
  if (tokens->tokens != s.grid_tokens || tokens->dim != s.feature_dim) {
    return absl::InvalidArgumentError(absl::StrCat(source, " gives ", tokens->tokens, "x",
                                                   tokens->dim, " tokens, but it says ",
                                                   s.grid_tokens, "x", s.feature_dim));
  }
  return std::move(tokens->features);
}

void MirrorTrainer::Forget(const std::string& device_id) {
  absl::MutexLock lock(&mu_);
  distillers_.erase(device_id);
}

}  // namespace cdcca::cloud::internal
