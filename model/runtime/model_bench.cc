// model_bench: student answer latency and tokens/s on CPU (batch 1, greedy, KV cache) for
// fp32 / int8 / int4 bases (int8/int4 held packed, hf_linear.h), plus resident memory. Each
// configuration runs in its own forked process so its RSS is its own.
//
//   model_bench --config configs/models/small.json            # random weights
//   model_bench --checkpoint models/small                     # trained weights
//   model_bench --threads 2 --tokens 8 --iters 200
#include <malloc.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "model/family/blip2_tower.h"
#include "model/family/checkpoint.h"
#include "model/family/config.h"
#include "model/family/vision_encoder.h"

ABSL_FLAG(std::string, config, "configs/models/small.json", "family config (random weights)");
ABSL_FLAG(std::string, checkpoint, "", "checkpoint directory (overrides --config)");
ABSL_FLAG(int, threads, 1, "torch intra-op threads");
ABSL_FLAG(int, tokens, 8, "answer tokens generated per call (EOS ignored)");
ABSL_FLAG(int, prompt, 10, "prompt tokens");
ABSL_FLAG(int, iters, 100, "timed answers per configuration");

namespace cdcca::model {
namespace {

long StatusKb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(k, 0) == 0) return std::stol(line.substr(k.size()));
  }
  return -1;
}

int RunOne(Precision precision) {
  torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
  const long rss_start = StatusKb("VmRSS");
  VisionEncoder encoder{nullptr};
  Blip2Tower student{nullptr};
  {
    Blip2Tower fp32{nullptr};
    if (!absl::GetFlag(FLAGS_checkpoint).empty()) {
      absl::StatusOr<FamilyCheckpoint> ck = LoadFamily(absl::GetFlag(FLAGS_checkpoint), precision);
      if (!ck.ok()) {
        std::fprintf(stderr, "%s\n", std::string(ck.status().message()).c_str());
        return 1;
      }
      encoder = ck->encoder;
      student = ck->student;
    } else {
      absl::StatusOr<FamilyConfig> fc = LoadFamilyConfig(absl::GetFlag(FLAGS_config));
      if (!fc.ok()) {
        std::fprintf(stderr, "%s\n", std::string(fc.status().message()).c_str());
        return 1;
      }
      encoder = VisionEncoder(fc->vision);
      fp32 = Blip2Tower(fc->student);
      absl::StatusOr<Blip2Tower> q = ConvertPrecision(fp32, precision);
      if (!q.ok()) return 1;
      student = *q;
    }
  }
  malloc_trim(0);  // give the fp32 staging copy back before measuring
  encoder->eval();
  student->eval();
  const TowerConfig& c = student->config();
  torch::Tensor image =
      torch::rand({1, 3, encoder->config().image_size, encoder->config().image_size});
  torch::Tensor prompt =
      torch::randint(4, c.vocab_size, {1, absl::GetFlag(FLAGS_prompt)}, torch::kLong);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  auto answer = [&] {
    torch::Tensor vis = encoder->forward(image);
    return student->Generate(vis, torch::Tensor(), prompt, torch::Tensor(), tokens, -1);
  };
  for (int i = 0; i < 10; ++i) answer();  // warm-up
  using Clock = std::chrono::steady_clock;
  std::vector<double> ms, enc_ms;
  const int iters = absl::GetFlag(FLAGS_iters);
  for (int i = 0; i < iters; ++i) {
    auto t0 = Clock::now();
    torch::Tensor vis = encoder->forward(image);
    auto t1 = Clock::now();
    student->Generate(vis, torch::Tensor(), prompt, torch::Tensor(), tokens, -1);
    auto t2 = Clock::now();
    enc_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    ms.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  double mean = 0, enc = 0;
  for (double v : ms) mean += v / iters;
  for (double v : enc_ms) enc += v / iters;
  const double gen = mean - enc;
  std::printf("%-5s %9.2f %9.2f %9.2f %9.2f %10.1f %10.1f %9.1f %9.1f\n",
              std::string(PrecisionName(precision)).c_str(), mean, ms[ms.size() / 2],
              ms[ms.size() * 9 / 10], enc, tokens / (gen / 1000.0),
              LinearBaseBytes(student) / 1024.0, (StatusKb("VmRSS") - rss_start) / 1024.0,
              StatusKb("VmRSS") / 1024.0);
  return 0;
}

}  // namespace
}  // namespace cdcca::model

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using cdcca::model::Precision;
  std::printf(
      "student answer latency, batch 1, greedy, %d prompt + %d answer tokens, %d thread(s)\n",
      absl::GetFlag(FLAGS_prompt), absl::GetFlag(FLAGS_tokens), absl::GetFlag(FLAGS_threads));
  std::printf("%-5s %9s %9s %9s %9s %10s %10s %9s %9s\n", "base", "mean_ms", "p50_ms", "p90_ms",
              "enc_ms", "tok/s_gen", "base_KiB", "dRSS_MiB", "RSS_MiB");
  std::fflush(stdout);
  const Precision runs[] = {Precision::kFp32, Precision::kInt8, Precision::kInt4};
  int rc = 0;
  for (Precision p : runs) {
    // A child per configuration: its RSS is not inflated by the previous one.
    pid_t pid = fork();
    if (pid == 0) {
      int r = cdcca::model::RunOne(p);
      std::fflush(stdout);
      _exit(r);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
  }
  return rc;
}
