// Building blocks of the Hugging Face architectures whose weights may be held at device
// precision: a linear layer (fp32/bf16/fp16 weight, or int8 per output channel / int4 in
// groups quantized as the checkpoint's floats arrive, keeping no full-precision copy), an
// embedding and RMSNorm. Parameter names are transformers' ("weight", "bias").
//
// Before loading, parameters are zero-stride placeholders of the right shape (no memory);
// ModelFolder::LoadInto replaces them. Modules are not thread-safe for mutation; concurrent
// forwards under NoGradGuard are fine.
#ifndef CDCCA_MODEL_ARCH_HF_LINEAR_H_
#define CDCCA_MODEL_ARCH_HF_LINEAR_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "model/family/config.h"
#include "model/hub/model_folder.h"
#include "model/runtime/fp8_product.h"
#include "model/runtime/quantize.h"

namespace cdcca::model {

// How the frozen weights of a loaded Hugging Face model are held and computed.
struct WeightPrecision {
  // Storage of linear weights: fp32 = float in `dtype`; int8/int4 = quantized at load.
  Precision weights = Precision::kFp32;
  int64_t int4_group = 128;  // 32, 64 or 128
  // Compute dtype of activations, norms, embeddings and unquantized weights:
  // kFloat, kBFloat16 or kHalf.
  torch::ScalarType dtype = torch::kFloat;
};

// A zero-stride tensor of `shape` (one element of storage), standing for a parameter until
// the checkpoint fills it. Make it on the device it stands on: .to() of it copies the whole
// shape there (LinearImpl::to shrinks it to its element before moving).
torch::Tensor Placeholder(c10::IntArrayRef shape, torch::ScalarType dtype,
                          torch::Device device = torch::kCPU);

struct LinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = false;
  WeightPrecision precision;
};

// y = x W^T + b (+ the LoRA term once AddLora ran). Quantized weights on CPU with fp32
// inputs run qmatmul.h's kernels on the packed bytes; elsewhere (CUDA) they are dequantized
// per call into the compute dtype.
class LinearImpl : public torch::nn::Module, public TensorSink {
 public:
  explicit LinearImpl(const LinearOptions& options);

  // Registers LoRA parameters "lora_a" [rank, in] (small random) and "lora_b" [out, rank]
  // (zero, so the layer's function is unchanged) and adds (alpha / rank) (x A^T) B^T to
  // forward from now on. Call after loading: they are not checkpoint tensors of the
  // architecture (ModelFolder::LoadInto would look for them). rank <= 0 does nothing.
  void AddLora(int64_t rank, double alpha);
  bool has_lora() const { return lora_a.defined(); }
  // alpha / rank (0 without LoRA).
  double lora_scale() const { return lora_scale_; }
  // The float weight with the LoRA product folded in (what a checkpoint without LoRA must
  // hold to compute the same function). Unquantized layers only.
  torch::Tensor MergedWeight() const;

  // With row segments active (model/arch/row_segments.h) that hold this layer's LoRA factors
  // or bias, each row takes its own segment's: the frozen product once over all rows.
  torch::Tensor forward(const torch::Tensor& x);

  // Takes "weight" (quantizing it when the precision says so) and "bias".
  absl::Status Adopt(const std::string& local_name, torch::Tensor tensor) override;
  // The packed "weight" of a quantized layer (a weight pack keeps it), and taking it back.
  const QuantizedWeight* Packed(const std::string& local_name) const override;
  absl::Status AdoptPacked(const std::string& local_name, const QuantizedWeight& q) override;
  // Takes an already packed weight of this layer's shape and precision (as QuantizeWeight
  // makes it), sharing its tensors: e.g. the embedding's rows for a tied LM head. The float
  // weight is dropped as in Adopt. InvalidArgument for an unquantized layer or other shapes.
  absl::Status AdoptQuantized(const QuantizedWeight& q);
  // The packed weight (undefined tensors before a quantized layer adopted its weight).
  const QuantizedWeight& quantized_weight() const { return q_; }
  // Whether forward(x) runs qmatmul.h's packed kernels: a quantized CPU weight, fp32 CPU
  // input, int8 or int4 groups of a multiple of 32.
  bool UsesPackedKernel(const torch::Tensor& x) const;

  bool quantized() const { return options_.precision.weights != Precision::kFp32; }
  // Keeps the weight dequantized (in the compute dtype), so that no product dequantizes it per
  // call any more: for a trainer, whose steps otherwise dequantize every frozen weight in the
  // forward and again in the backward pass. The values multiplied are the per-call path's
  // (EffectiveWeight). The packed bytes move to the host memory (quantized_weight() still
  // reads them there; a later to() moves the float copy alone), so an accelerator holds the
  // float weight instead of both. A no-op for an unquantized layer or one not loaded yet.
  void HoldDequantized();
  bool holds_dequantized() const { return held_.defined(); }
  // HoldDequantized's copy (undefined until it ran).
  const torch::Tensor& dequantized_weight() const { return held_; }
  // Keeps the weight as HoldDequantized does, but in FP8 for FP8 products
  // (model/runtime/fp8_product.h): every product with the base rounds its input and the weight
  // to e4m3 per row, natively where the GPU runs them, emulated elsewhere. The FP8 copies
  // replace the float one (the same bytes as bf16); the packed bytes move to the host. A
  // no-op for an unquantized layer or one not loaded yet, or one already held either way.
  void HoldFp8();
  bool holds_fp8() const { return fp8_.w.values.defined(); }
  const Fp8Weight& fp8_weight() const { return fp8_; }
  // Undoes HoldDequantized or HoldFp8: the held copies go, the packed bytes come back to
  // the layer's device and the products read them per call again.
  void ReleaseHeld();
  // The effective weight [out, in] in the compute dtype.
  torch::Tensor EffectiveWeight() const;
  // Bytes held for the weight (quantized values + scales, or the float weight).
  int64_t WeightBytes() const;

  const LinearOptions& options() const { return options_; }

  // Module::to moves registered tensors only: these also move the packed weight of a
  // quantized layer, whose "weight" placeholder stays one element wherever it goes.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  torch::Tensor weight;
  torch::Tensor bias;    // undefined without bias
  torch::Tensor lora_a;  // undefined until AddLora
  torch::Tensor lora_b;

 private:
  LinearOptions options_;
  double lora_scale_ = 0.0;
  QuantizedWeight q_;   // set once a quantized layer adopted its weight
  torch::Tensor held_;  // HoldDequantized's copy (undefined until then)
  Fp8Weight fp8_;       // HoldFp8's copies (undefined until then)

  // x W^T + `bias_term` (undefined: none), without the LoRA term: the packed kernel, the
  // dequantizing product or torch's.
  torch::Tensor BaseForward(const torch::Tensor& x, const torch::Tensor& bias_term);

  // Runs `move` (a Module::to) with the placeholder shrunk to its one element, then moves
  // the packed weight to where the parameters went.
  template <typename Move>
  void MoveHeld(Move move);
};
TORCH_MODULE(Linear);

// The outputs of layers that read one input (q/k/v, gate/up), each what its forward gives.
// In a trainer's steps (autograd recording, x needing its gradient, every layer holding its
// weight dequantized in x's dtype, no bias to train, LoRA factors in x's dtype, no row segments
// active) one autograd node computes them, and its backward pass sums x's gradient in the
// products: each product after the first accumulates into the same buffer (addmm with beta 1),
// the LoRA paths' as one product of their side-by-side factors, where autograd adds each
// layer's gradient of x in a pass of its own (four for q, k and v with LoRA on two of them).
// The forward values are the layers' own; the gradients equal theirs up to rounding. Elsewhere
// each layer's forward.
std::vector<torch::Tensor> SharedInputForward(const std::vector<Linear>& layers,
                                              const torch::Tensor& x);

// LinearImpl::HoldDequantized on every quantized layer under `root`; returns how many.
int64_t HoldDequantizedWeights(torch::nn::Module& root);
// LinearImpl::HoldFp8 on every quantized layer under `root`; returns how many hold FP8.
int64_t HoldFp8Weights(torch::nn::Module& root);

// While alive (and `on`), every quantized layer under `root` multiplies in FP8
// (LinearImpl::HoldFp8): a trainer's steps with distill::JobOptions::fp8_base. On destruction
// the layers it changed hold their weights as before (packed, or dequantized), so what runs
// outside it (an evaluation, the device's own passes) computes with the base as before. Layers
// that already hold FP8 are left as they are. Not thread-safe against other users of the model.
class Fp8BaseScope {
 public:
  Fp8BaseScope(torch::nn::Module& root, bool on);
  ~Fp8BaseScope();
  Fp8BaseScope(const Fp8BaseScope&) = delete;
  Fp8BaseScope& operator=(const Fp8BaseScope&) = delete;
  // Layers it changed.
  int64_t changed() const { return static_cast<int64_t>(changed_.size()); }

 private:
  std::vector<std::pair<LinearImpl*, bool>> changed_;  // layer, whether it held dequantized
};

// Quantized Linear layers that read the same input (q/k/v, gate/up), computed by one
// packed product on CPU: one pass and one parallel region instead of one per layer. Fuse
// concatenates their packed weights (and biases) along the output channels and makes each
// layer's weight (and bias) a view of the concatenation, so the bytes are held once and the
// layers keep working on their own. Not a module (the layers own the parameters); not
// thread-safe for Fuse, concurrent forwards are fine.
class FusedLinear {
 public:
  // Fuses `parts`: quantized layers of one precision, group and in_features whose packed
  // weights are on the CPU. Returns false and changes nothing when they do not qualify.
  bool Fuse(const std::vector<Linear>& parts);
  // Fused, and each part's weight and bias still the views Fuse made (a later Adopt, e.g. a
  // second load, gives a part its own again).
  bool Intact() const;
  // Whether forward(x) stands for the parts: Intact, no LoRA, no bias that needs a gradient,
  // and the packed kernel applies to x (LinearImpl::UsesPackedKernel).
  bool Serves(const torch::Tensor& x) const;
  // [..., sum of the parts' out_features]: the parts' outputs side by side.
  torch::Tensor forward(const torch::Tensor& x) const;

 private:
  // Where each part's slices start: a part whose weight or bias no longer points there was
  // given another one after Fuse.
  struct PartViews {
    const void* values;
    const void* scales;
    const void* bias;  // nullptr without bias
  };
  std::vector<Linear> parts_;
  std::vector<PartViews> views_;
  QuantizedWeight q_;
  torch::Tensor bias_;  // undefined when the parts have none
};

// Token embedding: "weight" [vocab, hidden]. After Quantize the rows are held packed (int8
// per row, int4 in groups: the format of an Linear weight [vocab, hidden], so a tied LM
// head shares them) and a lookup dequantizes only the rows it gathers.
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num, int64_t dim, torch::ScalarType dtype);
  torch::Tensor forward(const torch::Tensor& ids);  // [...] -> [..., dim] in the dtype
  // Packs the loaded weight (precision int8 or int4; `group` for int4) and drops the float
  // matrix: "weight" stays registered as a placeholder for its shape. For frozen embeddings
  // only (nothing trains packed rows). A no-op for fp32.
  void Quantize(Precision precision, int64_t group);
  // Takes rows packed as Quantize packs them at `precision` (a weight pack's copy) instead.
  // InvalidArgument where their shape differs from the embedding's.
  absl::Status AdoptQuantized(const QuantizedWeight& q, Precision precision, int64_t group);
  bool quantized() const { return q_.values.defined(); }
  const QuantizedWeight& quantized_weight() const { return q_; }
  Precision precision() const { return precision_; }
  torch::Tensor weight;

 private:
  torch::ScalarType dtype_;
  Precision precision_ = Precision::kFp32;
  int64_t group_ = 0;
  QuantizedWeight q_;  // set by Quantize
};
TORCH_MODULE(Embedding);

// Loads token embedding `embedding` from `folder` at `<prefix>weight` and packs it at
// `precision` (int8 / int4; fp32 only loads): from the folder's weight pack where it has the
// rows, else by Quantize, recording them where the load writes a pack.
absl::Status LoadTokenEmbedding(EmbeddingImpl& embedding, const ModelFolder& folder,
                                const std::string& prefix, const WeightPrecision& precision,
                                torch::Device device);

// RMSNorm as Llama/Qwen2: x / sqrt(mean(x^2) + eps) in fp32, cast back, times "weight".
class RmsNormLayerImpl : public torch::nn::Module {
 public:
  RmsNormLayerImpl(int64_t dim, double eps, torch::ScalarType dtype);
  torch::Tensor forward(const torch::Tensor& x);
  // {h, forward(h)} with h = x + delta (delta undefined: h = x): a pre-norm decoder's residual
  // addition and this norm of its result, one pass each way in training on a GPU
  // (fused_ops.h's AddRmsNorm), the same values elsewhere.
  std::pair<torch::Tensor, torch::Tensor> AddForward(const torch::Tensor& x,
                                                     const torch::Tensor& delta);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNormLayer);

// LayerNorm with "weight" and "bias" (CLIP/SigLIP/BERT), computed as torch's layer_norm.
class LayerNormLayerImpl : public torch::nn::Module {
 public:
  LayerNormLayerImpl(int64_t dim, double eps, torch::ScalarType dtype);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;

 private:
  double eps_;
};
TORCH_MODULE(LayerNormLayer);

// Activation by transformers' ACT2FN name: silu, gelu (erf), gelu_new / gelu_pytorch_tanh
// (tanh approximation), quick_gelu, relu (the names folder_config.h's CheckActivation accepts).
torch::Tensor Activation(const std::string& name, const torch::Tensor& x);

// Gives every placeholder parameter of `module` (layers.h Placeholder) real storage,
// initialised as transformers' _init_weights does for a fresh model: weights of norm layers
// (RmsNormLayer, LayerNorm) 1, biases 0, everything else normal(0, std) from torch's
// generator (seed it with torch::manual_seed). Parameters that already own storage (a
// torch::nn::Conv2d's) are left alone. For building a model to train instead of loading one.
void InitializeHfParameters(torch::nn::Module& module, double std = 0.02);

// Bytes the module tree holds resident: parameters, buffers and packed weights (of Linear
// and Embedding), each storage once (fused and shared packed weights count once).
// Placeholders count one element.
int64_t ResidentBytes(torch::nn::Module& module);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_HF_LINEAR_H_
