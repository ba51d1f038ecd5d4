// Test-time adaptation on the device, on any model folder: the device-side baselines that
// need no teacher and no cloud, TENT and CoTTA, on the student's own trainable set
// (model::MultimodalModel::TrainableParameters, the set the cloud's updates change).
//
//   tent   (Wang et al. 2021, continual form) The student answers each sample greedily and,
//          teacher-forced on its own answer, minimises the mean entropy of its next-token
//          distributions at the answer positions, updating only the normalisation parameters
//          of the trainable set (IsNormParameterName).
//   cotta  (Wang et al. 2022) A mean (EMA) copy of the trainable set answers and, teacher-
//          forced on its answer, gives soft next-token distributions; when it is unsure (mean
//          max-probability over the answer below confidence_threshold) they are averaged over
//          augmented views of the visual tokens (Gaussian feature noise relative to each
//          token's RMS, random token dropping: the device keeps tokens, not pixels). The
//          student minimises the soft cross-entropy to them on the plain input, the EMA
//          follows it after each step, and every trainable element returns to its source
//          (pre-adaptation) value with probability restore_prob. Confidence is the EMA's, not
//          a separate frozen source model's (one model copy fewer on the device).
//
// The adapted state carries over from job to job (continual: never reset); CoTTA's EMA and
// source state are taken at the first job. The model stays in eval mode (no dropout).
//
// Thread-safety: one Run at a time; it trains the side's model in place.
#ifndef CDCCA_DISTILL_HF_SELF_LEARNER_H_
#define CDCCA_DISTILL_HF_SELF_LEARNER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "distill/job.h"
#include "distill/pair_distiller.h"

namespace cdcca::distill {

// True for the parameters TENT adapts: those of a module whose name ends in "norm"
// ("...input_layernorm.weight", "...norm.weight").
bool IsNormParameterName(const std::string& name);

struct CottaConfig {
  double ema_decay = 0.999;           // ema = decay * ema + (1 - decay) * student
  double restore_prob = 0.01;         // per element and step
  int augmentations = 4;              // views averaged when unsure
  double confidence_threshold = 0.9;  // mean max-probability below which to average
  double noise_std = 0.1;             // feature noise, relative to each token's RMS
  double token_drop = 0.1;            // probability of hiding a kept token in a view
};

class SelfLearner {
 public:
  // `name`: "tent" or "cotta" (InvalidArgument otherwise, or for a side without model or
  // codec, or a student without a trainable set). `options`: steps, batch size, lr, weight
  // decay, seed, max_answer_tokens.
  static absl::StatusOr<std::unique_ptr<SelfLearner>> Create(const std::string& name,
                                                             PairSide student,
                                                             const JobOptions& options,
                                                             CottaConfig cotta = {});
  ~SelfLearner();

  const std::string& name() const;

  // Adapts the student's trainable set in place on `samples` (at least one); the result's
  // `trainable` is the whole set afterwards (fp32 CPU clones), `pseudo_labels` empty.
  // InvalidArgument for samples that do not fit the model; Internal for a LibTorch error.
  absl::StatusOr<PairJobResult> Run(const std::vector<PairSample>& samples);

 private:
  struct State;
  explicit SelfLearner(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_HF_SELF_LEARNER_H_
