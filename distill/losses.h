// The loss terms of the cloud learners (AKD and the feature-KD baselines) and the device
// learners (TENT, CoTTA), as pure functions of tensors. Every function takes a mask that
// says which positions count and averages over exactly those, so padding never enters a
// loss; an all-false mask gives 0 (not NaN). All return a scalar float tensor that is
// differentiable in the student-side arguments.
//
// Thread-safety: pure functions (no state).
#ifndef CDCCA_DISTILL_LOSSES_H_
#define CDCCA_DISTILL_LOSSES_H_

#include <torch/types.h>

namespace cdcca::distill {

// x normalised over its last dimension to zero mean and unit (population) variance, no
// affine parameters, eps 1e-5 (LayerNorm without weights). Used to make the alignment
// terms scale-free: teacher and student features live at different magnitudes.
torch::Tensor LayerNormFeatures(const torch::Tensor& x);

// Mean squared error between feature vectors [..., C]: over the positions where `mask`
// ([...] bool, undefined = all) is true, the mean over channels of (teacher - student)^2,
// averaged over those positions. With normalize, both sides go through
// LayerNormFeatures first (AKD's alignment terms).
torch::Tensor FeatureMse(const torch::Tensor& teacher, const torch::Tensor& student,
                         const torch::Tensor& mask, bool normalize);

// Cross-entropy of `logits` [B, T, V] against `targets` [B, T] int64, averaged over the
// positions with targets >= 0 (negative = ignore).
torch::Tensor TokenCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets);

// Cross-entropy against soft targets: -sum_v target_probs * log_softmax(logits), averaged
// over mask positions. target_probs [B, T, V] (rows sum to 1), mask [B, T] bool.
torch::Tensor SoftCrossEntropy(const torch::Tensor& logits, const torch::Tensor& target_probs,
                               const torch::Tensor& mask);

// Hinton's distillation term: T^2 * KL(softmax(teacher / T) || softmax(student / T)),
// summed over the vocabulary, averaged over mask positions. temperature > 0.
torch::Tensor TemperatureKl(const torch::Tensor& teacher_logits,
                            const torch::Tensor& student_logits, const torch::Tensor& mask,
                            double temperature);

// TokenCrossEntropy and TemperatureKl at K positions (logits [K, V], targets [K]) as means
// weighted by weights [K] (>= 0, not all 0): sum(w * term) / sum(w).
torch::Tensor WeightedTokenCrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                        const torch::Tensor& weights);
torch::Tensor WeightedTemperatureKl(const torch::Tensor& teacher_logits,
                                    const torch::Tensor& student_logits,
                                    const torch::Tensor& weights, double temperature);

// Mean entropy (nats) of softmax(logits) over mask positions (TENT's objective).
torch::Tensor MeanEntropy(const torch::Tensor& logits, const torch::Tensor& mask);

// PKD (Cao et al. 2022): 1 - the mean over channels of the Pearson correlation between
// teacher and student values of that channel across all mask positions of the batch.
// Equals half the MSE of the per-channel standardised features. Features [..., C].
torch::Tensor PearsonDistance(const torch::Tensor& teacher, const torch::Tensor& student,
                              const torch::Tensor& mask);

// Channel-wise distillation (Shu et al. 2021) on sequences: for each row b and channel c,
// softmax over the row's mask positions of value / tau; the loss is
// tau^2 * KL(teacher || student) summed over positions, averaged over rows with at least one
// position and over channels. Features [B, T, C], mask [B, T] bool (undefined = all).
torch::Tensor ChannelWiseDivergence(const torch::Tensor& teacher, const torch::Tensor& student,
                                    const torch::Tensor& mask, double tau);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_LOSSES_H_
