// The first bytes of a JPEG that declares a w x h frame: SOI, an APP0 segment, a frame header
// (`sof`: 0xC0 baseline, 0xC2 progressive, ...), then the start of a scan. What
// compress::ReadJpegSize and the cloud's ingest check read of a frame, without image data.
#ifndef CDCCA_TESTS_TESTING_JPEG_HEADER_H_
#define CDCCA_TESTS_TESTING_JPEG_HEADER_H_

#include <cstdint>
#include <string>

namespace cdcca::testing {

inline std::string JpegHeader(int w, int h, int components = 3, uint8_t sof = 0xC0) {
  std::string j = {'\xFF', '\xD8', '\xFF', '\xE0', 0, 4, 'J', 'F'};
  j += {'\xFF',
        static_cast<char>(sof),
        0,
        8,
        8,
        static_cast<char>(h >> 8),
        static_cast<char>(h & 0xFF),
        static_cast<char>(w >> 8),
        static_cast<char>(w & 0xFF),
        static_cast<char>(components)};
  j += {'\xFF', '\xDA', 0, 2};
  return j;
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_JPEG_HEADER_H_
