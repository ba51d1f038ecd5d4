#include "datasets/image.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace cdcca::datasets {
namespace {

// Source coordinate and weights for one destination index under centre alignment.
struct Tap {
  int i0, i1;
  float w1;  // weight of i1; i0 gets 1 - w1
};

std::vector<Tap> BilinearTaps(int src_n, int dst_n) {
  std::vector<Tap> taps(dst_n);
  const float scale = static_cast<float>(src_n) / dst_n;
  for (int d = 0; d < dst_n; ++d) {
    float s = (d + 0.5f) * scale - 0.5f;
    s = std::max(s, 0.f);
    int i0 = static_cast<int>(s);
    if (i0 > src_n - 1) i0 = src_n - 1;
    const int i1 = std::min(i0 + 1, src_n - 1);
    taps[d] = {i0, i1, s - i0};
  }
  return taps;
}

std::vector<int> NearestTaps(int src_n, int dst_n) {
  std::vector<int> taps(dst_n);
  for (int d = 0; d < dst_n; ++d) {
    taps[d] = std::min(static_cast<int>((static_cast<int64_t>(d) * src_n) / dst_n), src_n - 1);
  }
  return taps;
}

// Shared implementation over `channels` interleaved channels.
void ResizeInterleaved(const uint8_t* src, int sw, int sh, uint8_t* dst, int dw, int dh,
                       int channels, Interpolation interp) {
  if (interp == Interpolation::kNearest) {
    const std::vector<int> tx = NearestTaps(sw, dw), ty = NearestTaps(sh, dh);
    for (int y = 0; y < dh; ++y) {
      const uint8_t* row = src + static_cast<size_t>(ty[y]) * sw * channels;
      uint8_t* out = dst + static_cast<size_t>(y) * dw * channels;
      for (int x = 0; x < dw; ++x) {
        for (int c = 0; c < channels; ++c) out[x * channels + c] = row[tx[x] * channels + c];
      }
    }
    return;
  }
  const std::vector<Tap> tx = BilinearTaps(sw, dw), ty = BilinearTaps(sh, dh);
  for (int y = 0; y < dh; ++y) {
    const uint8_t* r0 = src + static_cast<size_t>(ty[y].i0) * sw * channels;
    const uint8_t* r1 = src + static_cast<size_t>(ty[y].i1) * sw * channels;
    const float wy = ty[y].w1;
    uint8_t* out = dst + static_cast<size_t>(y) * dw * channels;
    for (int x = 0; x < dw; ++x) {
      const int a = tx[x].i0 * channels, b = tx[x].i1 * channels;
      const float wx = tx[x].w1;
      for (int c = 0; c < channels; ++c) {
        const float top = r0[a + c] + wx * (r0[b + c] - r0[a + c]);
        const float bot = r1[a + c] + wx * (r1[b + c] - r1[a + c]);
        out[x * channels + c] = ClampPixel(top + wy * (bot - top));
      }
    }
  }
}

}  // namespace

std::vector<uint8_t> ResizeGray(const uint8_t* src, int src_w, int src_h, int dst_w, int dst_h,
                                Interpolation interp) {
  std::vector<uint8_t> dst(static_cast<size_t>(dst_w) * dst_h);
  ResizeInterleaved(src, src_w, src_h, dst.data(), dst_w, dst_h, 1, interp);
  return dst;
}

Image Resize(const Image& src, int dst_w, int dst_h, Interpolation interp) {
  Image dst(dst_w, dst_h);
  ResizeInterleaved(src.pixels.data(), src.width, src.height, dst.pixels.data(), dst_w, dst_h,
                    Image::kChannels, interp);
  return dst;
}

double MeanAbsDiff(const Image& a, const Image& b) {
  if (a.width != b.width || a.height != b.height || a.pixels.size() != b.pixels.size()) return -1;
  if (a.pixels.empty()) return 0;
  int64_t sum = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) sum += std::abs(a.pixels[i] - b.pixels[i]);
  return static_cast<double>(sum) / a.pixels.size();
}

}  // namespace cdcca::datasets
