// BLIP-2 and InstructBLIP (transformers' Blip2ForConditionalGeneration and
// InstructBlipForConditionalGeneration) with a decoder LM (Llama family or OPT) or T5's
// encoder-decoder (Flan-T5):
//   pixel_values -> ViT (blip2_vision.h) -> Q-Former over the learned query tokens
//   (qformer.h; InstructBLIP also reads the instruction, tokenized by qformer_tokenizer/)
//   -> language_projection -> the image's Q rows of the LM input (blip2_inputs.h) -> DecoderLm,
//   or T5's encoder input, whose decoder then generates (t5_lm.h).
//
// Checkpoint names (5.x layout as ModelFolder gives them): vision_model.*, query_tokens,
// qformer.*, language_projection.*, and the LM under language_model.model.* (OPT:
// language_model.model.decoder.*) + language_model.lm_head.* (what transformers saves for
// these classes) or model.language_model.* + lm_head.*; T5 under language_model.{shared,
// encoder, decoder, lm_head}.*; a `model.` prefix on the other parts is accepted too.
//
// Precision: the ViT, the language projection and the LM compute in precision.dtype with
// their linear weights stored as precision.weights; the Q-Former and the query tokens compute
// in fp32 (transformers keeps them fp32: `_keep_in_fp32_modules`), their linears quantized
// the same way.
//
// Thread-safety: concurrent Generate calls are fine under NoGradGuard (no shared state
// besides the weights).
#ifndef CDCCA_MODEL_ARCH_BLIP2_H_
#define CDCCA_MODEL_ARCH_BLIP2_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/arch/blip2_vision.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/layers.h"
#include "model/arch/multimodal_model.h"
#include "model/arch/qformer.h"
#include "model/arch/t5_lm.h"
#include "model/hub/blip2_config.h"
#include "model/hub/model_folder.h"
#include "model/runtime/generation.h"

namespace cdcca::model {

// Where each part's tensors are in a folder (found by probing for a known tensor).
struct Blip2Prefixes {
  std::string vision;        // "vision_model."
  std::string query_tokens;  // "query_tokens" (a full tensor name)
  std::string qformer;       // "qformer."
  std::string projection;    // "language_projection."
  // "language_model.model." or "model.language_model." (+ "decoder." for OPT); T5: the
  // prefix of its whole tree, "language_model."
  std::string lm_body;
  std::string lm_head;  // "language_model.lm_head." or "lm_head." (T5: unused)
  bool t5 = false;      // the LM is T5's encoder-decoder
};
absl::StatusOr<Blip2Prefixes> FindBlip2Prefixes(const ModelFolder& folder);

// Loads the ViT from `<prefix>...`, taking the fused qkv bias either as `qkv.bias` [3H] or as
// `q_bias` + `v_bias` [H] (the k third is zero). Errors name the folder's file and tensor.
absl::Status LoadBlip2Vision(const ModelFolder& folder, const std::string& prefix,
                             Blip2VisionModelImpl& vision, torch::Device device);

struct Blip2Inputs {
  torch::Tensor pixel_values;  // [B, 3, S, S] float, processed as the checkpoint's processor
  // LM input ids [B, T] int64, already expanded (ExpandBlip2InputIds) for checkpoints with
  // an image token; without one, the prompt's ids (the queries are prepended).
  torch::Tensor input_ids;
  torch::Tensor attention_mask;          // [B, T] 1 = token, 0 = left padding; undefined = all ones
  torch::Tensor qformer_input_ids;       // InstructBLIP: [B, Tq] int64 (undefined for BLIP-2)
  torch::Tensor qformer_attention_mask;  // InstructBLIP: [B, Tq]; undefined = all ones
  // StochasticVisualTokens only: the vision model's output [1, N, E] (float), read instead
  // of running it on pixel_values.
  torch::Tensor image_embeds;
};

class Blip2ForConditionalGenerationImpl : public torch::nn::Module {
 public:
  Blip2ForConditionalGenerationImpl(const Blip2Config& config, const DecoderConfig& text,
                                    const WeightPrecision& precision);
  // With T5's encoder-decoder as the LM.
  Blip2ForConditionalGenerationImpl(const Blip2Config& config, const T5Config& text,
                                    const WeightPrecision& precision);

  // Reads config.json (model_type blip-2 or instructblip, text_config llama/qwen2/opt/t5),
  // builds the model and loads every weight onto `device`. Errors name the file and the
  // field/tensor.
  static absl::StatusOr<std::shared_ptr<Blip2ForConditionalGenerationImpl>> FromFolder(
      const ModelFolder& folder, const WeightPrecision& precision, torch::Device device);

  absl::Status Load(const ModelFolder& folder, torch::Device device);

  // The projected query outputs [B, Q, H_lm] (in the LM's dtype) for an image batch.
  torch::Tensor ImageQueries(const torch::Tensor& pixel_values,
                             const torch::Tensor& qformer_input_ids = {},
                             const torch::Tensor& qformer_attention_mask = {});

  // The LM's input embeddings [B, T', H_lm] with the queries in place, and the matching
  // attention mask (undefined when the input's was): a decoder's input, or T5's encoder
  // input. InvalidArgument on a wrong number of image tokens.
  absl::StatusOr<std::pair<torch::Tensor, torch::Tensor>> InputsEmbeds(const Blip2Inputs& in);

  // Logits [B, T', V] fp32 of one forward pass (no cache): what transformers' forward gives.
  // Decoder LMs only (T5's needs decoder ids: FailedPrecondition).
  absl::StatusOr<torch::Tensor> Logits(const Blip2Inputs& in);

  // Greedy answer (GreedyGenerateFromEmbeds over the merged embeddings; T5GreedyGenerate for
  // T5, whose tokens are the decoder's after its start token). Torch errors are returned as
  // Internal.
  absl::StatusOr<GreedyResult> Generate(const Blip2Inputs& in, const GreedyOptions& options);

  // UTS stage 2 (VIS, multimodal_model.h VisualTokenPassOptions) for one image: the M passes run
  // the Q-Former once on M dropped-out copies of the ViT's tokens; F is each token's contribution
  // to the cross-attention output of every cross-attending layer. InvalidArgument for a batch
  // other than one, inputs InputsEmbeds refuses or bad options; torch errors as Internal.
  absl::StatusOr<VisualTokenPasses> StochasticVisualTokens(const Blip2Inputs& in,
                                                           const VisualTokenPassOptions& options);

  // The LM input ids for a tokenized prompt (image tokens prepended when the config has an
  // image token id).
  std::vector<int64_t> ExpandInputIds(const std::vector<int64_t>& prompt_ids) const;

  // The LM's token embeddings [B, T] -> [B, T, E] (the decoder's embed_tokens, T5's shared).
  torch::Tensor EmbedTokens(const torch::Tensor& ids);
  // Greedy decoding from merged embeddings (InputsEmbeds' output) with either LM.
  GreedyResult GenerateFromEmbeds(const torch::Tensor& embeds, const torch::Tensor& mask,
                                  const GreedyOptions& options);
  bool is_encoder_decoder() const { return !t5_language_model.is_empty(); }
  // The ids generation stops at by the LM's config (generation_config.json may override).
  std::vector<int64_t> ConfigEosTokenIds() const;

  const Blip2Config& config() const { return config_; }
  const WeightPrecision& precision() const { return precision_; }

  Blip2VisionModel vision_model{nullptr};
  torch::Tensor query_tokens;  // [1, Q, H_qformer] fp32
  QFormerModel qformer{nullptr};
  Linear language_projection{nullptr};
  // The LM, registered as "language_model": a decoder LM, or T5 (exactly one is non-null).
  DecoderLm language_model{nullptr};
  T5ForConditionalGeneration t5_language_model{nullptr};

 private:
  // InvalidArgument unless the instruction ids fit the layout and pixel_values are
  // [B (1 when one_image), C, S, S] for the tower.
  absl::Status CheckImageInputs(const Blip2Inputs& in, bool one_image) const;
  // The vision tower, query tokens, Q-Former and projection (to `lm_width`).
  void BuildImageSide(int64_t lm_width);

  Blip2Config config_;
  WeightPrecision precision_;
};
TORCH_MODULE(Blip2ForConditionalGeneration);

// The MultimodalModel of a blip-2 / instructblip folder (multimodal_model.cc dispatches here).
// ExpandPrompt leaves the text as it is (the processor adds no placeholder to the text; the
// image tokens go before BOS, so they cannot be written into it); ExpandImageTokens prepends
// num_query_tokens image tokens to the tokenized prompt. Generate also accepts the prompt's
// ids without them (no image token at all) and prepends them itself. InstructBLIP needs
// qformer_input_ids (the prompt in qformer_tokenizer/'s WordPiece).
absl::StatusOr<std::unique_ptr<MultimodalModel>> LoadBlip2Model(const ModelFolder& folder,
                                                                const WeightPrecision& precision,
                                                                torch::Device device);

// The MultimodalModel of a model built in memory (pretraining's): the same as LoadBlip2Model
// gives for the folder it would be saved as (tensors under transformers' names, the LM body
// under "language_model.model."), sharing `model`'s weights. Generation stops at
// `eos_token_ids`.
std::unique_ptr<MultimodalModel> WrapBlip2Model(
    std::shared_ptr<Blip2ForConditionalGenerationImpl> model, std::vector<int64_t> eos_token_ids,
    torch::Device device);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_BLIP2_H_
