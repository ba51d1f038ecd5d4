// Inputs and outputs of one MLLM tower of the family (teacher or student): what the
// learner, AKD, the cloud and the device hand a tower and get back. Shared by the tower
// implementations (MllmImpl in mllm.h, Blip2TowerImpl in blip2_tower.h).
//
// Plain values holding tensors; thread-compatible.
#ifndef CDCCA_MODEL_FAMILY_MLLM_IO_H_
#define CDCCA_MODEL_FAMILY_MLLM_IO_H_

#include <torch/torch.h>

namespace cdcca::model {

struct MllmInput {
  torch::Tensor visual_tokens;  // [B, N, d_vis] float (the frozen encoder's output)
  torch::Tensor visual_mask;    // [B, N] bool, true = present; undefined = all present
  torch::Tensor text_ids;       // [B, T] int64: left-padded prompt, then answer tokens
  torch::Tensor text_valid;     // [B, T] bool, false = padding; undefined = all valid
  // Optional [B] int64: row b's scene is visual_tokens[scene_index[b]] (then visual_tokens
  // and visual_mask hold S scenes). Several questions about one scene then share a single
  // query-adapter pass, which does not depend on the question.
  torch::Tensor scene_index;
};

// One group of questions for Mllm::ForwardGroups: rows are questions about the scenes of
// the call, padded among themselves only.
struct QuestionGroup {
  torch::Tensor text_ids;     // [B, T] int64: left-padded prompt, then answer tokens
  torch::Tensor text_valid;   // [B, T] bool, false = padding; undefined = all valid
  torch::Tensor scene_index;  // [B] int64: row b is about scene scene_index[b]
  // Text columns whose logits are wanted: [logit_first, logit_first + logit_count);
  // logit_count < 0 = all. The last LM layer then runs its queries and MLP on those
  // columns only; logits are [B, logit_count, V]. Default: all.
  int64_t logit_first = 0;
  int64_t logit_count = -1;
};

struct MllmOutput {
  torch::Tensor logits;          // [B, T, V]; logits[:, t] predicts text token t + 1
  torch::Tensor queries;         // Q [B, L, qa_dim]
  torch::Tensor representation;  // R [B, T, d_model]
  torch::Tensor attention_mass;  // [B, N] cross-attention mass per visual token
};

struct GenerateResult {
  torch::Tensor tokens;       // [B, n] int64 greedy answer; after EOS filled with eos_id
  torch::Tensor lengths;      // [B] int64 tokens before EOS (or n if none)
  torch::Tensor step_logits;  // [B, n, V] the logits each token was chosen from
};

struct StochasticStats {
  torch::Tensor attention_mass;           // [M, B, N] per pass
  torch::Tensor queries;                  // [M, B, L, qa_dim] per pass
  torch::Tensor attention_mass_variance;  // [B, N] variance over passes
  torch::Tensor query_variance;           // [B, L] variance over passes, mean over channels
  // [B, N] VIS (model/arch/hf_model.h): variance over the passes of each visual token's
  // contribution to the Q-Former's cross-attention output, mean over features and layers.
  torch::Tensor token_variance;
};

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_MLLM_IO_H_
