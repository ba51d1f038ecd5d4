#include "model/runtime/fp8_product.h"

#include <torch/torch.h>

#include <map>
#include <mutex>
#include <utility>

#if defined(CDCCA_HAVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>

#include "model/runtime/cuda_dispatch.h"
#endif

namespace cdcca::model {
namespace {

// The native product needs LibTorch's rowwise-scaled at::_scaled_mm (2.5 and later).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
#define CDCCA_HAS_SCALED_MM 1
#else
#define CDCCA_HAS_SCALED_MM 0
#endif

constexpr double kMinScale = 1e-12;  // an all-zero row keeps a finite scale

// [rows] fp32 scales: each row's largest magnitude over kE4m3Max.
torch::Tensor RowScales(const torch::Tensor& m) {
  return m.abs().amax(/*dim=*/1).to(torch::kFloat).clamp_min(kMinScale * kE4m3Max) / kE4m3Max;
}

#if CDCCA_HAS_SCALED_MM
// `a` [M, C] rounded per row for the native product, its rows padded to a multiple of 16 (the
// kernel's; zero rows with the smallest scale, their products zero, cut off after): the values
// [padded, C] float8_e4m3fn and the scales [padded, 1]. One pass of cdcca's kernel where it is
// built (cuda_kernels.h), LibTorch's passes otherwise; the same rounding either way.
std::pair<torch::Tensor, torch::Tensor> NativeRows(const torch::Tensor& a) {
  const int64_t rows = a.size(0), cols = a.size(1);
  const int64_t padded = (rows + 15) / 16 * 16;
#if defined(CDCCA_HAVE_CUDA_KERNELS)
  const torch::ScalarType d = a.scalar_type();
  if (a.is_cuda() && a.stride(1) == 1 &&
      (d == torch::kFloat || d == torch::kHalf || d == torch::kBFloat16)) {
    const c10::cuda::CUDAGuard guard(a.device());
    torch::Tensor q = torch::empty({padded, cols}, a.options().dtype(torch::kFloat8_e4m3fn));
    torch::Tensor s = torch::empty({padded, 1}, a.options().dtype(torch::kFloat));
    cuda_kernels::CheckKernel(
        cuda_kernels::QuantizeRowsE4m3(cuda_kernels::KernelDtype(a), a.data_ptr(), a.stride(0),
                                       rows, padded, cols, q.data_ptr(), s.data_ptr<float>(),
                                       cuda_kernels::StreamOf(a)),
        "the FP8 rounding");
    return {q, s};
  }
#endif
  const torch::Tensor scales = RowScales(a);
  // Row-major whatever a's strides (the GEMM reads row-major rows; a transposed weight's
  // element-wise result would keep the transposed strides).
  torch::Tensor q =
      (a.to(torch::kFloat) / scales.unsqueeze(1)).to(torch::kFloat8_e4m3fn).contiguous();
  torch::Tensor s = scales;
  if (padded != rows) {
    q = torch::cat({q, torch::zeros({padded - rows, cols}, q.options())});
    s = torch::cat({s, torch::full({padded - rows}, kMinScale, s.options())});
  }
  return {q, s.unsqueeze(1).contiguous()};
}
#endif

// The FP8 product a Q(b)^T for a [M, C] float, b's rows [R, C]: [M, R] in `dtype`.
torch::Tensor RowScaledProduct(const torch::Tensor& a, const Fp8Rows& b, bool native,
                               torch::ScalarType dtype) {
#if CDCCA_HAS_SCALED_MM
  if (native) {
    const auto [q, s] = NativeRows(a);
    torch::Tensor y = at::_scaled_mm(q, b.values.t(), s, b.scales.unsqueeze(0).contiguous(),
                                     std::nullopt, std::nullopt, dtype, /*use_fast_accum=*/false);
    return q.size(0) != a.size(0) ? y.narrow(0, 0, a.size(0)) : y;
  }
#else
  TORCH_CHECK(!native, "this LibTorch has no scaled FP8 product");
#endif
  const torch::Tensor a_scales = RowScales(a);
  const torch::Tensor q = RoundToE4m3(a.to(torch::kFloat) / a_scales.unsqueeze(1));
  return (torch::matmul(q, b.values.to(torch::kFloat).t()) * a_scales.unsqueeze(1) *
          b.scales.unsqueeze(0))
      .to(dtype);
}

class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w_values, const torch::Tensor& w_scales,
                               const torch::Tensor& wt_values, const torch::Tensor& wt_scales,
                               bool native) {
    ctx->save_for_backward({wt_values, wt_scales});
    ctx->saved_data["native"] = native;
    const int64_t in = x.size(-1);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w_values.size(0);
    return RowScaledProduct(x.reshape({-1, in}), Fp8Rows{w_values, w_scales}, native,
                            x.scalar_type())
        .view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& g = grads[0];
    std::vector<int64_t> shape = g.sizes().vec();
    shape.back() = saved[0].size(0);
    const torch::Tensor dx =
        RowScaledProduct(g.reshape({-1, g.size(-1)}).contiguous(), Fp8Rows{saved[0], saved[1]},
                         ctx->saved_data["native"].toBool(), g.scalar_type())
            .view(shape);
    return {
        dx, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RoundToE4m3(const torch::Tensor& x) {
  const torch::Tensor v = x.to(torch::kFloat);
  const torch::Tensor a = v.abs();
  // The step between neighbours at a's binade: 2^(e - 3), e = floor(log2 a) from -6 (below
  // it the subnormals' fixed step 2^-9). Zero takes the subnormal step and stays zero.
  const torch::Tensor e = torch::floor(torch::log2(a)).clamp_min(-6.0);
  const torch::Tensor step = torch::pow(2.0, e - 3.0);
  // a / step is exact (a power of two); round() breaks ties to even, as the format does.
  const torch::Tensor q = (torch::round(a / step) * step).clamp_max(kE4m3Max);
  return torch::where(v < 0, -q, q);
}

Fp8Rows QuantizeRowsE4m3(const torch::Tensor& m, bool native) {
  TORCH_CHECK(m.dim() == 2, "QuantizeRowsE4m3 takes a matrix");
  torch::NoGradGuard no_grad;
  Fp8Rows out;
#if CDCCA_HAS_SCALED_MM
  if (native) {
    auto [q, s] = NativeRows(m);
    const int64_t rows = m.size(0);
    out.values = q.size(0) != rows ? q.narrow(0, 0, rows).contiguous() : q;
    out.scales = s.view({-1}).narrow(0, 0, rows).contiguous();
    return out;
  }
#else
  TORCH_CHECK(!native, "this LibTorch has no float8 type");
#endif
  out.scales = RowScales(m);
  const torch::Tensor scaled = m.to(torch::kFloat) / out.scales.unsqueeze(1);
  out.values = RoundToE4m3(scaled).to(torch::kBFloat16).contiguous();
  return out;
}

bool NativeFp8Available(const torch::Device& device) {
#if CDCCA_HAS_SCALED_MM
  if (!device.is_cuda()) return false;
  static std::mutex mu;
  static std::map<int, bool> probed;
  std::lock_guard<std::mutex> lock(mu);
  const int index = device.has_index() ? device.index() : 0;
  auto it = probed.find(index);
  if (it != probed.end()) return it->second;
  bool ok = false;
  try {
    torch::NoGradGuard no_grad;
    const auto options = torch::TensorOptions().device(torch::Device(torch::kCUDA, index));
    const torch::Tensor m = torch::ones({16, 16}, options);
    const Fp8Rows b = QuantizeRowsE4m3(m, /*native=*/true);
    const torch::Tensor y = RowScaledProduct(m, b, /*native=*/true, torch::kFloat);
    ok = y.allclose(torch::full({16, 16}, 16.0, options));
  } catch (const c10::Error&) {
    ok = false;  // e.g. a GPU before compute capability 8.9
  }
  probed[index] = ok;
  return ok;
#else
  (void)device;
  return false;
#endif
}

Fp8Weight MakeFp8Weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "MakeFp8Weight takes a [out, in] weight");
  // The kernel multiplies operands whose dimensions are multiples of 16; other shapes (the
  // tiny families) take the emulated product on any device.
  const bool native =
      weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0 && NativeFp8Available(weight.device());
  Fp8Weight w;
  w.native = native;
  w.w = QuantizeRowsE4m3(weight, native);
  w.wt = QuantizeRowsE4m3(weight.t(), native);
  return w;
}

torch::Tensor Fp8WeightValues(const Fp8Weight& w, torch::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  return (w.w.values.to(torch::kFloat) * w.w.scales.unsqueeze(1)).to(dtype);
}

torch::Tensor Fp8Linear(const torch::Tensor& x, const Fp8Weight& w) {
  return Fp8LinearFunction::apply(x, w.w.values, w.w.scales, w.wt.values, w.wt.scales, w.native);
}

int64_t Fp8WeightBytes(const Fp8Weight& w) {
  int64_t n = 0;
  for (const Fp8Rows* r : {&w.w, &w.wt}) {
    if (!r->values.defined()) continue;
    n +=
        r->values.numel() * r->values.element_size() + r->scales.numel() * r->scales.element_size();
  }
  return n;
}

}  // namespace cdcca::model
