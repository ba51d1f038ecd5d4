// The adaptation experiment (`cdcca adapt-eval`): one cloud round, offline, on benchmark
// scenes. It answers the two questions the AKD and UTS issues leave to measurement:
//   - does AKD raise the student's accuracy on a shifted domain more than pseudo-label-only
//     training (and what does each of its loss terms contribute)?
//   - how much of the gain that the cloud gets from all visual tokens does it still get
//     from the UTS-selected half, and does UTS beat random tokens at the same ratio?
//
// This header defines the experiment: its options and arms, the scenes, how an arm builds
// its uplink from what the device observed, and the report. sim/adapt_eval_pair.h runs it on
// a teacher-student pair.
//
// Thread-safety: plain values; the functions are pure but GenerateAdaptScenes (which uses
// LibTorch's intra-op pool) and BuildArmUplink (which runs `step`).
#ifndef CDCCA_SIM_ADAPT_EVAL_H_
#define CDCCA_SIM_ADAPT_EVAL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/uplink_codec.h"
#include "datasets/domain.h"
#include "device/sample_step.h"
#include "distill/akd.h"
#include "distill/job.h"

namespace cdcca::sim {

// How an arm picks the visual tokens of each uplinked sample.
enum class TokenSelection { kAll, kUts, kRandom };

struct UplinkArm {
  std::string name;  // "all", "uts-attention_cv-50", "random-50"
  TokenSelection selection = TokenSelection::kAll;
  float token_ratio = 1.0f;  // fraction of the grid kept (kUts, kRandom)
  std::string score;         // the stage-2 token score's name (kUts)
  // The teacher labels each sample from all its tokens while the student trains on the kept
  // ones (distill/pair_distiller.h PairSample::complete).
  bool teacher_all_tokens = false;
  // The job trains on each question's ground-truth answer (the most frequent of its direct
  // answers) instead of the teacher's: the ceiling of the trainable set without label noise.
  // A benchmark question without answers refuses the arm (InvalidArgument).
  bool ground_truth = false;
};

// The answer the ground-truth arm trains on: the most frequent of `direct_answers` (the first
// of the most frequent on a tie). InvalidArgument naming `what` when there is none.
absl::StatusOr<std::string> GroundTruthAnswer(const std::vector<std::string>& direct_answers,
                                              const std::string& what);

struct AdaptEvalOptions {
  std::string fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";
  std::string precision = "int8";  // the device student's base (the teacher's is the pair's)
  // Domains of the stream and the test scenes (their splits are forced to train / test).
  datasets::DomainSpec domain;
  int stream_scenes = 1000;  // 5 questions each = the samples the device answers
  int test_scenes = 300;
  // UTS as the device runs it (device/uts.h defaults).
  int mc_passes = 8;
  float dropout_p = 0.1f;
  // Stage 1: keep the samples whose entropy is at or above the (1 - keep_fraction) quantile
  // of the stream's entropies (device::KeepTopEntropies); 0 or 1 = keep every sample.
  float keep_fraction = 0.0f;
  std::vector<UplinkArm> arms;        // at least one; "all" is the reference of "recovered"
  std::vector<std::string> learners;  // distill::ParseLearnerSpec specs, at least one
  distill::JobOptions job;            // shared by every job (seed included)
  int max_answer_tokens = 6;          // device answers and evaluation
  uint64_t seed = 1;                  // scenes, dropout passes, random selection
  // Progress lines (stderr by default when null).
  std::function<void(const std::string&)> progress;
};

struct AdaptRow {
  std::string arm;
  std::string learner;
  int64_t samples = 0;     // uplinked samples in the job
  double tokens_kept = 0;  // mean fraction of visual tokens kept per sample
  // DA % of the teacher's answers on (up to 1000 of) the uplinked samples, from the kept
  // tokens only: how good the pseudo-labels of this arm are.
  double teacher_uplink_accuracy = 0;
  double accuracy = 0;   // DA %, adapted student on the test scenes
  double gain = 0;       // accuracy - source accuracy (points)
  double recovered = 0;  // gain / gain of arm "all" with the same learner, %; NaN if none
  std::vector<distill::LossTerm> terms;  // the job's loss terms
  double job_seconds = 0;
};

struct AdaptReport {
  std::string domain;
  double source_accuracy = 0;   // the device student before adaptation
  double teacher_accuracy = 0;  // the teacher, all tokens (an upper reference)
  // The same test questions on the scenes' clean images (the shift taken off): the
  // teacher's lead over the student there, against its lead under the shift, is the part of
  // the lead the shift makes, which adaptation to the shift can hope to recover.
  double clean_source_accuracy = 0;
  double clean_teacher_accuracy = 0;
  double device_accuracy_stream = 0;  // the student's own DA on the stream it uplinks from
  int64_t stream_samples = 0, stage1_samples = 0;
  int test_questions = 0;
  std::vector<AdaptRow> rows;
  std::string device;  // "cpu" / "cuda:0"

  // The rows as a Markdown table followed by each job's loss terms.
  std::string Markdown() const;
  // Every field, rows included, as an indented JSON object ("recovered": null for NaN).
  std::string Json() const;
};

// What the device computed on the stream, kept for building every arm's uplink.
struct StreamObservation {
  std::vector<compress::UplinkSample> samples;  // one per question, every token kept
  std::vector<int64_t> scene_of_sample;
  // Per score kind name: per scene, the N token scores.
  std::vector<std::pair<std::string, std::vector<std::vector<float>>>> scene_scores;
  int64_t num_tokens = 0;
};

// The uplink of one arm: the samples (all, or those `keep` marks: stage 1 decided over the
// whole stream by device::KeepTopEntropies) each through the device's step, `step`
// (device::SampleStep::Run), reconfigured for the arm with stage 1 off: every token (kAll),
// the top token_ratio by the observed scores (kUts), or token_ratio at random from the step's
// one generator, which goes on from arm to arm (kRandom). Features are the observation's
// (fp16-rounded, as the device sends them). INVALID_ARGUMENT for an unknown score or a ratio
// outside (0, 1]; the step's errors (a sample the codec refuses).
absl::StatusOr<std::vector<compress::UplinkSample>> BuildArmUplink(
    const StreamObservation& observation, const std::vector<bool>& keep, const UplinkArm& arm,
    device::SampleStep& step);

// The experiment's scenes: the shifted stream (train-split images, seed) and the held-out
// test scenes (test-split images, seed + 7919). Errors of the Fashion-MNIST loader and of
// the domain (INVALID_ARGUMENT).
struct AdaptScenes {
  std::vector<datasets::Sample> stream, test;
};
absl::StatusOr<AdaptScenes> GenerateAdaptScenes(const AdaptEvalOptions& options);

// The learners the options name (distill::ParseLearnerSpec), after checking what every run needs:
// an arm and a learner, scenes >= 1, mc_passes 1-64, dropout_p in [0, 1). InvalidArgument
// otherwise.
absl::StatusOr<std::vector<distill::DistillConfig>> CheckAdaptEvalOptions(
    const AdaptEvalOptions& options);

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_ADAPT_EVAL_H_
