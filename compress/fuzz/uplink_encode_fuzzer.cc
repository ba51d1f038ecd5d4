// libFuzzer entry for the uplink encoder (what a device builds from its own answers and
// tokens): samples shaped by the input, encoded at the precision the input picks, must either
// be refused with a status or decode back to themselves, exactly for everything but the
// features, and the features within the precision's rounding.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "compress/uplink_codec.h"

namespace {

// Reads the input front to back; past its end every read is zero.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t Byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t U16() { return static_cast<uint16_t>(Byte() | (Byte() << 8)); }
  float Float() {
    uint32_t bits = 0;
    for (int i = 0; i < 4; ++i) bits |= static_cast<uint32_t>(Byte()) << (8 * i);
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  std::string Bytes(size_t n) {
    n = std::min(n, size_ - pos_);
    std::string s(reinterpret_cast<const char*>(data_) + pos_, n);
    pos_ += n;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

using cdcca::compress::FeaturePrecision;

// The most a decoded feature may differ from what was encoded.
bool Close(float encoded, float decoded, float row_max, FeaturePrecision precision) {
  if (precision == FeaturePrecision::kFp16) {
    const float expected = cdcca::compress::HalfToFloat(cdcca::compress::FloatToHalf(encoded));
    return std::memcmp(&expected, &decoded, sizeof(float)) == 0 ||
           (std::isnan(expected) && std::isnan(decoded));
  }
  const float levels = precision == FeaturePrecision::kInt8 ? 127.0f : 7.0f;
  const float step = row_max / levels;
  return std::fabs(encoded - decoded) <= 0.5f * step * 1.001f + 1e-30f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const uint8_t p = in.Byte() % 4;
  const FeaturePrecision precision = p == 0   ? FeaturePrecision::kFp16
                                     : p == 1 ? FeaturePrecision::kInt8
                                     : p == 2 ? FeaturePrecision::kInt4
                                              : FeaturePrecision::kJpeg;
  cdcca::compress::UplinkLimits limits;
  limits.max_grid_tokens = 64;
  limits.max_feature_dim = 64;
  limits.max_prompt_tokens = 32;
  limits.max_answer_tokens = 16;
  limits.max_frame_bytes = 4096;
  std::vector<cdcca::compress::UplinkSample> samples(1 + in.Byte() % 3);
  for (cdcca::compress::UplinkSample& s : samples) {
    s.sample_id = in.U16();
    s.model_version = in.Byte();
    s.entropy = in.Float();
    // Up to one past each limit, so the encoder's refusals are reached too.
    s.grid_tokens = in.Byte() % (limits.max_grid_tokens + 2);
    s.feature_dim = in.Byte() % (limits.max_feature_dim + 2);
    const uint8_t kept = in.Byte();
    for (uint32_t t = 0; t < s.grid_tokens && s.kept_indices.size() < kept; ++t) {
      if ((in.Byte() & 1) != 0) s.kept_indices.push_back(static_cast<uint16_t>(t));
    }
    if ((in.Byte() & 7) == 0 && s.kept_indices.size() >= 2) {
      std::swap(s.kept_indices[0], s.kept_indices[1]);  // not increasing: must be refused
    }
    s.prompt_tokens.resize(in.Byte() % (limits.max_prompt_tokens + 2));
    for (uint32_t& t : s.prompt_tokens) t = in.U16();
    s.answer_tokens.resize(in.Byte() % (limits.max_answer_tokens + 2));
    for (uint32_t& t : s.answer_tokens) t = in.U16();
    if (precision == FeaturePrecision::kJpeg) {
      s.frame = in.Bytes(in.U16() % (limits.max_frame_bytes + 2));
    } else {
      s.features.resize(static_cast<size_t>(s.kept_indices.size()) * s.feature_dim);
      // A few distinct values, so a small input still fills large rows.
      const float a = in.Float(), b = in.Float();
      for (size_t i = 0; i < s.features.size(); ++i) {
        s.features[i] = (in.Byte() & 1) != 0 ? a : b * static_cast<float>(i % 7);
      }
    }
  }
  absl::StatusOr<std::string> payload =
      cdcca::compress::EncodeUplinkBatch(samples, precision, limits, 1);
  if (!payload.ok()) return 0;
  absl::StatusOr<std::vector<cdcca::compress::UplinkSample>> decoded =
      cdcca::compress::DecodeUplinkBatch(*payload, limits);
  // What the encoder accepts, the decoder with the same limits takes back.
  if (!decoded.ok() || decoded->size() != samples.size()) __builtin_trap();
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto& a = samples[i];
    const auto& b = (*decoded)[i];
    if (a.sample_id != b.sample_id || a.model_version != b.model_version ||
        std::memcmp(&a.entropy, &b.entropy, sizeof(float)) != 0 || a.grid_tokens != b.grid_tokens ||
        a.feature_dim != b.feature_dim || a.kept_indices != b.kept_indices ||
        a.prompt_tokens != b.prompt_tokens || a.answer_tokens != b.answer_tokens ||
        a.frame != b.frame || a.features.size() != b.features.size()) {
      __builtin_trap();
    }
    for (size_t row = 0; a.feature_dim > 0 && row * a.feature_dim < a.features.size(); ++row) {
      const float* x = a.features.data() + row * a.feature_dim;
      const float* y = b.features.data() + row * a.feature_dim;
      float row_max = 0;
      for (uint32_t c = 0; c < a.feature_dim; ++c) row_max = std::max(row_max, std::fabs(x[c]));
      for (uint32_t c = 0; c < a.feature_dim; ++c) {
        if (!Close(x[c], y[c], row_max, precision)) __builtin_trap();
      }
    }
  }
  return 0;
}
