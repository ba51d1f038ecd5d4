// The update guard: no update that makes a device worse. The cloud holds out a fixed share
// of each device's uplinked samples (jobs never train on them) and, before it publishes an
// update, compares on that held-out pool how often the student's greedy answer equals the
// teacher's, with the mirror before the job and with the mirror the device would hold after
// applying the decoded update (per sample, AnswerAgreement: 1 for the same answer, partial
// credit for the words a longer answer such as a caption shares). PerDeviceStrategy
// (cloud/trainer.h) keeps the pool and runs the models; this header is the arithmetic: which
// samples are held out and what the paired comparison decides. Torch-free; pure functions,
// thread-safe.
#ifndef CDCCA_CLOUD_UPDATE_GUARD_H_
#define CDCCA_CLOUD_UPDATE_GUARD_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "settings/defaults.h"

namespace cdcca::cloud {

// What the guard scores a student's answer to a held-out sample by, in [0, 1].
enum class GuardMeasure {
  // AnswerAgreement with the teacher's greedy answer: 1 for the same answer, whatever the
  // teacher's own certainty.
  kAgreement,
  // The teacher's probability of the student's answer (distill::AnswerProbability, on what
  // the teacher labels the sample from). With a calibrated teacher it is the chance that the
  // answer is right: moving to a teacher answer the teacher is unsure of gains little, moving
  // off a sure one costs much. An answer an update leaves unchanged scores the same before
  // and after, under either measure.
  kTeacherProbability,
  // The mean of the teacher's probability of the answer and the pretrained base student's
  // (MirrorTrainer::BaseProbabilities, on what the device reads). Two judges instead of one:
  // where the shift leaves the teacher no better than its student, an update that moves
  // answers towards the teacher gains under the teacher's probability and loses as much
  // under the base's, and does not ship; where the teacher leads, the shifted base is
  // unsure of its own answers and the teacher's gain outweighs the base's loss. Both judges
  // are fixed models, so a score still depends only on the sample and the answer.
  kTeacherAndBase,
};
// "agreement" / "teacher_probability" / "teacher_and_base".
std::string_view GuardMeasureName(GuardMeasure measure);
// InvalidArgument naming the accepted names for anything else.
absl::StatusOr<GuardMeasure> ParseGuardMeasure(std::string_view name);

// Defaults: the defaults table's (settings/defaults.h), which says why.
struct UpdateGuardOptions {
  // Off: every update ships, no sample is held out. Default: on.
  bool enabled = settings::kGuard;
  // Share of each device's answers held out, in [0, 1): which ones is
  // compress::IsHeldOutSample of the device id and the sample id. The cloud tells its devices
  // the share at Register (RegisterReply.guard_holdout_fraction), and they pick it among all
  // their answers, before UTS stage 1, and uplink those samples whole: the pool is a sample
  // of the device's inputs, not of the uncertain ones stage 1 keeps. Default: 0.1 (at the
  // experiments' stage-1 rate of about one answer in two, as many held-out samples as the
  // earlier 0.2 of the uplinked ones).
  double holdout_fraction = settings::kGuardHoldoutFraction;
  // Most held-out samples kept per device (the newest). Default: 128.
  size_t pool_capacity = settings::kGuardPool;
  // Smallest pool the paired rule runs on; a smaller pool decides by JudgeUpdate's small-pool
  // rule. Default: 16.
  size_t min_pool = settings::kGuardMinPool;
  // The margin: an update ships when its gain in agreement exceeds z paired standard errors.
  // Default: 1.0 (about 84 % one-sided confidence that the update helps).
  double z = settings::kGuardZ;
  // Share of the held-out pool the comparison counts, in (0, 1]: the samples whose teacher
  // answers most surely (lowest mean answer-token entropy; ties by pool order). Agreement
  // with a sure teacher is closer to being right than agreement with an unsure one, at the
  // cost of a smaller pool. Default: 1 (every held-out sample).
  double confident_fraction = settings::kGuardConfidentFraction;
  // What each held-out answer is scored by (settings::kGuardMeasure, as an enum). Default:
  // kTeacherProbability (docs/RESULTS.md, "The
  // teacher's probability as the guard's measure": level with or ahead of agreement on the
  // mean of every table measured, and fewer harmful ships on snow and rain).
  GuardMeasure measure = GuardMeasure::kTeacherProbability;
  // When an update is withheld from a device that no longer runs the pretrained base, the
  // base is scored against the device's current version by the same rule on what the device
  // answers now: the job's newly held-out samples, or the newest min_pool of the pool where
  // the job brought fewer. If it wins ("helps": at least min_pool samples, the gain beyond z
  // paired SEs), the cloud returns the device to the base as a new version (a rollback to
  // version 0, logged as device_restored_to_base). An earlier update that helped on the inputs
  // of its day and hurts on today's is then undone instead of kept forever; judged on the
  // whole pool, the samples of the days it helped on would outvote today's. Default: on.
  bool restore_base = settings::kGuardRestoreBase;
};

// The indices of `entropies` the comparison counts under `fraction`
// (UpdateGuardOptions::confident_fraction): the ceil(fraction * n) lowest, ties to the lower index,
// ascending. All of them for a fraction >= 1.
std::vector<size_t> ConfidentSamples(const std::vector<double>& entropies, double fraction);

// How far a student's answer agrees with the teacher's, in [0, 1]: the F1 of their words
// (split on whitespace, counted with multiplicity), as VQA and SQuAD score partial answers.
// 1 for the same answer (two empty answers too), 0 when no word is shared. A one-word VQA
// answer scores as exact match; a caption earns credit for each word it shares, so an update
// that brings captions closer to the teacher's shows as a gain before any caption matches
// word for word.
double AnswerAgreement(std::string_view student, std::string_view teacher);

// What the guard found for one update.
struct GuardVerdict {
  int64_t pool = 0;   // held-out samples scored
  double before = 0;  // mean score (UpdateGuardOptions::measure), mirror before the job, in [0, 1]
  double after = 0;   // mean score with the mirror after the decoded update
  double gain = 0;    // after - before
  double se = 0;      // paired standard error of the gain (sample SD / sqrt(pool))
  bool ship = true;   // publish the update
  std::string decision;  // "helps", "not_beyond_noise", "small_pool", "small_pool_worse", "empty"
};

// The rule, per held-out sample i: d_i = after_i - before_i (each the sample's
// AnswerAgreement, in [0, 1]); gain = mean d; se = sd(d) / sqrt(n) (sd over n - 1).
//   n >= min_pool: ship iff gain > z * se ("helps"; else "not_beyond_noise": an update that
//     changes no answer on the pool has gain 0 and does not ship).
//   0 < n < min_pool: the pool cannot show that an update helps, and holding every update
//     back until it fills would stall a new device's first rounds, when its shift is new; so
//     the update ships ("small_pool") unless gain < -z / sqrt(n) ("small_pool_worse"):
//     1 / sqrt(n) is the largest standard error n paired agreements in [0, 1] can have, so such an
//     update is worse beyond any noise the pool allows.
//   n = 0: ships ("empty").
// `before` and `after` must have the same size (the shorter one bounds the pool otherwise).
GuardVerdict JudgeUpdate(const std::vector<double>& before, const std::vector<double>& after,
                         const UpdateGuardOptions& options);

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_UPDATE_GUARD_H_
