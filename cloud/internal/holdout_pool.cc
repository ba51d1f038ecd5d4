#include "cloud/internal/holdout_pool.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "cloud/internal/mirror_trainer.h"

namespace cdcca::cloud::internal {
namespace {

// `answers` of `n` held-out samples from `whose` (teacher, mirror, base), or why not.
absl::Status CheckAnswers(const absl::StatusOr<std::vector<std::string>>& answers, size_t n,
                          const char* whose) {
  if (!answers.ok()) return answers.status();
  if (answers->size() != n) {
    return absl::InternalError(
        absl::StrCat(whose, " answered ", answers->size(), " of ", n, " held-out samples"));
  }
  return absl::OkStatus();
}

}  // namespace

// The newest `n` of `pool` (all of it when it holds fewer).
HoldoutPool NewestOf(const HoldoutPool& pool, size_t n) {
  if (n >= pool.size()) return pool;
  return HoldoutPool(pool.end() - static_cast<std::ptrdiff_t>(n), pool.end());
}

// `pool` followed by `fresh`, the newest pool_capacity of them.
HoldoutPool JoinHoldout(const HoldoutPool& pool, const HoldoutPool& fresh, size_t capacity) {
  HoldoutPool out = pool;
  out.insert(out.end(), fresh.begin(), fresh.end());
  while (out.size() > capacity) out.pop_front();
  return out;
}

// The guard's score of each of `answers` (one per entry of `entries`, whose teachers are
// known): agreement with the teacher's answer, or the teacher's probability of it
// (UpdateGuardOptions::measure).
absl::StatusOr<std::vector<double>> GuardScorer::Scores(const std::vector<HoldoutEntry*>& entries,
                                                        const std::vector<std::string>& answers) {
  std::vector<double> out;
  if (options_->measure == GuardMeasure::kAgreement) {
    for (size_t i = 0; i < entries.size(); ++i) {
      out.push_back(AnswerAgreement(answers[i], entries[i]->teacher));
    }
    return out;
  }
  std::vector<const compress::UplinkSample*> samples;
  for (const HoldoutEntry* e : entries) samples.push_back(e->sample.get());
  absl::StatusOr<std::vector<double>> p = trainer_->TeacherProbabilities(samples, answers);
  if (!p.ok()) return p.status();
  if (p->size() != entries.size()) {
    return absl::InternalError(
        absl::StrCat("the teacher scored ", p->size(), " answers of ", entries.size()));
  }
  if (options_->measure == GuardMeasure::kTeacherAndBase) {
    absl::StatusOr<std::vector<double>> base = trainer_->BaseProbabilities(samples, answers);
    if (!base.ok()) return base.status();
    if (base->size() != entries.size()) {
      return absl::InternalError(
          absl::StrCat("the base scored ", base->size(), " answers of ", entries.size()));
    }
    for (size_t i = 0; i < p->size(); ++i) (*p)[i] = 0.5 * ((*p)[i] + (*base)[i]);
  }
  return p;
}

// Scores as Scores does, but an answer equal to the entry's current one (known at any
// version) takes its cached score: a score depends only on the sample and the answer, and
// most answers an update leaves as they were, so only the changed ones cost a teacher pass.
absl::StatusOr<std::vector<double>> GuardScorer::ScoresReusing(
    const std::vector<HoldoutEntry*>& entries, const std::vector<std::string>& answers) {
  std::vector<HoldoutEntry*> changed_entries;
  std::vector<std::string> changed_answers;
  std::vector<size_t> changed_at;
  std::vector<double> out(entries.size(), 0.0);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i]->student_known && entries[i]->student == answers[i]) {
      out[i] = entries[i]->student_score;
    } else {
      changed_entries.push_back(entries[i]);
      changed_answers.push_back(answers[i]);
      changed_at.push_back(i);
    }
  }
  if (changed_at.empty()) return out;
  absl::StatusOr<std::vector<double>> scored = Scores(changed_entries, changed_answers);
  if (!scored.ok()) return scored.status();
  for (size_t k = 0; k < changed_at.size(); ++k) out[changed_at[k]] = (*scored)[k];
  return out;
}

// Scores `pool` for the guard: the teacher's answers and the student's at version where
// not cached (they are cached in the entries, with their scores), and the student's with
// the `after` mirror (returned in `after_answers` and `after_scores`, in pool order).
//
absl::StatusOr<GuardVerdict> GuardScorer::ScoreUpdate(uint64_t version,
                                                      const compress::NamedTensors& mirror,
                                                      const HoldoutPool& pool,
                                                      const compress::NamedTensors& after,
                                                      std::vector<std::string>* after_answers,
                                                      std::vector<double>* after_scores) {
  if (pool.empty()) return JudgeUpdate({}, {}, (*options_));
  std::vector<HoldoutEntry*> need_teacher, need_student, entries;
  std::vector<const compress::UplinkSample*> all;
  for (const std::shared_ptr<HoldoutEntry>& e : pool) {
    all.push_back(e->sample.get());
    entries.push_back(e.get());
    if (!e->teacher_known) need_teacher.push_back(e.get());
    if (!e->student_known || e->student_version != version) need_student.push_back(e.get());
  }
  auto samples_of = [](const std::vector<HoldoutEntry*>& entries) {
    std::vector<const compress::UplinkSample*> out;
    for (const HoldoutEntry* e : entries) out.push_back(e->sample.get());
    return out;
  };
  if (!need_teacher.empty()) {
    std::vector<double> entropies;
    absl::StatusOr<std::vector<std::string>> t =
        trainer_->TeacherAnswers(samples_of(need_teacher), &entropies);
    if (absl::Status s = CheckAnswers(t, need_teacher.size(), "the teacher"); !s.ok()) return s;
    entropies.resize(need_teacher.size(), 0.0);
    for (size_t i = 0; i < need_teacher.size(); ++i) {
      need_teacher[i]->teacher = std::move((*t)[i]);
      need_teacher[i]->teacher_entropy = entropies[i];
      need_teacher[i]->teacher_known = true;
    }
  }
  if (!need_student.empty()) {
    absl::StatusOr<std::vector<std::string>> b =
        trainer_->StudentAnswers(mirror, samples_of(need_student));
    if (absl::Status s = CheckAnswers(b, need_student.size(), "the mirror"); !s.ok()) return s;
    absl::StatusOr<std::vector<double>> scores = Scores(need_student, *b);
    if (!scores.ok()) return scores.status();
    for (size_t i = 0; i < need_student.size(); ++i) {
      need_student[i]->student = std::move((*b)[i]);
      need_student[i]->student_score = (*scores)[i];
      need_student[i]->student_version = version;
      need_student[i]->student_known = true;
    }
  }
  absl::StatusOr<std::vector<std::string>> a = trainer_->StudentAnswers(after, all);
  if (absl::Status s = CheckAnswers(a, all.size(), "the updated mirror"); !s.ok()) return s;
  absl::StatusOr<std::vector<double>> scores = ScoresReusing(entries, *a);
  if (!scores.ok()) return scores.status();
  *after_answers = *std::move(a);
  *after_scores = *std::move(scores);
  return JudgeOnPool(pool, [&](size_t i) { return (*after_scores)[i]; });
}

// The guard's rule on `pool` (scored: teacher and current answers known): per compared
// sample (UpdateGuardOptions::confident_fraction), the current version's score against
// `candidate(i)`'s.
GuardVerdict GuardScorer::JudgeOnPool(const HoldoutPool& pool,
                                      absl::FunctionRef<double(size_t)> candidate) const {
  std::vector<double> entropies;
  for (const std::shared_ptr<HoldoutEntry>& e : pool) entropies.push_back(e->teacher_entropy);
  std::vector<double> current, candidates;
  for (size_t i : ConfidentSamples(entropies, options_->confident_fraction)) {
    current.push_back(pool[i]->student_score);
    candidates.push_back(candidate(i));
  }
  return JudgeUpdate(current, candidates, (*options_));
}

// The pretrained base against the device's current version on `pool`, by the guard's rule
// (base as "after"): the base's answers and scores are computed once per held-out sample
// and cached; the current version's are those ScoreUpdate cached.
absl::StatusOr<GuardVerdict> GuardScorer::ScoreBase(uint64_t version, const HoldoutPool& pool) {
  std::vector<HoldoutEntry*> need;
  std::vector<const compress::UplinkSample*> inputs;
  for (const std::shared_ptr<HoldoutEntry>& e : pool) {
    if (!e->teacher_known || !e->student_known || e->student_version != version) {
      return absl::InternalError("the held-out pool was not scored before the base");
    }
    if (!e->base_known) {
      need.push_back(e.get());
      inputs.push_back(e->sample.get());
    }
  }
  if (!need.empty()) {
    absl::StatusOr<std::vector<std::string>> b =
        trainer_->StudentAnswers(trainer_->base_trainable(), inputs);
    if (absl::Status s = CheckAnswers(b, need.size(), "the base"); !s.ok()) return s;
    absl::StatusOr<std::vector<double>> scores = ScoresReusing(need, *b);
    if (!scores.ok()) return scores.status();
    for (size_t i = 0; i < need.size(); ++i) {
      need[i]->base = std::move((*b)[i]);
      need[i]->base_score = (*scores)[i];
      need[i]->base_known = true;
    }
  }
  return JudgeOnPool(pool, [&](size_t i) { return pool[i]->base_score; });
}

}  // namespace cdcca::cloud::internal
