// Multimodal models loaded from Hugging Face folders: one interface that LLaVA,
// BLIP-2 and InstructBLIP implement, and LoadModel(), which dispatches on config.json's
// model_type. Programs (cdcca generate / answer, the device) use only this header.
//
// A model is not thread-safe: one Generate at a time.
#ifndef CDCCA_MODEL_ARCH_HF_MODEL_H_
#define CDCCA_MODEL_ARCH_HF_MODEL_H_

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "model/arch/layers.h"
#include "model/arch/named_tensors.h"
#include "model/hub/model_folder.h"
#include "model/runtime/generation.h"

namespace cdcca::model {

struct ModelOptions {
  // fp32 | bf16 | fp16 (compute and weights in that dtype), int8 | int4 (frozen linear
  // weights quantized at load; compute in fp32 on CPU, bf16 on CUDA). Default: fp32.
  std::string precision = "fp32";
  int64_t int4_group = 128;  // 32, 64 or 128
  torch::Device device = torch::kCPU;
  // The folder's weight pack at int8 / int4 (weight_pack.h): kUse reads the quantized weights
  // from one made from these weights where there is one (and says on stderr why one that is
  // there cannot be used); kWrite also writes one where there is none usable (`cdcca pack`);
  // kIgnore quantizes at load. The loaded model is the same bit for bit either way.
  enum class WeightPackUse { kUse, kWrite, kIgnore };
  WeightPackUse weight_pack = WeightPackUse::kUse;
  // Where set, told what the load did with the pack.
  struct WeightPackReport {
    std::string read;  // the pack read ("" = none)
    int64_t read_tensors = 0;
    std::string written;  // the pack written ("" = none)
    int64_t written_tensors = 0;
    int64_t written_bytes = 0;
  };
  WeightPackReport* weight_pack_report = nullptr;
};

// The weight storage and compute dtype an options set stands for. InvalidArgument naming
// the option for an unknown precision or int4 group. (bf16/fp16 on CPU are allowed, slow.)
absl::StatusOr<WeightPrecision> ResolveHfPrecision(const ModelOptions& options);

// What one generation call gets: the processor's outputs.
struct MultimodalInputs {
  torch::Tensor pixel_values;    // [B, 3, H, W] float, as the image processor gives them
  torch::Tensor input_ids;       // [B, T] int64: the LM prompt after image-token expansion
  torch::Tensor attention_mask;  // [B, T] (1 = token, 0 = left padding); undefined = all 1
  // InstructBLIP only: the instruction in the Q-Former's tokenizer.
  torch::Tensor qformer_input_ids, qformer_attention_mask;
  // [B, N, D] float, the vision tower's tokens as EncodeImages gives them. Where defined,
  // StochasticVisualTokens reads them instead of running the tower on pixel_values (which
  // may then be undefined): UTS stage 2 on the tokens the answer already computed.
  torch::Tensor visual_tokens;
};

// UTS stage 2 on a Hugging Face model: VIS, Variance-Informed Sampling (paper Sec. 3.2,
// Eq. 3). M stochastic passes over one image and prompt, run as one batch. In pass m,
// element-wise (inverted) dropout at rate p acts on the encoded visual tokens the model reads:
// every feature of every token is zeroed with probability p and the rest scaled by 1/(1-p),
// so a pass perturbs what each token says instead of deleting tokens. The model's own dropout
// sites run at the same rate (the Q-Former's embedding output, cross-attention weights and
// query feed-forward; the LM's attention and MLP outputs before each residual add).
// F_m(i), token i's representation in pass m, is taken where the model acts on the token:
//   BLIP-2 / InstructBLIP: in every cross-attending Q-Former layer, the token's contribution
//     to the query rows' cross-attention output (its value vector times the attention weight
//     the queries put on it, summed over queries, heads concatenated), the layers
//     concatenated. A visual token reaches the rest of the model only through this.
//   LLaVA: what the first RepresentationLayer() (half) LM layers add to the token's row (the
//     hidden state there minus the pass's dropped-out input row): the state the upper half of
//     the LM reads the token from (its keys and values) and where AKD takes R. The input is
//     subtracted because it reaches that state unchanged through the residual path, which
//     would make the variance the dropout's own noise, p/(1-p) times the row's squares.
// The score is Eq. 3 per feature, (1/M) sum_m (F_m - mean)^2, averaged over F's features.
// Nothing is trained for it, so it works on any checkpoint. The attention mass each token
// receives (BLIP-2: cross-attention averaged over cross-attending layers, heads and queries;
// LLaVA: the last prompt position's self-attention averaged over layers and heads), from the
// same passes, is kept for the attention_mass and attention_variance ablations.
struct VisualTokenPassOptions {
  int passes = 8;          // M, 1-256
  double dropout_p = 0.1;  // p, in (0, 1)
  // The draw: the input masks come from a CPU generator of this seed, and LibTorch's default
  // CPU generator is seeded with it for the call and restored afterwards (so the model's own
  // dropout on the CPU is reproducible too; on CUDA it draws from CUDA's generator).
  uint64_t seed = 0;
  // Fill VisualTokenPasses::features and input_masks (M x N x |F| floats more). For checks.
  bool keep_features = false;
  // [M, N, D] float input multipliers (0 or 1/(1-p)) to use instead of drawing; then the
  // model's own dropout is off (passes and dropout_p are not read). For reference checks.
  torch::Tensor input_masks;
};

struct VisualTokenPasses {
  // [N, D] fp32: the vision tower's output tokens the model consumes (BLIP-2: the ViT's last
  // hidden state after its layer norm; LLaVA: the selected layer(s) before the projector).
  // What a device uplinks, and what a teacher with the same tower reads.
  torch::Tensor tokens;
  torch::Tensor variance;  // [N] fp32: VIS, Eq. 3 on F averaged over F's features
  // [N] fp32: the same variance over F's mean square (VisRelativeVariance): an ablation
  torch::Tensor relative_variance;
  torch::Tensor mass;  // [M, N] fp32: attention mass per pass (ablations)
  // With keep_features: [M, N, |F|] fp32 F_m, and the [M, N, D] input multipliers the passes
  // used (D: the Q-Former's encoder width, or the LM's hidden size for LLaVA).
  torch::Tensor features;
  torch::Tensor input_masks;
};

// The input multipliers a pass options set stands for, [M, n, d] fp32 on the CPU:
// options.input_masks when defined, else Bernoulli(1 - p) / (1 - p) drawn from a CPU generator
// seeded with options.seed. InvalidArgument for passes outside 1-256, dropout_p outside
// (0, 1), or given masks that are not [M, n, d].
absl::StatusOr<torch::Tensor> VisInputMasks(const VisualTokenPassOptions& options, int64_t n,
                                            int64_t d);

// Seeds LibTorch's default CPU generator for a scope and restores its state afterwards, under
// a process-wide lock (so two seeded scopes never interleave their draws).
class ScopedTorchSeed {
 public:
  explicit ScopedTorchSeed(uint64_t seed);
  ~ScopedTorchSeed();
  ScopedTorchSeed(const ScopedTorchSeed&) = delete;
  ScopedTorchSeed& operator=(const ScopedTorchSeed&) = delete;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Eq. 3 over the passes: the population variance over dim 0 ([M, ...] -> [...]); identical
// passes give exactly zero.
torch::Tensor PassVariance(const torch::Tensor& x);

// VIS from F [M, ..., |F|]: Eq. 3 per feature averaged over the last dim ([M, ..., |F|] ->
// [...]), fp32.
torch::Tensor VisVariance(const torch::Tensor& features);
// VIS made scale-free: per token, Eq. 3's variance summed over F's features divided by the
// pass mean's squared norm ([M, ..., |F|] -> [...]), fp32; 0 where F is 0 in every pass.
// Element-wise input dropout moves a token's F in proportion to the token's own size, so
// plain VIS also ranks by |F|; this ranks by how much F moves relative to it.
torch::Tensor VisRelativeVariance(const torch::Tensor& features);
// Both of them into out->variance and out->relative_variance (CPU), from one pass variance.
void SetVisScores(const torch::Tensor& features, VisualTokenPasses* out);

// The paper's trainable set on a Hugging Face model: LoRA on the LM's q_proj and
// v_proj of every layer (and gate/up/down_proj with lora_mlp), the LM's norm weights and
// linear biases, and the Q-Former's query_tokens (BLIP-2, InstructBLIP) or the projector's
// biases (LLaVA). The vision tower, the Q-Former's own weights, embeddings and the LM head
// stay frozen unless an option below adds LoRA to them.
struct AdapterOptions {
  int64_t lora_rank = 8;     // > 0
  double lora_alpha = 16.0;  // the LoRA product is scaled by alpha / rank
  bool lora_mlp = false;     // LoRA on the MLP's three projections too
  // BLIP-2 / InstructBLIP: LoRA on the Q-Former's attention query and value too (self- and
  // cross-attention, every layer), where the student reads the image; drawn from seed + 1, so
  // the LM's LoRA is the same with it or without. LLaVA refuses it.
  bool lora_qformer = false;
  // LoRA on the projector into the LM too: LLaVA's multi_modal_projector (linear_1 and
  // linear_2), BLIP-2's and InstructBLIP's language_projection; the last step from what the
  // vision side encodes to what the LM reads. Drawn from seed + 2, so the other LoRA is the
  // same with it or without.
  bool lora_projector = false;
  // The vision side of the tower itself: LoRA on its attention (BLIP-2's and InstructBLIP's
  // fused qkv, CLIP's and SigLIP's q_proj and v_proj) and the weight and bias of its
  // LayerNorms, in the layers whose output the model reads (LLaVA stops at its feature
  // layer). A student with it trains from frames (TokenInputs::pixel_values); drawn from
  // seed + 3, so the other LoRA is the same with it or without.
  bool lora_vision = false;
  // With lora_vision: LoRA on the tower's MLP too (fc1 and fc2 of the same layers), drawn from
  // seed + 4, so the other LoRA is the same with it or without. InvalidArgument without
  // lora_vision.
  bool lora_vision_mlp = false;
  // LoRA A's draw (B starts at zero): a device and its cloud mirror must use the same seed to
  // start equal. LibTorch's process-wide generator is saved and restored around the draw.
  uint64_t seed = 0;
};

// One training forward on uplinked visual tokens: what the cloud's AKD job feeds a teacher or
// a student mirror. Rows are left-padded: the image positions and prompt, then the answer.
struct TokenInputs {
  torch::Tensor visual_tokens;  // [B, N, D] float: VisualTokenPasses::tokens of each image
  // [B, C, H, W] float, as the image processor gives them: where defined, the model runs its
  // own vision tower on them (differentiable in a vision-side trainable set) and ignores
  // visual_tokens.
  torch::Tensor pixel_values;
  torch::Tensor visual_present;  // [B, N] bool (true = kept by UTS); undefined = all kept
  // [B, T] int64: the LM ids as Generate takes them (the image placeholder expanded,
  // ExpandImageTokens) followed by the answer.
  torch::Tensor input_ids;
  torch::Tensor attention_mask;  // [B, T] 1 = token, 0 = padding; undefined = all tokens
  // InstructBLIP only: the instruction in the Q-Former's tokenizer [B, Tq] (and its mask).
  torch::Tensor qformer_input_ids, qformer_attention_mask;
  // > 0: TokenForward::logits holds only the last N positions of each row ([B, N, V], N <= T),
  // the LM head run on those alone: rows are left-padded, so a batch whose longest answer has
  // A tokens finds every answer predictor among the last A + 1. 0 = every position.
  int64_t logits_tail = 0;
  // [B] int64: per row the length of its prompt (the expanded prompt ids that begin the row's
  // tokens; the rest is the answer). Encoder-decoder LMs (T5) need it for ForwardTokens (the
  // encoder reads the prompt, the decoder the answer); decoder LMs ignore it.
  torch::Tensor prompt_lengths;
};

struct TokenForward {
  // [B, T, V] fp32: logits[:, t] predicts input_ids[:, t + 1] (the last TokenInputs::logits_tail
  // positions alone where that is set: [B, N, V])
  torch::Tensor logits;
  // Q, the alignment hook of the visual side: BLIP-2's Q-Former outputs [B, Q, H_qformer];
  // LLaVA's projected image tokens [B, N, H_lm]. fp32.
  torch::Tensor queries;
  torch::Tensor queries_present;  // [B, Q or N] bool: rows that stand for kept tokens
  // R, the LM's hidden state after RepresentationLayer() layers [B, T, H_lm], fp32.
  torch::Tensor representation;
};

class MultimodalModel {
 public:
  virtual ~MultimodalModel() = default;

  virtual std::string model_type() const = 0;
  // The prompt text after the processor's image-placeholder expansion (LLaVA: "<image>" ->
  // one image token per image feature), ready for the tokenizer.
  virtual std::string ExpandPrompt(const std::string& prompt) const = 0;
  // The same expansion on ids (identical when the placeholder is one added token).
  virtual std::vector<int64_t> ExpandImageTokens(const std::vector<int64_t>& ids) const = 0;
  // Greedy answer. InvalidArgument for inputs that do not fit the model (image size, image
  // token count); errors from the tensor library become Internal.
  virtual absl::StatusOr<GreedyResult> Generate(const MultimodalInputs& inputs,
                                                const GreedyOptions& options) = 0;
  // UTS stage 2 (VIS, VisualTokenPassOptions) for a batch of one image and prompt (the same
  // inputs Generate takes). InvalidArgument as Generate, for a batch other than one, or for
  // options VisInputMasks refuses.
  virtual absl::StatusOr<VisualTokenPasses> StochasticVisualTokens(
      const MultimodalInputs& inputs, const VisualTokenPassOptions& options) = 0;
  // The ids generation stops at (generation_config.json, else config.json).
  virtual std::vector<int64_t> eos_token_ids() const = 0;
  // The id that stands for an image position in the LM's input, or -1 where the model has
  // none (a BLIP-2 config without image_token_index prepends its queries instead).
  virtual int64_t image_token_id() const = 0;
  // Bytes of weights held (quantized weights at their packed size).
  virtual int64_t ResidentBytes() = 0;
  virtual torch::Device device() const = 0;

  // ---- Training on uplinked visual tokens ----

  // The vision tower's output per image, {N, D}: VisualTokenPasses::tokens' shape, what a
  // device uplinks and TokenInputs::visual_tokens holds.
  virtual std::pair<int64_t, int64_t> VisualTokenShape() const = 0;
  // The vision tower's output for the processor's pixels [B, N, D] fp32 on the CPU (no
  // gradients): the tokens GenerateFromTokens and ForwardTokens take. InvalidArgument for
  // pixels that do not fit the tower.
  virtual absl::StatusOr<torch::Tensor> EncodeImages(const MultimodalInputs& inputs) = 0;

  // Adds LoRA (AdapterOptions) once; InvalidArgument for a rank <= 0 or a second call.
  virtual absl::Status AddAdapters(const AdapterOptions& options) = 0;
  // The trainable set (AdapterOptions) under the checkpoint's tensor names (LoRA as
  // "<linear>.lora_a" [r, in] and "<linear>.lora_b" [out, r]), in a fixed order; the tensors
  // alias the model. Empty LoRA part before AddAdapters.
  virtual NamedTensors TrainableParameters() = 0;
  // The forward pass behind the AKD losses, differentiable in the trainable set when grad
  // mode is on. Absent visual tokens (not kept by UTS) are masked out: BLIP-2's Q-Former
  // keys, LLaVA's image positions. InvalidArgument for inputs that do not fit the model; torch
  // errors as Internal.
  virtual absl::StatusOr<TokenForward> ForwardTokens(const TokenInputs& inputs) = 0;
  // Greedy answers from visual tokens (input_ids: the expanded prompt only), no gradients.
  virtual absl::StatusOr<GreedyResult> GenerateFromTokens(const TokenInputs& inputs,
                                                          const GreedyOptions& options) = 0;
  // The layer R is taken after: half the LM's layers.
  virtual int64_t RepresentationLayer() const = 0;
  // The whole model as a module (train/eval, parameters, digest).
  virtual torch::nn::Module& module() = 0;
};

// Selects `model`'s trainable set (AdapterOptions) by name: parameters whose name starts with
// `lm_prefix` and are a LoRA factor, a norm module's parameter or a leaf "bias", plus those
// `extra` accepts. `rename` maps a module name to the checkpoint's. Used by the loaders.
NamedTensors SelectHfTrainable(const torch::nn::Module& model, const std::string& lm_prefix,
                               const std::function<bool(const std::string&)>& extra,
                               const std::function<std::string(const std::string&)>& rename);

// InvalidArgument unless inputs.input_ids is [b, T] and inputs.visual_present (when defined)
// is [b, n]. For ForwardTokens implementations.
absl::Status CheckTokenInputs(const TokenInputs& inputs, int64_t b, int64_t n);

// GenerateFromTokens' decoding from merged embeddings, without gradients: the reference loop
// (dropped image tokens leave holes in the mask, which it numbers positions from; the static
// loop assumes left padding). Torch errors as Internal naming `what`.
class DecoderLmImpl;
absl::StatusOr<GreedyResult> GreedyFromTokenEmbeds(DecoderLmImpl& lm, const torch::Tensor& embeds,
                                                   const torch::Tensor& mask,
                                                   const GreedyOptions& options,
                                                   const std::string& what);

// InvalidArgument for lora_vision_mlp without lora_vision (the families' AddAdapters).
absl::Status CheckVisionMlp(const AdapterOptions& options);

// LoRA on the q/v (and with lora_mlp the MLP) projections of every layer of `lm`, drawn from
// options.seed with LibTorch's generator restored afterwards. InvalidArgument for rank <= 0.
absl::Status AddDecoderLora(DecoderLmImpl& lm, const AdapterOptions& options);

// LoRA of options' rank and alpha on one linear: A drawn uniform(+-1/sqrt(in)) from `gen` (a
// CPU generator, whatever device the model is on), B zero. For the loaders' adapters.
void AddLinearLora(Linear& linear, const AdapterOptions& options, at::Generator& gen);

// The identity of a folder's vision tower, which Register compares between a device and its
// cloud's teacher: a hash over the tower's tensors as stored (names below the
// tower's prefix, shapes, fp32 values) and, for LLaVA, the feature layers and select strategy
// that decide which of its hidden states are the tokens. Independent of the precision a model
// is loaded at. Errors as LoadModel's.
absl::StatusOr<uint64_t> TowerFingerprint(const std::string& dir);

// "cpu" or "cuda" (FailedPrecondition where no CUDA device is available); InvalidArgument
// naming --device otherwise. (Defined beside the Answerer, which parses it too.)
absl::StatusOr<torch::Device> ParseDevice(const std::string& name);

// Opens `dir` and builds the model config.json names (model_type llava; blip-2 and
// instructblip where registered). Errors name the file and the field or tensor.
absl::StatusOr<std::unique_ptr<MultimodalModel>> LoadModel(const std::string& dir,
                                                           const ModelOptions& options);

// One architecture's loader, for the dispatch table in multimodal_model.cc.
using ModelLoader = absl::StatusOr<std::unique_ptr<MultimodalModel>> (*)(
    const ModelFolder& folder, const WeightPrecision& precision, torch::Device device);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_HF_MODEL_H_
