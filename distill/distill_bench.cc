// distill_bench: AKD (or any learner's) training throughput, samples/s, on random weights
// of a model family and random uplinked samples shaped like UTS output (half the visual
// tokens kept). Uses CUDA when available unless --cuda=false.
//
//   distill_bench --config=configs/models/small.json --learner=akd --steps=20 --batch=16
#include <torch/torch.h>

#include <cstdio>
#include <random>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "distill/akd.h"
#include "distill/learner.h"
#include "model/family/config.h"

ABSL_FLAG(std::string, config, "configs/models/small.json", "model family config");
ABSL_FLAG(std::string, learner, "akd", "akd, pl, pkd, cwd, tent or cotta");
ABSL_FLAG(int, steps, 20, "training steps to time");
ABSL_FLAG(int, batch, 16, "batch size");
ABSL_FLAG(int, samples, 64, "uplinked samples in the job");
ABSL_FLAG(int, threads, 0, "torch threads (0 = all cores)");
ABSL_FLAG(bool, cuda, true, "train on CUDA when available");
ABSL_FLAG(double, keep, 0.5, "share of visual tokens kept per sample");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<cdcca::model::FamilyConfig> family =
      cdcca::model::LoadFamilyConfig(absl::GetFlag(FLAGS_config));
  if (!family.ok()) {
    std::fprintf(stderr, "%s\n", std::string(family.status().message()).c_str());
    return 1;
  }
  torch::manual_seed(0);
  cdcca::model::Blip2Tower teacher(family->teacher);
  cdcca::model::Blip2Tower student(family->student);
  const bool cuda = absl::GetFlag(FLAGS_cuda) && torch::cuda::is_available();
  if (cuda) teacher->to(torch::kCUDA);

  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<double> uniform;
  const int tokens = family->vision.NumTokens(), dim = family->vision.d_vis;
  std::vector<cdcca::compress::UplinkSample> samples(absl::GetFlag(FLAGS_samples));
  for (size_t i = 0; i < samples.size(); ++i) {
    auto& s = samples[i];
    s.sample_id = i;
    s.grid_tokens = tokens;
    s.feature_dim = dim;
    for (int k = 0; k < tokens; ++k) {
      if (uniform(rng) < absl::GetFlag(FLAGS_keep)) s.kept_indices.push_back(k);
    }
    for (size_t k = 0; k < s.kept_indices.size() * dim; ++k) s.features.push_back(normal(rng));
    s.prompt_tokens.push_back(1);
    for (int k = 0; k < 7; ++k) s.prompt_tokens.push_back(4 + rng() % (family->vocab_size - 4));
  }
  auto learner = cdcca::distill::MakeLearner(absl::GetFlag(FLAGS_learner), teacher);
  if (!learner.ok()) {
    std::fprintf(stderr, "%s\n", std::string(learner.status().message()).c_str());
    return 1;
  }
  cdcca::distill::JobOptions o;
  o.max_steps = absl::GetFlag(FLAGS_steps);
  o.batch_size = absl::GetFlag(FLAGS_batch);
  o.num_threads = absl::GetFlag(FLAGS_threads);
  o.use_cuda = cuda;
  // One warm-up step (allocator, first-touch), then the timed job.
  cdcca::distill::JobOptions warm = o;
  warm.max_steps = 1;
  if (auto r = (*learner)->Run(samples, nullptr, student, warm); !r.ok()) {
    std::fprintf(stderr, "%s\n", std::string(r.status().message()).c_str());
    return 1;
  }
  auto r = (*learner)->Run(samples, nullptr, student, o);
  if (!r.ok()) {
    std::fprintf(stderr, "%s\n", std::string(r.status().message()).c_str());
    return 1;
  }
  const auto& st = r->stats;
  std::printf(
      "learner=%s config=%s device=%s threads=%d batch=%d steps=%d samples=%zu\n"
      "prepare (teacher pass + projection fit): %.2f s for %zu samples (%.1f samples/s)\n"
      "training: %.2f s, %.1f samples/s, %.3f s/step\n",
      (*learner)->name().c_str(), family->name.c_str(), st.device.c_str(), torch::get_num_threads(),
      o.batch_size, st.steps, samples.size(), st.prepare_seconds, samples.size(),
      samples.size() / st.prepare_seconds, st.train_seconds, st.samples_per_second,
      st.train_seconds / st.steps);
  for (const auto& t : st.terms) {
    std::printf("  %-8s first %.4f last %.4f\n", t.name.c_str(), t.first, t.last);
  }
  return 0;
}
