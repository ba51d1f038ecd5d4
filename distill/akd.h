// The settings of Adapter-based Knowledge Distillation (paper Sec. 3.3) and of the cloud
// baselines that share its job: pseudo-label only ("pl"), PKD ("pkd", Pearson-correlation
// feature KD) and channel-wise divergence ("cwd"). One job (distill::PairDistiller,
// distill/pair_distiller.h), configured by which feature loss aligns the student's query output Q
// and representation R with the teacher's through the cloud-only maps phi and psi:
//   l_ce * CE(student, pseudo-labels)
//   + l_query * D(Q_t, phi(Q_s)) + l_repr * D(R_t, psi(R_s))
//   + l_kl * T^2 * KL(softmax(teacher / T) || softmax(student / T))
// With normalize, D = MSE of layer-normed features: teacher and student live at different
// scales, and the prototype showed unnormalised MSE pulling the student off its task. With
// ridge_init, phi and psi start at the ridge-regression fit of the teacher's features on the
// student's over the job's samples, so the alignment terms begin by measuring real
// disagreement rather than a random projection's error.
//
// Thread-safety: plain values; the functions are pure (RidgeFit writes only its `linear`).
#ifndef CDCCA_DISTILL_AKD_H_
#define CDCCA_DISTILL_AKD_H_

#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "distill/job.h"
#include "settings/defaults.h"

namespace cdcca::distill {

enum class FeatureLoss {
  kNone,         // pseudo-label CE only ("pl")
  kMse,          // AKD
  kPearson,      // PKD
  kChannelWise,  // CWD
};

struct DistillConfig {
  std::string name = "akd";  // the learner's name in job reports
  FeatureLoss feature_loss = FeatureLoss::kMse;
  // Weights and temperature: the defaults table's (settings/defaults.h).
  double l_ce = settings::kLCe;
  double l_query = settings::kLQuery;
  double l_repr = settings::kLRepr;
  double l_kl = settings::kLKl;
  double temperature = settings::kTemperature;  // of the KL term
  bool normalize = true;  // kMse: layer-norm both sides (no affine) before the MSE
  // R is aligned at the answer tokens only (true) or at every text token (false): the
  // prompt positions carry no information about the shifted image in a decoder LM until
  // the visual prefix has been read, and they are the same text for every sample.
  bool repr_answer_only = true;
  bool ridge_init = true;      // fit phi/psi by ridge regression at their first job
  double ridge_lambda = 1e-2;  // relative to the mean diagonal of X^T X
  double cwd_tau = 1.0;        // kChannelWise temperature
  // The teacher's confidence in each label, used alike by every learner: a sample's CE and KL
  // positions weigh c^confidence_power, c the geometric mean of the teacher's probabilities
  // of its answer tokens (teacher-forced), the weights normalized over the step's rows
  // (weighted means). 0 = every sample weighs the same.
  double confidence_power = 0.0;
};

// "akd", "pl", "pkd", "cwd" with the defaults table's weights (configs/distill/akd.json
// holds the same; distill_test checks it): each its own feature term, the same CE and logit
// KL, so that the baselines train on equal terms; "pl" has no feature term.
absl::StatusOr<DistillConfig> PresetDistillConfig(const std::string& name);

// `shared` with the feature term of learner `name` ("akd" MSE, "pkd" Pearson, "cwd"
// channel-wise, "pl" none: its l_query and l_repr become 0) and that name; every other
// setting (CE and KL weights, temperature, feature weights, normalization, ridge start) is
// shared's. This is how baselines are compared on equal terms: the same settings, only the
// thing under test differs.
absl::StatusOr<DistillConfig> WithFeatureTermOf(const std::string& name, DistillConfig shared);

// A learner written "base[+key=value]...", e.g. "akd+l_query=0" or "akd+l_kl=0.5+temperature=2":
// the preset `base` with the overrides applied; keys are DistillConfig fields as in
// configs/distill/*.json. The config's name is the whole spec. INVALID_ARGUMENT for an
// unknown base or key, or a part without "=".
absl::StatusOr<DistillConfig> ParseLearnerSpec(const std::string& spec);

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

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_AKD_H_
