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
#include "distill/hf_akd.h"

namespace cdcca::distill {

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
