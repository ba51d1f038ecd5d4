// What every adaptation job shares: its options, its loss-term summaries and its statistics.
// The jobs themselves are distill::PairDistiller (AKD and the cloud baselines,
// distill/pair_distiller.h) and distill::SelfLearner (TENT and CoTTA on the device,
// distill/self_learner.h).
//
// Thread-safety: plain values; SummarizeLossTerm is pure.
#ifndef CDCCA_DISTILL_JOB_H_
#define CDCCA_DISTILL_JOB_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "settings/defaults.h"

namespace cdcca::distill {

struct JobOptions {
  // Defaults: the defaults table's (settings/defaults.h).
  int max_steps = settings::kMaxSteps;  // optimizer steps of a job, > 0
  int batch_size = settings::kBatchSize;
  double lr = settings::kLr;  // AdamW
  double weight_decay = 0.0;  // AdamW's decoupled decay
  uint64_t seed = 0;          // batch order, replay draws, dropout, augmentations
  // Share of each batch drawn from replayed samples (when a replay buffer is given and
  // holds samples). In [0, 1).
  double replay_fraction = settings::kReplayFraction;
  // Greedy pseudo-label / self-label length bound.
  int max_answer_tokens = settings::kMaxAnswerTokens;
  // Samples the teacher labels in one batch while a job prepares (0 = twice batch_size): one
  // greedy pass and one teacher-forced pass per chunk of them. Twice the training batch
  // measured faster than once at the LLaVA-1.5-13B / 7B shapes (docs/BENCHMARKS.md) and holds
  // less than a training step: the chunk's passes keep no activations for a backward pass.
  int prepare_batch = 0;
  // Wall-clock bound of the training loop in seconds (0 = none): a job stops after the first
  // step that ends past it, with at least one step (JobStats::stopped_by_budget). cdcca-cloud's
  // --time_budget_s overrides it.
  double time_budget_s = 0.0;
  // LibTorch intra-op threads (0 = automatic: model::IntraOpThreads). Process-wide: the cloud's
  // mirror trainer sets it when it is created (cdcca-cloud's --torch_threads overrides it).
  int num_threads = 0;
  // The last N steps of a job are timed phase by phase into JobStats::phases (0 = none), the
  // device synchronized at each phase's end: what a step's time is spent on (akd_bench
  // --phase_steps). Synchronizing costs those steps the overlap of the host's work with the
  // device's, so a timed job's samples/s is read with N = 0.
  int phase_steps = 0;
  // How the student's frozen base multiplies in the training steps (model::Fp8BaseScope,
  // model/runtime/fp8_product.h): "native" multiplies in FP8 where the GPU runs FP8 products
  // natively (compute capability 8.9+, LibTorch 2.5+) and plainly elsewhere; "on" multiplies in
  // FP8 everywhere, emulated off such a GPU (a CPU run's measure of what the rounding does to a
  // job; PairDistiller::Create refuses it on a GPU without native FP8); "off" never. Where FP8
  // runs on CUDA the trainer holds the base in FP8 for good (its passes outside the steps too:
  // the fit's, a guard's), in place of the bf16 copy; elsewhere the steps alone (cdcca-cloud's
  // --fp8_base, akd_bench's, adapt's; job key "fp8_base": one of the three, or true for "on"
  // and false for "off").
  std::string fp8_base = settings::kFp8Base;
  // Where a job trains is the program's choice (cdcca-cloud's --device), and the student trains
  // in eval() mode (no dropout): a settings file naming "use_cuda" or "student_dropout" is
  // refused with that explanation.
};

// One loss term over a job: value at the first step, mean of the last min(10, steps) steps,
// and mean over all steps.
struct LossTerm {
  std::string name;
  double first = 0;
  double last = 0;
  double mean = 0;
};

// OK when `mode` is a setting of JobOptions::fp8_base ("native", "on" or "off"), else
// INVALID_ARGUMENT naming `what` (the flag or key that gave it) and the three names.
absl::Status CheckFp8BaseMode(const std::string& mode, const std::string& what);

// Whether a training loop that started at `start` has used up options.time_budget_s (false
// without a budget).
bool PastBudget(const JobOptions& options, std::chrono::steady_clock::time_point start);

// Samples the teacher labels in one batch while a job prepares: options.prepare_batch, or
// twice batch_size where it is 0; at least 1.
int PrepareBatch(const JobOptions& options);

// A term's LossTerm from its per-step values (at least one).
LossTerm SummarizeLossTerm(const std::string& name, const std::vector<double>& per_step);

struct JobStats {
  int steps = 0;
  int64_t samples_seen = 0;     // summed batch sizes
  int64_t current_samples = 0;  // this round's samples in the job
  int64_t replay_samples = 0;   // replayed samples in the job
  double prepare_seconds = 0;   // teacher pass, projection fit
  double train_seconds = 0;
  double samples_per_second = 0;   // samples_seen / train_seconds
  std::vector<LossTerm> terms;     // "total" first, then the learner's terms
  std::string device;              // "cpu" or "cuda:0"
  bool stopped_by_budget = false;  // ended at JobOptions::time_budget_s before max_steps
  // Seconds per phase summed over the phase-timed steps (JobOptions::phase_steps), in step
  // order: "batch" (rows drawn, collated, copied to the device), "forward", "losses",
  // "backward", "optimizer".
  std::vector<std::pair<std::string, double>> phases;
  int phase_timed_steps = 0;
  // On CUDA, per phase the most GPU memory live tensors held at its end over the timed steps
  // (after "forward": the weights plus what autograd keeps for the backward pass).
  std::vector<std::pair<std::string, int64_t>> phase_allocated_bytes;
  // The preparation's seconds per phase where phases are timed: "greedy" (the teacher's
  // pseudo-labels), "forced" (its teacher-forced pass and what is kept of it), "fit" (the
  // feature projections' widths and ridge fit).
  std::vector<std::pair<std::string, double>> prepare_phases;
  // Wall seconds of each training step, up to its loss terms read back (which waits for the
  // device): where the first steps differ from the steady ones.
  std::vector<double> step_seconds;
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_JOB_H_
