// uplink_jpeg_bench: what uplinking a frame's visual tokens costs against sending its JPEG,
// at the published vision-tower shapes:
//   clip-l-336     CLIP ViT-L/14 at 336 px, LLaVA-1.5's tower: 576 x 1024 (layer -2, no CLS)
//   siglip-so400m  SigLIP so400m/14 at 384 px, llava-interleave-qwen's: 729 x 1152 (last layer)
// with random weights (transformers' initialisation: linear and embedding weights normal(0,
// 0.02), norms 1, biases 0), so the token statistics are those of an untrained tower.
//
//   uplink_jpeg_bench [--towers clip-l-336,siglip-so400m] [--frames 6] [--images DIR]
//                     [--threads 2]
//
// Frames: every image in --images DIR (e.g. your own camera's), else benchmark scenes
// (Fashion-MNIST scenes, 64 px, fog at severity 4). For each tower and frame it prints the
// JPEG (quality 90, OpenCV) of the frame as the tower sees it (resized to the tower's input)
// and at its own size, and the uplink payload (compress/uplink_codec.h: one sample, zstd
// level 3) of 25, 50 and 100 % of the tokens at fp16, int8 and int4, with the relative error
// of the decoded tokens (||decoded - x|| / ||x||), and at jpeg: the frame at the tower's input
// as JPEG q90 with the kept indices, whose error is that of the tokens the cloud recomputes
// from the decoded JPEG. Medians over the frames.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "compress/uplink_codec.h"
#include "datasets/domain.h"
#include "datasets/fashion_mnist.h"
#include "datasets/shifts.h"
#include "model/arch/clip_vision.h"
#include "opencv2/imgcodecs.hpp"
#include "opencv2/imgproc.hpp"

ABSL_FLAG(std::string, towers, "clip-l-336,siglip-so400m", "towers to measure (comma list)");
ABSL_FLAG(int, frames, 6, "frames per tower (benchmark scenes; --images takes every image)");
ABSL_FLAG(std::string, images, "", "folder of images to use instead of the benchmark scenes");
ABSL_FLAG(int, threads, 2, "LibTorch intra-op threads");

namespace cdcca::device {
namespace {

namespace ds = datasets;

struct Tower {
  std::string name;
  model::ClipVisionConfig config;
  int64_t feature_layer;  // index into HiddenStates (negative from the end)
  bool drop_cls;
};

Tower MakeTower(const std::string& name) {
  Tower t;
  t.name = name;
  model::ClipVisionConfig& c = t.config;
  c.patch_size = 14;
  if (name == "clip-l-336") {
    c.model_type = "clip_vision_model";
    c.hidden_size = 1024;
    c.intermediate_size = 4096;
    c.num_hidden_layers = 24;
    c.num_attention_heads = 16;
    c.image_size = 336;
    c.hidden_act = "quick_gelu";
    t.feature_layer = -2;
    t.drop_cls = true;
  } else if (name == "siglip-so400m") {
    c.model_type = "siglip_vision_model";
    c.hidden_size = 1152;
    c.intermediate_size = 4304;
    c.num_hidden_layers = 27;
    c.num_attention_heads = 16;
    c.image_size = 384;
    c.hidden_act = "gelu_pytorch_tanh";
    c.layer_norm_eps = 1e-6;
    t.feature_layer = -1;
    t.drop_cls = false;
  } else {
    std::fprintf(stderr, "uplink_jpeg_bench: unknown tower %s\n", name.c_str());
    std::exit(1);
  }
  return t;
}

// transformers' initialisation of an untrained tower.
void InitRandom(torch::nn::Module& m, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    const std::string& name = p.key();
    torch::Tensor& v = p.value();
    // The tower is built with placeholders for Load() to replace: give each its own storage.
    v.set_data(torch::empty(v.sizes(), v.options().dtype(torch::kFloat)));
    const bool bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    if (bias) {
      v.zero_();
    } else if (v.dim() == 1 && name.find("norm") != std::string::npos) {
      v.fill_(1.0);
    } else {
      v.normal_(0.0, 0.02);
    }
  }
}

struct Frame {
  std::string name;
  cv::Mat bgr;  // as captured
};

std::vector<Frame> LoadFrames() {
  std::vector<Frame> frames;
  const std::string dir = absl::GetFlag(FLAGS_images);
  if (!dir.empty()) {
    std::vector<std::filesystem::path> paths;
    for (const auto& e : std::filesystem::directory_iterator(dir)) paths.push_back(e.path());
    std::sort(paths.begin(), paths.end());
    for (const auto& p : paths) {
      cv::Mat m = cv::imread(p.string(), cv::IMREAD_COLOR);
      if (!m.empty()) frames.push_back({p.filename().string(), m});
    }
    return frames;
  }
  absl::StatusOr<ds::ImageSet> images = ds::LoadFashionMnist(ds::Split::kTest);
  if (!images.ok()) {
    std::fprintf(stderr, "uplink_jpeg_bench: %s\n", images.status().ToString().c_str());
    std::exit(1);
  }
  absl::StatusOr<ds::SampleGenerator> gen =
      ds::SampleGenerator::Create(&*images, ds::ImageShiftDomain(ds::ImageShift::kFog, 4), 7);
  if (!gen.ok()) std::exit(1);
  for (int i = 0; i < absl::GetFlag(FLAGS_frames); ++i) {
    ds::Sample s = gen->Generate(static_cast<uint64_t>(i));
    cv::Mat rgb(s.image.height, s.image.width, CV_8UC3, s.image.pixels.data());
    cv::Mat bgr;
    cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
    frames.push_back({"scene" + std::to_string(i), bgr});
  }
  return frames;
}

std::string Jpeg(const cv::Mat& bgr) {
  std::vector<uchar> out;
  cv::imencode(".jpg", bgr, out, {cv::IMWRITE_JPEG_QUALITY, 90});
  return std::string(out.begin(), out.end());
}

// The tower's input for a frame: resized to size x size (bicubic), CLIP's or SigLIP's
// normalisation.
torch::Tensor Pixels(const cv::Mat& resized_bgr, bool siglip) {
  cv::Mat rgb;
  cv::cvtColor(resized_bgr, rgb, cv::COLOR_BGR2RGB);
  torch::Tensor x = torch::from_blob(rgb.data, {rgb.rows, rgb.cols, 3}, torch::kUInt8)
                        .to(torch::kFloat)
                        .div(255.0)
                        .permute({2, 0, 1});
  const std::vector<float> mean = siglip ? std::vector<float>{0.5f, 0.5f, 0.5f}
                                         : std::vector<float>{0.48145466f, 0.4578275f, 0.40821073f};
  const std::vector<float> std_ = siglip
                                      ? std::vector<float>{0.5f, 0.5f, 0.5f}
                                      : std::vector<float>{0.26862954f, 0.26130258f, 0.27577711f};
  x = (x - torch::tensor(mean).view({3, 1, 1})) / torch::tensor(std_).view({3, 1, 1});
  return x.unsqueeze(0).contiguous();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int Main() {
  torch::set_num_threads(std::max(1, absl::GetFlag(FLAGS_threads)));
  const std::vector<Frame> frames = LoadFrames();
  if (frames.empty()) {
    std::fprintf(stderr, "uplink_jpeg_bench: no frames\n");
    return 1;
  }
  const std::vector<compress::FeaturePrecision> precisions = {
      compress::FeaturePrecision::kFp16, compress::FeaturePrecision::kInt8,
      compress::FeaturePrecision::kInt4, compress::FeaturePrecision::kJpeg};
  const std::vector<double> ratios = {0.25, 0.5, 1.0};
  const std::vector<std::string> tower_names =
      absl::StrSplit(absl::GetFlag(FLAGS_towers), ',', absl::SkipEmpty());
  for (const std::string& tower_name : tower_names) {
    const Tower tower = MakeTower(tower_name);
    model::ClipVisionTower net(tower.config, model::WeightPrecision{});
    InitRandom(*net, 1);
    net->eval();
    const int64_t size = tower.config.image_size;
    std::vector<double> jpeg_tower, jpeg_source;
    // [ratio][precision] bytes and errors over frames.
    std::vector<std::vector<std::vector<double>>> bytes(
        ratios.size(), std::vector<std::vector<double>>(precisions.size()));
    auto errors = bytes;
    int64_t tokens = 0, dim = 0;
    double tower_seconds = 0;
    for (const Frame& f : frames) {
      cv::Mat resized;
      cv::resize(f.bgr, resized, cv::Size(static_cast<int>(size), static_cast<int>(size)), 0, 0,
                 cv::INTER_CUBIC);
      const std::string jpeg = Jpeg(resized);
      jpeg_tower.push_back(static_cast<double>(jpeg.size()));
      jpeg_source.push_back(static_cast<double>(Jpeg(f.bgr).size()));
      torch::NoGradGuard no_grad;
      auto tokens_of = [&](const cv::Mat& bgr) {
        std::vector<torch::Tensor> states =
            net->HiddenStates(Pixels(bgr, tower.config.is_siglip()), tower.feature_layer);
        torch::Tensor t = states.back()[0];
        if (tower.drop_cls) t = t.narrow(0, 1, t.size(0) - 1);
        return t.contiguous();
      };
      const auto t0 = std::chrono::steady_clock::now();
      torch::Tensor h = tokens_of(resized);
      tower_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // What the cloud computes from the jpeg uplink: the tower on the decoded frame.
      const cv::Mat decoded =
          cv::imdecode(std::vector<uchar>(jpeg.begin(), jpeg.end()), cv::IMREAD_COLOR);
      const torch::Tensor h_jpeg = tokens_of(decoded);
      tokens = h.size(0);
      dim = h.size(1);
      for (size_t r = 0; r < ratios.size(); ++r) {
        const int64_t keep = std::max<int64_t>(1, std::llround(ratios[r] * tokens));
        compress::UplinkSample s;
        s.grid_tokens = static_cast<uint32_t>(tokens);
        s.feature_dim = static_cast<uint32_t>(dim);
        s.prompt_tokens = std::vector<uint32_t>(12, 7);  // a short question
        s.answer_tokens = std::vector<uint32_t>(6, 9);
        for (int64_t k = 0; k < keep; ++k) {
          const int64_t token = k * tokens / keep;  // spread over the grid
          s.kept_indices.push_back(static_cast<uint16_t>(token));
          const float* row = h.data_ptr<float>() + token * dim;
          s.features.insert(s.features.end(), row, row + dim);
        }
        for (size_t p = 0; p < precisions.size(); ++p) {
          if (precisions[p] == compress::FeaturePrecision::kJpeg) {
            compress::UplinkSample frame = s;
            frame.features.clear();
            frame.frame = jpeg;
            absl::StatusOr<std::string> payload =
                compress::EncodeUplinkBatch({frame}, precisions[p]);
            if (!payload.ok()) {
              std::fprintf(stderr, "uplink_jpeg_bench: %s\n", payload.status().ToString().c_str());
              return 1;
            }
            double num = 0, den = 0;
            for (uint16_t k : s.kept_indices) {
              const float* a = h.data_ptr<float>() + k * dim;
              const float* b = h_jpeg.data_ptr<float>() + k * dim;
              for (int64_t c = 0; c < dim; ++c) {
                num += (b[c] - a[c]) * static_cast<double>(b[c] - a[c]);
                den += static_cast<double>(a[c]) * a[c];
              }
            }
            bytes[r][p].push_back(static_cast<double>(payload->size()));
            errors[r][p].push_back(std::sqrt(num / std::max(den, 1e-30)));
            continue;
          }
          absl::StatusOr<std::string> payload = compress::EncodeUplinkBatch({s}, precisions[p]);
          absl::StatusOr<std::vector<compress::UplinkSample>> back =
              payload.ok() ? compress::DecodeUplinkBatch(*payload)
                           : absl::StatusOr<std::vector<compress::UplinkSample>>(payload.status());
          if (!back.ok()) {
            std::fprintf(stderr, "uplink_jpeg_bench: %s\n", back.status().ToString().c_str());
            return 1;
          }
          double num = 0, den = 0;
          for (size_t i = 0; i < s.features.size(); ++i) {
            const double d = (*back)[0].features[i] - s.features[i];
            num += d * d;
            den += static_cast<double>(s.features[i]) * s.features[i];
          }
          bytes[r][p].push_back(static_cast<double>(payload->size()));
          errors[r][p].push_back(std::sqrt(num / std::max(den, 1e-30)));
        }
      }
    }
    std::printf("\n%s: %lld x %lld tokens, input %lld px, %zu frames (%s), tower %.2f s/frame\n",
                tower.name.c_str(), static_cast<long long>(tokens), static_cast<long long>(dim),
                static_cast<long long>(size), frames.size(),
                absl::GetFlag(FLAGS_images).empty() ? "benchmark scenes" : "--images",
                tower_seconds / static_cast<double>(frames.size()));
    std::printf("  JPEG q90 at the tower's input size: %.0f bytes; at the frame's own size: %.0f\n",
                Median(jpeg_tower), Median(jpeg_source));
    std::printf("  %-8s %-6s %12s %10s %12s\n", "tokens", "codec", "bytes", "rel.err",
                "x JPEG(input)");
    for (size_t r = 0; r < ratios.size(); ++r) {
      for (size_t p = 0; p < precisions.size(); ++p) {
        std::printf("  %6.0f %% %-6s %12.0f %10.4f %12.2f\n", ratios[r] * 100,
                    compress::FeaturePrecisionName(precisions[p]), Median(bytes[r][p]),
                    Median(errors[r][p]), Median(bytes[r][p]) / Median(jpeg_tower));
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace cdcca::device

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cdcca::device::Main();
}
