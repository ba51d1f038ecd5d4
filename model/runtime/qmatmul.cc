#include "model/runtime/qmatmul.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "model/runtime/simd.h"

namespace cdcca::model {
namespace {

// Rows of x up to which the packed-weight kernels run; beyond, block dequantize + GEMM.
constexpr int64_t kMaxRowsDirect = 4;
// Weights per thread task in the direct kernels: small matrices run on few threads (or
// inline), since waking a thread costs more than its share of a small product.
constexpr int64_t kGrainWeights = int64_t{1} << 18;
constexpr int64_t kGrainRows = 16;  // at least, and for dequantizing blocks
// Floats of dequantized weight per block in the GEMM path (4 MB, reused per thread).
constexpr int64_t kBlockFloats = int64_t{1} << 20;

int64_t DirectGrain(int64_t in_features) {
  return std::max(kGrainRows, kGrainWeights / std::max<int64_t>(in_features, 1));
}

// ---- int8: y = scale * sum_k x[k] * w[k] ---------------------------------------------------

float DotInt8Portable(const float* x, const int8_t* w, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += x[k + j] * static_cast<float>(w[k + j]);
  }
  float s = 0;
  for (; k < n; ++k) s += x[k] * static_cast<float>(w[k]);
  for (float a : acc) s += a;
  return s;
}

// int4: x is "deinterleaved" per 32-column block (the 16 even columns, then the 16 odd ones,
// matching the low and high nibbles of 16 packed bytes) and zero-padded to whole groups;
// xsum[g] is the sum of x over group g, so sum x * (q - 8) = sum x * q - 8 * xsum.
float DotInt4Portable(const float* xd, const float* xsum, const uint8_t* w, const float* scales,
                      int64_t groups, int64_t group) {
  const int64_t blocks_per_group = group / 32;
  float total = 0;
  for (int64_t g = 0; g < groups; ++g) {
    float acc = 0;
    for (int64_t b = 0; b < blocks_per_group; ++b) {
      const int64_t blk = g * blocks_per_group + b;
      const uint8_t* wb = w + blk * 16;
      const float* xb = xd + blk * 32;
      for (int j = 0; j < 16; ++j) {
        acc += xb[j] * static_cast<float>(wb[j] & 15) + xb[16 + j] * static_cast<float>(wb[j] >> 4);
      }
    }
    total += scales[g] * (acc - 8.0f * xsum[g]);
  }
  return total;
}

#ifdef CDCCA_SIMD_X86
// 8 int8 values as 8 floats.
__attribute__((target("avx2,fma"))) inline __m256 Widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

__attribute__((target("avx2,fma"))) float DotInt8Avx2(const float* x, const int8_t* w, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
         a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    a0 = _mm256_fmadd_ps(Widen(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(Widen(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(Widen(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(Widen(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= n; k += 8) a0 = _mm256_fmadd_ps(Widen(w + k), _mm256_loadu_ps(x + k), a0);
  float s = HorizontalSum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < n; ++k) s += x[k] * static_cast<float>(w[k]);
  return s;
}

__attribute__((target("avx2,fma"))) float DotInt4Avx2(const float* xd, const float* xsum,
                                                      const uint8_t* w, const float* scales,
                                                      int64_t groups, int64_t group) {
  const int64_t blocks_per_group = group / 32;
  const __m128i low4 = _mm_set1_epi8(15);
  __m256 total = _mm256_setzero_ps();
  float correction = 0;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
           a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks_per_group; ++b) {
      const int64_t blk = g * blocks_per_group + b;
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + blk * 16));
      const __m128i lo = _mm_and_si128(bytes, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      const float* xb = xd + blk * 32;
      a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xb), a0);
      a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                           _mm256_loadu_ps(xb + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xb + 16),
                           a2);
      a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
                           _mm256_loadu_ps(xb + 24), a3);
    }
    const __m256 acc = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    total = _mm256_fmadd_ps(acc, _mm256_set1_ps(scales[g]), total);
    correction += scales[g] * xsum[g];
  }
  return HorizontalSum(total) - 8.0f * correction;
}

#endif

float DotInt8(const float* x, const int8_t* w, int64_t n) {
#ifdef CDCCA_SIMD_X86
  if (HaveAvx2()) return DotInt8Avx2(x, w, n);
#endif
  return DotInt8Portable(x, w, n);
}

float DotInt4(const float* xd, const float* xsum, const uint8_t* w, const float* scales,
              int64_t groups, int64_t group) {
#ifdef CDCCA_SIMD_X86
  if (HaveAvx2()) return DotInt4Avx2(xd, xsum, w, scales, groups, group);
#endif
  return DotInt4Portable(xd, xsum, w, scales, groups, group);
}

// Few rows: y [rows, out] from the packed weight.
void DirectInt8(const torch::Tensor& x, const QuantizedWeight& q, torch::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), out = q.values.size(0);
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = q.values.data_ptr<int8_t>();
  const float* sp = q.scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, DirectGrain(in), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t t = 0; t < rows; ++t) {
        yp[t * out + r] = sp[r] * DotInt8(xp + t * in, wp + r * in, in);
      }
    }
  });
}

void DirectInt4(const torch::Tensor& x, const QuantizedWeight& q, int64_t group, torch::Tensor& y) {
  const int64_t rows = x.size(0), in = x.size(1), out = q.values.size(0);
  const int64_t groups = q.scales.size(1), padded = groups * group, row_bytes = q.values.size(1);
  // Deinterleaved, zero-padded copies of x and their group sums.
  std::vector<float> xd(static_cast<size_t>(rows * padded), 0.0f);
  std::vector<float> xsum(static_cast<size_t>(rows * groups), 0.0f);
  const float* xp = x.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t) {
    const float* src = xp + t * in;
    float* dst = xd.data() + t * padded;
    for (int64_t c = 0; c < in; ++c) {
      const int64_t blk = c / 32, j = c % 32;
      dst[blk * 32 + (j % 2) * 16 + j / 2] = src[c];
      xsum[t * groups + c / group] += src[c];
    }
  }
  const uint8_t* wp = q.values.data_ptr<uint8_t>();
  const float* sp = q.scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, DirectGrain(in), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t t = 0; t < rows; ++t) {
        yp[t * out + r] = DotInt4(xd.data() + t * padded, xsum.data() + t * groups,
                                  wp + r * row_bytes, sp + r * groups, groups, group);
      }
    }
  });
}

// Output channels [r0, r0 + n) of the weight, dequantized into `dst` [n, in].
void DequantizeRows(const QuantizedWeight& q, Precision precision, int64_t in, int64_t group,
                    int64_t r0, int64_t n, float* dst) {
  at::parallel_for(0, n, kGrainRows, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t r = r0 + i;
      float* row = dst + i * in;
      if (precision == Precision::kInt8) {
        const int8_t* w = q.values.data_ptr<int8_t>() + r * in;
        const float s = q.scales.data_ptr<float>()[r];
        for (int64_t c = 0; c < in; ++c) row[c] = s * static_cast<float>(w[c]);
      } else {
        const uint8_t* w = q.values.data_ptr<uint8_t>() + r * q.values.size(1);
        const float* s = q.scales.data_ptr<float>() + r * q.scales.size(1);
        for (int64_t c = 0; c < in; ++c) {
          const int v = (c % 2 == 0 ? (w[c / 2] & 15) : (w[c / 2] >> 4)) - 8;
          row[c] = s[c / group] * static_cast<float>(v);
        }
      }
    }
  });
}

}  // namespace

torch::Tensor QuantizedLinear(const torch::Tensor& x, const QuantizedWeight& q, Precision precision,
                              int64_t in_features, int64_t group, const torch::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat,
              "QuantizedLinear: fp32 CPU input expected");
  TORCH_CHECK(x.size(-1) == in_features, "QuantizedLinear: input has ", x.size(-1),
              " features, the weight ", in_features);
  TORCH_CHECK(precision == Precision::kInt8 || precision == Precision::kInt4,
              "QuantizedLinear: not a quantized precision");
  TORCH_CHECK(precision == Precision::kInt8 || group % 32 == 0,
              "QuantizedLinear: int4 group must be a multiple of 32");
  const int64_t out = q.values.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out;
  torch::Tensor x2 = x.reshape({-1, in_features}).contiguous();
  const int64_t rows = x2.size(0);
  torch::Tensor y;
  if (rows <= kMaxRowsDirect) {
    y = torch::empty({rows, out}, torch::kFloat);
    if (precision == Precision::kInt8) {
      DirectInt8(x2, q, y);
    } else {
      DirectInt4(x2, q, group, y);
    }
  } else {
    y = torch::empty({rows, out}, torch::kFloat);
    const int64_t block = std::max<int64_t>(kGrainRows, std::min(out, kBlockFloats / in_features));
    // One scratch block per calling thread, kept: a fresh one per call would be mapped and
    // zeroed by the kernel every time.
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(
        std::max<int64_t>(block * in_features, static_cast<int64_t>(scratch.size()))));
    for (int64_t r0 = 0; r0 < out; r0 += block) {
      const int64_t n = std::min(block, out - r0);
      torch::Tensor w = torch::from_blob(scratch.data(), {n, in_features}, torch::kFloat);
      DequantizeRows(q, precision, in_features, group, r0, n, w.data_ptr<float>());
      y.narrow(1, r0, n).copy_(torch::mm(x2, w.t()));
    }
  }
  if (bias.defined()) y.add_(bias.to(torch::kFloat));
  return y.view(out_shape);
}

}  // namespace cdcca::model
