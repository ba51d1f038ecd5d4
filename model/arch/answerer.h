// Answerer: a Hugging Face multimodal folder (model, tokenizer, image processor) loaded
// once and answering greedily, as transformers' processor + generate do. What `cdcca
// generate` / `cdcca answer` and `cdcca-device` on a Hub folder run; no flags here, so any
// program can link it.
#ifndef CDCCA_MODEL_ARCH_HF_ANSWERER_H_
#define CDCCA_MODEL_ARCH_HF_ANSWERER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "datasets/image.h"

namespace cdcca::tokenizer {
class Tokenizer;
}  // namespace cdcca::tokenizer

namespace cdcca::model {

struct GenerateReply {
  std::vector<int64_t> prompt_ids;  // the tokenized prompt, before image-token expansion
  std::vector<int64_t> input_ids;   // LM input after image-token expansion
  std::vector<int64_t> tokens;      // generated ids (eos included when produced)
  std::string text;                 // decoded, special tokens skipped
  std::vector<float> first_logits;
  // Mean over the generated tokens (EOS included) of the entropy of the softmax each was
  // chosen from, nats: UTS stage 1's score. Only with AnswerRgb's `with_entropy` (it keeps
  // every step's logits, which rules out the fast CUDA decode path); 0 otherwise.
  double mean_entropy = 0;
  double seconds = 0;  // load excluded
};

// UTS stage 2 on one frame (MultimodalModel::StochasticVisualTokens, multimodal_model.h).
struct VisualTokenReply {
  int64_t tokens = 0;                    // N visual tokens
  int64_t dim = 0;                       // D per token
  std::vector<float> features;           // N x D row-major: the tokens a device uplinks
  std::vector<float> variance;           // N: VIS (multimodal_model.h, Eq. 3), higher = keep first
  std::vector<float> relative_variance;  // N: VIS over F's mean square (an ablation)
  // N each, from the same passes (ablations): the mean attention mass each token receives,
  // and its variance over the passes.
  std::vector<float> attention_mass;
  std::vector<float> attention_variance;
  double seconds = 0;
};

class MultimodalModel;
struct ChatTemplate;
struct GreedyResult;
struct ImageProcessorConfig;
struct PixelValues;
struct MultimodalInputs;

// A loaded folder ready to answer: model, tokenizer and image processor settings.
// Not thread-safe.
class Answerer {
 public:
  // Errors name the file and field (model, tokenizer, processor) or the flag.
  static absl::StatusOr<std::unique_ptr<Answerer>> Load(const std::string& model_dir,
                                                        const std::string& precision,
                                                        const std::string& device);
  ~Answerer();
  // Greedy answer for an image file and the processor's prompt text (with <image>).
  absl::StatusOr<GenerateReply> Answer(const std::string& image_path, const std::string& prompt,
                                       int64_t max_new_tokens);
  // The same for decoded RGB pixels (height x width x 3, row-major); `source` names the
  // image in errors. `with_entropy` fills GenerateReply::mean_entropy.
  absl::StatusOr<GenerateReply> AnswerRgb(const uint8_t* rgb, int width, int height,
                                          const std::string& source, const std::string& prompt,
                                          int64_t max_new_tokens, bool with_entropy = false);
  // AnswerRgb (with the entropy) through the vision tower's tokens: MultimodalModel::
  // EncodeImages, then GenerateFromTokens, which is what a cloud mirror computes from the
  // same tokens. `visual` receives the tokens (features N x D; no variance): what a device
  // uplinks.
  absl::StatusOr<GenerateReply> AnswerRgbFromTokens(const uint8_t* rgb, int width, int height,
                                                    const std::string& source,
                                                    const std::string& prompt,
                                                    int64_t max_new_tokens,
                                                    VisualTokenReply* visual);
  // UTS stage 2 (VIS, multimodal_model.h VisualTokenPassOptions) for the same frame and prompt as
  // AnswerRgb: `passes` MC-dropout passes at rate `dropout_p`, drawn from `seed`.
  absl::StatusOr<VisualTokenReply> VisualTokenVarianceRgb(const uint8_t* rgb, int width, int height,
                                                          const std::string& source,
                                                          const std::string& prompt, int passes,
                                                          double dropout_p, uint64_t seed);
  // The same from the vision tower's tokens of the frame (`tokens`: count x dim values, row by
  // row, as AnswerRgbFromTokens gives them in `visual`), without running the processor and
  // the tower again. Equal to VisualTokenVarianceRgb on that frame.
  absl::StatusOr<VisualTokenReply> VisualTokenVarianceFromTokens(const std::vector<float>& tokens,
                                                                 int64_t count, int64_t dim,
                                                                 const std::string& prompt,
                                                                 int passes, double dropout_p,
                                                                 uint64_t seed);

  // ---- The jpeg uplink (compress/uplink_codec.h): the frame instead of its tokens ----

  // The size of every image the processor hands the tower (its resize and crop), or
  // FAILED_PRECONDITION when that size depends on the image (no fixed crop or resize).
  absl::StatusOr<std::pair<int, int>> TowerInputSize() const;
  // The frame as the processor resizes and crops it for the tower, as JPEG at `quality`:
  // what a device uplinks in place of the tokens.
  absl::StatusOr<std::string> TowerInputJpeg(const uint8_t* rgb, int width, int height,
                                             int quality) const;
  // The tower's tokens (N x D, row-major; VisualTokenReply::features) of such a JPEG: its
  // declared size is checked against TowerInputSize before anything decodes it, then the
  // processor's value steps (no resize) and the tower. INVALID_ARGUMENT for a frame of
  // another size or not a JPEG, DATA_LOSS for one that does not decode; `source` names it.
  absl::StatusOr<VisualTokenReply> TowerTokensOfJpeg(absl::string_view jpeg,
                                                     const std::string& source);
  // The first two steps of TowerTokensOfJpeg, no model run: the frame's pixel values as the
  // tower takes them (what a student that trains its vision side reads). The same errors.
  absl::StatusOr<PixelValues> TowerPixelsOfJpeg(absl::string_view jpeg,
                                                const std::string& source) const;
  // The first step of TowerTokensOfJpeg alone, no model run: the frame checked and decoded
  // to the tower's input size, with the same errors.
  absl::StatusOr<datasets::Image> DecodeTowerFrame(absl::string_view jpeg,
                                                   const std::string& source) const;

  // config.json's model_type: "llava", "blip-2" or "instructblip".
  std::string model_type() const;

  // The parts, for the cloud's training job (distill/pair_distiller.h), which feeds uplinked tokens
  // rather than frames. Owned by the answerer; valid while it lives.
  MultimodalModel& model() { return *model_; }
  const tokenizer::Tokenizer& tokenizer() const { return *tokenizer_; }
  // InstructBLIP's Q-Former tokenizer, else null.
  const tokenizer::Tokenizer* qformer_tokenizer() const { return qformer_tokenizer_.get(); }

 private:
  Answerer() = default;
  // The processor's inputs for one frame and prompt; `ids` receives the prompt's ids and
  // the LM's (GenerateReply's prompt_ids and input_ids).
  absl::Status Prepare(const uint8_t* rgb, int width, int height, const std::string& source,
                       const std::string& prompt, MultimodalInputs* in, GenerateReply* ids);
  // Prepare's text half: the prompt's ids (and InstructBLIP's Q-Former ids) into `in`.
  absl::Status PrepareText(const std::string& prompt, MultimodalInputs* in, GenerateReply* ids);
  // The stage-2 passes on prepared inputs, as a reply.
  absl::StatusOr<VisualTokenReply> VisualTokenPassesOn(const MultimodalInputs& in, int passes,
                                                       double dropout_p, uint64_t seed);
  // Fills `reply`'s tokens, text, first logits and (from step logits) mean entropy.
  void Finish(const GreedyResult& result, GenerateReply* reply) const;
  // The size every image `processor` resizes and crops to, or FAILED_PRECONDITION.
  static absl::StatusOr<std::pair<int, int>> FixedOutputSize(const ImageProcessorConfig& processor);
  std::unique_ptr<MultimodalModel> model_;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  // InstructBLIP's Q-Former tokenizer (qformer_tokenizer/), else null.
  std::unique_ptr<tokenizer::Tokenizer> qformer_tokenizer_;
  std::unique_ptr<ImageProcessorConfig> processor_;
  // TowerInputSize's answer, worked out once at Load (the processor does not change).
  absl::StatusOr<std::pair<int, int>> tower_input_size_ = std::pair<int, int>{0, 0};
};

// The prompt with a named template applied ("" = unchanged). InvalidArgument for an unknown
// name (the message lists the known ones).
absl::StatusOr<std::string> ApplyPromptTemplate(const std::string& name, const std::string& prompt);

// The template a program's template flag names for a model of `model_type`: "auto" is llava's
// for LLaVA and none for the BLIP-2 family, "none" is none (""), any other name must be one
// ApplyPromptTemplate knows (InvalidArgument listing them otherwise).
absl::StatusOr<std::string> ResolvePromptTemplate(const std::string& name,
                                                  const std::string& model_type);

// How a program turns its text (a question and any instruction) into the prompt the
// processor receives for one image: a folder's chat template, a named template, or none.
class PromptFormat {
 public:
  // The text as it is.
  PromptFormat() = default;
  // ApplyPromptTemplate's `name` ("" = none); InvalidArgument for an unknown name.
  static absl::StatusOr<PromptFormat> Named(const std::string& name);
  // The chat template rendered for one user turn of an image and the text
  // (chat_template.h OneImageUserTurn), with the generation prompt; InvalidArgument naming
  // the file when the template is outside the renderer's Jinja (checked here, once).
  static absl::StatusOr<PromptFormat> Chat(ChatTemplate chat);

  absl::StatusOr<std::string> Apply(const std::string& text) const;
  // "chat template DIR/chat_template.json", "template llava" or "none".
  std::string Describe() const;

 private:
  std::string name_;
  std::shared_ptr<const ChatTemplate> chat_;  // null unless Chat
};

// The format a program's template flag names for the folder `model_dir` of `model_type`:
// "auto" is the folder's chat template where it has one (LoadChatTemplate: chat_template.jinja,
// chat_template.json, processor_config.json, tokenizer_config.json), else
// ResolvePromptTemplate's "auto" (llava for LLaVA, none for the BLIP-2 family); "chat" is the
// folder's chat template (FailedPrecondition naming the folder where it has none); any other
// name is ResolvePromptTemplate's.
absl::StatusOr<PromptFormat> ResolvePromptFormat(const std::string& name,
                                                 const std::string& model_type,
                                                 const std::string& model_dir);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_HF_ANSWERER_H_
