// Parity with transformers: every processor variant under tests/fixtures/hf/processors/
// (written by scripts/hf_fixtures.py with transformers 5.x) run on every image of
// tests/fixtures/hf/images/, decoded with datasets::LoadImageRgb, against the pixel_values
// transformers produced ([3, H, W] float32 per image stem): ImageBackend::kPil against the
// PIL backend (*ImageProcessorPil, the 4.x "slow" one; expected_pil.safetensors) and
// ImageBackend::kTorchvision against the default torchvision backend (expected.safetensors).
// Asserted: every value bit-identical, and (the bound the parity tests hold to, reported
// separately) at most 1/255 in rescaled units (a difference in normalised units times the channel's
// std).
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
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hub/image_processor.h"
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
  int64_t identical = 0;  // bit-identical floats

  void Add(const Comparison& o) {
    max_diff = std::max(max_diff, o.max_diff);
    values += o.values;
    identical += o.identical;
  }
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
    c.identical += ours.data[i] == expected.data[i];
    ++c.values;
  }
  return c;
}

// Runs `config` on every image `expected` has and compares, asserting the 1/255 bound when
// `bounded`.
Comparison CheckAll(const ImageProcessorConfig& config, const fs::path& images,
                    const std::map<std::string, F32Tensor>& expected, bool bounded) {
  Comparison total;
  for (const auto& [stem, want] : expected) {
    SCOPED_TRACE(stem);
    const std::string image_path = FindImage(images, stem);
    EXPECT_FALSE(image_path.empty()) << "no image " << stem << " in " << images;
    if (image_path.empty()) continue;
    absl::StatusOr<datasets::Image> image = datasets::LoadImageRgb(image_path);
    EXPECT_OK(image);
    if (!image.ok()) continue;
    absl::StatusOr<PixelValues> ours =
        PreprocessImage(config, image->pixels.data(), image->width, image->height);
    EXPECT_OK(ours);
    if (!ours.ok()) continue;
    EXPECT_EQ(want.shape, (std::vector<int64_t>{ours->channels, ours->height, ours->width}));
    if (want.data.size() != ours->data.size()) continue;
    const Comparison c = Compare(config, *ours, want);
    if (bounded) {
      EXPECT_LE(c.max_diff, 1.0 / 255 + 1e-6)
          << image->width << "x" << image->height << " -> " << ours->width << "x" << ours->height;
    }
    total.Add(c);
  }
  return total;
}

std::string Describe(const Comparison& c) {
  std::ostringstream out;
  out << "max |diff| " << c.max_diff * 255 << "/255, " << c.identical << "/" << c.values
      << " identical";
  return out.str();
}

// Every processor variant, with each backend against the output of the same backend in
// transformers; and the PIL emulation against the torchvision output, to show the gap
// between the backends.
TEST(ImageProcessorParityTest, MatchesTransformersBothBackends) {
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
    ASSERT_OK_AND_ASSIGN(auto pil,
                         ReadF32Safetensors((entry.path() / "expected_pil.safetensors").string()));
    ASSERT_OK_AND_ASSIGN(auto torchvision,
                         ReadF32Safetensors((entry.path() / "expected.safetensors").string()));
    ASSERT_FALSE(pil.empty());
    ASSERT_EQ(pil.size(), torchvision.size());

    config.backend = ImageBackend::kPil;
    const Comparison p = CheckAll(config, root / "images", pil, /*bounded=*/true);
    config.backend = ImageBackend::kTorchvision;
    const Comparison t = CheckAll(config, root / "images", torchvision, /*bounded=*/true);
    config.backend = ImageBackend::kPil;
    const Comparison cross = CheckAll(config, root / "images", torchvision, /*bounded=*/false);
    std::cout << "[parity] " << variant << " (" << config.processor_type << ", "
              << PilResampleName(config.resample) << ", " << pil.size() << " images): PIL backend "
              << Describe(p) << "; torchvision backend " << Describe(t)
              << "; PIL emulation vs torchvision output " << Describe(cross) << "\n";
    // Stronger than the bound, and what the fixtures show: every value bit-identical.
    EXPECT_EQ(p.identical, p.values);
    EXPECT_EQ(t.identical, t.values);
    ++variants;
  }
  EXPECT_GT(variants, 0) << "no processor variants under " << processors;
}

// The pixel values each model fixture received from AutoProcessor (transformers 5's default
// torchvision backend), from the model folder's own processor_config.json: what `cdcca
// generate` must feed the model to reproduce its logits.
TEST(ImageProcessorParityTest, ModelFoldersGetTheirProcessorsPixels) {
  const fs::path root = fs::path(CDCCA_SOURCE_DIR) / "tests" / "fixtures" / "hf";
  const fs::path models = root / "models";
  if (!fs::exists(models)) GTEST_SKIP() << "no fixtures at " << models;
  int checked = 0;
  for (const auto& entry : fs::directory_iterator(models)) {
    const fs::path pixels_path = entry.path() / "expected_pixels.safetensors";
    if (!fs::exists(pixels_path)) continue;
    SCOPED_TRACE(entry.path().filename().string());
    ASSERT_OK_AND_ASSIGN(ImageProcessorConfig config,
                         LoadImageProcessorConfig(entry.path().string()));
    config.backend = ImageBackend::kTorchvision;
    ASSERT_OK_AND_ASSIGN(auto pixels, ReadF32Safetensors(pixels_path.string()));
    std::ifstream in(entry.path() / "expected.json");
    const nlohmann::json expected = nlohmann::json::parse(in, nullptr, false);
    ASSERT_TRUE(expected.contains("cases"));
    for (size_t i = 0; i < expected["cases"].size(); ++i) {
      const std::string key = "case" + std::to_string(i);
      const auto want = pixels.find(key);
      ASSERT_NE(want, pixels.end()) << key;
      const std::string image = expected["cases"][i]["image"].get<std::string>();
      const std::map<std::string, F32Tensor> one = {
          {fs::path(image).stem().string(), want->second}};
      const Comparison c = CheckAll(config, root / "images", one, /*bounded=*/true);
      EXPECT_EQ(c.identical, c.values) << key << " " << image << ": " << Describe(c);
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
}

}  // namespace
}  // namespace cdcca::model
