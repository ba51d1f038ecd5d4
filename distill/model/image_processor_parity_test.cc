// Parity with transformers: every processor variant under tests/fixtures/hf/processors/
// (written by scripts/hf_fixtures.py with transformers 5.x) run on every image of
// tests/fixtures/hf/images/, decoded with datasets::LoadImageRgb, against the pixel_values
// transformers' PIL-backend image processor (*ImageProcessorPil, the 4.x "slow" one)
// produced (expected_pil.safetensors, [3, H, W] float32 per image stem). The bound is 1/255
// per value in rescaled units (a difference in normalised units times the channel's std),
// i.e. at most one 8-bit step. The default torchvision backend's output
// (expected.safetensors) is compared too and its largest difference printed, not asserted:
// it resizes differently.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "datasets/formats.h"
#include "distill/model/image_processor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

namespace fs = std::filesystem;

struct F32Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// A minimal safetensors reader for the fixtures (F32 only; the library's reader needs
// LibTorch, and this test stays torch-free).
absl::StatusOr<std::map<std::string, F32Tensor>> ReadF32Safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError("cannot read " + path);
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string bytes = buf.str();
  if (bytes.size() < 8) return absl::DataLossError(path + ": truncated");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | static_cast<uint8_t>(bytes[i]);
  if (8 + header_len > bytes.size()) return absl::DataLossError(path + ": truncated header");
  const nlohmann::json header =
      nlohmann::json::parse(bytes.substr(8, header_len), nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) return absl::DataLossError(path + ": bad header");
  const size_t base = 8 + header_len;
  std::map<std::string, F32Tensor> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const nlohmann::json& t = it.value();
    if (t.value("dtype", "") != "F32") {
      return absl::InvalidArgumentError(path + ": " + it.key() + ": dtype is not F32");
    }
    F32Tensor tensor;
    size_t count = 1;
    for (const auto& d : t["shape"]) {
      tensor.shape.push_back(d.get<int64_t>());
      count *= d.get<size_t>();
    }
    const size_t begin = t["data_offsets"][0].get<size_t>();
    const size_t end = t["data_offsets"][1].get<size_t>();
    if (end - begin != count * 4 || base + end > bytes.size()) {
      return absl::DataLossError(path + ": " + it.key() + ": bad data_offsets");
    }
    tensor.data.resize(count);
    std::memcpy(tensor.data.data(), bytes.data() + base + begin, count * 4);
    out[it.key()] = std::move(tensor);
  }
  return out;
}

// The image file in `dir` whose stem is `stem`.
std::string FindImage(const fs::path& dir, const std::string& stem) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().stem() == stem) return entry.path().string();
  }
  return "";
}

struct Comparison {
  double max_diff = 0;  // rescaled units (one 8-bit step = 1/255)
  int64_t values = 0;
  int64_t exact = 0;  // values within 1e-6 (float rounding)
};

// |ours - expected| in rescaled units: divided by the normalisation's scale (1/std), i.e.
// times std.
Comparison Compare(const ImageProcessorConfig& config, const PixelValues& ours,
                   const F32Tensor& expected) {
  Comparison c;
  const size_t plane = static_cast<size_t>(ours.height) * ours.width;
  for (size_t i = 0; i < ours.data.size(); ++i) {
    const int ch = static_cast<int>(i / plane);
    const double scale = config.do_normalize ? config.image_std[ch] : 1.0;
    const double d = std::fabs(static_cast<double>(ours.data[i]) - expected.data[i]) * scale;
    c.max_diff = std::max(c.max_diff, d);
    c.exact += d <= 1e-6;
    ++c.values;
  }
  return c;
}

TEST(ImageProcessorParityTest, MatchesTransformersSlowProcessors) {
  const fs::path root = fs::path(CDCCA_SOURCE_DIR) / "tests" / "fixtures" / "hf";
  const fs::path processors = root / "processors";
  if (!fs::exists(processors)) GTEST_SKIP() << "no fixtures at " << processors;
  int variants = 0;
  for (const auto& entry : fs::directory_iterator(processors)) {
    if (!entry.is_directory()) continue;
    const std::string variant = entry.path().filename().string();
    SCOPED_TRACE(variant);
    ASSERT_OK_AND_ASSIGN(ImageProcessorConfig config,
                         LoadImageProcessorConfig(entry.path().string()));
    ASSERT_OK_AND_ASSIGN(auto expected,
                         ReadF32Safetensors((entry.path() / "expected_pil.safetensors").string()));
    std::map<std::string, F32Tensor> fast;
    const fs::path fast_path = entry.path() / "expected.safetensors";
    if (fs::exists(fast_path)) {
      ASSERT_OK_AND_ASSIGN(fast, ReadF32Safetensors(fast_path.string()));
    }
    ASSERT_FALSE(expected.empty());
    Comparison total;
    double fast_max = 0;
    for (const auto& [stem, want] : expected) {
      SCOPED_TRACE(stem);
      const std::string image_path = FindImage(root / "images", stem);
      ASSERT_FALSE(image_path.empty()) << "no image " << stem << " in " << root / "images";
      ASSERT_OK_AND_ASSIGN(datasets::Image image, datasets::LoadImageRgb(image_path));
      ASSERT_OK_AND_ASSIGN(PixelValues ours,
                           PreprocessImage(config, image.pixels.data(), image.width, image.height));
      ASSERT_EQ(want.shape, (std::vector<int64_t>{ours.channels, ours.height, ours.width}));
      const Comparison c = Compare(config, ours, want);
      EXPECT_LE(c.max_diff, 1.0 / 255 + 1e-6)
          << image.width << "x" << image.height << " -> " << ours.width << "x" << ours.height;
      total.max_diff = std::max(total.max_diff, c.max_diff);
      total.values += c.values;
      total.exact += c.exact;
      const auto f = fast.find(stem);
      if (f != fast.end() && f->second.shape == want.shape) {
        fast_max = std::max(fast_max, Compare(config, ours, f->second).max_diff);
      }
    }
    std::cout << "[parity] " << variant << " (" << config.processor_type << ", "
              << PilResampleName(config.resample) << "): " << expected.size()
              << " images, PIL max |diff| " << total.max_diff * 255 << "/255, " << total.exact
              << "/" << total.values << " values exact";
    if (!fast.empty()) std::cout << "; torchvision max |diff| " << fast_max * 255 << "/255";
    std::cout << "\n";
    ++variants;
  }
  EXPECT_GT(variants, 0) << "no processor variants under " << processors;
}

}  // namespace
}  // namespace cdcca::model
