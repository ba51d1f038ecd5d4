// cdcca's CUDA kernels (cuda_kernels.h): the rotary embedding and the SwiGLU gate, forward and
// backward, one pass each. Each thread takes a pack of 16 bytes (8 bf16 or half values, 4
// floats) where every pointer and stride allows it, one element otherwise; the arithmetic is
// float32 whatever the storage, with one rounding to the storage type at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "model/runtime/cuda_kernels.h"

namespace cdcca::model::cuda_kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// V values of T moved as one aligned load or store.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> Load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void Store(T* p, const Pack<T, V>& x) {
  *reinterpret_cast<Pack<T, V>*>(p) = x;
}

// silu(g) as LibTorch computes it: g / (1 + exp(-g)).
__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// One thread per V consecutive positions j of a row's first half, with their partners j + half.
template <typename T, int V>
__global__ void RotaryKernel(const T* __restrict__ x, int64_t sb, int64_t sh, int64_t st,
                             const T* __restrict__ cos, const T* __restrict__ sin, int64_t cb,
                             T* __restrict__ out, int64_t heads, int64_t positions, int64_t half,
                             int64_t count, bool transpose) {
  const int64_t per_row = half / V;
  const int64_t d = 2 * half;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row;
    const int64_t j = (i - r * per_row) * V;
    const int64_t t = r % positions;
    const int64_t h = (r / positions) % heads;
    const int64_t b = r / (positions * heads);
    const T* xr = x + b * sb + h * sh + t * st;
    const T* cr = cos + b * cb + t * d;
    const T* sr = sin + b * cb + t * d;
    const Pack<T, V> x1 = Load<T, V>(xr + j), x2 = Load<T, V>(xr + j + half);
    const Pack<T, V> c1 = Load<T, V>(cr + j), c2 = Load<T, V>(cr + j + half);
    const Pack<T, V> s1 = Load<T, V>(sr + j), s2 = Load<T, V>(sr + j + half);
    Pack<T, V> y1, y2;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float a = ToFloat(x1.v[k]), b2 = ToFloat(x2.v[k]);
      float lo, hi;
      if (!transpose) {
        lo = a * ToFloat(c1.v[k]) - b2 * ToFloat(s1.v[k]);
        hi = b2 * ToFloat(c2.v[k]) + a * ToFloat(s2.v[k]);
      } else {
        lo = a * ToFloat(c1.v[k]) + b2 * ToFloat(s2.v[k]);
        hi = b2 * ToFloat(c2.v[k]) - a * ToFloat(s1.v[k]);
      }
      y1.v[k] = FromFloat<T>(lo);
      y2.v[k] = FromFloat<T>(hi);
    }
    T* o = out + r * d;
    Store<T, V>(o + j, y1);
    Store<T, V>(o + j + half, y2);
  }
}

template <typename T, int V>
__global__ void SiluMulKernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out,
                              int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * V;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * V; i < n;
       i += step) {
    if (i + V <= n) {
      const Pack<T, V> a = Load<T, V>(g + i), b = Load<T, V>(u + i);
      Pack<T, V> y;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float gk = ToFloat(a.v[k]);
        y.v[k] = FromFloat<T>(gk * Sigmoid(gk) * ToFloat(b.v[k]));
      }
      Store<T, V>(out + i, y);
    } else {
      for (int64_t k = i; k < n; ++k) {
        const float gk = ToFloat(g[k]);
        out[k] = FromFloat<T>(gk * Sigmoid(gk) * ToFloat(u[k]));
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void SiluMulGrads(float go, float g, float u, T* gg, T* gu) {
  const float s = Sigmoid(g);
  *gg = FromFloat<T>(go * u * s * (1.0f + g * (1.0f - s)));
  *gu = FromFloat<T>(go * g * s);
}

template <typename T, int V>
__global__ void SiluMulBackwardKernel(const T* __restrict__ go, const T* __restrict__ g,
                                      const T* __restrict__ u, T* __restrict__ gg,
                                      T* __restrict__ gu, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * V;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * V; i < n;
       i += step) {
    if (i + V <= n) {
      const Pack<T, V> o = Load<T, V>(go + i), a = Load<T, V>(g + i), b = Load<T, V>(u + i);
      Pack<T, V> da, db;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        SiluMulGrads(ToFloat(o.v[k]), ToFloat(a.v[k]), ToFloat(b.v[k]), &da.v[k], &db.v[k]);
      }
      Store<T, V>(gg + i, da);
      Store<T, V>(gu + i, db);
    } else {
      for (int64_t k = i; k < n; ++k) {
        SiluMulGrads(ToFloat(go[k]), ToFloat(g[k]), ToFloat(u[k]), gg + k, gu + k);
      }
    }
  }
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t Blocks(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 1 << 20));
}

template <typename T>
int RotaryAs(const void* x, const int64_t s[3], const void* cos, const void* sin, int64_t cb,
             void* out, int64_t batch, int64_t heads, int64_t positions, int64_t dim,
             bool transpose, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const int64_t half = dim / 2;
  const int64_t rows = batch * heads * positions;
  const bool packed = Aligned(x) && Aligned(cos) && Aligned(sin) && Aligned(out) &&
                      half % kV == 0 && s[0] % kV == 0 && s[1] % kV == 0 && s[2] % kV == 0 &&
                      cb % kV == 0;
  const auto* xp = static_cast<const T*>(x);
  const auto* cp = static_cast<const T*>(cos);
  const auto* sp = static_cast<const T*>(sin);
  auto* op = static_cast<T*>(out);
  if (packed) {
    const int64_t count = rows * (half / kV);
    RotaryKernel<T, kV><<<Blocks(count), kThreads, 0, stream>>>(
        xp, s[0], s[1], s[2], cp, sp, cb, op, heads, positions, half, count, transpose);
  } else {
    const int64_t count = rows * half;
    RotaryKernel<T, 1><<<Blocks(count), kThreads, 0, stream>>>(
        xp, s[0], s[1], s[2], cp, sp, cb, op, heads, positions, half, count, transpose);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int SiluMulAs(const void* gate, const void* up, void* out, int64_t n, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const auto* g = static_cast<const T*>(gate);
  const auto* u = static_cast<const T*>(up);
  auto* o = static_cast<T*>(out);
  if (Aligned(gate) && Aligned(up) && Aligned(out)) {
    SiluMulKernel<T, kV><<<Blocks((n + kV - 1) / kV), kThreads, 0, stream>>>(g, u, o, n);
  } else {
    SiluMulKernel<T, 1><<<Blocks(n), kThreads, 0, stream>>>(g, u, o, n);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int SiluMulBackwardAs(const void* go, const void* gate, const void* up, void* gate_grad,
                      void* up_grad, int64_t n, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const auto* o = static_cast<const T*>(go);
  const auto* g = static_cast<const T*>(gate);
  const auto* u = static_cast<const T*>(up);
  auto* gg = static_cast<T*>(gate_grad);
  auto* gu = static_cast<T*>(up_grad);
  if (Aligned(go) && Aligned(gate) && Aligned(up) && Aligned(gate_grad) && Aligned(up_grad)) {
    SiluMulBackwardKernel<T, kV>
        <<<Blocks((n + kV - 1) / kV), kThreads, 0, stream>>>(o, g, u, gg, gu, n);
  } else {
    SiluMulBackwardKernel<T, 1><<<Blocks(n), kThreads, 0, stream>>>(o, g, u, gg, gu, n);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int Rotary(Dtype dtype, const void* x, const int64_t x_strides[3], const void* cos, const void* sin,
           int64_t cos_batch_stride, void* out, int64_t batch, int64_t heads, int64_t positions,
           int64_t dim, bool transpose, void* stream) {
  if (batch * heads * positions * dim == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat:
      return RotaryAs<float>(x, x_strides, cos, sin, cos_batch_stride, out, batch, heads,
                             positions, dim, transpose, s);
    case Dtype::kHalf:
      return RotaryAs<__half>(x, x_strides, cos, sin, cos_batch_stride, out, batch, heads,
                              positions, dim, transpose, s);
    case Dtype::kBFloat16:
      return RotaryAs<__nv_bfloat16>(x, x_strides, cos, sin, cos_batch_stride, out, batch, heads,
                                     positions, dim, transpose, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int SiluMul(Dtype dtype, const void* gate, const void* up, void* out, int64_t n, void* stream) {
  if (n == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat:
      return SiluMulAs<float>(gate, up, out, n, s);
    case Dtype::kHalf:
      return SiluMulAs<__half>(gate, up, out, n, s);
    case Dtype::kBFloat16:
      return SiluMulAs<__nv_bfloat16>(gate, up, out, n, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int SiluMulBackward(Dtype dtype, const void* go, const void* gate, const void* up, void* gate_grad,
                    void* up_grad, int64_t n, void* stream) {
  if (n == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat:
      return SiluMulBackwardAs<float>(go, gate, up, gate_grad, up_grad, n, s);
    case Dtype::kHalf:
      return SiluMulBackwardAs<__half>(go, gate, up, gate_grad, up_grad, n, s);
    case Dtype::kBFloat16:
      return SiluMulBackwardAs<__nv_bfloat16>(go, gate, up, gate_grad, up_grad, n, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* ErrorString(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace cdcca::model::cuda_kernels
