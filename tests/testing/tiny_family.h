// A tiny cdcca family for the tests of the programs, the cloud, the device and the harness,
// made as `cdcca pretrain` lays one out and as everything reads one: a BLIP-2 folder (the
// student) with its teacher's BLIP-2 folder in teacher/, sharing the vision tower. Both come
// from the random BLIP-2 fixture (tests/fixtures/hf/models/blip2_llama: 24 x 24 images, 6 x 6
// patches, so 1 + 16 visual tokens of 32 features); nothing here depends on the model being
// any good.
#ifndef CDCCA_TESTS_TESTING_TINY_FAMILY_H_
#define CDCCA_TESTS_TESTING_TINY_FAMILY_H_

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/hub/safetensors.h"

namespace cdcca::testing {

inline constexpr int kTinyFamilyTokens = 17;  // the class token, then 4 x 4 patches
inline constexpr int kTinyFamilyDim = 32;

// Multiplies every weight of `folder`/model.safetensors whose name starts with `prefix` by
// `scale` and adds Gaussian noise of `noise` times its RMS (drawn from `seed`).
inline absl::Status PerturbWeights(const std::string& folder, const std::string& prefix,
                                   double scale, double noise, uint64_t seed = 1) {
  const std::string path = folder + "/model.safetensors";
  absl::StatusOr<model::SafetensorsContents> contents = model::ReadSafetensors(path);
  if (!contents.ok()) return contents.status();
  torch::Generator gen = at::detail::createCPUGenerator(seed);
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : contents->tensors) {
    if (!absl::StartsWith(name, prefix) || !t.is_floating_point()) continue;
    torch::Tensor x = t.to(torch::kFloat) * scale;
    if (noise > 0) {
      const double rms = x.pow(2).mean().sqrt().item<double>();
      x = x + torch::randn(x.sizes(), gen) * (noise * rms);
    }
    t = x.to(t.scalar_type()).contiguous();
  }
  return model::WriteSafetensors(path, contents->tensors, contents->metadata);
}

// Writes the family into `dir` (created): the fixture as the student, and in dir/teacher the
// fixture with every weight outside the vision tower multiplied by `teacher_scale`, so the
// two differ (1 = the teacher is the student's twin).
inline absl::Status WriteTinyFamily(const std::string& dir, double teacher_scale = 2.0) {
  const std::string fixture =
      std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/blip2_llama";
  std::error_code ec;
  std::filesystem::create_directories(dir + "/teacher", ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  for (const std::string& to : {dir, dir + "/teacher"}) {
    std::filesystem::copy(fixture, to,
                          std::filesystem::copy_options::recursive |
                              std::filesystem::copy_options::overwrite_existing,
                          ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot copy the fixture: ", ec.message()));
  }
  if (teacher_scale == 1.0) return absl::OkStatus();
  for (const char* prefix :
       {"qformer.", "query_tokens", "language_projection.", "language_model."}) {
    if (absl::Status s = PerturbWeights(dir + "/teacher", prefix, teacher_scale, 0.0); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_TINY_FAMILY_H_
