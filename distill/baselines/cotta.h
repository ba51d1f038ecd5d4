// CoTTA (Wang et al. 2022), continual test-time adaptation on the device, a baseline with
// no cloud. Three parts:
//   - a mean (EMA) teacher of the student's trainable set gives the pseudo-labels: its
//     greedy answer, and, teacher-forced on it, soft next-token distributions;
//   - when the teacher is unsure (mean max-probability over the answer below
//     confidence_threshold) those distributions are averaged over `augmentations` augmented
//     views of the visual tokens (Gaussian feature noise and random token dropping, the
//     token-space analogue of CoTTA's image augmentations, since the device keeps tokens);
//   - after each step, every trainable element is reset to its source (pre-adaptation)
//     value with probability restore_prob (stochastic restore against forgetting).
// The student minimises the soft cross-entropy to the teacher's distributions on the
// un-augmented input. Deviation from the paper: confidence is the EMA teacher's, not a
// separate frozen source model's (one model copy fewer on the device).
//
// The EMA teacher and the source state are created at the first job and kept across jobs.
#ifndef CDCCA_DISTILL_BASELINES_COTTA_H_
#define CDCCA_DISTILL_BASELINES_COTTA_H_

#include <string>
#include <vector>

#include "distill/hf_self_learner.h"  // CottaConfig
#include "distill/learner.h"

namespace cdcca::distill {

class CottaLearner : public Learner {
 public:
  explicit CottaLearner(CottaConfig config) : config_(config) {}
  std::string name() const override { return "cotta"; }
  bool uses_teacher() const override { return false; }

  // The EMA teacher (null before the first job).
  model::Blip2Tower ema_teacher() const { return ema_; }

 protected:
  absl::Status Prepare(const SamplePool& pool, model::Blip2Tower& student,
                       const JobOptions& options) override;
  Terms Loss(const SamplePool& pool, const std::vector<int64_t>& batch, model::Blip2Tower& student,
             const JobOptions& options) override;
  void AfterStep(model::Blip2Tower& student, const JobOptions& options) override;

 private:
  CottaConfig config_;
  model::Blip2Tower ema_{nullptr};
  model::NamedTensors source_;  // the trainable set before any adaptation
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_BASELINES_COTTA_H_
