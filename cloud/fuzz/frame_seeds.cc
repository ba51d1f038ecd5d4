// Writes a seed corpus for the frame-decode fuzzer: baseline JPEGs of a few sizes and
// qualities, as devices send them (datasets::EncodeJpeg).
// Usage: frame_fuzz_seeds OUT_DIR
#include <cstdio>
#include <string>

#include "datasets/formats.h"
#include "datasets/image.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  int written = 0;
  for (int side : {8, 17, 32}) {
    for (int quality : {50, 90}) {
      cdcca::datasets::Image image(side, side);
      for (int y = 0; y < side; ++y) {
        for (int x = 0; x < side; ++x) {
          uint8_t* p = image.at(x, y);
          p[0] = static_cast<uint8_t>(x * 8);
          p[1] = static_cast<uint8_t>(y * 8);
          p[2] = static_cast<uint8_t>((x ^ y) * 16);
        }
      }
      absl::StatusOr<std::string> jpeg = cdcca::datasets::EncodeJpeg(image, quality);
      if (!jpeg.ok()) {
        std::fprintf(stderr, "encode failed: %s\n", jpeg.status().ToString().c_str());
        return 1;
      }
      const std::string path = std::string(argv[1]) + "/seed_" + std::to_string(written++);
      std::FILE* f = std::fopen(path.c_str(), "wb");
      if (f == nullptr || std::fwrite(jpeg->data(), 1, jpeg->size(), f) != jpeg->size() ||
          std::fclose(f) != 0) {
        std::perror(path.c_str());
        return 1;
      }
    }
  }
  std::printf("wrote %d seeds to %s\n", written, argv[1]);
  return 0;
}
