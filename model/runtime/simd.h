// The AVX2 helpers the CPU kernels share (qmatmul.cc, batched_matmul.cc). CDCCA_SIMD_X86 is
// defined where they exist (x86-64 with GCC or Clang); elsewhere the kernels take their
// portable loops.
#ifndef CDCCA_MODEL_RUNTIME_SIMD_H_
#define CDCCA_MODEL_RUNTIME_SIMD_H_

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CDCCA_SIMD_X86 1
#include <immintrin.h>
#endif

namespace cdcca::model {

#ifdef CDCCA_SIMD_X86
// Whether this processor runs AVX2 and FMA (checked once).
inline bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return have;
}

// The AVX2 kernel where this processor runs it, else the portable one. Off x86 only the
// portable kernel exists, and the macro never names the other.
#define CDCCA_PICK_KERNEL(portable, avx2) (::cdcca::model::HaveAvx2() ? (avx2) : (portable))

// The sum of v's eight lanes.
__attribute__((target("avx2,fma"))) inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#else
#define CDCCA_PICK_KERNEL(portable, avx2) (portable)
#endif

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_SIMD_H_
