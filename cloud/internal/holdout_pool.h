// The update guard's held-out pool of one device and its scoring (cloud/update_guard.h):
// the samples that never train, the teacher's answer to each and the device's answers at the
// versions scored so far, cached per sample (a score depends only on the sample and the
// answer, so an answer an update leaves as it was costs no teacher pass).
//
// PerDeviceStrategy (cloud/trainer.cc) keeps a pool per device and asks a GuardScorer, before
// it commits a job's update, whether the update raises the pool's agreement with the teacher
// beyond noise (ScoreUpdate), and after a withheld update whether the pretrained base would
// do better than the device's current version (ScoreBase). Not thread-safe: a device's pool
// is used under its lock; a GuardScorer may serve several devices at once (the trainer's
// calls are thread-safe).
#ifndef CDCCA_CLOUD_INTERNAL_HOLDOUT_POOL_H_
#define CDCCA_CLOUD_INTERNAL_HOLDOUT_POOL_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "cloud/update_guard.h"
#include "compress/named_tensors.h"
#include "compress/uplink_codec.h"

namespace cdcca::cloud::internal {

class MirrorTrainer;

// A held-out sample and the answers known for it.
struct HoldoutEntry {
  uint64_t sequence = 0;  // the uplink batch it came in
  std::shared_ptr<const compress::UplinkSample> sample;
  bool teacher_known = false;
  std::string teacher;         // MirrorTrainer::TeacherAnswers
  double teacher_entropy = 0;  // and how sure the teacher was of it
  bool student_known = false;
  uint64_t student_version = 0;  // the mirror version `student` was answered with
  std::string student;
  double student_score = 0;  // the guard's score of `student` (UpdateGuardOptions::measure)
  bool base_known = false;
  std::string base;  // the pretrained base's answer (UpdateGuardOptions::restore_base)
  double base_score = 0;
};
using HoldoutPool = std::deque<std::shared_ptr<HoldoutEntry>>;  // oldest first

// The newest `n` of `pool` (all of it when it holds fewer).
HoldoutPool NewestOf(const HoldoutPool& pool, size_t n);
// `pool` followed by `fresh`, the newest `capacity` of them.
HoldoutPool JoinHoldout(const HoldoutPool& pool, const HoldoutPool& fresh, size_t capacity);

class GuardScorer {
 public:
  // `trainer` and `options` must outlive the scorer.
  GuardScorer(MirrorTrainer* trainer, const UpdateGuardOptions* options)
      : trainer_(trainer), options_(options) {}

  // Scores `pool` for an update from `mirror` (the device's state at `version`) to `after`:
  // the teacher's answers and the student's at `version` where not cached (they are cached
  // in the entries, with their scores), and the student's with `after` (returned in
  // `after_answers` and `after_scores`, in pool order). The guard's rule decides.
  absl::StatusOr<GuardVerdict> ScoreUpdate(uint64_t version, const compress::NamedTensors& mirror,
                                           const HoldoutPool& pool,
                                           const compress::NamedTensors& after,
                                           std::vector<std::string>* after_answers,
                                           std::vector<double>* after_scores);
  // The pretrained base against the device's current version (`version`) on `pool`, by the
  // guard's rule (base as "after"): the base's answers and scores are computed once per
  // held-out sample and cached; the current version's must be those ScoreUpdate cached
  // (INTERNAL otherwise).
  absl::StatusOr<GuardVerdict> ScoreBase(uint64_t version, const HoldoutPool& pool);

 private:
  // The guard's score of each of `answers` (one per entry, whose teachers are known):
  // agreement with the teacher's answer, or the teacher's probability of it.
  absl::StatusOr<std::vector<double>> Scores(const std::vector<HoldoutEntry*>& entries,
                                             const std::vector<std::string>& answers);
  // As Scores, but an answer equal to the entry's current one takes its cached score.
  absl::StatusOr<std::vector<double>> ScoresReusing(const std::vector<HoldoutEntry*>& entries,
                                                    const std::vector<std::string>& answers);
  // The guard's rule on `pool` (scored: teacher and current answers known): per compared
  // sample (UpdateGuardOptions::confident_fraction), the current version's score against
  // `candidate(i)`'s.
  GuardVerdict JudgeOnPool(const HoldoutPool& pool,
                           absl::FunctionRef<double(size_t)> candidate) const;

  MirrorTrainer* const trainer_;
  const UpdateGuardOptions* const options_;
};

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_HOLDOUT_POOL_H_
