// One MLLM of the family above the shared vision encoder: query adapter (visual tokens ->
// L query outputs -> LM prefix) + decoder LM. Teacher and student are both MllmImpl,
// built from different TowerConfigs.
//
// Sequence layout seen by the LM: [L visual queries][prompt, left-padded][answer]. Text
// positions are numbered consecutively after the prefix, padding takes none.
//
// Hooks for the other modules:
//   - MllmOutput::queries         Q, the query-adapter output (query alignment)
//   - MllmOutput::representation  R, the LM hidden state after lm_layers/2 layers at the
//                                 text positions (representation alignment)
//   - MllmOutput::logits / GenerateResult::step_logits: per-token distributions (entropy)
//   - StochasticPasses: M dropout passes of the query adapter as one batched forward;
//     StochasticAttention: only their cross-attention masses, at a fraction of the cost.
//
// Parameter names: "qa.*" (query_adapter.h) and "lm.*" (language_model.h).
// Thread-safety: as torch modules; concurrent const use under NoGradGuard is fine.
#ifndef CDCCA_DISTILL_MODEL_MLLM_H_
#define CDCCA_DISTILL_MODEL_MLLM_H_

#include <torch/torch.h>

#include <vector>

#include "distill/model/config.h"
#include "distill/model/language_model.h"
#include "distill/model/mllm_io.h"
#include "distill/model/query_adapter.h"

namespace cdcca::model {

class MllmImpl : public torch::nn::Module {
 public:
  explicit MllmImpl(const TowerConfig& config);

  // Teacher-forced pass. Dropout (config.dropout) is active only in train() mode.
  MllmOutput Forward(const MllmInput& input);

  // Teacher-forced passes of several question groups about one set of S scenes
  // (visual_tokens [S, N, d_vis], visual_mask [S, N] or undefined). The query adapter and
  // the LM over each scene's prefix run once for all groups; as the prefix comes first and
  // attention is causal, every group then gets the same sums as Forward on its rows (up to
  // rounding), with padding only up to its own longest question. Returns one output per
  // group, in order.
  std::vector<MllmOutput> ForwardGroups(const torch::Tensor& visual_tokens,
                                        const torch::Tensor& visual_mask,
                                        const std::vector<QuestionGroup>& groups);

  // Greedy decoding with a KV cache: prefill [prefix, prompt] once, then one position per
  // step. Stops when every row has emitted eos_id or after max_new_tokens. Runs under
  // NoGradGuard with dropout off whatever the mode.
  GenerateResult Generate(const torch::Tensor& visual_tokens, const torch::Tensor& visual_mask,
                          const torch::Tensor& prompt_ids, const torch::Tensor& prompt_valid,
                          int max_new_tokens, int64_t eos_id);

  // M stochastic passes over the part above the (cached) vision encoder, as one batched
  // forward of the query adapter (inputs repeated M times along the batch) with dropout
  // dropout_p on the projected tokens, cross-attention weights and MLP outputs. Variances
  // are population variances over the M passes. dropout_p == 0 yields M identical passes
  // and exactly zero variance. No gradients.
  StochasticStats StochasticPasses(const torch::Tensor& visual_tokens,
                                   const torch::Tensor& visual_mask, int passes, double dropout_p);

  // The attention half of StochasticPasses (attention_mass and attention_mass_variance;
  // queries and query_variance stay undefined), same distribution, a fraction of the work
  // (QueryAdapter::AttentionMassPasses). What UTS stage 2 runs on the device and in
  // `cdcca adapt-eval`.
  StochasticStats StochasticAttention(const torch::Tensor& visual_tokens,
                                      const torch::Tensor& visual_mask, int passes,
                                      double dropout_p);

  const TowerConfig& config() const { return config_; }
  QueryAdapter& query_adapter() { return qa_; }
  LanguageModel& language_model() { return lm_; }
  int representation_layer() const { return config_.lm_layers / 2; }

 private:
  TowerConfig config_;
  QueryAdapter qa_{nullptr};
  LanguageModel lm_{nullptr};
};
TORCH_MODULE(Mllm);

// Mean over generated tokens of the entropy (nats) of each step's softmax, counting tokens
// up to and including EOS (lengths + 1, capped at n). [B] float.
torch::Tensor MeanTokenEntropy(const GenerateResult& result);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_MLLM_H_
