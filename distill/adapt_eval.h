// The adaptation experiment (`cdcca adapt-eval`): one cloud round, offline, on benchmark
// scenes. It answers the two questions the AKD and UTS issues leave to measurement:
//   - does AKD raise the student's accuracy on a shifted domain more than pseudo-label-only
//     training (and what does each of its loss terms contribute)?
//   - how much of the gain that the cloud gets from all visual tokens does it still get
//     from the UTS-selected half, and does UTS beat random tokens at the same ratio?
//
// Steps: load a family; generate a stream of shifted scenes (train-split images) and
// held-out shifted test scenes (test-split images); run the device's student on the stream
// as the device runtime does (greedy answers, mean answer-token entropy, UTS stage-2 token
// scores from M stochastic passes, model::VisualTokenScores); build one uplink set per arm
// (all tokens, UTS top ratio per score kind, random at the same ratio; optionally only the
// samples that pass a stage-1 entropy quantile); run one cloud job per (arm, learner) from
// the same starting student mirror; evaluate each adapted student on the test scenes (DA,
// official VQA metric, every token present, as the device answers).
//
// Deterministic for a seed on CPU (CUDA kernels may differ in the last bits).
// Not thread-safe: sets torch's process-wide thread count and seed.
#ifndef CDCCA_DISTILL_ADAPT_EVAL_H_
#define CDCCA_DISTILL_ADAPT_EVAL_H_

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/uplink_codec.h"
#include "datasets/domain.h"
#include "distill/akd.h"
#include "distill/learner.h"

namespace cdcca::distill {

// How an arm picks the visual tokens of each uplinked sample.
enum class TokenSelection { kAll, kUts, kRandom };

struct UplinkArm {
  std::string name;  // "all", "uts-attention_cv-50", "random-50"
  TokenSelection selection = TokenSelection::kAll;
  float token_ratio = 1.0f;  // fraction of the grid kept (kUts, kRandom)
  std::string score;         // model::TokenScoreKind name (kUts)
  // The teacher labels each sample from all its tokens while the student trains on the kept
  // ones (distill/hf_akd.h HfSample::complete). Hugging Face pairs only
  // (sim/hub_adapt_eval.h).
  bool teacher_all_tokens = false;
};

// One learner of the experiment: a preset name with optional overrides, written
// "base[+key=value]...", e.g. "akd+l_query=0" or "akd+l_kl=0.5+temperature=2". Keys are
// DistillConfig fields as in configs/distill/*.json.
absl::StatusOr<DistillConfig> ParseLearnerSpec(const std::string& spec);

struct AdaptEvalOptions {
  std::string checkpoint_dir = "models/small";
  std::string fashion_mnist_dir = "/usr/share/datasets/fashion-mnist";
  std::string precision = "int8";  // the device student's base; the cloud mirror is its fp32
  // Domains of the stream and the test scenes (their splits are forced to train / test).
  datasets::DomainSpec domain;
  int stream_scenes = 1000;  // 5 questions each = the samples the device answers
  int test_scenes = 300;
  // UTS as the device runs it (device/uts.h defaults).
  int mc_passes = 8;
  float dropout_p = 0.1f;
  // Stage 1: keep the samples whose entropy is at or above the (1 - keep_fraction) quantile
  // of the stream's entropies; 0 or 1 = keep every sample.
  float keep_fraction = 0.0f;
  std::vector<UplinkArm> arms;        // at least one; "all" is the reference of "recovered"
  std::vector<std::string> learners;  // ParseLearnerSpec specs, at least one
  JobOptions job;                     // shared by every job (seed included)
  int max_answer_tokens = 6;          // device answers and evaluation
  uint64_t seed = 1;                  // scenes, dropout passes, random selection
  int threads = 0;                    // torch intra-op threads; 0 = automatic (1)
  bool force_cpu = false;
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
  double accuracy = 0;          // DA %, adapted student on the test scenes
  double gain = 0;              // accuracy - source accuracy (points)
  double recovered = 0;         // gain / gain of arm "all" with the same learner, %; NaN if none
  std::vector<LossTerm> terms;  // the job's loss terms
  double job_seconds = 0;
};

struct AdaptReport {
  std::string domain;
  double source_accuracy = 0;         // the device student before adaptation
  double teacher_accuracy = 0;        // the teacher, all tokens (an upper reference)
  double device_accuracy_stream = 0;  // the student's own DA on the stream it uplinks from
  int64_t stream_samples = 0, stage1_samples = 0;
  int test_questions = 0;
  std::vector<AdaptRow> rows;
  std::string device;  // "cpu" / "cuda:0"

  std::string Markdown() const;
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

// The uplink of one arm: the samples (all or the stage-1 ones, by `keep`) with their kept
// tokens. Features are the observation's (fp16-rounded, as the device sends them).
// INVALID_ARGUMENT for an unknown score or a ratio outside (0, 1].
absl::StatusOr<std::vector<compress::UplinkSample>> BuildArmUplink(
    const StreamObservation& observation, const std::vector<bool>& keep, const UplinkArm& arm,
    std::mt19937_64& rng);

// The experiment's scenes: the shifted stream (train-split images, seed) and the held-out
// test scenes (test-split images, seed + 7919). Errors of the Fashion-MNIST loader and of
// the domain (INVALID_ARGUMENT).
struct AdaptScenes {
  std::vector<datasets::Sample> stream, test;
};
absl::StatusOr<AdaptScenes> GenerateAdaptScenes(const AdaptEvalOptions& options);

// The samples that pass stage 1: entropy at or above the (1 - keep_fraction) quantile of
// all entropies (EntropyGate's rule over the whole stream as its window); every sample for
// a keep_fraction of 0 or 1.
std::vector<bool> Stage1Keep(const std::vector<compress::UplinkSample>& samples,
                             float keep_fraction);

// Top `ratio` of `scores` (ties to the lower index, at least one token), ascending: the
// rule of device::SelectTokens with every token present.
std::vector<uint16_t> TopTokens(const std::vector<float>& scores, float ratio);

// The learners the options name (ParseLearnerSpec), after checking what every run needs: an
// arm and a learner, scenes >= 1, mc_passes 1-64, dropout_p in [0, 1). InvalidArgument
// otherwise.
absl::StatusOr<std::vector<DistillConfig>> CheckAdaptEvalOptions(const AdaptEvalOptions& options);

// Runs the whole experiment. Errors: the loaders' (NOT_FOUND, DATA_LOSS), INVALID_ARGUMENT
// for bad options, INTERNAL for a LibTorch error.
absl::StatusOr<AdaptReport> RunAdaptEval(const AdaptEvalOptions& options);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_ADAPT_EVAL_H_
