// The one interface behind which every adaptation method runs: AKD and the cloud-side
// baselines (pseudo-label only, PKD, channel-wise divergence) in distill/akd.h, and the
// device-side baselines TENT and CoTTA in distill/baselines/. A job takes the samples a
// device uplinked (plus replayed ones from earlier rounds), trains the student's adapter set
// within a step or time budget, and returns the new trainable state and statistics.
//
// Where the job trains: by default on a private copy of the student (on CUDA when
// available), so the cloud's student mirror, which must keep equalling the device's state
// until the DWC update is applied, is never touched and may serve concurrent readers. With
// train_in_place (device-side adaptation, tests) the given student itself is trained on its
// own device.
//
// Thread-safety: a Learner is not thread-safe (it may keep state across jobs: AKD's
// projections, CoTTA's EMA teacher); run one job per learner at a time. torch's intra-op
// thread count is process-wide and a job sets it.
#ifndef CDCCA_DISTILL_LEARNER_H_
#define CDCCA_DISTILL_LEARNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/uplink_codec.h"
#include "distill/replay_buffer.h"
#include "distill/sample_batch.h"
#include "model/family/blip2_tower.h"
#include "model/family/trainable.h"

namespace cdcca::distill {

// Averages gradients across the ranks of a data-parallel job (distill/data_parallel.h
// implements it over c10d). Called once per step with every trained gradient, in the same
// order on every rank; replaces each tensor's values with the mean over ranks.
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  virtual absl::Status AllReduceMean(std::vector<torch::Tensor>& gradients) = 0;
};

struct JobOptions {
  int max_steps = 200;         // 0 = no step bound (time_budget_s must then be > 0)
  double time_budget_s = 0.0;  // wall-clock seconds of the training loop; 0 = no bound
  int batch_size = 16;
  double lr = 1e-3;           // AdamW
  double weight_decay = 0.0;  // AdamW's decoupled decay
  uint64_t seed = 0;          // batch order, replay draws, dropout, augmentations
  // Share of each batch drawn from replayed samples (when a replay buffer is given and
  // holds samples). In [0, 1). Default: 0.25.
  double replay_fraction = 0.25;
  int num_threads = 0;   // torch intra-op threads; 0 = automatic (model/threads.h)
  bool use_cuda = true;  // train on CUDA when available (ignored with train_in_place)
  bool train_in_place = false;
  bool student_dropout = false;  // train the student with its config dropout on
  int max_answer_tokens = 6;     // greedy pseudo-label / self-label length bound
  int64_t eos_id = 2;            // datasets::Tokenizer::kEos
  int64_t pad_id = 0;            // datasets::Tokenizer::kPad
  // Data parallelism: this process's rank and the world size. Every rank draws the same
  // global batch of batch_size samples and computes the loss on its contiguous slice
  // (batch_size must divide by world_size); `reducer` (not owned, required when
  // world_size > 1) averages the gradients, so all ranks take the same step.
  int rank = 0;
  int world_size = 1;
  GradientReducer* reducer = nullptr;
};

// One loss term over a job: value at the first step, mean of the last min(10, steps) steps,
// and mean over all steps.
struct LossTerm {
  std::string name;
  double first = 0;
  double last = 0;
  double mean = 0;
};

// A term's LossTerm from its per-step values (at least one).
LossTerm SummarizeLossTerm(const std::string& name, const std::vector<double>& per_step);

struct JobStats {
  int steps = 0;
  int64_t samples_seen = 0;     // summed batch sizes (this rank)
  int64_t current_samples = 0;  // this round's samples in the job
  int64_t replay_samples = 0;   // replayed samples in the job
  double prepare_seconds = 0;   // teacher pass, projection fit
  double train_seconds = 0;
  double samples_per_second = 0;  // samples_seen / train_seconds
  std::vector<LossTerm> terms;    // "total" first, then the learner's terms
  std::string device;             // "cpu" or "cuda:0"
};

struct JobResult {
  // The student's whole trainable set after the job (model::TrainableParameters order),
  // fp32 contiguous CPU clones: what compress::DeltaEncoder / ApplyUpdate take.
  model::NamedTensors trainable;
  JobStats stats;
};

class Learner {
 public:
  virtual ~Learner() = default;

  // "akd", "pl", "pkd", "cwd", "tent", "cotta".
  virtual std::string name() const = 0;
  // True for the cloud learners that need a teacher.
  virtual bool uses_teacher() const = 0;

  // Runs one job on `samples` (at least one) and, if `replay` is non-null and non-empty,
  // replay_fraction of each batch from samples drawn from it (the buffer's generator
  // advances; the buffer is not changed otherwise - the caller Add()s the round's samples
  // after the job). Only the student's trainable set (or the learner's subset of it, e.g.
  // TENT's norms) and the learner's own parameters get gradients. Errors: INVALID_ARGUMENT
  // for bad options or samples that do not fit the student; INTERNAL for a LibTorch error.
  absl::StatusOr<JobResult> Run(const std::vector<compress::UplinkSample>& samples,
                                ReplayBuffer* replay, model::Blip2Tower& student,
                                const JobOptions& options);

 protected:
  using Terms = std::vector<std::pair<std::string, torch::Tensor>>;

  // The student parameters this learner trains. Default: the whole trainable set.
  virtual model::NamedTensors TrainedParameters(model::Blip2Tower& student);
  // Once per job before training; `pool` is on the job's device.
  virtual absl::Status Prepare(const SamplePool& pool, model::Blip2Tower& student,
                               const JobOptions& options) = 0;
  // Parameters owned by the learner that train alongside (AKD's phi and psi).
  virtual std::vector<torch::Tensor> ExtraParameters() { return {}; }
  // Loss terms of one batch (indices into the pool); the first is the total to minimise.
  virtual Terms Loss(const SamplePool& pool, const std::vector<int64_t>& batch,
                     model::Blip2Tower& student, const JobOptions& options) = 0;
  // After each optimizer step (CoTTA's EMA update and stochastic restore).
  virtual void AfterStep(model::Blip2Tower& student, const JobOptions& options) {}
};

// Makes a learner by name with default settings ("tent", "cotta"), or with `teacher` for
// the cloud learners ("akd", "pl", "pkd", "cwd"; see distill/akd.h for their configs).
// INVALID_ARGUMENT for an unknown name or a cloud learner without a teacher.
absl::StatusOr<std::unique_ptr<Learner>> MakeLearner(const std::string& name,
                                                     model::Blip2Tower teacher);

// A copy of `source` on `device` with parameters and buffers of its own (model::CopyTower;
// the packed weights of a quantized base are shared: nothing writes them).
absl::StatusOr<model::Blip2Tower> CopyMllm(model::Blip2Tower& source, torch::Device device);

// The device of a module's first parameter (CPU if it has none).
torch::Device ModuleDevice(const torch::nn::Module& module);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_LEARNER_H_
