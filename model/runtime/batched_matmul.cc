#include "model/runtime/batched_matmul.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <algorithm>
#include <vector>

#include "model/runtime/simd.h"

namespace cdcca::model {
namespace {

// Largest M, K and P the kernel takes: past this one BLAS call per pair costs little next to
// its arithmetic.
constexpr int64_t kMaxSide = 128;

// out[i, j] = x[i, :] . y[j, :] for one pair: x [m, k], y [p, k], out [m, p], rows contiguous.
void DotRowsScalar(const float* x, const float* y, float* out, int64_t m, int64_t p, int64_t k) {
  for (int64_t i = 0; i < m; ++i) {
    const float* xi = x + i * k;
    for (int64_t j = 0; j < p; ++j) {
      const float* yj = y + j * k;
      float s = 0.f;
      for (int64_t t = 0; t < k; ++t) s += xi[t] * yj[t];
      out[i * p + j] = s;
    }
  }
}

#ifdef CDCCA_SIMD_X86
// As DotRowsScalar, four rows of y at a time against one row of x.
__attribute__((target("avx2,fma"))) void DotRowsAvx2(const float* x, const float* y, float* out,
                                                     int64_t m, int64_t p, int64_t k) {
  const int64_t k8 = k / 8 * 8;
  for (int64_t i = 0; i < m; ++i) {
    const float* xi = x + i * k;
    float* oi = out + i * p;
    int64_t j = 0;
    for (; j + 4 <= p; j += 4) {
      const float* y0 = y + j * k;
      const float* y1 = y0 + k;
      const float* y2 = y1 + k;
      const float* y3 = y2 + k;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
             a3 = _mm256_setzero_ps();
      for (int64_t t = 0; t < k8; t += 8) {
        const __m256 xv = _mm256_loadu_ps(xi + t);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y0 + t), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y1 + t), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y2 + t), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y3 + t), a3);
      }
      float s0 = HorizontalSum(a0), s1 = HorizontalSum(a1), s2 = HorizontalSum(a2),
            s3 = HorizontalSum(a3);
      for (int64_t t = k8; t < k; ++t) {
        s0 += xi[t] * y0[t];
        s1 += xi[t] * y1[t];
        s2 += xi[t] * y2[t];
        s3 += xi[t] * y3[t];
      }
      oi[j] = s0;
      oi[j + 1] = s1;
      oi[j + 2] = s2;
      oi[j + 3] = s3;
    }
    for (; j < p; ++j) {
      const float* yj = y + j * k;
      __m256 a = _mm256_setzero_ps();
      for (int64_t t = 0; t < k8; t += 8) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(xi + t), _mm256_loadu_ps(yj + t), a);
      }
      float s = HorizontalSum(a);
      for (int64_t t = k8; t < k; ++t) s += xi[t] * yj[t];
      oi[j] = s;
    }
  }
}

// out[i, c0 : c0 + width] = sum_t x[i, t] y[t, c0 : c0 + width] for one pair (x [m, k],
// y [k, p], out [m, p], rows contiguous), width <= 8 * kBlocks, eight columns a vector, the
// last block masked. kBlocks is a compile-time constant so the accumulators stay in registers.
template <int kBlocks>
__attribute__((target("avx2,fma"))) inline void AxpyColumnsAvx2(const float* x, const float* y,
                                                                float* out, int64_t m, int64_t p,
                                                                int64_t k, int64_t c0,
                                                                __m256i tail) {
  for (int64_t i = 0; i < m; ++i) {
    const float* xi = x + i * k;
    __m256 acc[kBlocks];
    for (int v = 0; v < kBlocks; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t t = 0; t < k; ++t) {
      const __m256 xv = _mm256_broadcast_ss(xi + t);
      const float* yt = y + t * p + c0;
      for (int v = 0; v + 1 < kBlocks; ++v) {
        acc[v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(yt + 8 * v), acc[v]);
      }
      acc[kBlocks - 1] =
          _mm256_fmadd_ps(xv, _mm256_maskload_ps(yt + 8 * (kBlocks - 1), tail), acc[kBlocks - 1]);
    }
    float* oi = out + i * p + c0;
    for (int v = 0; v + 1 < kBlocks; ++v) _mm256_storeu_ps(oi + 8 * v, acc[v]);
    _mm256_maskstore_ps(oi + 8 * (kBlocks - 1), tail, acc[kBlocks - 1]);
  }
}

// out[i, :] = sum_t x[i, t] y[t, :] for one pair: x [m, k], y [k, p], out [m, p], rows
// contiguous. Up to 64 columns of out a pass: the form the gradients need, whose inner
// dimension (the query or key count) is short.
__attribute__((target("avx2,fma"))) void AxpyRowsAvx2(const float* x, const float* y, float* out,
                                                      int64_t m, int64_t p, int64_t k) {
  alignas(32) int32_t lanes[8];
  for (int l = 0; l < 8; ++l) lanes[l] = l;
  const __m256i lane = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  for (int64_t c0 = 0; c0 < p; c0 += 64) {
    const int64_t width = std::min<int64_t>(64, p - c0);
    const int64_t blocks = (width + 7) / 8;
    const __m256i tail =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(width - 8 * (blocks - 1))), lane);
    using Columns =
        void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, __m256i);
    static constexpr Columns kColumns[8] = {
        AxpyColumnsAvx2<1>, AxpyColumnsAvx2<2>, AxpyColumnsAvx2<3>, AxpyColumnsAvx2<4>,
        AxpyColumnsAvx2<5>, AxpyColumnsAvx2<6>, AxpyColumnsAvx2<7>, AxpyColumnsAvx2<8>};
    kColumns[blocks - 1](x, y, out, m, p, k, c0, tail);
  }
}

#endif  // CDCCA_SIMD_X86

// As AxpyRowsAvx2, without vector instructions.
void AxpyRowsScalar(const float* x, const float* y, float* out, int64_t m, int64_t p, int64_t k) {
  for (int64_t i = 0; i < m; ++i) {
    float* oi = out + i * p;
    std::fill(oi, oi + p, 0.f);
    for (int64_t t = 0; t < k; ++t) {
      const float xv = x[i * k + t];
      const float* yt = y + t * p;
      for (int64_t j = 0; j < p; ++j) oi[j] += xv * yt[j];
    }
  }
}

// One pair's product: x [m, k] with y (p * k floats), out [m, p], all contiguous.
using PairKernel = void (*)(const float* x, const float* y, float* out, int64_t m, int64_t p,
                            int64_t k);

// Runs `kernel` (`avx2` where the processor has it and it is not null) over every pair of x
// [..., M, K] and y (same leading dimensions, P * K floats a pair): out [..., M, P], contiguous.
torch::Tensor ForEachPair(const torch::Tensor& x_in, const torch::Tensor& y_in, int64_t p,
                          PairKernel avx2, PairKernel scalar) {
  const int64_t m = x_in.size(-2), k = x_in.size(-1);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = p;
  const torch::Tensor x = x_in.contiguous(), y = y_in.contiguous();
  torch::Tensor out = torch::empty(shape, x.options());
  const int64_t n = m == 0 ? 0 : x.numel() / (m * k);
  const float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  PairKernel run = scalar;
#ifdef CDCCA_SIMD_X86
  if (avx2 != nullptr && HaveAvx2()) run = avx2;
#endif
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, m * p * k));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) run(xp + i * m * k, yp + i * p * k, op + i * m * p, m, p, k);
  });
  return out;
}

#ifdef CDCCA_SIMD_X86
constexpr PairKernel kDotRowsAvx2 = DotRowsAvx2;
constexpr PairKernel kAxpyRowsAvx2 = AxpyRowsAvx2;
#else
constexpr PairKernel kDotRowsAvx2 = nullptr;
constexpr PairKernel kAxpyRowsAvx2 = nullptr;
#endif

// out[n] = x[n] y[n] for x [..., M, K] and y [..., K, P] (same leading dimensions).
torch::Tensor AxpyRows(const torch::Tensor& x, const torch::Tensor& y) {
  return ForEachPair(x, y, y.size(-1), kAxpyRowsAvx2, AxpyRowsScalar);
}

// out[n] = x[n] y[n]^T for x [..., M, K] and y [..., P, K] (same leading dimensions).
torch::Tensor DotRows(const torch::Tensor& x, const torch::Tensor& y) {
  return ForEachPair(x, y, y.size(-2), kDotRowsAvx2, DotRowsScalar);
}

class SmallBatchedMatmul : public torch::autograd::Function<SmallBatchedMatmul> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& a,
                               const torch::Tensor& b) {
    ctx->save_for_backward({a, b});
    return DotRows(a, b.transpose(-1, -2));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& a = saved[0];
    const torch::Tensor& b = saved[1];
    const torch::Tensor& g = grads[0];  // [..., M, P]
    torch::Tensor ga, gb;
    // The gradients' inner dimension is the query or key count (short): AxpyRows' form, which
    // vectorizes along the output columns instead (torch::bmm's per-pair BLAS calls cost 0.32
    // against 0.27 s a teacher pretraining step on the 2-core machine).
    if (ctx->needs_input_grad(0)) ga = AxpyRows(g, b.transpose(-1, -2));  // [..., M, K]
    if (ctx->needs_input_grad(1)) gb = AxpyRows(a.transpose(-1, -2), g);  // [..., K, P]
    return {ga, gb};
  }
};

}  // namespace

bool UsesSmallMatrixKernel(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.device().is_cpu() || !b.device().is_cpu()) return false;
  if (a.scalar_type() != torch::kFloat || b.scalar_type() != torch::kFloat) return false;
  if (a.dim() < 3 || a.dim() != b.dim()) return false;
  for (int64_t d = 0; d + 2 < a.dim(); ++d) {
    if (a.size(d) != b.size(d)) return false;
  }
  const int64_t m = a.size(-2), k = a.size(-1), p = b.size(-1);
  if (b.size(-2) != k) return false;
  return m > 0 && k > 0 && p > 0 && m <= kMaxSide && k <= kMaxSide && p <= kMaxSide;
}

torch::Tensor BatchedMatmul(const torch::Tensor& a, const torch::Tensor& b) {
  if (!UsesSmallMatrixKernel(a, b)) return torch::matmul(a, b);
  return SmallBatchedMatmul::apply(a, b);
}

}  // namespace cdcca::model
