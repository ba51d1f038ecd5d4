// TENT (Wang et al. 2021) in its continual form, a device-side baseline: no cloud, no
// teacher. The student answers each sample greedily, and, teacher-forced on its own answer,
// minimises the mean entropy of its next-token distributions at the answer positions,
// updating only its normalisation parameters (LayerNorm/RMSNorm weights and biases). The
// adapted state carries over from job to job (continual: never reset).
#ifndef CDCCA_DISTILL_BASELINES_TENT_H_
#define CDCCA_DISTILL_BASELINES_TENT_H_

#include <string>
#include <vector>

#include "distill/hf_self_learner.h"  // IsNormParameterName
#include "distill/learner.h"

namespace cdcca::distill {

class TentLearner : public Learner {
 public:
  std::string name() const override { return "tent"; }
  bool uses_teacher() const override { return false; }

 protected:
  model::NamedTensors TrainedParameters(model::Blip2Tower& student) override;
  absl::Status Prepare(const SamplePool& pool, model::Blip2Tower& student,
                       const JobOptions& options) override;
  Terms Loss(const SamplePool& pool, const std::vector<int64_t>& batch, model::Blip2Tower& student,
             const JobOptions& options) override;
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_BASELINES_TENT_H_
