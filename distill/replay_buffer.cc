#include "distill/replay_buffer.h"

#include <algorithm>
#include <numeric>

namespace cdcca::distill {
namespace {

// Uniform in [0, n) from the raw 64-bit engine output. The standard distributions are
// implementation-defined, this is not, so draws match across standard libraries; the modulo
// bias (n / 2^64) is negligible for any buffer size.
uint64_t Below(std::mt19937_64& rng, uint64_t n) { return rng() % n; }

}  // namespace

ReplayBuffer::ReplayBuffer(size_t capacity, uint64_t seed) : capacity_(capacity), rng_(seed) {}

void ReplayBuffer::Add(const std::vector<compress::UplinkSample>& samples) {
  for (const compress::UplinkSample& s : samples) {
    ++seen_;
    if (items_.size() < capacity_) {
      items_.push_back(s);
      continue;
    }
    if (capacity_ == 0) continue;
    // Keep the new sample with probability capacity / seen, replacing a uniform victim.
    const uint64_t slot = Below(rng_, seen_);
    if (slot < capacity_) items_[slot] = s;
  }
}

std::vector<const compress::UplinkSample*> ReplayBuffer::Draw(size_t count) {
  std::vector<size_t> order(items_.size());
  std::iota(order.begin(), order.end(), 0);
  // Partial Fisher-Yates (std::shuffle's use of the engine is implementation-defined).
  const size_t n = std::min(count, order.size());
  for (size_t i = 0; i < n; ++i) {
    std::swap(order[i], order[i + Below(rng_, order.size() - i)]);
  }
  std::vector<const compress::UplinkSample*> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(&items_[order[i]]);
  return out;
}

}  // namespace cdcca::distill
