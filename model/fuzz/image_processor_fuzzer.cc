// libFuzzer entry for the image processor settings (preprocessor_config.json, or
// processor_config.json's "image_processor" entry): ParseImageProcessorConfig, then the
// output size it gives for a few image shapes, and the whole preprocessing of a small image
// when the output is small (so the run stays fast; kMaxImageProcessorSide bounds the rest).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "model/hub/image_processor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cdcca::model;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ImageProcessorConfig> c =
      ParseImageProcessorConfig(text, "preprocessor_config.json");
  if (!c.ok()) return 0;
  const struct { int height, width; } kShapes[] = {{1, 1}, {480, 640}, {3, 4000}};
  for (const auto& s : kShapes) {
    absl::StatusOr<std::pair<int, int>> out = ResizeOutputSize(c->size, s.height, s.width);
    if (out.ok() && (out->first < 1 || out->second < 1)) __builtin_trap();
  }
  const int side = 5;
  absl::StatusOr<std::pair<int, int>> out = ResizeOutputSize(c->size, side, side);
  const auto small = [](int n) { return n <= 64; };
  if ((!c->do_resize || (out.ok() && small(out->first) && small(out->second))) &&
      (!c->do_center_crop || (small(c->crop_height) && small(c->crop_width))) &&
      small(c->pad_height) && small(c->pad_width)) {
    std::vector<uint8_t> rgb(side * side * 3);
    for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<uint8_t>(i * 37);
    for (ImageBackend backend : {ImageBackend::kPil, ImageBackend::kTorchvision}) {
      c->backend = backend;
      absl::StatusOr<PixelValues> px = PreprocessImage(*c, rgb.data(), side, side);
      if (px.ok() &&
          px->data.size() != static_cast<size_t>(px->channels) * px->height * px->width) {
        __builtin_trap();
      }
    }
  }
  return 0;
}
