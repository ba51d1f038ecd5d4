// Adapter-based Knowledge Distillation (paper Sec. 3.3) and the cloud-side baselines that
// share its machinery: pseudo-label only ("pl"), PKD ("pkd", Pearson-correlation feature
// KD) and channel-wise divergence ("cwd"). One learner, configured by which feature loss
// aligns the student's query-adapter output Q and representation R with the teacher's.
//
// Per job: the teacher (eval, no grad) answers every sample greedily on the masked token set
// the device kept - those answers are the pseudo-labels - and, teacher-forced on them,
// gives Q_t and R_t (and its logits for the optional KL term); this is computed once per
// job, since the teacher does not change. Each step the student, teacher-forced on the same
// text, minimises
//   l_ce * CE(student, pseudo-labels)
//   + l_query * D(Q_t, phi(Q_s)) + l_repr * D(R_t, psi(R_s))
//   + l_kl * T^2 * KL(softmax(teacher / T) || softmax(student / T))
// where D is the configured feature loss and phi, psi are cloud-only linear maps from the
// student's widths to the teacher's, trained jointly and kept across jobs (per learner, so
// per device). With normalize, D = MSE of layer-normed features: teacher and student live
// at different scales, and the prototype showed unnormalised MSE pulling the student off
// its task. With ridge_init, phi and psi start at the ridge-regression fit of the teacher's
// features on the student's over the job's samples, so the alignment terms begin by
// measuring real disagreement rather than a random projection's error.
//
// Teacher and student must have the same number of queries (L).
#ifndef CDCCA_DISTILL_AKD_H_
#define CDCCA_DISTILL_AKD_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "distill/learner.h"

namespace cdcca::distill {

enum class FeatureLoss {
  kNone,         // pseudo-label CE only ("pl")
  kMse,          // AKD
  kPearson,      // PKD
  kChannelWise,  // CWD
};

struct DistillConfig {
  std::string name = "akd";  // reported by Learner::name()
  FeatureLoss feature_loss = FeatureLoss::kMse;
  double l_ce = 1.0;
  double l_query = 0.1;
  double l_repr = 0.1;
  double l_kl = 0.0;
  double temperature = 2.0;  // of the KL term
  bool normalize = true;     // kMse: layer-norm both sides (no affine) before the MSE
  // R is aligned at the answer tokens only (true) or at every text token (false): the
  // prompt positions carry no information about the shifted image in a decoder LM until
  // the visual prefix has been read, and they are the same text for every sample.
  bool repr_answer_only = true;
  bool ridge_init = true;      // fit phi/psi by ridge regression at their first job
  double ridge_lambda = 1e-2;  // relative to the mean diagonal of X^T X
  double cwd_tau = 1.0;        // kChannelWise temperature
};

// "akd", "pl", "pkd", "cwd" with the weights of configs/distill/akd.json's defaults.
absl::StatusOr<DistillConfig> PresetDistillConfig(const std::string& name);

// `shared` with the feature term of learner `name` ("akd" MSE, "pkd" Pearson, "cwd"
// channel-wise, "pl" none: its l_query and l_repr become 0) and that name; every other
// setting (CE and KL weights, temperature, feature weights, normalization, ridge start) is
// shared's. This is how baselines are compared on equal terms: the same settings, only the
// thing under test differs.
absl::StatusOr<DistillConfig> WithFeatureTermOf(const std::string& name, DistillConfig shared);

// Reads a config: {"learner": {...DistillConfig fields..., "feature_loss": "mse"|"none"|
// "pearson"|"channel_wise"}, "job": {...JobOptions fields...}}. Either section may be absent
// (defaults: PresetDistillConfig(name) / JobOptions{}); unknown keys are INVALID_ARGUMENT.
struct DistillSettings {
  DistillConfig learner;
  JobOptions job;
};
absl::StatusOr<DistillSettings> ParseDistillSettings(absl::string_view json);
absl::StatusOr<DistillSettings> LoadDistillSettings(const std::string& path);

// D(teacher, student) of config's feature term over mask positions (losses.h); 0 for kNone.
torch::Tensor FeatureDistance(const DistillConfig& config, const torch::Tensor& teacher,
                              const torch::Tensor& student, const torch::Tensor& mask);

// Solves min_W |[X 1] W - Y|^2 + lambda |W|^2 for x [rows, in], y [rows, out] and writes W into
// `linear` (weight [out, in], bias [out]): phi/psi's start. lambda is scaled to X's energy, so
// the bias column is barely penalised.
void RidgeFit(const torch::Tensor& x, const torch::Tensor& y, double lambda,
              torch::nn::Linear& linear);

class DistillLearner : public Learner {
 public:
  // `teacher` is shared, used read-only under NoGradGuard and put in eval() mode.
  DistillLearner(model::Blip2Tower teacher, DistillConfig config);

  std::string name() const override { return config_.name; }
  bool uses_teacher() const override { return true; }
  const DistillConfig& config() const { return config_; }

  // phi (queries) and psi (representation); null before the first job or for "pl".
  torch::nn::Linear phi() const { return phi_; }
  torch::nn::Linear psi() const { return psi_; }

 protected:
  absl::Status Prepare(const SamplePool& pool, model::Blip2Tower& student,
                       const JobOptions& options) override;
  std::vector<torch::Tensor> ExtraParameters() override;
  Terms Loss(const SamplePool& pool, const std::vector<int64_t>& batch, model::Blip2Tower& student,
             const JobOptions& options) override;

 private:
  bool UsesFeatures() const;
  torch::Tensor FeatureTerm(const torch::Tensor& teacher, const torch::Tensor& student,
                            const torch::Tensor& mask) const;
  void FitProjections(const SamplePool& pool, model::Blip2Tower& student,
                      const JobOptions& options);

  model::Blip2Tower teacher_;
  DistillConfig config_;
  torch::nn::Linear phi_{nullptr};
  torch::nn::Linear psi_{nullptr};
  // Teacher outputs for the current job's pool (on the job device).
  std::vector<std::vector<int64_t>> answers_;  // pseudo-labels, EOS included
  torch::Tensor queries_;                      // [P, L, qa_t]
  std::vector<torch::Tensor> representation_;  // per sample [prompt + answer, d_t]
  std::vector<torch::Tensor> answer_logits_;   // per sample [answer, V] (l_kl > 0 only)
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_AKD_H_
