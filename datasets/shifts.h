// Image domain shifts (after VQAv2-IDS / ImageNet-C): rain, snow, fog, brightness,
// contrast, Gaussian noise, motion blur and JPEG, each at severity 1 (mild: a person still
// reads the scene easily) to 5 (hard, yet the items stay recognisable). The damage grows
// monotonically with severity (datasets/shifts_test.cc checks the mean absolute pixel
// difference from the clean image).
#ifndef CDCCA_DATASETS_SHIFTS_H_
#define CDCCA_DATASETS_SHIFTS_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "datasets/image.h"

namespace cdcca::datasets {

enum class ImageShift {
  kNone,
  kRain,
  kSnow,
  kFog,
  kBrightness,
  kContrast,
  kGaussianNoise,
  kMotionBlur,
  kJpeg,
};

inline constexpr int kMaxSeverity = 5;

// Every real shift (all but kNone), in enum order.
const std::vector<ImageShift>& AllImageShifts();
// Stable lower-case names: "none", "rain", "snow", "fog", "brightness", "contrast",
// "gaussian_noise", "motion_blur", "jpeg".
std::string_view ImageShiftName(ImageShift shift);
absl::StatusOr<ImageShift> ImageShiftFromName(std::string_view name);

// Applies `shift` at `severity` in place. Random parts (rain streaks, noise, fog field,
// blur angle) come only from `seed`, so the result is a pure function of
// (image, shift, severity, seed). severity 0 or kNone leaves the image unchanged.
// Errors: INVALID_ARGUMENT for a severity outside [0, 5]. Thread-safe (no shared state).
absl::Status ApplyShift(ImageShift shift, int severity, uint64_t seed, Image& image);

// JPEG's lossy step, done faithfully: RGB -> YCbCr (JFIF), 4:2:0 chroma subsampling,
// 8x8 forward DCT per block, quantization with the standard (ITU T.81 Annex K) tables
// scaled to `quality` (1-100) as libjpeg scales them, dequantization, inverse DCT,
// chroma replication and back to RGB. Entropy coding is lossless, so it is skipped.
void JpegRoundTrip(int quality, Image& image);

// The JPEG quality used at each severity (1-5).
int JpegQualityForSeverity(int severity);

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_SHIFTS_H_
