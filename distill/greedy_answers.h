// Greedy answers to uplinked samples on one side of a Hugging Face pair, as the cloud's
// teachers label them. The learners label with them, and the cloud's update guard
// (cloud/update_guard.h) compares a mirror's answers with the teacher's through them.
//
// Thread-safety: a call runs the model it is given; two calls on one model at once are safe
// only where its forward pass is.
#ifndef CDCCA_DISTILL_GREEDY_ANSWERS_H_
#define CDCCA_DISTILL_GREEDY_ANSWERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "distill/pair_distiller.h"

namespace cdcca::distill {

// `side`'s greedy answer to `sample`, at most max_new_tokens: the prompt in the side's
// template and tokenizer, the sample's present tokens as the visual input, no gradients.
// Returns the decoded text with surrounding whitespace stripped; `ids` (optional) receives
// the answer's ids without the EOS (the pseudo-label PairDistiller trains on). An answer
// ends before an image placeholder id (model::MultimodalModel::image_token_id), which a
// model read back would take for an image position. Errors of the codec or the model.
// `entropy` (optional) receives the mean entropy (nats) of the distributions the answer's
// tokens were chosen from, EOS included (model::MeanStepEntropy): how sure the side is.
absl::StatusOr<std::string> GreedyAnswer(const PairSide& side, const PairSample& sample,
                                         int max_new_tokens, std::vector<int64_t>* ids = nullptr,
                                         double* entropy = nullptr);

// GreedyAnswer for several samples in one batch (the rows left-padded and masked; where the
// side reads frames, one batch for the samples with a frame and one for those without): each
// answer, its ids and entropy what GreedyAnswer gives the sample alone, up to the rounding of
// the batch's products. `ids` and `entropies` (optional) receive one entry per sample. An
// error that concerns one sample names it "sample <i>", i its index in `samples` (so do the
// other batched calls below).
absl::StatusOr<std::vector<std::string>> GreedyAnswers(
    const PairSide& side, const std::vector<const PairSample*>& samples, int max_new_tokens,
    std::vector<std::vector<int64_t>>* ids = nullptr, std::vector<double>* entropies = nullptr);

// `side`'s probability of answering `sample` with `answer`: the answer's ids in the side's
// codec (no specials), the side's first EOS appended, teacher-forced after the prompt as
// GreedyAnswer reads it (same template, same present tokens); the product of the ids'
// probabilities, in [0, 1]. The cloud's update guard scores a student's answer with it
// (cloud/update_guard.h, GuardMeasure::kTeacherProbability): with a calibrated teacher it is
// the chance that the answer is right. 1 for an empty answer on a side without an EOS.
// Errors of the codec or the model.
absl::StatusOr<double> AnswerProbability(const PairSide& side, const PairSample& sample,
                                         const std::string& answer);
// AnswerProbability for several samples and their answers in one teacher-forced batch (one
// answer per sample; InvalidArgument otherwise).
absl::StatusOr<std::vector<double>> AnswerProbabilities(
    const PairSide& side, const std::vector<const PairSample*>& samples,
    const std::vector<std::string>& answers);
// The same for answer ids as they are (nothing appended): the product of their probabilities
// teacher-forced after the prompt; 1 for no ids.
absl::StatusOr<double> AnswerIdsProbability(const PairSide& side, const PairSample& sample,
                                            const std::vector<int64_t>& ids);
absl::StatusOr<std::vector<double>> AnswerIdsProbabilities(
    const PairSide& side, const std::vector<const PairSample*>& samples,
    const std::vector<std::vector<int64_t>>& ids);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_GREEDY_ANSWERS_H_
