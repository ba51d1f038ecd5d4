#include "compress/uplink_codec.h"

#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compress/byte_io.h"
#include "compress/hash64.h"
#include "compress/zstd_frame.h"

namespace cdcca::compress {
namespace {

constexpr uint32_t kUplinkMagic = 0x50554443u;  // bytes "CDUP"
constexpr uint16_t kUplinkVersion = 1;
constexpr size_t kHeaderBytes = 20;
constexpr size_t kChecksumBytes = 8;

// compress/byte_io.h: Put, and the bounds-checked reader over a byte view.
using Reader = ByteReader;

absl::Status CheckSample(const UplinkSample& s, size_t i, FeaturePrecision precision,
                         const UplinkLimits& limits) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("uplink sample ", i, " (id ", s.sample_id, "): ", why));
  };
  if (s.grid_tokens == 0 || s.grid_tokens > limits.max_grid_tokens)
    return bad("grid_tokens out of range");
  if (s.feature_dim == 0 || s.feature_dim > limits.max_feature_dim)
    return bad("feature_dim out of range");
  if (s.kept_indices.size() > s.grid_tokens) return bad("more kept tokens than the grid has");
  for (size_t k = 0; k < s.kept_indices.size(); ++k) {
    if (s.kept_indices[k] >= s.grid_tokens) return bad("kept index outside the grid");
    if (k > 0 && s.kept_indices[k] <= s.kept_indices[k - 1]) {
      return bad("kept indices must strictly increase");
    }
  }
  if (s.prompt_tokens.size() > limits.max_prompt_tokens) return bad("prompt too long");
  if (s.answer_tokens.size() > limits.max_answer_tokens) return bad("answer too long");
  if (precision == FeaturePrecision::kJpeg) {
    if (!s.features.empty()) return bad("a jpeg sample carries its frame, not features");
    if (s.frame.empty()) return bad("a jpeg sample needs its frame");
    if (s.frame.size() > limits.max_frame_bytes) return bad("frame exceeds max_frame_bytes");
    if (absl::StatusOr<JpegSize> size = ReadJpegSize(s.frame); !size.ok()) {
      return bad(absl::StrCat("frame: ", size.status().message()));
    }
  } else {
    if (!s.frame.empty()) return bad("only a jpeg batch carries frames");
    if (s.features.size() != s.kept_indices.size() * s.feature_dim) {
      return bad("features must hold kept x feature_dim values");
    }
  }
  if (!std::isfinite(s.entropy)) return bad("entropy is not finite");
  for (float f : s.features) {
    if (!std::isfinite(f)) return bad("features hold a non-finite value");
    // fp16's largest value is 65504; from 65520 up a float rounds to infinity, which the
    // receiver would refuse as non-finite: refuse it here, where the sender can still choose.
    if (precision == FeaturePrecision::kFp16 && std::fabs(f) >= 65520.0f) {
      return bad(absl::StrCat("feature ", f, " is beyond fp16's range (|x| < 65520); send int8"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (e <= 0) {
    if (e < -10) return static_cast<uint16_t>(sign);  // underflow -> 0
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t half = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1))) ++half;  // may carry into exponent
  return static_cast<uint16_t>(sign | half);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      x = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

absl::StatusOr<JpegSize> ReadJpegSize(absl::string_view jpeg) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(jpeg[i]); };
  const auto bad = [](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("not a usable JPEG: ", why));
  };
  if (jpeg.size() < 4 || byte(0) != 0xFF || byte(1) != 0xD8) return bad("no start-of-image");
  size_t pos = 2;
  while (true) {
    // A marker: 0xFF, optional 0xFF fill bytes, then the code.
    if (pos >= jpeg.size() || byte(pos) != 0xFF) return bad("a segment does not start a marker");
    while (pos < jpeg.size() && byte(pos) == 0xFF) ++pos;
    if (pos >= jpeg.size()) return bad("ends inside a marker");
    const uint8_t code = byte(pos++);
    if (code == 0xD9 || code == 0xDA) return bad("no frame header before the first scan");
    // Only the segments a decoder reads before a frame header (APPn, COM, DQT, DHT, DRI,
    // DAC) are skipped by their length. A decoder takes any other byte after 0xFF for
    // something else (0x00 is a stuffed byte: libjpeg goes on looking for a marker inside
    // what this reader would skip), so the size it decodes could differ from the one read
    // here: refused.
    const bool table_or_app = (code >= 0xE0 && code <= 0xEF) || code == 0xFE || code == 0xDB ||
                              code == 0xC4 || code == 0xDD || code == 0xCC;
    const bool frame_header = code >= 0xC0 && code <= 0xCF && !table_or_app && code != 0xC8;
    if (!table_or_app && !frame_header) {
      return bad(
          absl::StrCat("marker 0x", absl::Hex(code, absl::kZeroPad2), " before the frame header"));
    }
    if (pos + 2 > jpeg.size()) return bad("ends inside a segment length");
    const size_t length = (size_t{byte(pos)} << 8) | byte(pos + 1);
    if (length < 2 || pos + length > jpeg.size()) return bad("a segment runs past the end");
    if (frame_header) {
      if (length < 8) return bad("a short frame header");
      JpegSize size;
      size.height = (int{byte(pos + 3)} << 8) | byte(pos + 4);
      size.width = (int{byte(pos + 5)} << 8) | byte(pos + 6);
      size.components = byte(pos + 7);
      size.progressive = code != 0xC0 && code != 0xC1;
      if (size.width == 0 || size.height == 0) return bad("a zero width or height");
      if (size.components != 1 && size.components != 3) {
        return bad(absl::StrCat(size.components, " components (1 or 3 expected)"));
      }
      return size;
    }
    pos += length;
  }
}

uint64_t FeatureBytes(uint32_t kept, uint32_t dim, FeaturePrecision precision) {
  switch (precision) {
    case FeaturePrecision::kFp16:
      return uint64_t{kept} * dim * 2;
    case FeaturePrecision::kInt8:
      return uint64_t{kept} * (4 + uint64_t{dim});
    case FeaturePrecision::kInt4:
      return uint64_t{kept} * (4 + (uint64_t{dim} + 1) / 2);
  }
  return 0;
}

const char* FeaturePrecisionName(FeaturePrecision precision) {
  switch (precision) {
    case FeaturePrecision::kFp16:
      return "fp16";
    case FeaturePrecision::kInt8:
      return "int8";
    case FeaturePrecision::kInt4:
      return "int4";
    case FeaturePrecision::kJpeg:
      return "jpeg";
  }
  return "unknown";
}

absl::StatusOr<FeaturePrecision> ParseFeaturePrecision(absl::string_view name) {
  for (FeaturePrecision p : {FeaturePrecision::kFp16, FeaturePrecision::kInt8,
                             FeaturePrecision::kInt4, FeaturePrecision::kJpeg}) {
    if (name == FeaturePrecisionName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("feature precision \"", name, "\" is not one of fp16, int8, int4, jpeg"));
}

namespace {

bool KnownPrecision(FeaturePrecision p) {
  return p == FeaturePrecision::kFp16 || p == FeaturePrecision::kInt8 ||
         p == FeaturePrecision::kInt4 || p == FeaturePrecision::kJpeg;
}

// A row's scale for `levels` quantization steps each side of zero. max|x| / levels
// underflows to 0 when max|x| is a tiny subnormal: x / 0 would be NaN or inf, and casting
// that to an integer is undefined. Such a row is zero at that precision. Near the float
// range's top, max|x| / levels rounded up can make the receiver's levels * scale overflow
// to infinity (a value it refuses as non-finite): the scale steps down until that product is
// finite, which moves the largest values by a relative 1e-7 at most.
float RowScale(const float* row, size_t dim, float levels) {
  float max_abs = 0;
  for (size_t c = 0; c < dim; ++c) max_abs = std::max(max_abs, std::fabs(row[c]));
  float scale = max_abs / levels;
  if (!(scale > 0) || !std::isfinite(scale)) return 1.0f;
  while (!std::isfinite(scale * levels)) scale = std::nextafter(scale, 0.0f);
  return scale;
}

}  // namespace

absl::Status CheckUplinkSample(const UplinkSample& sample, FeaturePrecision precision,
                               const UplinkLimits& limits) {
  if (!KnownPrecision(precision)) return absl::InvalidArgumentError("unknown feature precision");
  return CheckSample(sample, 0, precision, limits);
}

absl::StatusOr<std::string> EncodeUplinkBatch(const std::vector<UplinkSample>& samples,
                                              FeaturePrecision precision,
                                              const UplinkLimits& limits, int zstd_level) {
  if (samples.empty()) return absl::InvalidArgumentError("uplink batch holds no samples");
  if (samples.size() > limits.max_samples) {
    return absl::InvalidArgumentError(absl::StrCat("uplink batch holds ", samples.size(),
                                                   " samples; the limit is ", limits.max_samples));
  }
  if (!KnownPrecision(precision)) return absl::InvalidArgumentError("unknown feature precision");
  std::string body;
  for (size_t i = 0; i < samples.size(); ++i) {
    const UplinkSample& s = samples[i];
    if (absl::Status st = CheckSample(s, i, precision, limits); !st.ok()) return st;
    Put<uint64_t>(body, s.sample_id);
    Put<uint64_t>(body, s.model_version);
    Put<float>(body, s.entropy);
    Put<uint16_t>(body, static_cast<uint16_t>(s.grid_tokens));
    Put<uint16_t>(body, static_cast<uint16_t>(s.feature_dim));
    Put<uint16_t>(body, static_cast<uint16_t>(s.kept_indices.size()));
    if (precision == FeaturePrecision::kJpeg) {  // a bitmask over the grid, low bit first
      std::string mask((s.grid_tokens + 7) / 8, '\0');
      for (uint16_t k : s.kept_indices)
        mask[k / 8] = static_cast<char>(mask[k / 8] | (1 << (k % 8)));
      body += mask;
    } else {
      for (uint16_t k : s.kept_indices) Put<uint16_t>(body, k);
    }
    Put<uint16_t>(body, static_cast<uint16_t>(s.prompt_tokens.size()));
    for (uint32_t t : s.prompt_tokens) Put<uint32_t>(body, t);
    Put<uint16_t>(body, static_cast<uint16_t>(s.answer_tokens.size()));
    for (uint32_t t : s.answer_tokens) Put<uint32_t>(body, t);
    if (precision == FeaturePrecision::kJpeg) {
      Put<uint32_t>(body, static_cast<uint32_t>(s.frame.size()));
      body += s.frame;
    }
    const size_t dim = s.feature_dim;
    const size_t feature_rows = precision == FeaturePrecision::kJpeg ? 0 : s.kept_indices.size();
    for (size_t r = 0; r < feature_rows; ++r) {
      const float* row = s.features.data() + r * dim;
      if (precision == FeaturePrecision::kFp16) {
        for (size_t c = 0; c < dim; ++c) Put<uint16_t>(body, FloatToHalf(row[c]));
      } else if (precision == FeaturePrecision::kInt8) {
        const float scale = RowScale(row, dim, 127.0f);
        Put<float>(body, scale);
        for (size_t c = 0; c < dim; ++c) {
          const float q = std::nearbyint(row[c] / scale);
          Put<int8_t>(body, static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f)));
        }
      } else {
        const float scale = RowScale(row, dim, 7.0f);
        Put<float>(body, scale);
        auto code = [&](size_t c) {
          return static_cast<uint8_t>(std::clamp(std::nearbyint(row[c] / scale), -7.0f, 7.0f) + 8);
        };
        for (size_t c = 0; c < dim; c += 2) {
          const uint8_t high = c + 1 < dim ? code(c + 1) : 0;
          Put<uint8_t>(body, static_cast<uint8_t>(code(c) | (high << 4)));
        }
      }
    }
    if (body.size() > limits.max_body_bytes) {
      return absl::InvalidArgumentError("uplink batch body exceeds max_body_bytes");
    }
  }
  std::string out;
  Put<uint32_t>(out, kUplinkMagic);
  Put<uint16_t>(out, kUplinkVersion);
  Put<uint16_t>(out, static_cast<uint16_t>(precision));
  Put<uint32_t>(out, static_cast<uint32_t>(samples.size()));
  Put<uint64_t>(out, body.size());
  const size_t bound = ZSTD_compressBound(body.size());
  out.resize(kHeaderBytes + bound);
  const size_t z = ZSTD_compress(out.data() + kHeaderBytes, bound, body.data(), body.size(),
                                 std::clamp(zstd_level, 1, 19));
  if (ZSTD_isError(z)) {
    return absl::InternalError(absl::StrCat("zstd: ", ZSTD_getErrorName(z)));
  }
  out.resize(kHeaderBytes + z);
  Put<uint64_t>(out, Hash64(out.data(), out.size()));
  return out;
}

absl::StatusOr<std::vector<UplinkSample>> DecodeUplinkBatch(absl::string_view payload,
                                                            const UplinkLimits& limits) {
  if (payload.size() < kHeaderBytes + kChecksumBytes) {
    return absl::DataLossError("uplink payload is shorter than its header");
  }
  uint64_t stored_hash;
  std::memcpy(&stored_hash, payload.data() + payload.size() - kChecksumBytes, 8);
  const absl::string_view covered = payload.substr(0, payload.size() - kChecksumBytes);
  if (Hash64(covered.data(), covered.size()) != stored_hash) {
    return absl::DataLossError("uplink payload checksum mismatch (truncated or corrupted)");
  }
  Reader header(covered.substr(0, kHeaderBytes));
  uint32_t magic = 0, count = 0;
  uint16_t version = 0, precision_raw = 0;
  uint64_t body_size = 0;
  header.Get(&magic);
  header.Get(&version);
  header.Get(&precision_raw);
  header.Get(&count);
  header.Get(&body_size);
  if (magic != kUplinkMagic) return absl::DataLossError("not an uplink payload (bad magic)");
  if (version != kUplinkVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "uplink payload version ", version, " is not supported (expected ", kUplinkVersion, ")"));
  }
  const auto precision = static_cast<FeaturePrecision>(precision_raw);
  if (!KnownPrecision(precision)) {
    return absl::InvalidArgumentError("uplink payload has an unknown feature precision");
  }
  if (count == 0 || count > limits.max_samples) {
    return absl::InvalidArgumentError(
        absl::StrCat("uplink payload sample count ", count, " is outside 1-", limits.max_samples));
  }
  if (body_size > limits.max_body_bytes) {
    return absl::InvalidArgumentError("uplink payload body exceeds max_body_bytes");
  }
  const absl::string_view frame = covered.substr(kHeaderBytes);
  absl::StatusOr<std::string> decompressed =
      DecompressBoundedFrame(frame, body_size, limits.max_body_bytes, "uplink payload body");
  if (!decompressed.ok()) return decompressed.status();
  const std::string body = *std::move(decompressed);

  Reader r(body);
  std::vector<UplinkSample> samples;
  samples.reserve(count);
  auto truncated = [&](size_t i) {
    return absl::DataLossError(absl::StrCat("uplink payload ends inside sample ", i));
  };
  for (uint32_t i = 0; i < count; ++i) {
    UplinkSample& s = samples.emplace_back();
    uint16_t grid = 0, dim = 0, kept = 0, prompt = 0, answer = 0;
    if (!r.Get(&s.sample_id) || !r.Get(&s.model_version) || !r.Get(&s.entropy) || !r.Get(&grid) ||
        !r.Get(&dim) || !r.Get(&kept)) {
      return truncated(i);
    }
    s.grid_tokens = grid;
    s.feature_dim = dim;
    // Bounds first, so nothing below allocates from an unchecked count.
    if (grid == 0 || grid > limits.max_grid_tokens || dim == 0 || dim > limits.max_feature_dim ||
        kept > grid) {
      return absl::InvalidArgumentError(
          absl::StrCat("uplink sample ", i, " has sizes outside the limits"));
    }
    if (precision == FeaturePrecision::kJpeg) {
      absl::string_view mask;
      if (!r.Skip((size_t{grid} + 7) / 8, &mask)) return truncated(i);
      s.kept_indices.reserve(kept);
      for (uint32_t t = 0; t < grid; ++t) {
        if ((static_cast<uint8_t>(mask[t / 8]) >> (t % 8)) & 1) {
          s.kept_indices.push_back(static_cast<uint16_t>(t));
        }
      }
      // Bits past the grid must be clear, and the mask must hold exactly `kept` bits.
      for (uint32_t t = grid; t < mask.size() * 8; ++t) {
        if ((static_cast<uint8_t>(mask[t / 8]) >> (t % 8)) & 1) {
          return absl::DataLossError(
              absl::StrCat("uplink sample ", i, " marks a token past its grid"));
        }
      }
      if (s.kept_indices.size() != kept) {
        return absl::DataLossError(
            absl::StrCat("uplink sample ", i, " kept count does not match its mask"));
      }
    } else {
      s.kept_indices.resize(kept);
      for (auto& k : s.kept_indices) {
        if (!r.Get(&k)) return truncated(i);
      }
    }
    if (!r.Get(&prompt) || prompt > limits.max_prompt_tokens) {
      return prompt > limits.max_prompt_tokens
                 ? absl::InvalidArgumentError(absl::StrCat("uplink sample ", i, " prompt too long"))
                 : truncated(i);
    }
    s.prompt_tokens.resize(prompt);
    for (auto& t : s.prompt_tokens) {
      if (!r.Get(&t)) return truncated(i);
    }
    if (!r.Get(&answer) || answer > limits.max_answer_tokens) {
      return answer > limits.max_answer_tokens
                 ? absl::InvalidArgumentError(absl::StrCat("uplink sample ", i, " answer too long"))
                 : truncated(i);
    }
    s.answer_tokens.resize(answer);
    for (auto& t : s.answer_tokens) {
      if (!r.Get(&t)) return truncated(i);
    }
    if (precision == FeaturePrecision::kJpeg) {
      uint32_t frame_bytes = 0;
      if (!r.Get(&frame_bytes)) return truncated(i);
      if (frame_bytes > limits.max_frame_bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("uplink sample ", i, " frame exceeds max_frame_bytes"));
      }
      absl::string_view frame;
      if (!r.Skip(frame_bytes, &frame)) return truncated(i);
      s.frame = std::string(frame);
    }
    absl::string_view feats;
    if (!r.Skip(FeatureBytes(kept, dim, precision), &feats)) return truncated(i);
    const size_t feature_rows = precision == FeaturePrecision::kJpeg ? 0 : kept;
    s.features.resize(feature_rows * dim);
    Reader f(feats);
    for (size_t row = 0; row < feature_rows; ++row) {
      float* out = s.features.data() + row * dim;
      if (precision == FeaturePrecision::kFp16) {
        for (size_t c = 0; c < dim; ++c) {
          uint16_t h = 0;
          f.Get(&h);
          out[c] = HalfToFloat(h);
        }
      } else if (precision == FeaturePrecision::kInt8) {
        float scale = 0;
        f.Get(&scale);
        for (size_t c = 0; c < dim; ++c) {
          int8_t q = 0;
          f.Get(&q);
          out[c] = scale * static_cast<float>(q);
        }
      } else {
        float scale = 0;
        f.Get(&scale);
        for (size_t c = 0; c < dim; c += 2) {
          uint8_t b = 0;
          f.Get(&b);
          out[c] = scale * static_cast<float>((b & 0xF) - 8);
          if (c + 1 < dim) out[c + 1] = scale * static_cast<float>((b >> 4) - 8);
        }
      }
    }
    if (absl::Status st = CheckSample(s, i, precision, limits); !st.ok()) {
      return absl::DataLossError(st.message());
    }
  }
  if (!r.done()) return absl::DataLossError("uplink payload has bytes after its last sample");
  return samples;
}

bool IsHeldOutSample(absl::string_view device_id, uint64_t sample_id, double fraction) {
  if (!(fraction > 0)) return false;
  std::string key(device_id);
  key.push_back('\0');
  for (int b = 0; b < 8; ++b) key.push_back(static_cast<char>((sample_id >> (8 * b)) & 0xff));
  const uint64_t h = Hash64(key.data(), key.size(), /*seed=*/0x6775617264ull);
  // The top 53 bits as a uniform double in [0, 1).
  return static_cast<double>(h >> 11) * 0x1.0p-53 < fraction;
}

}  // namespace cdcca::compress
