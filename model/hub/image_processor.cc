#include "model/hub/image_processor.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/hub/folder_json.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------
// Pillow's filters (libImaging/Resample.c). Each takes the distance from the output
// pixel's centre in input pixels, divided by the filter scale.

constexpr double kPi = 3.14159265358979323846;

double BoxFilter(double x) { return (x > -0.5 && x <= 0.5) ? 1.0 : 0.0; }

double BilinearFilter(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

double HammingFilter(double x) {
  x = std::fabs(x);
  if (x == 0.0) return 1.0;
  if (x >= 1.0) return 0.0;
  x *= kPi;
  // Pillow writes the window's constants as float literals (0.54f, 0.46f).
  return std::sin(x) / x * (0.54f + 0.46f * std::cos(x));
}

double BicubicFilter(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

double Sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= kPi;
  return std::sin(x) / x;
}

double LanczosFilter(double x) { return (-3.0 <= x && x < 3.0) ? Sinc(x) * Sinc(x / 3) : 0.0; }

struct Filter {
  double (*fn)(double);
  double support;  // in input pixels at scale 1
};

Filter FilterFor(PilResample filter) {
  switch (filter) {
    case PilResample::kBox:
      return {BoxFilter, 0.5};
    case PilResample::kBilinear:
      return {BilinearFilter, 1.0};
    case PilResample::kHamming:
      return {HammingFilter, 1.0};
    case PilResample::kBicubic:
      return {BicubicFilter, 2.0};
    case PilResample::kLanczos:
      return {LanczosFilter, 3.0};
    case PilResample::kNearest:
      break;
  }
  return {BilinearFilter, 1.0};  // unreachable: nearest does not convolve
}

// The two fixed-point rules this file reproduces. Both convolve with the same windows and
// double-precision weights (normalised to sum 1); they differ in how the weights become
// integers.
enum class FixedPoint {
  // Pillow (Resample.c, normalize_coeffs_8bpc): 22 fractional bits in int32, leaving 8 bits
  // of result and 2 of headroom for filters with negative lobes.
  kPillow,
  // LibTorch's uint8 antialiased interpolation (_compute_indices_int16_weights_aa, after
  // Pillow-SIMD): int16 weights with as many fractional bits (at most 22) as keep the
  // largest weight of the axis, doubled, below 2^15.
  kTorchInt16,
};

// LibTorch writes the Keys cubic's outer piece in another order than Pillow
// (HelperInterpCubic::aa_filter, cubic_convolution2); the last bit can differ.
double TorchBicubicFilter(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2.0) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0.0;
}

// Fixed-point taps of one axis: for output pixel i, `count[i]` consecutive inputs from
// `first[i]`, weights weights[i * stride .. + count[i]], `precision` fractional bits.
struct AxisTaps {
  int precision = 0;
  int stride = 0;
  std::vector<int> first;
  std::vector<int> count;
  std::vector<int32_t> weights;
};

// One axis of the resize, as Pillow's precompute_coeffs computes it (and LibTorch's
// _compute_weights_aa, which copies it): the filter widens by the downscale factor, each
// output pixel's window runs from (int)(centre - support + 0.5) to (int)(centre + support
// + 0.5) clamped to the image, and its weights are normalised to sum 1 in double, then
// rounded half away from zero to fixed point.
AxisTaps ComputeAxisTaps(int in_size, int out_size, const Filter& filter, FixedPoint rule) {
  // Pillow passes the box edges as float; with the full image they are exact.
  const double scale = static_cast<double>(static_cast<float>(in_size)) / out_size;
  const double filter_scale = std::max(scale, 1.0);
  const double support = filter.support * filter_scale;
  const double inv_filter_scale = 1.0 / filter_scale;
  AxisTaps taps;
  taps.stride = static_cast<int>(std::ceil(support)) * 2 + 1;
  taps.first.resize(out_size);
  taps.count.resize(out_size);
  std::vector<double> w(static_cast<size_t>(out_size) * taps.stride, 0.0);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    // C truncation, as both round the window ends.
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    const int count = std::clamp(xmax - xmin, 0, taps.stride);
    double* k = &w[static_cast<size_t>(xx) * taps.stride];
    double sum = 0.0;
    for (int x = 0; x < count; ++x) {
      k[x] = filter.fn((x + xmin - center + 0.5) * inv_filter_scale);
      sum += k[x];
    }
    if (sum != 0.0) {
      for (int x = 0; x < count; ++x) k[x] /= sum;
    }
    taps.first[xx] = xmin;
    taps.count[xx] = count;
  }
  if (rule == FixedPoint::kPillow) {
    taps.precision = 32 - 8 - 2;
  } else {
    const double w_max = *std::max_element(w.begin(), w.end());
    for (taps.precision = 0; taps.precision < 22; ++taps.precision) {
      const int next = static_cast<int>(0.5 + w_max * (1 << (taps.precision + 1)));
      if (next >= (1 << 15)) break;
    }
  }
  taps.weights.resize(w.size());
  const double one = static_cast<double>(1 << taps.precision);
  for (size_t i = 0; i < w.size(); ++i) {
    const double fixed = w[i] * one;
    taps.weights[i] = static_cast<int32_t>(w[i] < 0 ? fixed - 0.5 : fixed + 0.5);
  }
  return taps;
}

// A fixed-point sum back to a pixel: the sum started at one half (rounding); the integer
// part is taken with an arithmetic shift and clamped to [0, 255] (Pillow's clip8;
// LibTorch's saturating packs). Integer sums are exact, so the order of the additions below
// (chosen for speed) does not change the result.
inline uint8_t ToPixel(int32_t sum, int precision) {
  return static_cast<uint8_t>(std::clamp<int32_t>(sum >> precision, 0, 255));
}

// The separable resize both libraries run: a horizontal pass over the rows the vertical
// pass reads, rounded to uint8, then the vertical pass; a pass whose size does not change
// is skipped.
std::vector<uint8_t> SeparableResize(const uint8_t* src, int width, int height, int channels,
                                     int out_width, int out_height, const Filter& filter,
                                     FixedPoint rule) {
  const bool need_horizontal = out_width != width;
  const bool need_vertical = out_height != height;
  const AxisTaps vtaps = ComputeAxisTaps(height, out_height, filter, rule);

  const uint8_t* rows = src;  // the image the vertical pass reads
  int rows_width = width;
  int row_offset = 0;  // input row of rows[0]
  std::vector<uint8_t> temp;
  if (need_horizontal) {
    const int first = vtaps.first.front();
    const int last = vtaps.first.back() + vtaps.count.back();
    const AxisTaps htaps = ComputeAxisTaps(width, out_width, filter, rule);
    const int32_t half_h = int32_t{1} << (htaps.precision - 1);
    temp.resize(static_cast<size_t>(last - first) * out_width * channels);
    for (int y = first; y < last; ++y) {
      const uint8_t* in = src + static_cast<size_t>(y) * width * channels;
      uint8_t* out = temp.data() + static_cast<size_t>(y - first) * out_width * channels;
      for (int xx = 0; xx < out_width; ++xx) {
        const int32_t* k = &htaps.weights[static_cast<size_t>(xx) * htaps.stride];
        const uint8_t* p = in + static_cast<size_t>(htaps.first[xx]) * channels;
        if (channels == 3) {  // RGB, the common case: one pass over the window
          int32_t r = half_h;
          int32_t g = half_h;
          int32_t b = half_h;
          for (int i = 0; i < htaps.count[xx]; ++i) {
            const uint8_t* px = p + static_cast<ptrdiff_t>(3) * i;
            r += px[0] * k[i];
            g += px[1] * k[i];
            b += px[2] * k[i];
          }
          uint8_t* o = out + static_cast<ptrdiff_t>(3) * xx;
          o[0] = ToPixel(r, htaps.precision);
          o[1] = ToPixel(g, htaps.precision);
          o[2] = ToPixel(b, htaps.precision);
          continue;
        }
        for (int c = 0; c < channels; ++c) {
          int32_t sum = half_h;
          for (int i = 0; i < htaps.count[xx]; ++i) sum += p[i * channels + c] * k[i];
          out[xx * channels + c] = ToPixel(sum, htaps.precision);
        }
      }
    }
    rows = temp.data();
    rows_width = out_width;
    row_offset = first;
  }
  if (!need_vertical) {
    if (need_horizontal) return temp;
    return std::vector<uint8_t>(src, src + static_cast<size_t>(width) * height * channels);
  }
  const size_t stride = static_cast<size_t>(rows_width) * channels;
  std::vector<uint8_t> out(static_cast<size_t>(out_height) * stride);
  std::vector<int32_t> sum(stride);
  for (int yy = 0; yy < out_height; ++yy) {
    const int32_t* k = &vtaps.weights[static_cast<size_t>(yy) * vtaps.stride];
    const uint8_t* in = rows + static_cast<size_t>(vtaps.first[yy] - row_offset) * stride;
    std::fill(sum.begin(), sum.end(), int32_t{1} << (vtaps.precision - 1));
    // Row by row, so the inner loop runs over contiguous bytes.
    for (int j = 0; j < vtaps.count[yy]; ++j) {
      const uint8_t* row = in + static_cast<size_t>(j) * stride;
      const int32_t w = k[j];
      for (size_t i = 0; i < stride; ++i) sum[i] += row[i] * w;
    }
    uint8_t* dst = out.data() + static_cast<size_t>(yy) * stride;
    for (size_t i = 0; i < stride; ++i) dst[i] = ToPixel(sum[i], vtaps.precision);
  }
  return out;
}

// Nearest neighbour: Pillow's resize maps it to an affine scale (Geometry.c,
// ImagingScaleAffine), whose source coordinate starts at half a step and is accumulated
// step by step in double.
std::vector<int> NearestIndex(int in_size, int out_size) {
  const double step = static_cast<double>(static_cast<float>(in_size)) / out_size;
  std::vector<int> index(out_size);
  double pos = step * 0.5;
  for (int i = 0; i < out_size; ++i) {
    const int v = pos < 0.0 ? -1 : static_cast<int>(pos);
    index[i] = std::clamp(v, 0, in_size - 1);
    pos += step;
  }
  return index;
}

// torch.nn.functional.interpolate(mode="nearest-exact"), what transformers' torchvision
// backend uses for NEAREST: source floor((i + 0.5) * in / out), the scale and product in
// float as ATen computes them.
std::vector<int> NearestExactIndex(int in_size, int out_size) {
  const float scale = static_cast<float>(in_size) / static_cast<float>(out_size);
  std::vector<int> index(out_size);
  for (int i = 0; i < out_size; ++i) {
    const int v = static_cast<int>(std::floor((static_cast<float>(i) + 0.5f) * scale));
    index[i] = std::min(v, in_size - 1);
  }
  return index;
}

std::vector<uint8_t> ResizeNearest(const uint8_t* src, int width, int height, int channels,
                                   int out_width, int out_height, bool exact = false) {
  const std::vector<int> xs =
      exact ? NearestExactIndex(width, out_width) : NearestIndex(width, out_width);
  const std::vector<int> ys =
      exact ? NearestExactIndex(height, out_height) : NearestIndex(height, out_height);
  std::vector<uint8_t> out(static_cast<size_t>(out_width) * out_height * channels);
  for (int y = 0; y < out_height; ++y) {
    const uint8_t* row = src + static_cast<size_t>(ys[y]) * width * channels;
    uint8_t* dst = out.data() + static_cast<size_t>(y) * out_width * channels;
    for (int x = 0; x < out_width; ++x) {
      std::copy_n(row + static_cast<size_t>(xs[x]) * channels, channels,
                  dst + static_cast<ptrdiff_t>(x) * channels);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Config parsing.

constexpr std::array<float, 3> kOpenAiClipMean = {0.48145466f, 0.4578275f, 0.40821073f};
constexpr std::array<float, 3> kOpenAiClipStd = {0.26862954f, 0.26130258f, 0.27577711f};
constexpr std::array<float, 3> kImagenetStandard = {0.5f, 0.5f, 0.5f};

enum class ProcessorFamily { kClip, kSiglip, kBlip };

// Class defaults (transformers' constructors in 4.x, class attributes in 5.x), and whether
// an integer `size` means a square (else the shortest edge).
struct FamilyDefaults {
  ImageProcessorConfig config;
  bool default_to_square = true;
};

FamilyDefaults DefaultsFor(ProcessorFamily family) {
  FamilyDefaults d;
  ImageProcessorConfig& c = d.config;
  c.do_convert_rgb = true;
  c.do_resize = true;
  c.resample = PilResample::kBicubic;
  c.do_rescale = true;
  c.rescale_factor = 1.0 / 255.0;
  c.do_normalize = true;
  switch (family) {
    case ProcessorFamily::kClip:
      c.size.shortest_edge = 224;
      c.do_center_crop = true;
      c.crop_height = c.crop_width = 224;
      c.image_mean = kOpenAiClipMean;
      c.image_std = kOpenAiClipStd;
      d.default_to_square = false;
      break;
    case ProcessorFamily::kSiglip:
      c.size.height = c.size.width = 224;
      c.image_mean = kImagenetStandard;
      c.image_std = kImagenetStandard;
      d.default_to_square = false;
      break;
    case ProcessorFamily::kBlip:
      c.size.height = c.size.width = 384;
      c.image_mean = kOpenAiClipMean;
      c.image_std = kOpenAiClipStd;
      d.default_to_square = true;
      break;
  }
  return d;
}

absl::StatusOr<ProcessorFamily> FamilyOf(const std::string& type) {
  static const std::pair<const char*, ProcessorFamily> kBases[] = {
      {"CLIPImageProcessor", ProcessorFamily::kClip},
      {"CLIPFeatureExtractor", ProcessorFamily::kClip},
      {"SiglipImageProcessor", ProcessorFamily::kSiglip},
      {"BlipImageProcessor", ProcessorFamily::kBlip},
  };
  for (const auto& [base, family] : kBases) {
    if (type == base || type == absl::StrCat(base, "Fast") || type == absl::StrCat(base, "Pil")) {
      return family;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("unsupported image processor type \"", type,
                                                 "\" (supported: CLIPImageProcessor, "
                                                 "SiglipImageProcessor, BlipImageProcessor)"));
}

// Fields that never change pixel values.
bool IsIgnoredField(const std::string& key) {
  static const std::set<std::string> kIgnored = {"image_processor_type",
                                                 "feature_extractor_type",
                                                 "processor_class",
                                                 "auto_map",
                                                 "backend",
                                                 "return_tensors",
                                                 "data_format",
                                                 "input_data_format",
                                                 "device",
                                                 "disable_grouping",
                                                 "image_seq_length"};
  return !key.empty() && (key[0] == '_' || kIgnored.count(key) > 0);
}

// Reads a pixel count: a JSON integer in 1..kMaxImageProcessorSide.
absl::StatusOr<int> PositiveInt(const json& v, const std::string& where) {
  if (v.is_number_integer() && v.get<int64_t>() > 0 && v.get<int64_t>() <= kMaxImageProcessorSide) {
    return static_cast<int>(v.get<int64_t>());
  }
  return absl::InvalidArgumentError(absl::StrCat(where, ": expected a positive integer up to ",
                                                 kMaxImageProcessorSide, ", got ", v.dump()));
}

absl::StatusOr<bool> Bool(const json& v, const std::string& where) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": expected true or false, got ", v.dump()));
}

absl::StatusOr<double> Number(const json& v, const std::string& where) {
  if (v.is_number()) return v.get<double>();
  return absl::InvalidArgumentError(absl::StrCat(where, ": expected a number, got ", v.dump()));
}

// `size`: a dict with one of the key sets transformers accepts, an int (square or shortest
// edge by `default_to_square`) or [height, width] (transformers' get_size_dict).
absl::StatusOr<ResizeSpec> ParseResizeSpec(const json& v, bool default_to_square,
                                           const std::string& where) {
  ResizeSpec spec;
  if (v.is_number_integer()) {
    absl::StatusOr<int> n = PositiveInt(v, where);
    if (!n.ok()) return n.status();
    if (default_to_square) {
      spec.height = spec.width = *n;
    } else {
      spec.shortest_edge = *n;
    }
    return spec;
  }
  if (v.is_array()) {
    if (v.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected [height, width]"));
    }
    absl::StatusOr<int> h = PositiveInt(v[0], where + "[0]");
    if (!h.ok()) return h.status();
    absl::StatusOr<int> w = PositiveInt(v[1], where + "[1]");
    if (!w.ok()) return w.status();
    spec.height = *h;
    spec.width = *w;
    return spec;
  }
  if (!v.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": expected an object, an integer or [height, width]"));
  }
  std::set<std::string> keys;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.value().is_null()) continue;  // transformers' SizeDict leaves None keys unset
    keys.insert(it.key());
    int* slot = nullptr;
    if (it.key() == "height") slot = &spec.height;
    if (it.key() == "width") slot = &spec.width;
    if (it.key() == "shortest_edge") slot = &spec.shortest_edge;
    if (it.key() == "longest_edge") slot = &spec.longest_edge;
    if (it.key() == "max_height") slot = &spec.max_height;
    if (it.key() == "max_width") slot = &spec.max_width;
    if (slot == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".", it.key(), ": unsupported size key"));
    }
    absl::StatusOr<int> n = PositiveInt(it.value(), absl::StrCat(where, ".", it.key()));
    if (!n.ok()) return n.status();
    *slot = *n;
  }
  const std::set<std::set<std::string>> kValid = {{"height", "width"},
                                                  {"shortest_edge"},
                                                  {"shortest_edge", "longest_edge"},
                                                  {"max_height", "max_width"}};
  if (kValid.count(keys) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": unsupported combination of keys {", absl::StrJoin(keys, ", "),
        "} (expected {height, width}, {shortest_edge}, {shortest_edge, longest_edge} or "
        "{max_height, max_width})"));
  }
  return spec;
}

// A {height, width} size (crop_size, pad_size): dict, int (square) or [height, width].
absl::StatusOr<std::pair<int, int>> ParseHeightWidth(const json& v, const std::string& where) {
  absl::StatusOr<ResizeSpec> spec = ParseResizeSpec(v, /*default_to_square=*/true, where);
  if (!spec.ok()) return spec.status();
  if (spec->height == 0 || spec->width == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected height and width"));
  }
  return std::make_pair(spec->height, spec->width);
}

absl::StatusOr<PilResample> ParseResample(const json& v, const std::string& where) {
  if (v.is_null()) return PilResample::kBilinear;  // transformers' resize default
  if (v.is_number_integer()) {
    const int64_t n = v.get<int64_t>();
    if (n >= 0 && n <= 5) return static_cast<PilResample>(n);
  }
  if (v.is_string()) {
    // torchvision's InterpolationMode values and PIL's names.
    std::string name = absl::AsciiStrToLower(v.get<std::string>());
    if (absl::StartsWith(name, "interpolationmode.")) name = name.substr(18);
    if (absl::StartsWith(name, "resampling.")) name = name.substr(11);
    static const std::pair<const char*, PilResample> kNames[] = {
        {"nearest", PilResample::kNearest},   {"lanczos", PilResample::kLanczos},
        {"bilinear", PilResample::kBilinear}, {"bicubic", PilResample::kBicubic},
        {"box", PilResample::kBox},           {"hamming", PilResample::kHamming}};
    for (const auto& [n, f] : kNames) {
      if (name == n) return f;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": unsupported resampling ", v.dump(),
                   " (expected 0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming)"));
}

absl::StatusOr<std::array<float, 3>> ParseChannels(const json& v, const std::string& where) {
  std::array<float, 3> out{};
  if (v.is_number()) {
    out.fill(static_cast<float>(v.get<double>()));
    return out;
  }
  if (!v.is_array() || v.size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": expected a number or 3 numbers (R, G, B), got ", v.dump()));
  }
  for (int c = 0; c < 3; ++c) {
    if (!v[c].is_number()) {
      return absl::InvalidArgumentError(absl::StrCat(where, "[", c, "]: expected a number"));
    }
    out[c] = static_cast<float>(v[c].get<double>());
  }
  return out;
}

// Stores a parsed value in `out`, or passes the parse error on.
template <typename T>
absl::Status Set(absl::StatusOr<T> parsed, T& out) {
  if (!parsed.ok()) return parsed.status();
  out = *std::move(parsed);
  return absl::OkStatus();
}

// `where` names the settings object in errors ("f.json" or "f.json: image_processor"); a
// field is named `at` + key ("f.json: size", "f.json: image_processor.size").
absl::StatusOr<ImageProcessorConfig> ParseSettings(const json& s, const std::string& where,
                                                   const std::string& at) {
  if (!s.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected an object"));
  }
  std::string type;
  if (s.contains("image_processor_type") && s["image_processor_type"].is_string()) {
    type = s["image_processor_type"].get<std::string>();
  } else if (s.contains("feature_extractor_type") && s["feature_extractor_type"].is_string()) {
    type = s["feature_extractor_type"].get<std::string>();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(where,
                     ".image_processor_type: missing (the processor class is needed "
                     "for its defaults)"));
  }
  absl::StatusOr<ProcessorFamily> family = FamilyOf(type);
  if (!family.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, "image_processor_type: ", family.status().message()));
  }
  FamilyDefaults defaults = DefaultsFor(*family);
  ImageProcessorConfig c = defaults.config;
  c.processor_type = type;

  // default_to_square first: it decides what an integer `size` means.
  bool default_to_square = defaults.default_to_square;
  if (s.contains("default_to_square") && !s["default_to_square"].is_null()) {
    absl::Status st =
        Set(Bool(s["default_to_square"], at + "default_to_square"), default_to_square);
    if (!st.ok()) return st;
  }
  bool use_square_size = false;
  for (auto it = s.begin(); it != s.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    const std::string field = at + key;
    if (IsIgnoredField(key) || key == "default_to_square") continue;
    absl::Status st;
    std::pair<int, int> hw;
    if (key == "do_convert_rgb") {
      st = Set(Bool(v, field), c.do_convert_rgb);
    } else if (key == "do_resize") {
      st = Set(Bool(v, field), c.do_resize);
    } else if (key == "size") {
      if (!v.is_null()) st = Set(ParseResizeSpec(v, default_to_square, field), c.size);
    } else if (key == "resample") {
      st = Set(ParseResample(v, field), c.resample);
    } else if (key == "do_center_crop") {
      st = Set(Bool(v, field), c.do_center_crop);
    } else if (key == "crop_size") {
      if (!v.is_null() && (st = Set(ParseHeightWidth(v, field), hw)).ok()) {
        c.crop_height = hw.first;
        c.crop_width = hw.second;
      }
    } else if (key == "do_rescale") {
      st = Set(Bool(v, field), c.do_rescale);
    } else if (key == "rescale_factor") {
      if (!v.is_null()) st = Set(Number(v, field), c.rescale_factor);
    } else if (key == "do_normalize") {
      st = Set(Bool(v, field), c.do_normalize);
    } else if (key == "image_mean") {
      if (!v.is_null()) st = Set(ParseChannels(v, field), c.image_mean);
    } else if (key == "image_std") {
      if (!v.is_null()) st = Set(ParseChannels(v, field), c.image_std);
    } else if (key == "do_pad") {
      st = Set(Bool(v, field), c.do_pad);
    } else if (key == "pad_size") {
      if (!v.is_null() && (st = Set(ParseHeightWidth(v, field), hw)).ok()) {
        c.pad_height = hw.first;
        c.pad_width = hw.second;
      }
    } else if (key == "use_square_size" && *family == ProcessorFamily::kClip) {
      st = Set(Bool(v, field), use_square_size);
    } else if (!(v.is_null() || (v.is_boolean() && !v.get<bool>()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": unsupported image processor setting (", v.dump(),
          "); it may change pixel values, which this implementation does not reproduce"));
    }
    if (!st.ok()) return st;
  }
  // KOSMOS-2's CLIP compatibility switch: a square of the shortest edge.
  if (use_square_size && c.size.shortest_edge > 0) {
    const int n = c.size.shortest_edge;
    c.size = ResizeSpec{};
    c.size.height = c.size.width = n;
  }
  if (c.do_center_crop && (c.crop_height <= 0 || c.crop_width <= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, "crop_size: needed when do_center_crop is true"));
  }
  for (int ch = 0; ch < 3; ++ch) {
    if (c.do_normalize && c.image_std[ch] == 0.f) {
      return absl::InvalidArgumentError(absl::StrCat(at, "image_std[", ch, "]: is zero"));
    }
  }
  return c;
}

}  // namespace

absl::string_view PilResampleName(PilResample filter) {
  switch (filter) {
    case PilResample::kNearest:
      return "nearest";
    case PilResample::kLanczos:
      return "lanczos";
    case PilResample::kBilinear:
      return "bilinear";
    case PilResample::kBicubic:
      return "bicubic";
    case PilResample::kBox:
      return "box";
    case PilResample::kHamming:
      return "hamming";
  }
  return "unknown";
}

std::vector<uint8_t> PilResize(const uint8_t* src, int width, int height, int channels,
                               int out_width, int out_height, PilResample filter) {
  if (filter == PilResample::kNearest) {
    return ResizeNearest(src, width, height, channels, out_width, out_height);
  }
  return SeparableResize(src, width, height, channels, out_width, out_height, FilterFor(filter),
                         FixedPoint::kPillow);
}

absl::StatusOr<std::vector<uint8_t>> TorchvisionResize(const uint8_t* src, int width, int height,
                                                       int channels, int out_width, int out_height,
                                                       PilResample filter) {
  Filter f{BilinearFilter, 1.0};
  switch (filter) {
    case PilResample::kBilinear:
      break;
    case PilResample::kBicubic:
    case PilResample::kLanczos:  // transformers substitutes bicubic (no tensor Lanczos)
      f = {TorchBicubicFilter, 2.0};
      break;
    case PilResample::kNearest:  // transformers maps NEAREST to nearest-exact
      return ResizeNearest(src, width, height, channels, out_width, out_height, /*exact=*/true);
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "the torchvision backend resize supports nearest, bilinear and bicubic, not ",
          PilResampleName(filter)));
  }
  return SeparableResize(src, width, height, channels, out_width, out_height, f,
                         FixedPoint::kTorchInt16);
}

absl::StatusOr<std::pair<int, int>> ResizeOutputSize(const ResizeSpec& spec, int height,
                                                     int width) {
  if (height < 1 || width < 1) {
    return absl::InvalidArgumentError(absl::StrCat("empty image ", width, "x", height));
  }
  int out_h = 0;
  int out_w = 0;
  if (spec.shortest_edge > 0 && spec.longest_edge > 0) {
    // image_transforms.get_size_with_aspect_ratio(size=shortest_edge, max_size=longest_edge).
    int size = spec.shortest_edge;
    const int max_size = spec.longest_edge;
    const double min_original = std::min(height, width);
    const double max_original = std::max(height, width);
    double raw_size = 0.0;
    bool have_raw = false;
    if (max_original / min_original * size > max_size) {
      raw_size = max_size * min_original / max_original;
      have_raw = true;
      size = static_cast<int>(std::nearbyint(raw_size));  // Python round(): half to even
    }
    if ((height <= width && height == size) || (width <= height && width == size)) {
      out_h = height;
      out_w = width;
    } else if (width < height) {
      out_w = size;
      out_h = have_raw ? static_cast<int>(raw_size * height / width)
                       : static_cast<int>(static_cast<double>(int64_t{size} * height) / width);
    } else {
      out_h = size;
      out_w = have_raw ? static_cast<int>(raw_size * width / height)
                       : static_cast<int>(static_cast<double>(int64_t{size} * width) / height);
    }
  } else if (spec.shortest_edge > 0) {
    // get_resize_output_image_size(default_to_square=False): the short side becomes
    // shortest_edge, the long side int(shortest_edge * long / short).
    const int short_side = std::min(height, width);
    const int long_side = std::max(height, width);
    const int new_short = spec.shortest_edge;
    const int new_long =
        static_cast<int>(static_cast<double>(int64_t{new_short} * long_side) / short_side);
    if (width <= height) {
      out_h = new_long;
      out_w = new_short;
    } else {
      out_h = new_short;
      out_w = new_long;
    }
  } else if (spec.max_height > 0 && spec.max_width > 0) {
    const double scale = std::min(static_cast<double>(spec.max_height) / height,
                                  static_cast<double>(spec.max_width) / width);
    out_h = static_cast<int>(height * scale);
    out_w = static_cast<int>(width * scale);
  } else if (spec.height > 0 && spec.width > 0) {
    out_h = spec.height;
    out_w = spec.width;
  } else {
    return absl::InvalidArgumentError("size: no height/width, shortest_edge or max_height/width");
  }
  if (out_h < 1 || out_w < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resizing ", width, "x", height, " gives an empty image (", out_w, "x", out_h, ")"));
  }
  return std::make_pair(out_h, out_w);
}

absl::StatusOr<ImageProcessorConfig> ParseImageProcessorConfig(absl::string_view json_text,
                                                               absl::string_view file_name) {
  const std::string name(file_name);
  // Size and nesting bounded (folder_json.h) before anything is built from the text.
  absl::StatusOr<json> parsed = ParseHfJson(json_text, name);
  if (!parsed.ok()) return parsed.status();
  const json& root = *parsed;
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": expected a JSON object"));
  }
  if (root.contains("image_processor")) {
    return ParseSettings(root["image_processor"], name + ": image_processor",
                         name + ": image_processor.");
  }
  return ParseSettings(root, name, name + ": ");
}

absl::StatusOr<ImageProcessorConfig> LoadImageProcessorConfig(const std::string& model_dir) {
  const std::filesystem::path dir(model_dir);
  const std::string processor = (dir / "processor_config.json").string();
  const std::string preprocessor = (dir / "preprocessor_config.json").string();
  if (std::filesystem::exists(processor)) {
    absl::StatusOr<std::string> text = ReadHfJsonText(processor);
    if (!text.ok()) return text.status();
    absl::StatusOr<json> root = ParseHfJson(*text, processor);
    if (!root.ok()) return root.status();
    if (root->is_object() && root->contains("image_processor")) {
      return ParseImageProcessorConfig(*text, processor);
    }
  }
  if (std::filesystem::exists(preprocessor)) {
    absl::StatusOr<std::string> text = ReadHfJsonText(preprocessor);
    if (!text.ok()) return text.status();
    return ParseImageProcessorConfig(*text, preprocessor);
  }
  return absl::NotFoundError(absl::StrCat(model_dir,
                                          ": no image processor settings (neither "
                                          "processor_config.json with \"image_processor\" nor "
                                          "preprocessor_config.json)"));
}

absl::StatusOr<RgbImage> ResizeAndCrop(const ImageProcessorConfig& config, const uint8_t* rgb,
                                       int width, int height) {
  if (width < 1 || height < 1 || rgb == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("empty image ", width, "x", height));
  }
  RgbImage image;
  if (config.do_resize) {
    const absl::StatusOr<std::pair<int, int>> hw = ResizeOutputSize(config.size, height, width);
    if (!hw.ok()) return hw.status();
    image.height = hw->first;
    image.width = hw->second;
    if (config.backend == ImageBackend::kPil) {
      image.pixels = PilResize(rgb, width, height, 3, image.width, image.height, config.resample);
    } else if (image.width == width && image.height == height) {
      image.pixels.assign(rgb, rgb + static_cast<size_t>(width) * height * 3);  // as torchvision
    } else {
      const absl::Status st =
          Set(TorchvisionResize(rgb, width, height, 3, image.width, image.height, config.resample),
              image.pixels);
      if (!st.ok()) return st;
    }
  } else {
    image.width = width;
    image.height = height;
    image.pixels.assign(rgb, rgb + static_cast<size_t>(width) * height * 3);
  }
  if (config.do_center_crop) {
    if (config.crop_height < 1 || config.crop_width < 1) {
      return absl::InvalidArgumentError("crop_size: needed when do_center_crop is true");
    }
    // transformers' numpy center_crop: the window starts at floor((size - crop) / 2); where
    // the crop is larger, the image sits ceil((crop - size) / 2) pixels in, zeros around.
    // torchvision pads floor((crop - size) / 2) before the image instead.
    const bool pad_first = config.backend == ImageBackend::kPil;
    auto offset = [pad_first](int size, int crop) {
      if (size >= crop) return (size - crop) / 2;
      return pad_first ? -((crop - size + 1) / 2) : -((crop - size) / 2);
    };
    const int top = offset(image.height, config.crop_height);
    const int left = offset(image.width, config.crop_width);
    RgbImage cropped;
    cropped.height = config.crop_height;
    cropped.width = config.crop_width;
    cropped.pixels.assign(static_cast<size_t>(cropped.height) * cropped.width * 3, 0);
    for (int y = 0; y < cropped.height; ++y) {
      const int sy = y + top;
      if (sy < 0 || sy >= image.height) continue;
      const int x0 = std::max(0, -left);
      const int x1 = std::min(cropped.width, image.width - left);
      if (x1 <= x0) continue;
      std::copy_n(image.pixels.data() + (static_cast<size_t>(sy) * image.width + x0 + left) * 3,
                  static_cast<size_t>(x1 - x0) * 3,
                  cropped.pixels.data() + (static_cast<size_t>(y) * cropped.width + x0) * 3);
    }
    image = std::move(cropped);
  }
  return image;
}

absl::StatusOr<PixelValues> RescaleNormalizePad(const ImageProcessorConfig& config,
                                                const RgbImage& image) {
  if (image.width < 1 || image.height < 1 ||
      image.pixels.size() != static_cast<size_t>(image.width) * image.height * 3) {
    return absl::InvalidArgumentError("RescaleNormalizePad: malformed image");
  }
  const int out_h = config.do_pad && config.pad_height > 0 ? config.pad_height : image.height;
  const int out_w = config.do_pad && config.pad_width > 0 ? config.pad_width : image.width;
  if (out_h < image.height || out_w < image.width) {
    return absl::InvalidArgumentError(absl::StrCat("pad_size ", out_h, "x", out_w,
                                                   " is smaller than the image ", image.height, "x",
                                                   image.width));
  }
  PixelValues pv;
  pv.channels = 3;
  pv.height = out_h;
  pv.width = out_w;
  pv.data.assign(static_cast<size_t>(3) * out_h * out_w, 0.f);
  // One value per possible byte and channel: the arithmetic is per value anyway.
  std::array<std::array<float, 256>, 3> lut{};
  const bool torchvision = config.backend == ImageBackend::kTorchvision;
  for (int c = 0; c < 3; ++c) {
    float mean = config.image_mean[c];
    float std = config.image_std[c];
    if (torchvision && config.do_rescale && config.do_normalize) {
      // Fused: mean and std (float32 tensors) times the inverse rescale factor, which LibTorch
      // applies as a float32 scalar.
      const float inverse = static_cast<float>(1.0 / config.rescale_factor);
      mean *= inverse;
      std *= inverse;
    }
    for (int v = 0; v < 256; ++v) {
      float x = static_cast<float>(v);
      if (torchvision) {
        if (config.do_normalize) {
          x = (x - mean) / std;
        } else if (config.do_rescale) {
          x = x * static_cast<float>(config.rescale_factor);
        }
      } else {
        // numpy: rescale in float64 then cast; normalise in float32.
        if (config.do_rescale) {
          x = static_cast<float>(static_cast<double>(v) * config.rescale_factor);
        }
        if (config.do_normalize) x = (x - mean) / std;
      }
      lut[c][v] = x;
    }
  }
  for (int c = 0; c < 3; ++c) {
    for (int y = 0; y < image.height; ++y) {
      const uint8_t* row = image.pixels.data() + static_cast<size_t>(y) * image.width * 3;
      float* dst = pv.data.data() + (static_cast<size_t>(c) * out_h + y) * out_w;
      for (int x = 0; x < image.width; ++x) dst[x] = lut[c][row[x * 3 + c]];
    }
  }
  return pv;
}

absl::StatusOr<PixelValues> PreprocessImage(const ImageProcessorConfig& config, const uint8_t* rgb,
                                            int width, int height) {
  absl::StatusOr<RgbImage> image = ResizeAndCrop(config, rgb, width, height);
  if (!image.ok()) return image.status();
  return RescaleNormalizePad(config, *image);
}

}  // namespace cdcca::model
