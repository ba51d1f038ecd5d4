#include "compress/hash64.h"

#include <cstring>

namespace cdcca::compress {
namespace {

// Odd 64-bit constants with well-spread bits (fractional digits of sqrt(2), sqrt(3), e, pi);
// odd so that multiplying by them is a bijection modulo 2^64.
constexpr uint64_t kMulA = 0x6a09e667f3bcc909ULL;
constexpr uint64_t kMulB = 0xbb67ae8584caa73bULL;
constexpr uint64_t kMulC = 0xb7e151628aed2a6bULL;
constexpr uint64_t kMulD = 0x243f6a8885a308d3ULL;

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t LoadLe64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// One lane step: bijective in `word` for a fixed lane state, and bijective in the state.
inline uint64_t Lane(uint64_t state, uint64_t word) {
  state += word * kMulB;
  state = Rotl(state, 29);
  return state * kMulA;
}

// Final avalanche: xor-shift-multiply rounds, each a bijection, so no two states collide.
inline uint64_t Avalanche(uint64_t h) {
  h ^= h >> 31;
  h *= kMulC;
  h ^= h >> 29;
  h *= kMulD;
  h ^= h >> 32;
  return h;
}

}  // namespace

uint64_t Hash64(const void* data, size_t size, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + size;
  uint64_t h;
  if (size >= 32) {
    uint64_t v0 = seed + kMulA + kMulB;
    uint64_t v1 = seed + kMulB;
    uint64_t v2 = seed;
    uint64_t v3 = seed - kMulA;
    // Four independent lanes keep the multiplier pipelines busy.
    while (end - p >= 32) {
      v0 = Lane(v0, LoadLe64(p));
      v1 = Lane(v1, LoadLe64(p + 8));
      v2 = Lane(v2, LoadLe64(p + 16));
      v3 = Lane(v3, LoadLe64(p + 24));
      p += 32;
    }
    h = Rotl(v0, 1) + Rotl(v1, 7) + Rotl(v2, 12) + Rotl(v3, 18);
    // Fold each lane in again so a lane's state is not hidden by the sum alone.
    h = (h ^ Lane(0, v0)) * kMulA + kMulD;
    h = (h ^ Lane(0, v1)) * kMulA + kMulD;
    h = (h ^ Lane(0, v2)) * kMulA + kMulD;
    h = (h ^ Lane(0, v3)) * kMulA + kMulD;
  } else {
    h = seed + kMulC;
  }
  h += static_cast<uint64_t>(size);
  while (end - p >= 8) {
    h ^= Lane(0, LoadLe64(p));
    h = Rotl(h, 27) * kMulA + kMulD;
    p += 8;
  }
  if (p < end) {
    // Tail of 1..7 bytes, padded with zeros; the length above tells paddings apart.
    unsigned char tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tail, p, static_cast<size_t>(end - p));
    h ^= Lane(0, LoadLe64(tail));
    h = Rotl(h, 23) * kMulB + kMulC;
  }
  return Avalanche(h);
}

}  // namespace cdcca::compress
