#include "datasets/shifts.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "datasets/random.h"

namespace cdcca::datasets {
namespace {

// absl::string_view is not std::string_view in every Abseil build (Debian's is not).
absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr float kPi = 3.14159265358979f;

// Per-severity parameters, index 0 = severity 1. Calibrated on 64x64 scenes: severity 1
// changes a few percent of the picture, severity 5 keeps every item visible to a person.
constexpr float kBrightnessDelta[] = {0.08f, 0.16f, 0.24f, 0.32f, 0.40f};  // x 255
constexpr float kContrastFactor[] = {0.75f, 0.6f, 0.45f, 0.33f, 0.23f};
constexpr float kNoiseSigma[] = {0.04f, 0.08f, 0.12f, 0.17f, 0.23f};  // x 255
constexpr int kBlurLength[] = {3, 5, 7, 9, 11};                       // pixels
constexpr float kFogStrength[] = {0.3f, 0.42f, 0.54f, 0.64f, 0.74f};
constexpr int kRainStreaks[] = {12, 30, 55, 85, 120};  // per 64x64; scaled by area
constexpr int kRainLength[] = {4, 6, 8, 10, 12};
constexpr float kRainAlpha[] = {0.45f, 0.5f, 0.55f, 0.6f, 0.65f};
constexpr float kRainDarken[] = {0.97f, 0.93f, 0.88f, 0.83f, 0.78f};
constexpr int kSnowFlakes[] = {15, 35, 60, 95, 140};  // per 64x64; scaled by area
constexpr float kSnowBigFraction[] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f};
constexpr float kSnowWhiten[] = {0.0f, 0.05f, 0.1f, 0.16f, 0.22f};
constexpr int kJpegQuality[] = {70, 40, 22, 12, 6};

// Blends `color` into pixel (x, y) with weight `alpha`, if inside the image.
void Blend(Image& img, int x, int y, const float color[3], float alpha) {
  if (x < 0 || y < 0 || x >= img.width || y >= img.height) return;
  uint8_t* p = img.at(x, y);
  for (int c = 0; c < 3; ++c) p[c] = ClampPixel(p[c] + alpha * (color[c] - p[c]));
}

int ScaledCount(const Image& img, int per_64x64) {
  return std::max(1, static_cast<int>(std::lround(per_64x64 * img.width * img.height / 4096.0)));
}

void Brightness(Image& img, int s) {
  const float d = kBrightnessDelta[s - 1] * 255.f;
  for (uint8_t& v : img.pixels) v = ClampPixel(v + d);
}

void Contrast(Image& img, int s) {
  double sum = 0;
  for (uint8_t v : img.pixels) sum += v;
  const float mean = static_cast<float>(sum / std::max<size_t>(1, img.pixels.size()));
  const float f = kContrastFactor[s - 1];
  for (uint8_t& v : img.pixels) v = ClampPixel((v - mean) * f + mean);
}

void Noise(Image& img, int s, Rng& rng) {
  const float sigma = kNoiseSigma[s - 1] * 255.f;
  for (uint8_t& v : img.pixels) v = ClampPixel(v + sigma * static_cast<float>(rng.Normal()));
}

// Bilinear sample with clamped borders.
void Sample(const Image& img, float x, float y, float out[3]) {
  x = std::clamp(x, 0.f, img.width - 1.f);
  y = std::clamp(y, 0.f, img.height - 1.f);
  const int x0 = static_cast<int>(x), y0 = static_cast<int>(y);
  const int x1 = std::min(x0 + 1, img.width - 1), y1 = std::min(y0 + 1, img.height - 1);
  const float fx = x - x0, fy = y - y0;
  const uint8_t *a = img.at(x0, y0), *b = img.at(x1, y0), *c = img.at(x0, y1), *d = img.at(x1, y1);
  for (int k = 0; k < 3; ++k) {
    const float top = a[k] + fx * (b[k] - a[k]);
    const float bot = c[k] + fx * (d[k] - c[k]);
    out[k] = top + fy * (bot - top);
  }
}

// Box kernel of `kBlurLength` taps along a random direction, centred on the pixel.
void MotionBlur(Image& img, int s, Rng& rng) {
  const int len = kBlurLength[s - 1];
  const float angle = static_cast<float>(rng.Uniform(-0.25, 0.25)) * kPi;  // +-45 degrees
  const float dx = std::cos(angle), dy = std::sin(angle);
  const Image src = img;
  for (int y = 0; y < img.height; ++y) {
    for (int x = 0; x < img.width; ++x) {
      float acc[3] = {0, 0, 0};
      for (int t = 0; t < len; ++t) {
        const float o = t - (len - 1) * 0.5f;
        float v[3];
        Sample(src, x + o * dx, y + o * dy, v);
        for (int c = 0; c < 3; ++c) acc[c] += v[c];
      }
      uint8_t* p = img.at(x, y);
      for (int c = 0; c < 3; ++c) p[c] = ClampPixel(acc[c] / len);
    }
  }
}

// Smooth random field in [0, 1]: two octaves of bilinear value noise.
std::vector<float> ValueNoise(int w, int h, Rng& rng) {
  std::vector<float> field(static_cast<size_t>(w) * h, 0.f);
  float total = 0;
  for (int octave = 0; octave < 2; ++octave) {
    const int cell = octave == 0 ? 24 : 10;
    const float weight = octave == 0 ? 0.7f : 0.3f;
    const int gw = w / cell + 2, gh = h / cell + 2;
    std::vector<float> grid(static_cast<size_t>(gw) * gh);
    for (float& g : grid) g = static_cast<float>(rng.Uniform());
    for (int y = 0; y < h; ++y) {
      const float gy = static_cast<float>(y) / cell;
      const int y0 = static_cast<int>(gy);
      const float fy = gy - y0;
      for (int x = 0; x < w; ++x) {
        const float gx = static_cast<float>(x) / cell;
        const int x0 = static_cast<int>(gx);
        const float fx = gx - x0;
        const float a = grid[y0 * gw + x0], b = grid[y0 * gw + x0 + 1];
        const float c = grid[(y0 + 1) * gw + x0], d = grid[(y0 + 1) * gw + x0 + 1];
        const float top = a + fx * (b - a), bot = c + fx * (d - c);
        field[static_cast<size_t>(y) * w + x] += weight * (top + fy * (bot - top));
      }
    }
    total += weight;
  }
  for (float& f : field) f /= total;
  return field;
}

void Fog(Image& img, int s, Rng& rng) {
  const std::vector<float> field = ValueNoise(img.width, img.height, rng);
  const float strength = kFogStrength[s - 1];
  const float fog[3] = {205.f, 205.f, 210.f};
  for (int y = 0; y < img.height; ++y) {
    for (int x = 0; x < img.width; ++x) {
      const float a = strength * (0.55f + 0.45f * field[static_cast<size_t>(y) * img.width + x]);
      Blend(img, x, y, fog, a);
    }
  }
}

void Rain(Image& img, int s, Rng& rng) {
  const float darken = kRainDarken[s - 1];
  for (uint8_t& v : img.pixels) v = ClampPixel(v * darken);
  const float color[3] = {200.f, 205.f, 215.f};
  const float slant = static_cast<float>(rng.Uniform(-0.35, 0.35));  // dx per dy, one wind
  const int streaks = ScaledCount(img, kRainStreaks[s - 1]);
  for (int i = 0; i < streaks; ++i) {
    const float x0 = static_cast<float>(rng.Uniform(-4, img.width + 4));
    const float y0 = static_cast<float>(rng.Uniform(-4, img.height));
    const int len = kRainLength[s - 1] + rng.UniformInt(-1, 1);
    for (int t = 0; t < len; ++t) {
      Blend(img, static_cast<int>(std::lround(x0 + slant * t)), static_cast<int>(y0) + t, color,
            kRainAlpha[s - 1]);
    }
  }
}

void Snow(Image& img, int s, Rng& rng) {
  const float white[3] = {235.f, 238.f, 245.f};
  const float whiten = kSnowWhiten[s - 1];
  if (whiten > 0) {
    for (int y = 0; y < img.height; ++y) {
      for (int x = 0; x < img.width; ++x) Blend(img, x, y, white, whiten);
    }
  }
  const int flakes = ScaledCount(img, kSnowFlakes[s - 1]);
  for (int i = 0; i < flakes; ++i) {
    const int cx = rng.UniformInt(0, img.width - 1), cy = rng.UniformInt(0, img.height - 1);
    const float alpha = static_cast<float>(rng.Uniform(0.6, 0.95));
    Blend(img, cx, cy, white, alpha);
    if (rng.Bernoulli(kSnowBigFraction[s - 1])) {  // a plus-shaped flake, softer edges
      Blend(img, cx - 1, cy, white, alpha * 0.6f);
      Blend(img, cx + 1, cy, white, alpha * 0.6f);
      Blend(img, cx, cy - 1, white, alpha * 0.6f);
      Blend(img, cx, cy + 1, white, alpha * 0.6f);
    }
  }
}

// ---- JPEG ----------------------------------------------------------------------------

// ITU T.81 Annex K.1 / K.2 tables, in natural (row-major) order.
constexpr int kLumaQuant[64] = {16,  11,  10,  16,  24, 40, 51,  61,  12,  12,  14,  19,  26,
                                58,  60,  55,  14,  13, 16, 24,  40,  57,  69,  56,  14,  17,
                                22,  29,  51,  87,  80, 62, 18,  22,  37,  56,  68,  109, 103,
                                77,  24,  35,  55,  64, 81, 104, 113, 92,  49,  64,  78,  87,
                                103, 121, 120, 101, 72, 92, 95,  98,  112, 100, 103, 99};
constexpr int kChromaQuant[64] = {17, 18, 24, 47, 99, 99, 99, 99, 18, 21, 26, 66, 99, 99, 99, 99,
                                  24, 26, 56, 99, 99, 99, 99, 99, 47, 66, 99, 99, 99, 99, 99, 99,
                                  99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99,
                                  99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99, 99};

// libjpeg's jpeg_quality_scaling + jpeg_add_quant_table (baseline: clamp to [1, 255]).
std::array<float, 64> ScaledTable(const int* base, int quality) {
  quality = std::clamp(quality, 1, 100);
  const int scale = quality < 50 ? 5000 / quality : 200 - quality * 2;
  std::array<float, 64> t{};
  for (int i = 0; i < 64; ++i) {
    t[i] = static_cast<float>(std::clamp((base[i] * scale + 50) / 100, 1, 255));
  }
  return t;
}

struct DctBasis {
  float c[8][8];  // c[u][x] = C(u)/2 * cos((2x+1) u pi / 16)
  DctBasis() {
    for (int u = 0; u < 8; ++u) {
      const float cu = u == 0 ? 0.70710678f : 1.f;
      for (int x = 0; x < 8; ++x) c[u][x] = 0.5f * cu * std::cos((2 * x + 1) * u * kPi / 16);
    }
  }
};

// Quantizes one 8x8 block (level-shifted samples) in the DCT domain and back, in place.
void QuantizeBlock(float block[64], const std::array<float, 64>& q, const DctBasis& b) {
  float tmp[64], coef[64];
  // Forward: coef = C * block * C^T.
  for (int u = 0; u < 8; ++u) {
    for (int x = 0; x < 8; ++x) {
      float s = 0;
      for (int y = 0; y < 8; ++y) s += b.c[u][y] * block[y * 8 + x];
      tmp[u * 8 + x] = s;
    }
  }
  for (int u = 0; u < 8; ++u) {
    for (int v = 0; v < 8; ++v) {
      float s = 0;
      for (int x = 0; x < 8; ++x) s += tmp[u * 8 + x] * b.c[v][x];
      coef[u * 8 + v] = std::nearbyint(s / q[u * 8 + v]) * q[u * 8 + v];
    }
  }
  // Inverse: block = C^T * coef * C.
  for (int y = 0; y < 8; ++y) {
    for (int v = 0; v < 8; ++v) {
      float s = 0;
      for (int u = 0; u < 8; ++u) s += b.c[u][y] * coef[u * 8 + v];
      tmp[y * 8 + v] = s;
    }
  }
  for (int y = 0; y < 8; ++y) {
    for (int x = 0; x < 8; ++x) {
      float s = 0;
      for (int v = 0; v < 8; ++v) s += tmp[y * 8 + v] * b.c[v][x];
      block[y * 8 + x] = s;
    }
  }
}

// Runs every 8x8 block of a plane (w, h multiples of 8) through QuantizeBlock.
void QuantizePlane(std::vector<float>& plane, int w, int h, const std::array<float, 64>& q,
                   const DctBasis& basis) {
  float block[64];
  for (int by = 0; by < h; by += 8) {
    for (int bx = 0; bx < w; bx += 8) {
      for (int y = 0; y < 8; ++y) {
        for (int x = 0; x < 8; ++x) block[y * 8 + x] = plane[(by + y) * w + bx + x] - 128.f;
      }
      QuantizeBlock(block, q, basis);
      for (int y = 0; y < 8; ++y) {
        for (int x = 0; x < 8; ++x) {
          plane[(by + y) * w + bx + x] = std::clamp(block[y * 8 + x] + 128.f, 0.f, 255.f);
        }
      }
    }
  }
}

}  // namespace

void JpegRoundTrip(int quality, Image& img) {
  if (img.empty()) return;
  static const DctBasis basis;
  const std::array<float, 64> luma_q = ScaledTable(kLumaQuant, quality);
  const std::array<float, 64> chroma_q = ScaledTable(kChromaQuant, quality);
  // Pad to whole 16x16 MCUs by edge replication, as encoders do.
  const int w = (img.width + 15) / 16 * 16, h = (img.height + 15) / 16 * 16;
  const int cw = w / 2, ch = h / 2;
  std::vector<float> luma(static_cast<size_t>(w) * h), cb(static_cast<size_t>(cw) * ch, 0.f),
      cr(static_cast<size_t>(cw) * ch, 0.f);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      const uint8_t* p = img.at(std::min(x, img.width - 1), std::min(y, img.height - 1));
      const float r = p[0], g = p[1], b = p[2];
      luma[y * w + x] = 0.299f * r + 0.587f * g + 0.114f * b;
      // 4:2:0: each chroma sample is the mean of its 2x2 luma-resolution block.
      cb[(y / 2) * cw + x / 2] += 0.25f * (-0.168736f * r - 0.331264f * g + 0.5f * b + 128.f);
      cr[(y / 2) * cw + x / 2] += 0.25f * (0.5f * r - 0.418688f * g - 0.081312f * b + 128.f);
    }
  }
  QuantizePlane(luma, w, h, luma_q, basis);
  QuantizePlane(cb, cw, ch, chroma_q, basis);
  QuantizePlane(cr, cw, ch, chroma_q, basis);
  for (int y = 0; y < img.height; ++y) {
    for (int x = 0; x < img.width; ++x) {
      const float yy = luma[y * w + x];
      const float u = cb[(y / 2) * cw + x / 2] - 128.f, v = cr[(y / 2) * cw + x / 2] - 128.f;
      uint8_t* p = img.at(x, y);
      p[0] = ClampPixel(yy + 1.402f * v);
      p[1] = ClampPixel(yy - 0.344136f * u - 0.714136f * v);
      p[2] = ClampPixel(yy + 1.772f * u);
    }
  }
}

int JpegQualityForSeverity(int severity) {
  return kJpegQuality[std::clamp(severity, 1, kMaxSeverity) - 1];
}

const std::vector<ImageShift>& AllImageShifts() {
  static const std::vector<ImageShift> kAll = {ImageShift::kRain,       ImageShift::kSnow,
                                               ImageShift::kFog,        ImageShift::kBrightness,
                                               ImageShift::kContrast,   ImageShift::kGaussianNoise,
                                               ImageShift::kMotionBlur, ImageShift::kJpeg};
  return kAll;
}

std::string_view ImageShiftName(ImageShift shift) {
  switch (shift) {
    case ImageShift::kNone:
      return "none";
    case ImageShift::kRain:
      return "rain";
    case ImageShift::kSnow:
      return "snow";
    case ImageShift::kFog:
      return "fog";
    case ImageShift::kBrightness:
      return "brightness";
    case ImageShift::kContrast:
      return "contrast";
    case ImageShift::kGaussianNoise:
      return "gaussian_noise";
    case ImageShift::kMotionBlur:
      return "motion_blur";
    case ImageShift::kJpeg:
      return "jpeg";
  }
  return "?";
}

absl::StatusOr<ImageShift> ImageShiftFromName(std::string_view name) {
  if (name == "none") return ImageShift::kNone;
  for (ImageShift s : AllImageShifts()) {
    if (ImageShiftName(s) == name) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown image shift '", AV(name), "'"));
}

absl::Status ApplyShift(ImageShift shift, int severity, uint64_t seed, Image& image) {
  if (severity < 0 || severity > kMaxSeverity) {
    return absl::InvalidArgumentError(absl::StrCat("severity ", severity, " outside [0, 5]"));
  }
  if (severity == 0 || shift == ImageShift::kNone || image.empty()) return absl::OkStatus();
  Rng rng(MixSeed(seed, static_cast<uint64_t>(shift)));
  switch (shift) {
    case ImageShift::kNone:
      break;
    case ImageShift::kRain:
      Rain(image, severity, rng);
      break;
    case ImageShift::kSnow:
      Snow(image, severity, rng);
      break;
    case ImageShift::kFog:
      Fog(image, severity, rng);
      break;
    case ImageShift::kBrightness:
      Brightness(image, severity);
      break;
    case ImageShift::kContrast:
      Contrast(image, severity);
      break;
    case ImageShift::kGaussianNoise:
      Noise(image, severity, rng);
      break;
    case ImageShift::kMotionBlur:
      MotionBlur(image, severity, rng);
      break;
    case ImageShift::kJpeg:
      JpegRoundTrip(kJpegQuality[severity - 1], image);
      break;
  }
  return absl::OkStatus();
}

}  // namespace cdcca::datasets
