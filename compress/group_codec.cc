#include "compress/group_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_format.h"

namespace cdcca::compress {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Half the number of levels: the offset that centres codes 0..2^b-1 on zero.
float HalfLevels(int bits) { return (static_cast<float>(1u << bits) - 1.0f) * 0.5f; }

// Packs codes of `bits` bits LSB-first.
class BitWriter {
 public:
  BitWriter(std::string* out, int bits) : out_(out), bits_(bits) {}
  void Put(uint32_t code) {
    acc_ |= static_cast<uint64_t>(code) << fill_;
    fill_ += bits_;
    while (fill_ >= 8) {
      out_->push_back(static_cast<char>(acc_ & 0xff));
      acc_ >>= 8;
      fill_ -= 8;
    }
  }
  void Flush() {
    if (fill_ > 0) out_->push_back(static_cast<char>(acc_ & 0xff));
    acc_ = 0;
    fill_ = 0;
  }

 private:
  std::string* out_;
  int bits_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

// Codes for one group at a given step; returns the squared error.
double GroupError(const float* x, size_t n, int bits, float step) {
  const float half = HalfLevels(bits);
  const float top = static_cast<float>((1u << bits) - 1);
  double err = 0.0;
  if (step == 0.0f) {
    for (size_t i = 0; i < n; ++i) err += static_cast<double>(x[i]) * x[i];
    return err;
  }
  const float inv = 1.0f / step;
  for (size_t i = 0; i < n; ++i) {
    const float q = std::min(top, std::max(0.0f, std::nearbyint(x[i] * inv + half)));
    const float d = (q - half) * step - x[i];
    err += static_cast<double>(d) * d;
  }
  return err;
}

}  // namespace

bool IsSupportedBits(int bits) {
  return bits == 0 || bits == 1 || bits == 2 || bits == 3 || bits == 4 || bits == 8;
}

uint64_t CodedBlockBytes(uint64_t n, int bits, uint64_t group_size) {
  if (bits == 0 || n == 0) return 0;
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  if (group_size == 0 || n > kMax / 16) return kMax;
  const uint64_t groups = n / group_size + (n % group_size != 0 ? 1 : 0);
  return groups * 2 + (n * static_cast<uint64_t>(bits) + 7) / 8;
}

uint16_t FloatToBfloat16(float f) {
  const uint32_t u = FloatBits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  const uint32_t rounding = 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float Bfloat16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

void QuantizeBlock(const float* x, size_t n, int bits, size_t group_size, std::string* out) {
  if (bits == 0 || n == 0) return;
  const size_t groups = (n + group_size - 1) / group_size;
  const size_t scale_at = out->size();
  out->resize(scale_at + groups * 2);
  std::string codes;
  codes.reserve((n * bits + 7) / 8);
  BitWriter writer(&codes, bits);
  const float half = HalfLevels(bits);
  const float top = static_cast<float>((1u << bits) - 1);
  for (size_t g = 0; g < groups; ++g) {
    const float* gx = x + g * group_size;
    const size_t gn = std::min(group_size, n - g * group_size);
    float scale = 0.0f;
    if (bits == 1) {
      double sum_abs = 0.0;
      for (size_t i = 0; i < gn; ++i) sum_abs += std::fabs(gx[i]);
      scale = Bfloat16ToFloat(FloatToBfloat16(
          std::min(kMaxScale, static_cast<float>(sum_abs / static_cast<double>(gn)))));
      for (size_t i = 0; i < gn; ++i) writer.Put(gx[i] >= 0.0f ? 1u : 0u);
    } else {
      float max_abs = 0.0f;
      for (size_t i = 0; i < gn; ++i) max_abs = std::max(max_abs, std::fabs(gx[i]));
      // Clipping ratios tried; 8 bits has levels to spare, so its grid spans the max.
      static constexpr float kRatios[] = {1.0f, 0.9f, 0.8f, 0.7f, 0.6f, 0.5f};
      const int tries = bits >= 8 ? 1 : 6;
      double best_err = std::numeric_limits<double>::infinity();
      for (int t = 0; t < tries; ++t) {
        const float step =
            Bfloat16ToFloat(FloatToBfloat16(std::min(kMaxScale, kRatios[t] * max_abs / half)));
        const double err = GroupError(gx, gn, bits, step);
        if (err < best_err) {
          best_err = err;
          scale = step;
        }
      }
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      for (size_t i = 0; i < gn; ++i) {
        const float q = std::min(top, std::max(0.0f, std::nearbyint(gx[i] * inv + half)));
        writer.Put(static_cast<uint32_t>(q));
      }
    }
    const uint16_t h = FloatToBfloat16(scale);
    (*out)[scale_at + 2 * g] = static_cast<char>(h & 0xff);
    (*out)[scale_at + 2 * g + 1] = static_cast<char>(h >> 8);
  }
  writer.Flush();
  out->append(codes);
}

absl::Status DequantizeBlock(absl::string_view block, size_t n, int bits, size_t group_size,
                             float* out) {
  if (!IsSupportedBits(bits)) {
    return absl::DataLossError(absl::StrFormat("unsupported bit width %d", bits));
  }
  const uint64_t expected = CodedBlockBytes(n, bits, group_size);
  if (block.size() != expected) {
    return absl::DataLossError(
        absl::StrFormat("coded block holds %d bytes, %d values at %d bits in groups of %d need %d",
                        block.size(), n, bits, group_size, expected));
  }
  if (bits == 0) {
    std::fill(out, out + n, 0.0f);
    return absl::OkStatus();
  }
  const auto* bytes = reinterpret_cast<const unsigned char*>(block.data());
  const size_t groups = (n + group_size - 1) / group_size;
  const unsigned char* codes = bytes + groups * 2;
  const uint32_t mask = (1u << bits) - 1;
  const float half = HalfLevels(bits);
  uint64_t bit_pos = 0;
  for (size_t g = 0; g < groups; ++g) {
    const uint16_t h = static_cast<uint16_t>(bytes[2 * g] | (bytes[2 * g + 1] << 8));
    const float scale = Bfloat16ToFloat(h);
    // Written as a negated range test so NaN fails it too.
    if (!(scale >= 0.0f && scale <= kMaxScale)) {
      return absl::DataLossError(absl::StrFormat("group %d has invalid scale %g", g, scale));
    }
    const size_t begin = g * group_size;
    const size_t end = std::min(n, begin + group_size);
    if (bits == 8) {
      for (size_t i = begin; i < end; ++i) out[i] = (static_cast<float>(codes[i]) - half) * scale;
      continue;
    }
    for (size_t i = begin; i < end; ++i, bit_pos += bits) {
      // Codes never straddle more than two bytes (bits <= 4 here); the second byte exists
      // whenever the code needs it, because the block length was checked above.
      const uint64_t byte = bit_pos >> 3;
      const int shift = static_cast<int>(bit_pos & 7);
      uint32_t word = codes[byte];
      if (shift + bits > 8) word |= static_cast<uint32_t>(codes[byte + 1]) << 8;
      const uint32_t code = (word >> shift) & mask;
      if (bits == 1) {
        out[i] = code != 0 ? scale : -scale;
      } else {
        out[i] = (static_cast<float>(code) - half) * scale;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace cdcca::compress
