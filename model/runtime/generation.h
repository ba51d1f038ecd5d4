// Greedy decoding shared by the Hugging Face models (LLaVA, BLIP-2, InstructBLIP): the model
// supplies "prefill" and "one step" logits; the loop picks argmax tokens, stops each row at
// an eos id or after max_new_tokens, and keeps the logits for scoring (entropy).
//
// Matches transformers' greedy generate: a row that produced eos is finished (it keeps
// receiving a filler token, never read), the loop ends when every row is finished.
#ifndef CDCCA_MODEL_RUNTIME_GENERATION_H_
#define CDCCA_MODEL_RUNTIME_GENERATION_H_

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "model/arch/decoder_lm.h"

namespace cdcca::model {

struct GreedyOptions {
  int64_t max_new_tokens = 32;
  std::vector<int64_t> eos_token_ids;  // empty = never stop early
  bool keep_step_logits = false;       // fill GreedyResult::step_logits
  // GreedyGenerateFromEmbeds' loop: kAuto takes the static-cache loop (static_decode.h) on
  // CUDA where it applies and the reference loop elsewhere; kStatic takes it wherever it
  // applies (CPU too: tests compare the two); kReference never. The environment variable
  // CDCCA_NO_STATIC_DECODE makes kAuto take the reference loop (for measuring the difference).
  enum class DecodePath { kAuto, kReference, kStatic };
  DecodePath decode_path = DecodePath::kAuto;
};

struct GreedyResult {
  // Per batch row: generated ids, ending with the eos id when one was produced.
  std::vector<std::vector<int64_t>> tokens;
  torch::Tensor first_logits;              // [B, V] fp32, CPU: what the first token came from
  std::vector<torch::Tensor> step_logits;  // per step [B, V] fp32 CPU (keep_step_logits)
};

// The model side of greedy decoding.
class GreedyStepper {
 public:
  virtual ~GreedyStepper() = default;
  // Runs the prompt; returns the last position's logits [B, V].
  virtual torch::Tensor Prefill() = 0;
  // Feeds the chosen ids [B, 1]; returns the next logits [B, V].
  virtual torch::Tensor Step(const torch::Tensor& ids) = 0;
};

GreedyResult GreedyGenerate(GreedyStepper& model, const GreedyOptions& options);

// A generated row's answer: its ids before the first of `eos_token_ids` (all of them when
// none was produced).
std::vector<int64_t> AnswerIds(const std::vector<int64_t>& generated,
                               const std::vector<int64_t>& eos_token_ids);

// UTS stage 1 (paper Eq. 2): the mean over row `row`'s generated tokens of the entropy (nats)
// of the distribution each was chosen from, in double precision. Needs keep_step_logits; 0
// when the row generated nothing or no step logits were kept.
double MeanStepEntropy(const GreedyResult& result, size_t row);

// Greedy decoding of a decoder LM from prompt embeddings [B, T, H] (a multimodal prefix
// already merged in) with an attention mask [B, T] (1 = token, 0 = left padding; undefined
// = all tokens), using a KV cache.
GreedyResult GreedyGenerateFromEmbeds(DecoderLmImpl& lm, const torch::Tensor& inputs_embeds,
                                      const torch::Tensor& attention_mask,
                                      const GreedyOptions& options);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_GENERATION_H_
