// A plain owned RGB image and the few resampling operations the scene renderer needs.
//
// Written without OpenCV on purpose: the dataset core must build on the GPU machine, which
// has no OpenCV (see docs/ARCHITECTURE.md, "datasets").
#ifndef CDCCA_DATASETS_IMAGE_H_
#define CDCCA_DATASETS_IMAGE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cdcca::datasets {

// 8-bit RGB image, interleaved (HWC), rows top to bottom, no padding:
// pixel (x, y) channel c is pixels[(y * width + x) * 3 + c]. A value type: copies copy the
// pixels. Not thread-safe for concurrent mutation (plain data).
struct Image {
  static constexpr int kChannels = 3;

  Image() = default;
  Image(int w, int h, uint8_t fill = 0)
      : width(w), height(h), pixels(static_cast<size_t>(w) * h * kChannels, fill) {}

  uint8_t* at(int x, int y) { return &pixels[(static_cast<size_t>(y) * width + x) * kChannels]; }
  const uint8_t* at(int x, int y) const {
    return &pixels[(static_cast<size_t>(y) * width + x) * kChannels];
  }
  bool empty() const { return pixels.empty(); }

  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;
};

enum class Interpolation { kNearest, kBilinear };

// Resizes a single-channel 8-bit image (row-major, src_w * src_h bytes) to dst_w x dst_h.
// Bilinear uses pixel-centre alignment (as OpenCV's INTER_LINEAR does).
std::vector<uint8_t> ResizeGray(const uint8_t* src, int src_w, int src_h, int dst_w, int dst_h,
                                Interpolation interp);

// Resizes an RGB image; same conventions as ResizeGray.
Image Resize(const Image& src, int dst_w, int dst_h, Interpolation interp);

// Mean absolute difference per channel value between two images of equal size, in [0, 255].
// Returns -1 when the sizes differ.
double MeanAbsDiff(const Image& a, const Image& b);

// Saturating conversion of a float to a pixel value (rounds to nearest).
inline uint8_t ClampPixel(float v) {
  return v <= 0.f ? 0 : (v >= 255.f ? 255 : static_cast<uint8_t>(v + 0.5f));
}

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_IMAGE_H_
