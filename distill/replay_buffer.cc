#include "distill/replay_buffer.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "compress/byte_io.h"

namespace cdcca::distill {
namespace {

using compress::Put;
using compress::PutArray;

// Uniform in [0, n) from the raw 64-bit engine output. The standard distributions are
// implementation-defined, this is not, so draws match across standard libraries; the modulo
// bias (n / 2^64) is negligible for any buffer size.
uint64_t Below(std::mt19937_64& rng, uint64_t n) { return rng() % n; }

// Serialize's layout, little-endian: u32 magic "CDRB" | u32 format | u64 seen | u64 size +
// the generator's state as the standard's text | u64 samples | each sample: u64 sample_id,
// u64 model_version, f32 entropy, u32 grid_tokens, u32 feature_dim, u64 n + u16 kept
// indices, u64 n + u32 prompt tokens, u64 n + u32 answer tokens, u8 feature kind (1 fp16,
// 2 fp32), u64 n + the features, u64 n + frame bytes.
constexpr uint32_t kMagic = 0x42524443;  // "CDRB"
constexpr uint32_t kFormat = 1;
constexpr uint8_t kHalf = 1;
constexpr uint8_t kFloat = 2;

bool ExactInHalf(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) {
    const float back = compress::HalfToFloat(compress::FloatToHalf(x));
    return std::memcmp(&back, &x, sizeof(x)) == 0;
  });
}

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

std::string ReplayBuffer::Serialize() const {
  std::string out;
  Put(out, kMagic);
  Put(out, kFormat);
  Put<uint64_t>(out, seen_);
  std::ostringstream rng;
  rng << rng_;
  compress::PutBytes(out, rng.str());
  Put<uint64_t>(out, items_.size());
  for (const compress::UplinkSample& s : items_) {
    Put(out, s.sample_id);
    Put(out, s.model_version);
    Put(out, s.entropy);
    Put(out, s.grid_tokens);
    Put(out, s.feature_dim);
    PutArray(out, s.kept_indices);
    PutArray(out, s.prompt_tokens);
    PutArray(out, s.answer_tokens);
    if (ExactInHalf(s.features)) {
      Put(out, kHalf);
      std::vector<uint16_t> half(s.features.size());
      std::transform(s.features.begin(), s.features.end(), half.begin(), compress::FloatToHalf);
      PutArray(out, half);
    } else {
      Put(out, kFloat);
      PutArray(out, s.features);
    }
    compress::PutBytes(out, s.frame);
  }
  return out;
}

absl::Status ReplayBuffer::Restore(absl::string_view bytes, absl::string_view what) {
  const auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("replay buffer of ", what, ": ", why));
  };
  compress::ByteReader in(bytes);
  uint32_t magic = 0, format = 0;
  if (!in.Get(&magic) || !in.Get(&format)) return bad("truncated");
  if (magic != kMagic || format != kFormat) return bad("not a replay buffer of format 1");
  uint64_t seen = 0, count = 0;
  std::string rng_text;
  if (!in.Get(&seen) || !in.GetBytes(&rng_text)) return bad("truncated");
  std::mt19937_64 rng;
  std::istringstream rng_in(rng_text);
  if (!(rng_in >> rng)) return bad("the generator's state does not parse");
  if (!in.Get(&count)) return bad("truncated");
  if (count > capacity_ || count > seen) {
    return bad(absl::StrCat(count, " samples, past the capacity ", capacity_,
                            " or the samples offered, ", seen));
  }
  std::vector<compress::UplinkSample> items(count);
  for (compress::UplinkSample& s : items) {
    uint8_t kind = 0;
    if (!in.Get(&s.sample_id) || !in.Get(&s.model_version) || !in.Get(&s.entropy) ||
        !in.Get(&s.grid_tokens) || !in.Get(&s.feature_dim) || !in.GetArray(&s.kept_indices) ||
        !in.GetArray(&s.prompt_tokens) || !in.GetArray(&s.answer_tokens) || !in.Get(&kind)) {
      return bad("truncated sample");
    }
    if (kind == kHalf) {
      std::vector<uint16_t> half;
      if (!in.GetArray(&half)) return bad("truncated features");
      s.features.resize(half.size());
      std::transform(half.begin(), half.end(), s.features.begin(), compress::HalfToFloat);
    } else if (kind == kFloat) {
      if (!in.GetArray(&s.features)) return bad("truncated features");
    } else {
      return bad(absl::StrCat("unknown feature kind ", kind));
    }
    if (!in.GetBytes(&s.frame)) return bad("truncated frame");
  }
  if (!in.done()) return bad("trailing bytes");
  seen_ = seen;
  rng_ = rng;
  items_ = std::move(items);
  return absl::OkStatus();
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
