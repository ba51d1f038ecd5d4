#include "model/runtime/fused_ops.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>

#include "model/runtime/simd.h"

#if defined(CDCCA_HAVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>

#include "model/runtime/cuda_dispatch.h"
#endif

// Each kernel below is one loop over rows or elements, written for the compiler to vectorize
// (this file is built with -O3); on x86-64 it is compiled twice and the AVX2 copy runs where
// the processor has it.
#ifdef CDCCA_SIMD_X86
#define CDCCA_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CDCCA_VECTOR_CLONES
#endif

namespace cdcca::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether autograd records an operation on `inputs` (training).
bool Recorded(std::initializer_list<const torch::Tensor*> inputs) {
  if (!torch::GradMode::is_enabled()) return false;
  for (const torch::Tensor* t : inputs) {
    if (t->requires_grad()) return true;
  }
  return false;
}

// CDCCA_PLAIN_GPU_OPS=1 keeps the plain formulas in training off the CPU too (read once):
// what the benchmarks compare the fewer-pass forms against.
bool PlainGpuOps() {
  static const bool plain = [] {
    const char* v = std::getenv("CDCCA_PLAIN_GPU_OPS");
    return v != nullptr && std::string(v) == "1";
  }();
  return plain;
}

bool FloatCpu(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat;
}

// Whether cdcca's CUDA kernels (cuda_kernels.h) take `t` in training: built in, a CUDA
// tensor of float, half or bf16, and CDCCA_PLAIN_GPU_OPS unset.
bool CudaKernelsTake(const torch::Tensor& t) {
#if defined(CDCCA_HAVE_CUDA_KERNELS)
  const torch::ScalarType d = t.defined() ? t.scalar_type() : torch::kFloat;
  return t.defined() && t.is_cuda() && !PlainGpuOps() &&
         (d == torch::kFloat || d == torch::kHalf || d == torch::kBFloat16);
#else
  (void)t;
  return false;
#endif
}

#if defined(CDCCA_HAVE_CUDA_KERNELS)
using cuda_kernels::CheckKernel;
using cuda_kernels::KernelDtype;
using cuda_kernels::StreamOf;
#endif

// Rows per parallel_for task: about 32K elements, as LibTorch's own grain.
int64_t RowGrain(int64_t row_size) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_size));
}

// ---- RMSNorm ----------------------------------------------------------------------------

// out = x * inv * w per row; inv[i] = 1 / sqrt(mean(x[i]^2) + eps).
CDCCA_VECTOR_CLONES void RmsNormRows(const float* x, const float* w, float* out, float* inv,
                                     int64_t begin, int64_t end, int64_t d, float eps) {
  for (int64_t i = begin; i < end; ++i) {
    const float* xi = x + i * d;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) {
      for (int l = 0; l < 8; ++l) acc[l] += xi[j + l] * xi[j + l];
    }
    float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; j < d; ++j) ss += xi[j] * xi[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
    inv[i] = r;
    float* oi = out + i * d;
    for (j = 0; j < d; ++j) oi[j] = (xi[j] * r) * w[j];
  }
}

// gx = inv * (g * w) - x * inv^3 * mean(g * w * x) per row.
CDCCA_VECTOR_CLONES void RmsNormGradRows(const float* g, const float* x, const float* w,
                                         const float* inv, float* gx, int64_t begin, int64_t end,
                                         int64_t d) {
  for (int64_t i = begin; i < end; ++i) {
    const float* gi = g + i * d;
    const float* xi = x + i * d;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) {
      for (int l = 0; l < 8; ++l) acc[l] += gi[j + l] * w[j + l] * xi[j + l];
    }
    float dot = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; j < d; ++j) dot += gi[j] * w[j] * xi[j];
    const float r = inv[i];
    const float c = r * r * r * dot / static_cast<float>(d);
    float* o = gx + i * d;
    for (j = 0; j < d; ++j) o[j] = r * gi[j] * w[j] - xi[j] * c;
  }
}

// part[j] = sum over rows [begin, end) of g * x * inv (one block's share of the weight's
// gradient).
CDCCA_VECTOR_CLONES void RmsNormWeightGradRows(const float* g, const float* x, const float* inv,
                                               float* part, int64_t begin, int64_t end, int64_t d) {
  for (int64_t j = 0; j < d; ++j) part[j] = 0.f;
  for (int64_t i = begin; i < end; ++i) {
    const float* gi = g + i * d;
    const float* xi = x + i * d;
    const float r = inv[i];
    for (int64_t j = 0; j < d; ++j) part[j] += gi[j] * (xi[j] * r);
  }
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& w_in, double eps) {
    const torch::Tensor x = x_in.contiguous(), w = w_in.contiguous();
    const int64_t d = x.size(-1), n = d == 0 ? 0 : x.numel() / d;
    torch::Tensor out = torch::empty_like(x);
    torch::Tensor inv = torch::empty({n}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    float* ip = inv.data_ptr<float>();
    at::parallel_for(0, n, RowGrain(d), [&](int64_t b, int64_t e) {
      RmsNormRows(xp, wp, op, ip, b, e, d, static_cast<float>(eps));
    });
    ctx->save_for_backward({x, w, inv});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    const torch::Tensor& inv = saved[2];
    const torch::Tensor g = grads[0].contiguous();
    const int64_t d = x.size(-1), n = inv.size(0);
    const float* gp = g.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* ip = inv.data_ptr<float>();
    torch::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      gx = torch::empty_like(x);
      float* out = gx.data_ptr<float>();
      at::parallel_for(0, n, RowGrain(d), [&](int64_t b, int64_t e) {
        RmsNormGradRows(gp, xp, wp, ip, out, b, e, d);
      });
    }
    if (ctx->needs_input_grad(1)) {
      // Fixed blocks of rows, each summed on its own, then the blocks: the same sum whatever
      // the thread count.
      constexpr int64_t kBlock = 64;
      const int64_t blocks = (n + kBlock - 1) / kBlock;
      torch::Tensor parts = torch::empty({std::max<int64_t>(1, blocks), d}, x.options());
      if (blocks == 0) parts.zero_();
      float* pp = parts.data_ptr<float>();
      at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
        for (int64_t k = b; k < e; ++k) {
          RmsNormWeightGradRows(gp, xp, ip, pp + k * d, k * kBlock, std::min(n, (k + 1) * kBlock),
                                d);
        }
      });
      gw = parts.sum(0);
    }
    return {gx, gw, torch::Tensor()};
  }
};

// ---- SiluMul ------------------------------------------------------------------------------

// silu(g) u forward, and its gradients d/dg = go u s (1 + g (1 - s)), d/du = go g s, with
// s = sigmoid(g) recomputed in each pass rather than stored.
void SiluMulForwardScalar(const float* gate, const float* up, float* out, int64_t begin,
                          int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float s = 1.0f / (1.0f + std::exp(-gate[i]));
    out[i] = (gate[i] * s) * up[i];
  }
}

void SiluMulBackwardScalar(const float* go, const float* gate, const float* up, float* g_gate,
                           float* g_up, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = gate[i], s = 1.0f / (1.0f + std::exp(-g));
    g_gate[i] = go[i] * up[i] * (s * (1.0f + g * (1.0f - s)));
    g_up[i] = go[i] * (g * s);
  }
}

#ifdef CDCCA_SIMD_X86
// exp(x) for eight floats: Cephes' single-precision method (x = n ln 2 + r, a degree-5
// polynomial for exp(r), n added to the exponent), within 2 ulp of expf; inputs clamped to
// [-88.38, 88.38].
__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2 =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

__attribute__((target("avx2,fma"))) inline __m256 Sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

__attribute__((target("avx2,fma"))) void SiluMulForwardAvx2(const float* gate, const float* up,
                                                            float* out, int64_t begin,
                                                            int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    _mm256_storeu_ps(out + i,
                     _mm256_mul_ps(_mm256_mul_ps(g, Sigmoid8(g)), _mm256_loadu_ps(up + i)));
  }
  SiluMulForwardScalar(gate, up, out, i, end);
}

__attribute__((target("avx2,fma"))) void SiluMulBackwardAvx2(const float* go, const float* gate,
                                                             const float* up, float* g_gate,
                                                             float* g_up, int64_t begin,
                                                             int64_t end) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i), s = Sigmoid8(g), o = _mm256_loadu_ps(go + i);
    const __m256 dsilu = _mm256_mul_ps(s, _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one));
    _mm256_storeu_ps(g_gate + i, _mm256_mul_ps(_mm256_mul_ps(o, _mm256_loadu_ps(up + i)), dsilu));
    _mm256_storeu_ps(g_up + i, _mm256_mul_ps(o, _mm256_mul_ps(g, s)));
  }
  SiluMulBackwardScalar(go, gate, up, g_gate, g_up, i, end);
}
#endif

class SiluMulFunction : public torch::autograd::Function<SiluMulFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate_in,
                               const torch::Tensor& up_in) {
    const torch::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
    torch::Tensor out = torch::empty_like(gate);
    ctx->save_for_backward({gate, up});
#if defined(CDCCA_HAVE_CUDA_KERNELS)
    if (gate.is_cuda()) {
      const c10::cuda::CUDAGuard guard(gate.device());
      CheckKernel(cuda_kernels::SiluMul(KernelDtype(gate), gate.data_ptr(), up.data_ptr(),
                                        out.data_ptr(), gate.numel(), StreamOf(gate)),
                  "SiluMul");
      return out;
    }
#endif
    const float* gp = gate.data_ptr<float>();
    const float* up_p = up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const auto kernel = CDCCA_PICK_KERNEL(SiluMulForwardScalar, SiluMulForwardAvx2);
    at::parallel_for(0, gate.numel(), 32768,
                     [&](int64_t b, int64_t e) { kernel(gp, up_p, op, b, e); });
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& gate = saved[0];
    const torch::Tensor& up = saved[1];
    const torch::Tensor go = grads[0].contiguous();
    torch::Tensor g_gate = torch::empty_like(gate), g_up = torch::empty_like(up);
#if defined(CDCCA_HAVE_CUDA_KERNELS)
    if (gate.is_cuda()) {
      const c10::cuda::CUDAGuard guard(gate.device());
      CheckKernel(cuda_kernels::SiluMulBackward(KernelDtype(gate), go.data_ptr(), gate.data_ptr(),
                                                up.data_ptr(), g_gate.data_ptr(), g_up.data_ptr(),
                                                gate.numel(), StreamOf(gate)),
                  "SiluMul's backward");
      return {g_gate, g_up};
    }
#endif
    const float* gop = go.data_ptr<float>();
    const float* gp = gate.data_ptr<float>();
    const float* up_p = up.data_ptr<float>();
    float* ggp = g_gate.data_ptr<float>();
    float* gup = g_up.data_ptr<float>();
    const auto kernel = CDCCA_PICK_KERNEL(SiluMulBackwardScalar, SiluMulBackwardAvx2);
    at::parallel_for(0, gate.numel(), 32768,
                     [&](int64_t b, int64_t e) { kernel(gop, gp, up_p, ggp, gup, b, e); });
    return {g_gate, g_up};
  }
};

#if defined(CDCCA_HAVE_CUDA_KERNELS)
// h = x + a and y = RMSNorm(h) * w in one pass each way (cuda_kernels.h's AddRmsNorm): {h, y}.
// Keeps h and each row's rstd for the backward pass, which gives x and a the same gradient.
class AddRmsNormFunction : public torch::autograd::Function<AddRmsNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& a,
                               const torch::Tensor& w, double eps) {
    const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(1, dim);
    torch::Tensor h = torch::empty_like(x, at::MemoryFormat::Contiguous);
    torch::Tensor y = torch::empty_like(x, at::MemoryFormat::Contiguous);
    torch::Tensor rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
    const c10::cuda::CUDAGuard guard(x.device());
    CheckKernel(cuda_kernels::AddRmsNorm(KernelDtype(x), x.data_ptr(), a.data_ptr(), w.data_ptr(),
                                         h.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(), rows,
                                         dim, static_cast<float>(eps), StreamOf(x)),
                "AddRmsNorm");
    ctx->save_for_backward({h, w, rstd});
    return {h, y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& h = saved[0];
    const torch::Tensor& w = saved[1];
    const torch::Tensor& rstd = saved[2];
    const int64_t dim = h.size(-1), rows = h.numel() / std::max<int64_t>(1, dim);
    const torch::Tensor dy = grads[1].defined() ? grads[1].contiguous() : torch::zeros_like(h);
    const torch::Tensor dres = grads[0].defined() ? grads[0].contiguous() : torch::Tensor();
    torch::Tensor dh = torch::empty_like(h);
    const c10::cuda::CUDAGuard guard(h.device());
    const int64_t partial_rows = cuda_kernels::AddRmsNormPartialRows(KernelDtype(h), rows, dim);
    torch::Tensor partial = torch::empty({partial_rows, dim}, h.options().dtype(torch::kFloat));
    CheckKernel(cuda_kernels::AddRmsNormBackward(
                    KernelDtype(h), dy.data_ptr(), h.data_ptr(), w.data_ptr(),
                    rstd.data_ptr<float>(), dres.defined() ? dres.data_ptr() : nullptr,
                    dh.data_ptr(), partial.data_ptr<float>(), partial_rows, rows, dim, StreamOf(h)),
                "AddRmsNorm's backward");
    torch::Tensor dw;
    if (ctx->needs_input_grad(2)) dw = partial.sum(0).to(w.scalar_type());
    return {dh, dh, dw, torch::Tensor()};
  }
};

bool Aligned16(const torch::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}
#endif

// ---- Rotary embedding ---------------------------------------------------------------------

// One row of D: out = x * c + rotate_half(x) * s, or with `transpose` the gradient form
// out = x * c + rotate_half^T(x * s) (rotate_half^T(y) = cat(y2, -y1)).
CDCCA_VECTOR_CLONES void RotaryRow(const float* x, const float* c, const float* s, float* out,
                                   int64_t d, bool transpose) {
  const int64_t half = d / 2;
  if (!transpose) {
    for (int64_t j = 0; j < half; ++j) out[j] = x[j] * c[j] - x[j + half] * s[j];
    for (int64_t j = half; j < d; ++j) out[j] = x[j] * c[j] + x[j - half] * s[j];
  } else {
    for (int64_t j = 0; j < half; ++j) out[j] = x[j] * c[j] + x[j + half] * s[j + half];
    for (int64_t j = half; j < d; ++j) out[j] = x[j] * c[j] - x[j - half] * s[j - half];
  }
}

// Applies RotaryRow to every (b, h, t) row of x [B, H, T, D] (last dimension contiguous,
// other strides any) with cos/sin [B or 1, T, D] contiguous; out [B, H, T, D] as RotaryOutput
// makes it.
void RotaryRows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                torch::Tensor& out, bool transpose) {
#if defined(CDCCA_HAVE_CUDA_KERNELS)
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t strides[3] = {x.stride(0), x.stride(1), x.stride(2)};
    const int64_t out_strides[3] = {out.stride(0), out.stride(1), out.stride(2)};
    CheckKernel(cuda_kernels::Rotary(KernelDtype(x), x.data_ptr(), strides, cos.data_ptr(),
                                     sin.data_ptr(), cos.size(0) == 1 ? 0 : x.size(2) * x.size(3),
                                     out.data_ptr(), out_strides, x.size(0), x.size(1), x.size(2),
                                     x.size(3), transpose, StreamOf(x)),
                "the rotary embedding");
    return;
  }
#endif
  const int64_t nb = x.size(0), nh = x.size(1), nt = x.size(2), d = x.size(3);
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  const int64_t cb = cos.size(0) == 1 ? 0 : nt * d;
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, nb * nh * nt, RowGrain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r % nt, h = (r / nt) % nh, b = r / (nt * nh);
      RotaryRow(xp + b * sb + h * sh + t * st, cp + b * cb + t * d, sp + b * cb + t * d, op + r * d,
                d, transpose);
    }
  });
}

// The rotary embedding's result for x [B, H, T, D]: contiguous on the CPU; on a GPU a
// [B, T, H, D] buffer seen as [B, H, T, D], the layout the projections give and take. The fused
// attention then writes its output in that layout too (it follows the query's), so neither the
// output's way to o_proj nor the gradients' way back to the projections copies a tensor (a
// contiguous query made LibTorch copy the output and its gradient, and the query's and key's
// gradients, into the other layout).
torch::Tensor RotaryOutput(const torch::Tensor& x) {
  if (!x.is_cuda()) return torch::empty(x.sizes(), x.options());
  return torch::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    const torch::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
    torch::Tensor out = RotaryOutput(x);
    RotaryRows(x, cos, sin, out, /*transpose=*/false);
    ctx->save_for_backward({cos, sin});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const torch::Tensor g = grads[0].stride(3) == 1 ? grads[0] : grads[0].contiguous();
    torch::Tensor gx = RotaryOutput(g);
    RotaryRows(g, saved[0], saved[1], gx, /*transpose=*/true);
    return {gx, torch::Tensor(), torch::Tensor()};
  }
};

// ---- Dropout ------------------------------------------------------------------------------

// murmur3's 32-bit finalizer: a bijection that mixes every input bit into every output bit.
inline uint32_t Mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The keep decision for element `index` (of one 2^32-element block) as a 31-bit draw: kept
// where the draw >= threshold. Two rounds of the finalizer.
inline uint32_t DropoutDraw31(uint32_t index, uint32_t lo, uint32_t hi) {
  return Mix32(Mix32(index * 0x9e3779b9u + lo) ^ hi) >> 1;
}

// out[i] = x[i] * scale where the draw for element i >= threshold, else 0, for i in
// [begin, end) within one 2^32-element block (element i of the whole tensor, so the mask does
// not depend on how the work is split).
void DropoutRangeScalar(const float* x, float* out, int64_t begin, int64_t end, uint32_t lo,
                        uint32_t hi, uint32_t threshold, float scale) {
  for (int64_t i = begin; i < end; ++i) {
    out[i] = DropoutDraw31(static_cast<uint32_t>(i), lo, hi) >= threshold ? x[i] * scale : 0.0f;
  }
}

#ifdef CDCCA_SIMD_X86
__attribute__((target("avx2,fma"))) inline __m256i Mix32x8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// As DropoutRangeScalar, eight elements at a time.
__attribute__((target("avx2,fma"))) void DropoutRangeAvx2(const float* x, float* out, int64_t begin,
                                                          int64_t end, uint32_t lo, uint32_t hi,
                                                          uint32_t threshold, float scale) {
  const __m256i step = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i golden = _mm256_set1_epi32(static_cast<int>(0x9e3779b9u));
  const __m256i vlo = _mm256_set1_epi32(static_cast<int>(lo));
  const __m256i vhi = _mm256_set1_epi32(static_cast<int>(hi));
  // Draws are 31 bits, so a signed compare orders them: keep where draw > threshold - 1.
  const __m256i below = _mm256_set1_epi32(static_cast<int>(threshold) - 1);
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256i index =
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i))), step);
    __m256i h = Mix32x8(_mm256_add_epi32(_mm256_mullo_epi32(index, golden), vlo));
    h = _mm256_srli_epi32(Mix32x8(_mm256_xor_si256(h, vhi)), 1);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(h, below));
    _mm256_storeu_ps(out + i, _mm256_and_ps(keep, _mm256_mul_ps(_mm256_loadu_ps(x + i), vscale)));
  }
  DropoutRangeScalar(x, out, i, end, lo, hi, threshold, scale);
}
#endif

struct DropoutDraw {
  uint64_t seed;
  uint32_t threshold;  // keep where the 31-bit draw >= threshold: probability 1 - p
  float scale;         // 1 / (1 - p)
};

void DropoutApply(const torch::Tensor& x, torch::Tensor& out, const DropoutDraw& d) {
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto range = CDCCA_PICK_KERNEL(DropoutRangeScalar, DropoutRangeAvx2);
  // Each 2^32-element block of the tensor draws with its own key.
  constexpr int64_t kBlock = int64_t{1} << 32;
  at::parallel_for(0, x.numel(), 32768, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e;) {
      const int64_t block = s / kBlock, stop = std::min(e, (block + 1) * kBlock);
      range(xp, op, s, stop, static_cast<uint32_t>(d.seed),
            static_cast<uint32_t>(d.seed >> 32) ^ Mix32(static_cast<uint32_t>(block)), d.threshold,
            d.scale);
      s = stop;
    }
  });
}

class DropoutFunction : public torch::autograd::Function<DropoutFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in, double p) {
    const torch::Tensor x = x_in.contiguous();
    DropoutDraw d;
    {
      at::CPUGeneratorImpl* gen =
          at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
      std::lock_guard<std::mutex> lock(gen->mutex_);
      d.seed = gen->random64();
    }
    d.threshold = static_cast<uint32_t>(std::min(2147483647.0, std::ldexp(p, 31)));
    d.scale = static_cast<float>(1.0 / (1.0 - p));
    torch::Tensor out = torch::empty_like(x);
    DropoutApply(x, out, d);
    ctx->saved_data["seed"] = static_cast<int64_t>(d.seed);
    ctx->saved_data["threshold"] = static_cast<int64_t>(d.threshold);
    ctx->saved_data["scale"] = static_cast<double>(d.scale);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const torch::Tensor g = grads[0].contiguous();
    DropoutDraw d;
    d.seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
    d.threshold = static_cast<uint32_t>(ctx->saved_data["threshold"].toInt());
    d.scale = static_cast<float>(ctx->saved_data["scale"].toDouble());
    torch::Tensor gx = torch::empty_like(g);
    DropoutApply(g, gx, d);
    return {gx, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  if (FloatCpu(x) && FloatCpu(weight) && x.dim() >= 1 && weight.dim() == 1 &&
      weight.size(0) == x.size(-1)) {
    return RmsNormFunction::apply(x, weight, eps);
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  // Training on a GPU: LibTorch's own RMSNorm, one kernel each way where the build has it,
  // in place of about five passes forward and ten backward (the weight multiplies before the
  // cast back, so the output can differ from the formula below by one rounding).
  if (x.is_cuda() && Recorded({&x, &weight}) && !PlainGpuOps() && weight.dim() == 1 &&
      weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type()) {
    return at::rms_norm(x, {x.size(-1)}, weight, eps);
  }
#endif
  torch::Tensor h = x.to(torch::kFloat);
  torch::Tensor variance = h.pow(2).mean(-1, /*keepdim=*/true);
  h = h * torch::rsqrt(variance + eps);
  return weight * h.to(x.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(const torch::Tensor& x, const torch::Tensor& a,
                                                   const torch::Tensor& weight, double eps) {
#if defined(CDCCA_HAVE_CUDA_KERNELS)
  if (Recorded({&x, &a, &weight}) && CudaKernelsTake(x) && a.scalar_type() == x.scalar_type() &&
      weight.scalar_type() == x.scalar_type() && a.device() == x.device() &&
      weight.device() == x.device() && x.sizes() == a.sizes() && x.is_contiguous() &&
      a.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.dim() >= 1 &&
      weight.size(0) == x.size(-1) && cuda_kernels::AddRmsNormFits(KernelDtype(x), x.size(-1)) &&
      Aligned16(x) && Aligned16(a) && Aligned16(weight)) {
    const variable_list hy = AddRmsNormFunction::apply(x, a, weight, eps);
    return {hy[0], hy[1]};
  }
#endif
  torch::Tensor h = x + a;
  torch::Tensor y = RmsNorm(h, weight, eps);
  return {h, y};
}

torch::Tensor SiluMul(const torch::Tensor& gate, const torch::Tensor& up) {
  // Without autograd LibTorch's two passes are as fast, and inference keeps its exact silu.
  // Training on a GPU with cdcca's kernels: one pass each way, and the backward pass keeps
  // gate and up instead of also silu(gate).
  const bool cuda = CudaKernelsTake(gate) && CudaKernelsTake(up) &&
                    gate.scalar_type() == up.scalar_type() && gate.device() == up.device();
  if (Recorded({&gate, &up}) && ((FloatCpu(gate) && FloatCpu(up)) || cuda) &&
      gate.sizes() == up.sizes()) {
    return SiluMulFunction::apply(gate, up);
  }
  return torch::silu(gate) * up;
}

torch::Tensor RotaryEmbedding(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin) {
  const bool shapes = x.dim() == 4 && x.size(-1) % 2 == 0 && cos.dim() == 3 &&
                      cos.sizes() == sin.sizes() &&
                      (cos.size(0) == x.size(0) || cos.size(0) == 1) && cos.size(1) == x.size(2) &&
                      cos.size(2) == x.size(3) && cos.is_contiguous() && sin.is_contiguous();
  const bool cpu = FloatCpu(x) && FloatCpu(cos) && FloatCpu(sin);
  // Training on a GPU with cdcca's kernels: one pass each way (inference keeps the formula).
  const bool cuda = Recorded({&x}) && CudaKernelsTake(x) && cos.scalar_type() == x.scalar_type() &&
                    sin.scalar_type() == x.scalar_type() && cos.device() == x.device() &&
                    sin.device() == x.device();
  if (shapes && (cpu || cuda)) return RotaryFunction::apply(x, cos, sin);
  const int64_t half = x.size(-1) / 2;
  if (Recorded({&x}) && !PlainGpuOps() && x.size(-1) % 2 == 0) {
    // Training elsewhere (a GPU): rotate_half(x) * sin is x rolled by half a row times sin
    // with its first half negated, so x * cos + that is one product and one addcmul over x
    // (three passes each way) instead of a negation, a concatenation, two products and a sum.
    torch::Tensor signed_sin =
        torch::cat({-sin.narrow(-1, 0, half), sin.narrow(-1, half, half)}, -1);
    return torch::addcmul(x * cos.unsqueeze(1), x.roll(half, -1), signed_sin.unsqueeze(1));
  }
  torch::Tensor rotated =
      torch::cat({-x.narrow(-1, half, x.size(-1) - half), x.narrow(-1, 0, half)}, -1);
  return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);
}

torch::Tensor TrainingDropout(const torch::Tensor& x, double p) {
  if (p <= 0.0) return x;
  if (p >= 1.0) return x * 0.0;
  if (FloatCpu(x)) return DropoutFunction::apply(x, p);
  return torch::dropout(x, p, /*train=*/true);
}

}  // namespace cdcca::model
