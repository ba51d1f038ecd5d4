// libFuzzer entry for the decoding of an uplinked frame, as the cloud's Hugging Face trainer
// does it: the frame passed the ingest check (baseline JPEG whose declared size is the
// tower's input, at most 3 bytes a pixel + 64 KiB), then OpenCV decodes it
// (datasets::DecodeImageRgb). A decoded frame must be exactly the declared size with three
// channels; a frame that does not decode must be a status, never a crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "compress/uplink_codec.h"
#include "datasets/formats.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view frame(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<cdcca::compress::JpegSize> declared = cdcca::compress::ReadJpegSize(frame);
  if (!declared.ok() || declared->progressive) return 0;
  // The towers' inputs are at most 1024 x 1024; the fuzzer keeps to small frames.
  const uint64_t pixels = uint64_t(declared->width) * uint64_t(declared->height);
  if (declared->width > 128 || declared->height > 128 || size > pixels * 3 + (64u << 10)) {
    return 0;
  }
  absl::StatusOr<cdcca::datasets::Image> image =
      cdcca::datasets::DecodeImageRgb(frame, "uplinked frame");
  if (!image.ok()) return 0;
  if (image->width != declared->width || image->height != declared->height ||
      image->pixels.size() != pixels * cdcca::datasets::Image::kChannels) {
    __builtin_trap();
  }
  return 0;
}
