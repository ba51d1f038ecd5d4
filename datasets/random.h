// Small, portable pseudo-random numbers for data generation.
//
// The standard <random> distributions differ between standard libraries, so scenes built
// with them would differ between this machine and the GPU machine. Everything here is
// specified bit for bit: SplitMix64 for seeding, xoshiro256** for the stream, and
// distributions written out by hand.
#ifndef CDCCA_DATASETS_RANDOM_H_
#define CDCCA_DATASETS_RANDOM_H_

#include <cmath>
#include <cstdint>

namespace cdcca::datasets {

// One step of SplitMix64: a strong 64-bit mixer, used to derive independent seeds.
inline uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Combines a seed with a sub-stream id (sample index, purpose tag) into a new seed, so
// sample i of seed s is reproducible without generating samples 0..i-1.
inline uint64_t MixSeed(uint64_t seed, uint64_t stream) {
  uint64_t s = seed ^ (stream * 0xD1B54A32D192ED03ULL);
  SplitMix64(s);
  return SplitMix64(s);
}

// xoshiro256**. Not thread-safe; cheap to construct, so make one per sample.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t& w : s_) w = SplitMix64(seed);
  }

  uint64_t Next() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * Uniform(); }
  // Uniform integer in [lo, hi] (inclusive). Requires lo <= hi.
  int UniformInt(int lo, int hi) {
    const uint64_t span = static_cast<uint64_t>(static_cast<int64_t>(hi) - lo) + 1;
    return lo + static_cast<int>(Next() % span);  // bias < 2^-40 for spans used here
  }
  bool Bernoulli(double p) { return Uniform() < p; }
  // Standard normal by Box-Muller (one value per call; simplicity over speed).
  double Normal() {
    double u1 = Uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    const double u2 = Uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// Fisher-Yates shuffle of [first, last) with `rng`.
template <typename It>
void Shuffle(It first, It last, Rng& rng) {
  const auto n = last - first;
  for (auto i = n - 1; i > 0; --i) {
    const auto j = static_cast<decltype(i)>(rng.UniformInt(0, static_cast<int>(i)));
    std::swap(first[i], first[j]);
  }
}

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_RANDOM_H_
