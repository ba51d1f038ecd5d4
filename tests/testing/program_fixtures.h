// What the program tests (tests/programs_e2e_test.cc, tests/cluster_e2e_test.cc) give the
// real cdcca-cloud and cdcca-device: the tiny family and a folder of shifted scenes. Nothing here
// depends on the model being any good.
#ifndef CDCCA_TESTS_TESTING_PROGRAM_FIXTURES_H_
#define CDCCA_TESTS_TESTING_PROGRAM_FIXTURES_H_

#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "datasets/scene.h"
#include "datasets/shifts.h"
#include "datasets/test_images.h"
#include "opencv2/imgcodecs.hpp"
#include "opencv2/imgproc.hpp"
#include "tests/testing/tiny_family.h"

namespace cdcca::testing {

// The tiny family (tests/testing/tiny_family.h) in `dir`, its teacher's weights doubled so
// that teacher and student differ.
inline absl::Status SaveRandomTinyFamily(const std::string& dir) { return WriteTinyFamily(dir); }

// Writes `count` scenes of synthetic glyphs into `dir` as scene-<100 + i>.png, each under a
// different shift and severity (deterministic).
inline absl::Status WriteShiftedScenes(const std::string& dir, int count = 12) {
  std::filesystem::create_directories(dir);
  datasets::ImageSet set = datasets::SyntheticImageSet(datasets::Split::kTest);
  const auto& shifts = datasets::AllImageShifts();
  for (int i = 0; i < count; ++i) {
    datasets::Rng rng(100 + i);
    datasets::Scene scene = datasets::RenderScene(set, datasets::SceneOptions{}, rng);
    if (absl::Status s =
            datasets::ApplyShift(shifts[i % shifts.size()], 1 + i % 5, 7 + i, scene.image);
        !s.ok()) {
      return s;
    }
    cv::Mat rgb(scene.image.height, scene.image.width, CV_8UC3, scene.image.pixels.data());
    cv::Mat bgr;
    cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
    const std::string path = absl::StrCat(dir, "/scene-", 100 + i, ".png");
    if (!cv::imwrite(path, bgr)) return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_PROGRAM_FIXTURES_H_
