// cdcca's CUDA kernels (cuda_kernels.h): the rotary embedding, the SwiGLU gate, and a pre-norm
// decoder's residual addition with the RMSNorm that reads its result, forward and backward,
// one pass each. Each thread takes a pack of 16 bytes (8 bf16 or half values, 4 floats) where
// every pointer and stride allows it, one element otherwise (the norm: always packs); the
// arithmetic is float32 whatever the storage, with one rounding to the storage type at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>

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
                             T* __restrict__ out, int64_t ob, int64_t oh, int64_t ot,
                             int64_t heads, int64_t positions, int64_t half, int64_t count,
                             bool transpose) {
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
    T* o = out + b * ob + h * oh + t * ot;
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
             void* out, const int64_t o[3], int64_t batch, int64_t heads, int64_t positions,
             int64_t dim, bool transpose, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const int64_t half = dim / 2;
  const int64_t rows = batch * heads * positions;
  const bool packed = Aligned(x) && Aligned(cos) && Aligned(sin) && Aligned(out) &&
                      half % kV == 0 && s[0] % kV == 0 && s[1] % kV == 0 && s[2] % kV == 0 &&
                      o[0] % kV == 0 && o[1] % kV == 0 && o[2] % kV == 0 && cb % kV == 0;
  const auto* xp = static_cast<const T*>(x);
  const auto* cp = static_cast<const T*>(cos);
  const auto* sp = static_cast<const T*>(sin);
  auto* op = static_cast<T*>(out);
  if (packed) {
    const int64_t count = rows * (half / kV);
    RotaryKernel<T, kV><<<Blocks(count), kThreads, 0, stream>>>(
        xp, s[0], s[1], s[2], cp, sp, cb, op, o[0], o[1], o[2], heads, positions, half, count,
        transpose);
  } else {
    const int64_t count = rows * half;
    RotaryKernel<T, 1><<<Blocks(count), kThreads, 0, stream>>>(
        xp, s[0], s[1], s[2], cp, sp, cb, op, o[0], o[1], o[2], heads, positions, half, count,
        transpose);
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

// ---- The residual addition and RMSNorm ----

// v reduced over the block by `op` (sum or max; every thread gets the result). `shared` holds 32
// floats; the block's threads are a multiple of 32.
template <typename Op>
__device__ __forceinline__ float BlockReduce(float v, float* shared, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // shared is free again (an earlier call's readers are done)
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = lane < warps ? shared[lane] : op.identity;
  for (int o = 16; o > 0; o >>= 1) total = op(total, __shfl_xor_sync(0xffffffffu, total, o));
  return total;
}

struct SumOp {
  float identity = 0.0f;
  __device__ float operator()(float a, float b) const { return a + b; }
};

struct MaxOp {
  float identity = 0.0f;  // the magnitudes reduced are >= 0
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ __forceinline__ float BlockSum(float v, float* shared) {
  return BlockReduce(v, shared, SumOp());
}

// One block per row (rows strided over the grid): h = x + a rounded to T, rstd = 1 / sqrt(mean
// of h^2 + eps) over the rounded h, y = h * rstd * w in float rounded once.
template <typename T, int V>
__global__ void AddRmsNormKernel(const T* __restrict__ x, const T* __restrict__ a,
                                 const T* __restrict__ w, T* __restrict__ h, T* __restrict__ y,
                                 float* __restrict__ rstd, int64_t rows, int64_t dim, float eps) {
  __shared__ float shared[32];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * dim;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x * V; c < dim; c += static_cast<int64_t>(blockDim.x) * V) {
      const Pack<T, V> xv = Load<T, V>(x + base + c), av = Load<T, V>(a + base + c);
      Pack<T, V> hv;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        hv.v[k] = FromFloat<T>(ToFloat(xv.v[k]) + ToFloat(av.v[k]));
        const float f = ToFloat(hv.v[k]);
        ss += f * f;
      }
      Store<T, V>(h + base + c, hv);
    }
    const float r = rsqrtf(BlockSum(ss, shared) / static_cast<float>(dim) + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    for (int64_t c = threadIdx.x * V; c < dim; c += static_cast<int64_t>(blockDim.x) * V) {
      const Pack<T, V> hv = Load<T, V>(h + base + c), wv = Load<T, V>(w + c);
      Pack<T, V> yv;
#pragma unroll
      for (int k = 0; k < V; ++k) yv.v[k] = FromFloat<T>(ToFloat(hv.v[k]) * r * ToFloat(wv.v[k]));
      Store<T, V>(y + base + c, yv);
    }
  }
}

constexpr int kNormPacks = 4;  // packs of a row one thread holds at most

// The gradients: with n = h * rstd, dh = rstd * (dy * w - n * mean(dy * w * n)) + dres (dres,
// the gradient reaching h along the residual stream, may be null), and each block's sum of
// dy * n over its rows into dw_partial[block, :]. Each thread holds P packs of a row: w's for
// all rows, and a row's dy, h and dres from one load (all three requested before the row's sum
// waits for them) to the gradient's store.
template <typename T, int V, int P>
__global__ void AddRmsNormBackwardKernel(const T* __restrict__ dy, const T* __restrict__ h,
                                         const T* __restrict__ w, const float* __restrict__ rstd,
                                         const T* __restrict__ dres, T* __restrict__ dh,
                                         float* __restrict__ dw_partial, int64_t rows,
                                         int64_t dim) {
  __shared__ float shared[32];
  const int64_t stride = static_cast<int64_t>(blockDim.x) * V;
  float dw[P][V];
  Pack<T, V> wv[P];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int64_t c = threadIdx.x * V + p * stride;
    if (c < dim) wv[p] = Load<T, V>(w + c);
#pragma unroll
    for (int k = 0; k < V; ++k) dw[p][k] = 0.0f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * dim;
    const float r = rstd[row];
    Pack<T, V> gv[P], hv[P], rv[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t c = threadIdx.x * V + p * stride;
      if (c >= dim) continue;
      gv[p] = Load<T, V>(dy + base + c);
      hv[p] = Load<T, V>(h + base + c);
      if (dres != nullptr) rv[p] = Load<T, V>(dres + base + c);
    }
    float dot = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t c = threadIdx.x * V + p * stride;
      if (c >= dim) continue;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        dot += ToFloat(gv[p].v[k]) * ToFloat(wv[p].v[k]) * ToFloat(hv[p].v[k]) * r;
      }
    }
    const float mean = BlockSum(dot, shared) / static_cast<float>(dim);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t c = threadIdx.x * V + p * stride;
      if (c >= dim) continue;
      Pack<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float g = ToFloat(gv[p].v[k]), n = ToFloat(hv[p].v[k]) * r;
        float d = r * (g * ToFloat(wv[p].v[k]) - n * mean);
        if (dres != nullptr) d += ToFloat(rv[p].v[k]);
        out.v[k] = FromFloat<T>(d);
        dw[p][k] += g * n;
      }
      Store<T, V>(dh + base + c, out);
    }
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int64_t c = threadIdx.x * V + p * stride;
    if (c >= dim) continue;
#pragma unroll
    for (int k = 0; k < V; ++k) dw_partial[blockIdx.x * dim + c + k] = dw[p][k];
  }
}

// Threads per block for rows of dim: a multiple of 32, at most 1024, each thread at most
// kNormPacks packs; 0 where dim does not fit.
template <typename T>
int NormThreads(int64_t dim) {
  constexpr int kV = 16 / sizeof(T);
  if (dim <= 0 || dim % kV != 0) return 0;
  const int64_t packs = dim / kV;
  int64_t threads = (packs + kNormPacks - 1) / kNormPacks;
  threads = std::max<int64_t>(threads, std::min<int64_t>(packs, 256));  // at least a few warps
  threads = (threads + 31) / 32 * 32;
  return threads <= 1024 ? static_cast<int>(threads) : 0;
}

template <typename T>
int AddRmsNormAs(const void* x, const void* a, const void* w, void* h, void* y, float* rstd,
                 int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const int threads = NormThreads<T>(dim);
  if (threads == 0 || !Aligned(x) || !Aligned(a) || !Aligned(w) || !Aligned(h) || !Aligned(y)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t blocks = std::min<int64_t>(rows, 65535);
  AddRmsNormKernel<T, kV><<<blocks, threads, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(a), static_cast<const T*>(w),
      static_cast<T*>(h), static_cast<T*>(y), rstd, rows, dim, eps);
  return static_cast<int>(cudaGetLastError());
}

// The backward kernel's shape for rows of dim, {threads, P}: a thread per pack where a row has
// at most 1024 (P = 1, the fewest registers a thread, so the most threads resident), else P
// packs a thread. {0, 0} where dim does not fit.
template <typename T>
std::pair<int, int> NormBackwardShape(int64_t dim) {
  constexpr int kV = 16 / sizeof(T);
  if (dim <= 0 || dim % kV != 0) return {0, 0};
  const int64_t packs = dim / kV;
  const int64_t p = (packs + 1023) / 1024;
  if (p > kNormPacks) return {0, 0};
  const int64_t threads = ((packs + p - 1) / p + 31) / 32 * 32;
  return {static_cast<int>(threads), p <= 1 ? 1 : p <= 2 ? 2 : kNormPacks};
}

template <typename T, int P>
auto NormBackwardKernelOf() {
  return AddRmsNormBackwardKernel<T, 16 / sizeof(T), P>;
}

// Calls f with the backward kernel of P packs a thread.
template <typename T, typename F>
void WithNormBackwardKernel(int packs, F f) {
  if (packs == 1) {
    f(NormBackwardKernelOf<T, 1>());
  } else if (packs == 2) {
    f(NormBackwardKernelOf<T, 2>());
  } else {
    f(NormBackwardKernelOf<T, kNormPacks>());
  }
}

// As many blocks as the GPU runs at once (each then walks its share of the rows in one wave).
// The device's multiprocessors and the kernel's occupancy are asked once per device and shape
// (a backward pass calls this for every norm), kept per thread.
template <typename T>
int64_t NormBackwardBlocks(int64_t rows, int64_t dim) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  static thread_local std::map<std::pair<int, int64_t>, int64_t> resident;
  auto [it, fresh] = resident.try_emplace({device, dim}, 1);
  if (fresh) {
    const std::pair<int, int> shape = NormBackwardShape<T>(dim);
    const int threads = shape.first, packs = shape.second;
    int sms = 1, per_sm = 1;
    if (threads == 0 || device < 0 ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      sms = 1;
    }
    WithNormBackwardKernel<T>(packs, [&](auto kernel) {
      if (threads == 0 || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads,
                                                                          0) != cudaSuccess) {
        per_sm = 1;
      }
    });
    it->second = std::max<int64_t>(1, static_cast<int64_t>(sms) * per_sm);
  }
  return std::max<int64_t>(1, std::min<int64_t>(rows, it->second));
}

template <typename T>
int AddRmsNormBackwardAs(const void* dy, const void* h, const void* w, const float* rstd,
                         const void* dres, void* dh, float* dw_partial, int64_t partial_rows,
                         int64_t rows, int64_t dim, cudaStream_t stream) {
  const std::pair<int, int> shape = NormBackwardShape<T>(dim);
  const int threads = shape.first, packs = shape.second;
  if (threads == 0 || partial_rows < 1 || !Aligned(dy) || !Aligned(h) || !Aligned(w) ||
      !Aligned(dh) || (dres != nullptr && !Aligned(dres))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  WithNormBackwardKernel<T>(packs, [&](auto kernel) {
    kernel<<<partial_rows, threads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(h), static_cast<const T*>(w), rstd,
        static_cast<const T*>(dres), static_cast<T*>(dh), dw_partial, rows, dim);
  });
  return static_cast<int>(cudaGetLastError());
}

// ---- Rows rounded to e4m3 for FP8 products ----

// e4m3's largest finite magnitude (fp8_product.h's kE4m3Max), and the smallest largest
// magnitude a row's scale is taken from (an all-zero row keeps a finite scale): 1e-12 of it.
constexpr float kE4m3Max = 448.0f;
constexpr float kMinAbsMax = static_cast<float>(1e-12 * 448.0);

// One block per row of x (row stride `stride`): the row's largest magnitude m, its scale
// max(m, kMinAbsMax) / 448, each value divided by the scale and rounded to e4m3 (nearest,
// ties to even, saturated). Rows from `rows` to `padded_rows` are written as zeros with the
// smallest scale. V values a thread per load (1 where the row is not in aligned packs).
template <typename T, int V>
__global__ void QuantizeRowsKernel(const T* __restrict__ x, int64_t stride, int64_t rows,
                                   int64_t cols, __nv_fp8_storage_t* __restrict__ q,
                                   float* __restrict__ scales) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  __nv_fp8_storage_t* qr = q + row * cols;
  if (row >= rows) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) qr[j] = 0;
    if (threadIdx.x == 0) scales[row] = kMinAbsMax / kE4m3Max;
    return;
  }
  const T* xr = x + row * stride;
  float m = 0.0f;
  for (int64_t j = threadIdx.x * V; j < cols; j += blockDim.x * V) {
    const Pack<T, V> p = Load<T, V>(xr + j);
#pragma unroll
    for (int k = 0; k < V; ++k) m = fmaxf(m, fabsf(ToFloat(p.v[k])));
  }
  const float scale = fmaxf(BlockReduce(m, shared, MaxOp()), kMinAbsMax) / kE4m3Max;
  if (threadIdx.x == 0) scales[row] = scale;
  for (int64_t j = threadIdx.x * V; j < cols; j += blockDim.x * V) {
    const Pack<T, V> p = Load<T, V>(xr + j);  // the row again, from the cache
    Pack<__nv_fp8_storage_t, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      out.v[k] = __nv_cvt_float_to_fp8(ToFloat(p.v[k]) / scale, __NV_SATFINITE, __NV_E4M3);
    }
    Store<__nv_fp8_storage_t, V>(qr + j, out);
  }
}

template <typename T>
int QuantizeRowsE4m3As(const void* x, int64_t stride, int64_t rows, int64_t padded_rows,
                       int64_t cols, void* q, float* scales, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  const auto* xp = static_cast<const T*>(x);
  auto* qp = static_cast<__nv_fp8_storage_t*>(q);
  // A row's largest dimension (11,008 at the 7B shape) is a few loads a thread.
  if (Aligned(x) && Aligned(q) && cols % kV == 0 && stride % kV == 0) {
    QuantizeRowsKernel<T, kV><<<padded_rows, kThreads, 0, stream>>>(xp, stride, rows, cols, qp,
                                                                      scales);
  } else {
    QuantizeRowsKernel<T, 1><<<padded_rows, kThreads, 0, stream>>>(xp, stride, rows, cols, qp,
                                                                     scales);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int Rotary(Dtype dtype, const void* x, const int64_t x_strides[3], const void* cos, const void* sin,
           int64_t cos_batch_stride, void* out, const int64_t out_strides[3], int64_t batch,
           int64_t heads, int64_t positions, int64_t dim, bool transpose, void* stream) {
  if (batch * heads * positions * dim == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat:
      return RotaryAs<float>(x, x_strides, cos, sin, cos_batch_stride, out, out_strides, batch,
                             heads, positions, dim, transpose, s);
    case Dtype::kHalf:
      return RotaryAs<__half>(x, x_strides, cos, sin, cos_batch_stride, out, out_strides, batch,
                              heads, positions, dim, transpose, s);
    case Dtype::kBFloat16:
      return RotaryAs<__nv_bfloat16>(x, x_strides, cos, sin, cos_batch_stride, out, out_strides,
                                     batch, heads, positions, dim, transpose, s);
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

bool AddRmsNormFits(Dtype dtype, int64_t dim) {
  switch (dtype) {
    case Dtype::kFloat:
      return NormThreads<float>(dim) > 0;
    case Dtype::kHalf:
      return NormThreads<__half>(dim) > 0;
    case Dtype::kBFloat16:
      return NormThreads<__nv_bfloat16>(dim) > 0;
  }
  return false;
}

int64_t AddRmsNormPartialRows(Dtype dtype, int64_t rows, int64_t dim) {
  switch (dtype) {
    case Dtype::kFloat:
      return NormBackwardBlocks<float>(rows, dim);
    case Dtype::kHalf:
      return NormBackwardBlocks<__half>(rows, dim);
    case Dtype::kBFloat16:
      return NormBackwardBlocks<__nv_bfloat16>(rows, dim);
  }
  return 1;
}

int AddRmsNorm(Dtype dtype, const void* x, const void* a, const void* w, void* h, void* y,
               float* rstd, int64_t rows, int64_t dim, float eps, void* stream) {
  if (rows == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat:
      return AddRmsNormAs<float>(x, a, w, h, y, rstd, rows, dim, eps, s);
    case Dtype::kHalf:
      return AddRmsNormAs<__half>(x, a, w, h, y, rstd, rows, dim, eps, s);
    case Dtype::kBFloat16:
      return AddRmsNormAs<__nv_bfloat16>(x, a, w, h, y, rstd, rows, dim, eps, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int AddRmsNormBackward(Dtype dtype, const void* dy, const void* h, const void* w, const float* rstd,
                       const void* dres, void* dh, float* dw_partial, int64_t partial_rows,
                       int64_t rows, int64_t dim, void* stream) {
  if (rows == 0) return 0;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat:
      return AddRmsNormBackwardAs<float>(dy, h, w, rstd, dres, dh, dw_partial, partial_rows, rows,
                                         dim, s);
    case Dtype::kHalf:
      return AddRmsNormBackwardAs<__half>(dy, h, w, rstd, dres, dh, dw_partial, partial_rows, rows,
                                          dim, s);
    case Dtype::kBFloat16:
      return AddRmsNormBackwardAs<__nv_bfloat16>(dy, h, w, rstd, dres, dh, dw_partial, partial_rows,
                                                 rows, dim, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int QuantizeRowsE4m3(Dtype dtype, const void* x, int64_t row_stride, int64_t rows,
                     int64_t padded_rows, int64_t cols, void* q, float* scales, void* stream) {
  if (padded_rows == 0) return 0;
  if (padded_rows < rows || padded_rows > 0x7fffffff) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case Dtype::kFloat:
      return QuantizeRowsE4m3As<float>(x, row_stride, rows, padded_rows, cols, q, scales, s);
    case Dtype::kHalf:
      return QuantizeRowsE4m3As<__half>(x, row_stride, rows, padded_rows, cols, q, scales, s);
    case Dtype::kBFloat16:
      return QuantizeRowsE4m3As<__nv_bfloat16>(x, row_stride, rows, padded_rows, cols, q, scales,
                                               s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* ErrorString(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace cdcca::model::cuda_kernels
