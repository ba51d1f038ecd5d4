#include "model/arch/layers.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "model/arch/row_segments.h"
#include "model/runtime/fused_ops.h"
#include "model/runtime/qmatmul.h"

namespace cdcca::model {
namespace {

// Whether `q` is a [rows, cols] weight packed at `precision` as Quantize packs it: int8 values
// with a scale per row, or int4 nibbles with a scale per group of `group` columns.
bool PackedAs(const QuantizedWeight& q, Precision precision, int64_t rows, int64_t cols,
              int64_t group) {
  if (precision == Precision::kFp32 || !q.values.defined() || !q.scales.defined() ||
      q.values.dim() != 2 || q.values.size(0) != rows || q.scales.size(0) != rows) {
    return false;
  }
  if (precision == Precision::kInt8) {
    return q.values.scalar_type() == torch::kChar && q.values.size(1) == cols &&
           q.scales.dim() == 1;
  }
  const int64_t groups = (cols + group - 1) / group;
  return q.values.scalar_type() == torch::kByte && q.scales.dim() == 2 &&
         q.scales.size(1) == groups && q.values.size(1) == groups * group / 2;
}

// x W^T + b with W a quantized weight, differentiable in x and b (W is the frozen base): backward
// dequantizes W again rather than autograd keeping each layer's dequantized copy alive from
// the forward to the backward pass, which for a 7B int4 student is 13.5 GB of bf16 weights
// per training step. The forward product is the one torch::linear gives.
class DequantizedMatmul : public torch::autograd::Function<DequantizedMatmul> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& bias, const torch::Tensor& values,
                               const torch::Tensor& scales, int64_t precision, int64_t in_features,
                               int64_t group) {
    ctx->save_for_backward({values, scales});
    ctx->saved_data["precision"] = precision;
    ctx->saved_data["in_features"] = in_features;
    ctx->saved_data["group"] = group;
    // A layer without bias passes an empty tensor: autograd functions take no undefined inputs.
    const bool has_bias = bias.numel() > 0;
    ctx->saved_data["bias"] = has_bias && bias.requires_grad();
    return torch::linear(x, Weight(values, scales, precision, in_features, group, x),
                         has_bias ? bias : torch::Tensor());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor w =
        Weight(saved[0], saved[1], ctx->saved_data["precision"].toInt(),
               ctx->saved_data["in_features"].toInt(), ctx->saved_data["group"].toInt(), grads[0]);
    const torch::Tensor& g = grads[0];
    torch::Tensor bias_grad;
    if (ctx->saved_data["bias"].toBool()) bias_grad = g.reshape({-1, g.size(-1)}).sum(0);
    return {torch::matmul(g, w), bias_grad,       torch::Tensor(), torch::Tensor(),
            torch::Tensor(),     torch::Tensor(), torch::Tensor()};
  }

 private:
  static torch::Tensor Weight(const torch::Tensor& values, const torch::Tensor& scales,
                              int64_t precision, int64_t in_features, int64_t group,
                              const torch::Tensor& like) {
    return DequantizeWeight(QuantizedWeight{values, scales}, static_cast<Precision>(precision),
                            in_features, group)
        .to(like.scalar_type());
  }
};

}  // namespace

torch::Tensor Placeholder(c10::IntArrayRef shape, torch::ScalarType dtype, torch::Device device) {
  return torch::zeros({1}, torch::dtype(dtype).device(device)).expand(shape);
}

LinearImpl::LinearImpl(const LinearOptions& options) : options_(options) {
  weight = register_parameter(
      "weight", Placeholder({options.out_features, options.in_features}, options.precision.dtype),
      /*requires_grad=*/false);
  if (options.bias) {
    bias = register_parameter("bias", Placeholder({options.out_features}, options.precision.dtype),
                              /*requires_grad=*/false);
  }
}

absl::Status LinearImpl::Adopt(const std::string& local_name, torch::Tensor tensor) {
  torch::NoGradGuard no_grad;
  if (local_name == "bias" && options_.bias) {
    bias.set_data(tensor.to(options_.precision.dtype));
    return absl::OkStatus();
  }
  if (local_name != "weight") {
    return absl::InvalidArgumentError(absl::StrCat("linear layer has no tensor ", local_name));
  }
  if (!quantized()) {
    weight.set_data(tensor.to(options_.precision.dtype));
    return absl::OkStatus();
  }
  const torch::Device device = tensor.device();
  QuantizedWeight q = QuantizeWeight(tensor.to(torch::kFloat), options_.precision.weights,
                                     options_.precision.int4_group);
  q_.values = q.values.to(device);
  q_.scales = q.scales.to(device);
  held_ = torch::Tensor();
  fp8_ = Fp8Weight();
  // The float weight is dropped: the placeholder stays registered for its shape only.
  weight.set_data(Placeholder(weight.sizes(), options_.precision.dtype, device));
  return absl::OkStatus();
}

const QuantizedWeight* LinearImpl::Packed(const std::string& local_name) const {
  return local_name == "weight" && quantized() && q_.values.defined() ? &q_ : nullptr;
}

absl::Status LinearImpl::AdoptPacked(const std::string& local_name, const QuantizedWeight& q) {
  if (local_name != "weight") return TensorSink::AdoptPacked(local_name, q);
  return AdoptQuantized(q);
}

template <typename Move>
void LinearImpl::MoveHeld(Move move) {
  if (!quantized() || !q_.values.defined()) {
    move();
    return;
  }
  torch::NoGradGuard no_grad;
  const std::vector<int64_t> shape = weight.sizes().vec();
  // to() of an expanded tensor would allocate the full [out, in] weight on the target.
  weight.set_data(torch::zeros({1}, weight.options()));
  move();
  weight.set_data(weight.expand(shape));
  if (held_.defined()) {
    held_ = held_.to(weight.device(), weight.scalar_type());  // the packed bytes stay on the host
  } else if (holds_fp8()) {
    for (Fp8Rows* r : {&fp8_.w, &fp8_.wt}) {
      r->values = r->values.to(weight.device());
      r->scales = r->scales.to(weight.device());
    }
    // Off the GPU the FP8 values multiply through the emulated product.
    fp8_.native = fp8_.native && weight.device().is_cuda();
  } else {
    q_.values = q_.values.to(weight.device());
    q_.scales = q_.scales.to(weight.device());
  }
}

void LinearImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  MoveHeld([&] { torch::nn::Module::to(device, dtype, non_blocking); });
}

void LinearImpl::to(torch::Dtype dtype, bool non_blocking) {
  MoveHeld([&] { torch::nn::Module::to(dtype, non_blocking); });
}

void LinearImpl::to(torch::Device device, bool non_blocking) {
  MoveHeld([&] { torch::nn::Module::to(device, non_blocking); });
}

absl::Status LinearImpl::AdoptQuantized(const QuantizedWeight& q) {
  if (!quantized() || !PackedAs(q, options_.precision.weights, options_.out_features,
                                options_.in_features, options_.precision.int4_group)) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear layer [", options_.out_features, ", ", options_.in_features,
                     "] cannot adopt this packed weight (precision or shape differs)"));
  }
  q_ = q;
  held_ = torch::Tensor();
  fp8_ = Fp8Weight();
  weight.set_data(Placeholder(weight.sizes(), options_.precision.dtype, q.values.device()));
  return absl::OkStatus();
}

bool LinearImpl::UsesPackedKernel(const torch::Tensor& x) const {
  // The packed kernels take int4 groups of a multiple of 32 (the published 32/64/128); other
  // group sizes (the small families use any divisor of the width) dequantize per call.
  const bool kernel_group =
      options_.precision.weights != Precision::kInt4 || options_.precision.int4_group % 32 == 0;
  // The kernels have no backward: a training pass whose input needs a gradient (LoRA below
  // this layer) multiplies with the dequantized weight, which autograd differentiates.
  const bool needs_grad = torch::GradMode::is_enabled() && x.requires_grad();
  return quantized() && q_.values.defined() && !held_.defined() && !holds_fp8() &&
         q_.values.device().is_cpu() && x.device().is_cpu() && x.scalar_type() == torch::kFloat &&
         kernel_group && !needs_grad;
}

torch::Tensor LinearImpl::EffectiveWeight() const {
  if (held_.defined()) return held_;
  if (holds_fp8()) return Fp8WeightValues(fp8_, options_.precision.dtype);
  if (!quantized() || !q_.values.defined()) return weight;
  return DequantizeWeight(q_, options_.precision.weights, options_.in_features,
                          options_.precision.int4_group)
      .to(options_.precision.dtype);
}

void LinearImpl::AddLora(int64_t rank, double alpha) {
  if (rank <= 0 || has_lora()) return;
  const auto options =
      torch::TensorOptions().dtype(options_.precision.dtype).device(weight.device());
  // A as torch's Linear default (kaiming-uniform-like scale), B zero: the product starts at 0.
  const double bound = 1.0 / std::sqrt(static_cast<double>(options_.in_features));
  lora_a = register_parameter(
      "lora_a", torch::empty({rank, options_.in_features}, options).uniform_(-bound, bound));
  lora_b = register_parameter("lora_b", torch::zeros({options_.out_features, rank}, options));
  lora_scale_ = alpha / static_cast<double>(rank);
}

torch::Tensor LinearImpl::MergedWeight() const {
  TORCH_CHECK(!quantized(), "MergedWeight needs an unquantized layer");
  if (!has_lora()) return weight;
  return weight + torch::matmul(lora_b, lora_a) * lora_scale_;
}

namespace {

// y + scale (x A^T) B^T, the LoRA side path added to the base product y: the second product
// accumulates into y with its scale (one addmm), where the formula writes the product, scales
// it and adds it (two more passes over y's rows each way). `xa_out`, when given, receives
// x A^T.
torch::Tensor AddLoraPath(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a,
                          const torch::Tensor& b, double scale, torch::Tensor* xa_out = nullptr) {
  const torch::Tensor xa = torch::linear(x, a);
  if (xa_out != nullptr) *xa_out = xa;
  if (y.dim() < 1 || y.numel() == 0 || y.scalar_type() != b.scalar_type() ||
      xa.scalar_type() != b.scalar_type()) {
    return y + torch::linear(xa, b) * scale;
  }
  const int64_t out = y.size(-1), rank = a.size(0);
  return torch::addmm(y.reshape({-1, out}), xa.reshape({-1, rank}), b.t(), /*beta=*/1.0,
                      /*alpha=*/scale)
      .view(y.sizes());
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// SharedInputForward's node. Autograd takes defined tensors only, so the inputs are x, each
// layer's held weight, the LoRA factors of the layers that have them (A, B side by side) and
// the biases there are; lora_slot and bias_slot say for each layer which pair or bias is its
// own (-1: none).
class SharedInputFunction : public torch::autograd::Function<SharedInputFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x,
                               torch::TensorList weights, torch::TensorList lora,
                               torch::TensorList biases, std::vector<int64_t> lora_slot,
                               std::vector<int64_t> bias_slot, std::vector<double> scales) {
    const size_t n = weights.size();
    // x itself only where a LoRA factor's gradient needs it (the frozen products' backward
    // passes read their weights alone): the MLP's gate and up keep nothing of it.
    variable_list outputs, saved = {lora.empty() ? torch::Tensor() : x};
    for (size_t i = 0; i < n; ++i) {
      const int64_t l = lora_slot[i], bi = bias_slot[i];
      torch::Tensor y = torch::linear(x, weights[i], bi < 0 ? torch::Tensor() : biases[bi]);
      torch::Tensor xa;
      if (l >= 0) y = AddLoraPath(y, x, lora[2 * l], lora[2 * l + 1], scales[i], &xa);
      outputs.push_back(y);
      saved.push_back(xa);  // undefined without LoRA
    }
    // Saved as variables (autograd checks that nothing changed them in place before the
    // backward pass), as the layers' own nodes save them: no copies.
    saved.insert(saved.end(), weights.begin(), weights.end());
    saved.insert(saved.end(), lora.begin(), lora.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["lora_slot"] = lora_slot;
    ctx->saved_data["biases"] = static_cast<int64_t>(biases.size());
    ctx->saved_data["scales"] = c10::List<double>(scales);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return outputs;
  }

  // With g_i the gradient of output i: dB_i = s_i g_i^T (x A_i^T), dA_i = (s_i g_i B_i)^T x and
  // dx = sum_i g_i W_i + sum_i (s_i g_i B_i) A_i, the first product written, every later one
  // accumulated into it (addmm with beta 1: the sum rides in the products' epilogue, one
  // rounding), the LoRA paths' as one product of their side-by-side factors.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const size_t n = grads.size();
    // saved: x (or undefined), each layer's x A^T (or undefined), the weights, the LoRA factors.
    const auto weight = [&](size_t i) -> const torch::Tensor& { return saved[1 + n + i]; };
    const auto factor = [&](int64_t k) -> const torch::Tensor& { return saved[1 + 2 * n + k]; };
    const size_t factors = saved.size() - (1 + 2 * n);
    const std::vector<int64_t> lora_slot = ctx->saved_data["lora_slot"].toIntVector();
    const int64_t biases = ctx->saved_data["biases"].toInt();
    const c10::List<double> scales = ctx->saved_data["scales"].toDoubleList();
    const std::vector<int64_t> x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const torch::Tensor x2 = saved[0].defined() ? saved[0].reshape({-1, x_sizes.back()}) : saved[0];
    const bool want_x = ctx->needs_input_grad(0);
    // Gradient slots: x, the weights, the LoRA factors, the biases (every tensor of a list its
    // own), then the three lists of numbers.
    const size_t lora_base = 1 + n;
    variable_list result(1 + n + factors + static_cast<size_t>(biases) + 3);
    torch::Tensor dx;
    std::vector<torch::Tensor> side_grads, side_factors;
    for (size_t i = 0; i < n; ++i) {
      if (!grads[i].defined()) continue;
      const torch::Tensor g = grads[i].reshape({-1, grads[i].size(-1)});
      if (want_x) dx = dx.defined() ? dx.addmm_(g, weight(i)) : torch::mm(g, weight(i));
      const int64_t l = lora_slot[i];
      if (l < 0) continue;
      const torch::Tensor& a = factor(2 * l);
      const torch::Tensor& b = factor(2 * l + 1);
      const double s = scales[i];
      const torch::Tensor xa2 = saved[1 + i].reshape({-1, a.size(0)});
      if (ctx->needs_input_grad(lora_base + 2 * l + 1)) {
        result[lora_base + 2 * l + 1] = torch::mm(g.t(), xa2) * s;
      }
      const torch::Tensor dxa = torch::mm(g, b) * s;
      if (ctx->needs_input_grad(lora_base + 2 * l))
        result[lora_base + 2 * l] = torch::mm(dxa.t(), x2);
      side_grads.push_back(dxa);
      side_factors.push_back(a);
    }
    if (want_x && dx.defined() && !side_grads.empty()) {
      if (side_grads.size() == 1) {
        dx.addmm_(side_grads[0], side_factors[0]);
      } else {
        dx.addmm_(torch::cat(side_grads, 1), torch::cat(side_factors, 0));
      }
    }
    if (dx.defined()) result[0] = dx.view(x_sizes);
    return result;
  }
};

}  // namespace

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (const RowSegments* segments = ActiveRowSegments(); segments != nullptr) {
    const torch::Tensor bias_rows = segments->Rows(bias);
    const torch::Tensor a_rows = segments->Rows(lora_a);
    const torch::Tensor b_rows = segments->Rows(lora_b);
    if (bias_rows.defined() || a_rows.defined() || b_rows.defined()) {
      TORCH_CHECK(a_rows.defined() == b_rows.defined(),
                  "row segments hold one LoRA factor of a layer without the other");
      torch::Tensor y = BaseForward(x, bias_rows.defined() ? torch::Tensor() : bias);
      if (bias_rows.defined()) y = AddPerRow(y, bias_rows);
      if (a_rows.defined()) return y + PerRowLora(x, a_rows, b_rows) * lora_scale_;
      if (has_lora()) y = AddLoraPath(y, x, lora_a, lora_b, lora_scale_);
      return y;
    }
  }
  if (has_lora() && !quantized()) {
    // Folding B A into the weight costs out * in * rank multiplications, the side path below
    // rows * (in + out) * rank and three more passes over the rows, so many rows (training
    // batches, prompts) take the folded weight: the same product up to rounding, and autograd
    // takes the gradients of the weight, A and B through the fold (the teacher's 2-core
    // pretraining step ~8 % shorter).
    const int64_t in = options_.in_features, out = options_.out_features;
    const int64_t rows = x.numel() / std::max<int64_t>(1, in);
    if (rows * (in + out) >= in * out) return torch::linear(x, MergedWeight(), bias);
  }
  torch::Tensor y = BaseForward(x, bias);
  if (has_lora()) y = AddLoraPath(y, x, lora_a, lora_b, lora_scale_);
  return y;
}

std::vector<torch::Tensor> SharedInputForward(const std::vector<Linear>& layers,
                                              const torch::Tensor& x) {
  // CDCCA_SEPARATE_INPUT_GRADIENTS=1 keeps each layer's own node (read once): to compare.
  static const bool separate = [] {
    const char* v = std::getenv("CDCCA_SEPARATE_INPUT_GRADIENTS");
    return v != nullptr && std::string(v) == "1";
  }();
  bool fused = !separate && !layers.empty() && torch::GradMode::is_enabled() && x.requires_grad() &&
               x.dim() >= 2 && ActiveRowSegments() == nullptr;
  for (const Linear& layer : layers) {
    if (!fused) break;
    const torch::Tensor& w = layer->dequantized_weight();
    fused = layer->holds_dequantized() && w.scalar_type() == x.scalar_type() &&
            w.device() == x.device() && w.size(1) == x.size(-1) &&
            (!layer->bias.defined() || !layer->bias.requires_grad()) &&
            (!layer->has_lora() || (layer->lora_a.scalar_type() == x.scalar_type() &&
                                    layer->lora_b.scalar_type() == x.scalar_type()));
  }
  std::vector<torch::Tensor> outputs;
  if (!fused) {
    for (Linear layer : layers) outputs.push_back(layer->forward(x));
    return outputs;
  }
  std::vector<torch::Tensor> weights, lora, biases;
  std::vector<int64_t> lora_slot, bias_slot;
  std::vector<double> scales;
  for (const Linear& layer : layers) {
    weights.push_back(layer->dequantized_weight());
    lora_slot.push_back(layer->has_lora() ? static_cast<int64_t>(lora.size() / 2) : -1);
    if (layer->has_lora()) {
      lora.push_back(layer->lora_a);
      lora.push_back(layer->lora_b);
    }
    bias_slot.push_back(layer->bias.defined() ? static_cast<int64_t>(biases.size()) : -1);
    if (layer->bias.defined()) biases.push_back(layer->bias);
    scales.push_back(layer->lora_scale());
  }
  return SharedInputFunction::apply(x, torch::TensorList(weights), torch::TensorList(lora),
                                    torch::TensorList(biases), lora_slot, bias_slot, scales);
}

torch::Tensor LinearImpl::BaseForward(const torch::Tensor& x, const torch::Tensor& bias_term) {
  if (held_.defined()) return torch::linear(x, held_, bias_term);
  if (holds_fp8()) {
    torch::Tensor y = Fp8Linear(x, fp8_);
    return bias_term.defined() ? y + bias_term : y;
  }
  if (UsesPackedKernel(x)) {
    return QuantizedLinear(x, q_, options_.precision.weights, options_.in_features,
                           options_.precision.int4_group, bias_term);
  }
  if (quantized() && q_.values.defined() && torch::GradMode::is_enabled() && x.requires_grad()) {
    return DequantizedMatmul::apply(x, bias_term.defined() ? bias_term : x.new_empty({0}),
                                    q_.values, q_.scales,
                                    static_cast<int64_t>(options_.precision.weights),
                                    options_.in_features, options_.precision.int4_group);
  }
  return torch::linear(x, EffectiveWeight(), bias_term);
}

int64_t LinearImpl::WeightBytes() const {
  const int64_t held =
      (held_.defined() ? held_.numel() * held_.element_size() : 0) + Fp8WeightBytes(fp8_);
  if (quantized() && q_.values.defined()) return QuantizedBytes(q_) + held;
  return weight.numel() * weight.element_size();
}

void LinearImpl::HoldDequantized() {
  torch::NoGradGuard no_grad;
  if (!quantized() || !q_.values.defined() || held_.defined() || holds_fp8()) return;
  held_ = EffectiveWeight();
  // No product reads the packed bytes any more: they move to the host, where a weight pack or
  // a digest still finds them, and the accelerator holds the float weight alone.
  q_.values = q_.values.cpu();
  q_.scales = q_.scales.cpu();
}

void LinearImpl::HoldFp8() {
  torch::NoGradGuard no_grad;
  if (!quantized() || !q_.values.defined() || held_.defined() || holds_fp8()) return;
  // Rounded from the fp32 dequantized weight (the values the device multiplies), not from a
  // bf16 copy of it: one rounding, not two.
  fp8_ = MakeFp8Weight(DequantizeWeight(q_, options_.precision.weights, options_.in_features,
                                        options_.precision.int4_group)
                           .to(torch::kFloat));
  q_.values = q_.values.cpu();
  q_.scales = q_.scales.cpu();
}

void LinearImpl::ReleaseHeld() {
  if (!held_.defined() && !holds_fp8()) return;
  torch::NoGradGuard no_grad;
  held_ = torch::Tensor();
  fp8_ = Fp8Weight();
  q_.values = q_.values.to(weight.device());
  q_.scales = q_.scales.to(weight.device());
}

namespace {

// The quantized Linear layers under `root` (itself included).
std::vector<LinearImpl*> QuantizedLayers(torch::nn::Module& root) {
  std::vector<LinearImpl*> out;
  for (const std::shared_ptr<torch::nn::Module>& m : root.modules(/*include_self=*/true)) {
    auto* linear = dynamic_cast<LinearImpl*>(m.get());
    if (linear != nullptr && linear->quantized()) out.push_back(linear);
  }
  return out;
}

}  // namespace

Fp8BaseScope::Fp8BaseScope(torch::nn::Module& root, bool on) {
  if (!on) return;
  for (LinearImpl* linear : QuantizedLayers(root)) {
    if (linear->holds_fp8() || !linear->quantized_weight().values.defined()) continue;
    const bool was_held = linear->holds_dequantized();
    // One layer at a time: its float copy goes before its FP8 copies come.
    linear->ReleaseHeld();
    linear->HoldFp8();
    changed_.emplace_back(linear, was_held);
  }
}

Fp8BaseScope::~Fp8BaseScope() {
  for (auto& [linear, was_held] : changed_) {
    linear->ReleaseHeld();
    if (was_held) linear->HoldDequantized();
  }
}

int64_t HoldFp8Weights(torch::nn::Module& root) {
  int64_t n = 0;
  for (LinearImpl* linear : QuantizedLayers(root)) {
    linear->HoldFp8();
    n += linear->holds_fp8() ? 1 : 0;
  }
  return n;
}

int64_t HoldDequantizedWeights(torch::nn::Module& root) {
  int64_t n = 0;
  for (LinearImpl* linear : QuantizedLayers(root)) {
    linear->HoldDequantized();
    n += linear->holds_dequantized() ? 1 : 0;
  }
  return n;
}

bool FusedLinear::Fuse(const std::vector<Linear>& parts) {
  torch::NoGradGuard no_grad;
  if (parts.size() < 2) return false;
  const LinearOptions& first = parts[0]->options();
  for (const Linear& p : parts) {
    const LinearOptions& o = p->options();
    if (!p->quantized() || !p->quantized_weight().values.defined() ||
        !p->quantized_weight().values.device().is_cpu() || p->has_lora() ||
        o.in_features != first.in_features || o.precision.weights != first.precision.weights ||
        o.precision.int4_group != first.precision.int4_group || o.bias != first.bias) {
      return false;
    }
  }
  std::vector<torch::Tensor> values, scales, biases;
  for (const Linear& p : parts) {
    values.push_back(p->quantized_weight().values);
    scales.push_back(p->quantized_weight().scales);
    if (p->bias.defined()) biases.push_back(p->bias.detach());
  }
  QuantizedWeight fused{torch::cat(values, 0), torch::cat(scales, 0)};
  torch::Tensor bias = biases.empty() ? torch::Tensor() : torch::cat(biases, 0);
  int64_t offset = 0;
  views_.clear();
  for (Linear p : parts) {  // a copy of the holder: the layers are changed
    const int64_t n = p->options().out_features;
    QuantizedWeight view{fused.values.narrow(0, offset, n), fused.scales.narrow(0, offset, n)};
    TORCH_CHECK(p->AdoptQuantized(view).ok(), "FusedLinear: a part refused its slice");
    if (bias.defined()) p->bias.set_data(bias.narrow(0, offset, n));
    views_.push_back({view.values.data_ptr(), view.scales.data_ptr(),
                      bias.defined() ? p->bias.data_ptr() : nullptr});
    offset += n;
  }
  parts_ = parts;
  q_ = std::move(fused);
  bias_ = std::move(bias);
  return true;
}

bool FusedLinear::Intact() const {
  if (parts_.empty()) return false;
  for (size_t i = 0; i < parts_.size(); ++i) {
    const LinearImpl& p = *parts_[i];
    const QuantizedWeight& w = p.quantized_weight();
    if (!w.values.defined() || w.values.data_ptr() != views_[i].values ||
        w.scales.data_ptr() != views_[i].scales ||
        (bias_.defined() && p.bias.data_ptr() != views_[i].bias)) {
      return false;
    }
  }
  return true;
}

bool FusedLinear::Serves(const torch::Tensor& x) const {
  if (!Intact() || !parts_[0]->UsesPackedKernel(x)) return false;
  const bool grad = torch::GradMode::is_enabled();
  const RowSegments* segments = ActiveRowSegments();
  for (const Linear& p : parts_) {
    if (p->has_lora() || (grad && bias_.defined() && p->bias.requires_grad())) return false;
    // A part whose bias is per row computes on its own.
    if (segments != nullptr && bias_.defined() && segments->Rows(p->bias).defined()) return false;
  }
  return true;
}

torch::Tensor FusedLinear::forward(const torch::Tensor& x) const {
  const LinearOptions& o = parts_[0]->options();
  return QuantizedLinear(x, q_, o.precision.weights, o.in_features, o.precision.int4_group, bias_);
}

EmbeddingImpl::EmbeddingImpl(int64_t num, int64_t dim, torch::ScalarType dtype) : dtype_(dtype) {
  weight = register_parameter("weight", Placeholder({num, dim}, dtype), /*requires_grad=*/false);
}

void EmbeddingImpl::Quantize(Precision precision, int64_t group) {
  torch::NoGradGuard no_grad;
  if (precision == Precision::kFp32) return;
  const torch::Device device = weight.device();
  QuantizedWeight q = QuantizeWeight(weight.to(torch::kFloat), precision, group);
  q_.values = q.values.to(device);
  q_.scales = q.scales.to(device);
  precision_ = precision;
  group_ = group;
  weight.set_data(Placeholder(weight.sizes(), dtype_, device));
}

absl::Status EmbeddingImpl::AdoptQuantized(const QuantizedWeight& q, Precision precision,
                                           int64_t group) {
  const int64_t num = weight.size(0), dim = weight.size(1);
  if (!PackedAs(q, precision, num, dim, group)) {
    return absl::InvalidArgumentError(absl::StrCat("embedding [", num, ", ", dim,
                                                   "] cannot adopt these packed rows at ",
                                                   PrecisionName(precision)));
  }
  q_ = q;
  precision_ = precision;
  group_ = group;
  weight.set_data(Placeholder(weight.sizes(), dtype_, q.values.device()));
  return absl::OkStatus();
}

absl::Status LoadTokenEmbedding(EmbeddingImpl& embedding, const ModelFolder& folder,
                                const std::string& prefix, const WeightPrecision& precision,
                                torch::Device device) {
  const std::string name = prefix + "weight";
  if (precision.weights != Precision::kFp32) {
    absl::StatusOr<std::optional<QuantizedWeight>> packed = folder.PackedTensor(name, device);
    if (!packed.ok()) return packed.status();
    if (packed->has_value()) {
      return embedding.AdoptQuantized(**packed, precision.weights, precision.int4_group);
    }
  }
  LoadIntoOptions o;
  o.device = device;
  if (absl::Status s = folder.LoadInto(embedding, prefix, o); !s.ok()) return s;
  if (precision.weights == Precision::kFp32) return absl::OkStatus();
  embedding.Quantize(precision.weights, precision.int4_group);
  folder.RecordPacked(name, embedding.quantized_weight());
  return absl::OkStatus();
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  if (!quantized()) return torch::embedding(weight, ids);
  // Only the gathered rows are dequantized: the same values DequantizeWeight gives for the
  // whole matrix.
  torch::Tensor flat = ids.reshape({-1}).to(q_.values.device(), torch::kLong);
  QuantizedWeight rows{q_.values.index_select(0, flat), q_.scales.index_select(0, flat)};
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(weight.size(1));
  return DequantizeWeight(rows, precision_, weight.size(1), group_).to(dtype_).view(shape);
}

RmsNormLayerImpl::RmsNormLayerImpl(int64_t dim, double eps, torch::ScalarType dtype) : eps_(eps) {
  weight = register_parameter("weight", Placeholder({dim}, dtype), /*requires_grad=*/false);
}

torch::Tensor RmsNormLayerImpl::forward(const torch::Tensor& x) {
  if (const RowSegments* segments = ActiveRowSegments(); segments != nullptr) {
    if (torch::Tensor w = segments->Rows(weight); w.defined()) {
      return MulPerRow(RmsNorm(x, torch::ones_like(weight), eps_), w);
    }
  }
  return RmsNorm(x, weight, eps_);
}

std::pair<torch::Tensor, torch::Tensor> RmsNormLayerImpl::AddForward(const torch::Tensor& x,
                                                                     const torch::Tensor& delta) {
  if (!delta.defined()) return {x, forward(x)};
  if (const RowSegments* segments = ActiveRowSegments();
      segments != nullptr && segments->Rows(weight).defined()) {
    torch::Tensor h = x + delta;
    return {h, forward(h)};
  }
  return AddRmsNorm(x, delta, weight, eps_);
}

LayerNormLayerImpl::LayerNormLayerImpl(int64_t dim, double eps, torch::ScalarType dtype)
    : eps_(eps) {
  weight = register_parameter("weight", Placeholder({dim}, dtype), /*requires_grad=*/false);
  bias = register_parameter("bias", Placeholder({dim}, dtype), /*requires_grad=*/false);
}

torch::Tensor LayerNormLayerImpl::forward(const torch::Tensor& x) {
  if (const RowSegments* segments = ActiveRowSegments(); segments != nullptr) {
    const torch::Tensor w = segments->Rows(weight), b = segments->Rows(bias);
    if (w.defined() || b.defined()) {
      torch::Tensor y = torch::layer_norm(x, {x.size(-1)}, {}, {}, eps_);
      y = w.defined() ? MulPerRow(y, w) : y * weight;
      return b.defined() ? AddPerRow(y, b) : y + bias;
    }
  }
  return torch::layer_norm(x, {x.size(-1)}, weight, bias, eps_);
}

torch::Tensor Activation(const std::string& name, const torch::Tensor& x) {
  if (name == "silu" || name == "swish") return torch::silu(x);
  if (name == "gelu") return torch::gelu(x);
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return torch::gelu(x, "tanh");
  if (name == "quick_gelu") return x * torch::sigmoid(1.702 * x);
  if (name == "relu") return torch::relu(x);
  TORCH_CHECK(false, "unsupported activation ", name);
}

void InitializeHfParameters(torch::nn::Module& module, double std) {
  torch::NoGradGuard no_grad;
  // `module` itself may be under construction (not yet owned by a shared_ptr), so it is not
  // taken from named_modules(include_self).
  std::vector<torch::nn::Module*> all{&module};
  for (const auto& m : module.modules(/*include_self=*/false)) all.push_back(m.get());
  for (torch::nn::Module* mp : all) {
    torch::nn::Module& m = *mp;
    const bool norm = dynamic_cast<RmsNormLayerImpl*>(&m) != nullptr ||
                      dynamic_cast<LayerNormLayerImpl*>(&m) != nullptr;
    for (auto& p : m.named_parameters(/*recurse=*/false)) {
      torch::Tensor& t = p.value();
      // A placeholder is an expanded single element: a zero stride on a dimension > 1.
      bool placeholder = false;
      for (int64_t d = 0; d < t.dim(); ++d) placeholder |= t.stride(d) == 0 && t.size(d) > 1;
      // (A one-element parameter cannot be told apart; initialising it again is harmless.)
      if (!placeholder && t.numel() > 1) continue;
      torch::Tensor fresh = torch::empty(t.sizes(), t.options());
      if (p.key() == "bias") {
        fresh.zero_();
      } else if (norm) {
        fresh.fill_(1.0);
      } else {
        fresh.normal_(0.0, std);
      }
      t.set_data(fresh);
    }
  }
}

int64_t ResidentBytes(torch::nn::Module& module) {
  std::set<const void*> seen;
  int64_t total = 0;
  auto count = [&](const torch::Tensor& t) {
    if (!t.defined()) return;
    const void* key = t.storage().data();
    if (key == nullptr || !seen.insert(key).second) return;
    total += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : module.parameters()) count(p);
  for (const auto& b : module.buffers()) count(b);
  for (const auto& m : module.modules()) {
    const QuantizedWeight* q = nullptr;
    if (auto* linear = dynamic_cast<LinearImpl*>(m.get()); linear != nullptr) {
      q = &linear->quantized_weight();
      count(linear->dequantized_weight());
    } else if (auto* embedding = dynamic_cast<EmbeddingImpl*>(m.get()); embedding != nullptr) {
      q = &embedding->quantized_weight();
    }
    if (q != nullptr) {
      count(q->values);
      count(q->scales);
    }
  }
  return total;
}

}  // namespace cdcca::model
