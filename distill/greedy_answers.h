// Greedy answers to uplinked samples, as the cloud's teachers label them: on a cdcca family
// (model::Blip2Tower over a SamplePool) and on one side of a Hugging Face pair. The learners
// label with them, and the cloud's update guard (cloud/update_guard.h) compares a mirror's
// answers with the teacher's through them.
//
// Thread-safety: a call runs the model it is given; two calls on one model at once are safe
// only where its forward pass is (eval mode, no gradients: the family's towers).
#ifndef CDCCA_DISTILL_GREEDY_ANSWERS_H_
#define CDCCA_DISTILL_GREEDY_ANSWERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "distill/hf_akd.h"
#include "distill/learner.h"
#include "distill/sample_batch.h"
#include "model/family/blip2_tower.h"

namespace cdcca::distill {

// The greedy answers of `tower` (put in eval(), no gradients) to every sample of `pool`, in
// chunks of options.batch_size on the tower's device, at most options.max_answer_tokens
// each: per sample its tokens up to and including the first EOS (AnswerTokens).
std::vector<std::vector<int64_t>> GreedyAnswers(model::Blip2Tower& tower, const SamplePool& pool,
                                                const JobOptions& options);

// `side`'s greedy answer to `sample`, at most max_new_tokens: the prompt in the side's
// template and tokenizer, the sample's present tokens as the visual input, no gradients.
// Returns the decoded text with surrounding whitespace stripped; `ids` (optional) receives
// the answer's ids without the EOS (the pseudo-label HfPairDistiller trains on). An answer
// ends before an image placeholder id (model::MultimodalModel::image_token_id), which a
// model read back would take for an image position. Errors of the codec or the model.
// `entropy` (optional) receives the mean entropy (nats) of the distributions the answer's
// tokens were chosen from, EOS included (model::MeanStepEntropy): how sure the side is.
absl::StatusOr<std::string> GreedyAnswer(const HfPairSide& side, const HfSample& sample,
                                         int max_new_tokens, std::vector<int64_t>* ids = nullptr,
                                         double* entropy = nullptr);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_GREEDY_ANSWERS_H_
