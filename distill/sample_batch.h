// Uplinked samples as model inputs. A device sends, per kept sample, the indices of the
// visual tokens UTS kept and their features (compress/uplink_codec.h); the cloud rebuilds
// the encoder's token grid with zeros at the absent positions and a mask that hides them,
// so teacher and student both see exactly the token set the device kept.
//
// Thread-safety: plain values; functions are pure.
#ifndef CDCCA_DISTILL_SAMPLE_BATCH_H_
#define CDCCA_DISTILL_SAMPLE_BATCH_H_

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/uplink_codec.h"

namespace cdcca::distill {

// The samples of one job, visual part stacked (CPU tensors).
struct SamplePool {
  torch::Tensor visual_tokens;  // [P, N, d_vis] float32, zeros where a token is absent
  torch::Tensor visual_mask;    // [P, N] bool, true = kept by the device
  std::vector<std::vector<int64_t>> prompts;         // prompt token ids, non-empty
  std::vector<std::vector<int64_t>> device_answers;  // the device's own answer
  int64_t size() const { return static_cast<int64_t>(prompts.size()); }
};

// Builds the pool. INVALID_ARGUMENT (naming the sample id) if a sample's grid_tokens or
// feature_dim differ from the model's (num_tokens, d_vis), its features do not hold
// kept x dim values, an index is out of range or not strictly increasing, or its prompt is
// empty (the first answer token is predicted from the last prompt position).
absl::StatusOr<SamplePool> BuildSamplePool(
    const std::vector<const compress::UplinkSample*>& samples, int64_t num_tokens, int64_t d_vis);

// Text of a batch laid out as the Blip2Tower wants it: [prompt, left-padded][answer, right-padded].
struct TextBatch {
  torch::Tensor text_ids;    // [B, T] int64 (pad_id at padding)
  torch::Tensor text_valid;  // [B, T] bool
  // [B, T] int64: at column c the answer token that logits[:, c] must predict, -1 elsewhere.
  torch::Tensor targets;
  torch::Tensor answer_mask;  // [B, T] bool, true at the answer tokens themselves
  int64_t prompt_width = 0;   // Pmax: column of the first answer token
  std::vector<int64_t> prompt_lengths;
  std::vector<int64_t> answer_lengths;
};

// Collates prompts and answers (answers may be empty). CPU tensors.
TextBatch CollateText(const std::vector<std::vector<int64_t>>& prompts,
                      const std::vector<std::vector<int64_t>>& answers, int64_t pad_id);

// Rows `index` of `x` along dim 0 (an index_select with the index on x's device).
torch::Tensor SelectRows(const torch::Tensor& x, const std::vector<int64_t>& index);

// Answer tokens of row b of a greedy generation: tokens up to and including the first EOS
// (lengths[b] + 1, capped at the generated length).
std::vector<int64_t> AnswerTokens(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                  int64_t row);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_SAMPLE_BATCH_H_
