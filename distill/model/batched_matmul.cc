#include "distill/model/batched_matmul.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/autograd.h>

#include <algorithm>
#include <vector>

#include "distill/model/simd.h"

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

#endif  // CDCCA_SIMD_X86

// out[n] = x[n] y[n]^T for x [..., M, K] and y [..., P, K] (same leading dimensions):
// [..., M, P], contiguous.
torch::Tensor DotRows(const torch::Tensor& x_in, const torch::Tensor& y_in) {
  const int64_t m = x_in.size(-2), k = x_in.size(-1), p = y_in.size(-2);
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = p;
  const torch::Tensor x = x_in.contiguous(), y = y_in.contiguous();
  torch::Tensor out = torch::empty(shape, x.options());
  const int64_t n = m == 0 ? 0 : x.numel() / (m * k);
  const float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, m * p * k));
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
#ifdef CDCCA_SIMD_X86
      if (HaveAvx2()) {
        DotRowsAvx2(xp + i * m * k, yp + i * p * k, op + i * m * p, m, p, k);
        continue;
      }
#endif
      DotRowsScalar(xp + i * m * k, yp + i * p * k, op + i * m * p, m, p, k);
    }
  });
  return out;
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
    // The gradients' products are torch::matmul's: with short dot products (the key count) and
    // transposed operands this kernel was slower than LibTorch's there (measured, 2-core machine).
    torch::Tensor ga, gb;
    if (ctx->needs_input_grad(0)) ga = torch::matmul(g, b.transpose(-1, -2));  // [..., M, K]
    if (ctx->needs_input_grad(1)) gb = torch::matmul(a.transpose(-1, -2), g);  // [..., K, P]
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
