// `cdcca adapt-eval` on a Hugging Face teacher-student pair (a cdcca family's folder is read
// as its BLIP-2 pair): the experiment of sim/adapt_eval.h on its benchmark scenes.
//
// The student (at the device's precision) answers every stream question from its vision
// tower's tokens (Answerer::AnswerRgbFromTokens: greedy, mean answer-token entropy) and,
// when a UTS arm asks for it, scores the tokens by VIS (the paper's Eq. 3 as
// model/arch/multimodal_model.h defines it, VisualTokenVarianceRgb, M passes as one batch); stage 1
// keeps the top keep_fraction of the stream by entropy (device::KeepTopEntropies), and each
// arm's tokens are those the device's step chooses (BuildArmUplink, device::SampleStep). Each
// (arm, learner) job starts from the
// same student state, runs the cloud's job (PairDistiller on SampleFromUplink of the arm's
// uplink: pseudo-labels as text, the KL only with identical tokenizers), and the adapted
// student answers the held-out test scenes; DA is the official VQA accuracy of its decoded
// answer against the scene's ten answers. The teacher's DA on an arm's uplink is that of its
// pseudo-labels.
//
// A teacher-all arm (UplinkArm::teacher_all_tokens, name "+teacher-all") gives the job
// complete samples (distill::CompleteHfSample: every token, the arm's kept ones present): the
// teacher labels from all tokens, the student trains on the kept ones. (Both on all tokens is
// the "all" arm, which is what the cloud does with an uplinked frame.)
//
// UTS arms score by VIS whatever score they name; an arm's name says "vis". Not thread-safe.
#ifndef CDCCA_SIM_HUB_ADAPT_EVAL_H_
#define CDCCA_SIM_HUB_ADAPT_EVAL_H_

#include <string>

#include "absl/status/statusor.h"
#include "model/arch/multimodal_model.h"
#include "sim/adapt_eval.h"

namespace cdcca::sim {

struct EvalPairOptions {
  std::string teacher_dir;
  std::string student_base_dir;    // the device's base; its precision is options.precision
  std::string teacher_precision;   // "" = bf16 on CUDA, fp32 on the CPU
  std::string teacher_template;    // prompt templates (model::ApplyPromptTemplate names);
  std::string student_template;    // "" = the model type's default
  std::string device = "cpu";      // "cpu" or "cuda" for both models
  model::AdapterOptions adapters;  // the student's trainable set
};

// Runs the experiment.
// Errors: FailedPrecondition for a pair whose vision towers differ; InvalidArgument for bad
// options (no arm, no learner, scenes < 1, unknown learner); the loaders' errors; Internal
// for a LibTorch error.
absl::StatusOr<AdaptReport> RunHubAdaptEval(const AdaptEvalOptions& options,
                                            const EvalPairOptions& pair);

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_HUB_ADAPT_EVAL_H_
