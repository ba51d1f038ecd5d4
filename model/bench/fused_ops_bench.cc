// fused_ops_bench: forward + backward time of each fused kernel of fused_ops.h against the
// plain LibTorch formula it replaces, at the shapes of the small teacher's training step
// (~2,000 rows of 160 features, SwiGLU width 432, 5 heads of 32), and the same with glibc's
// malloc told to keep freed memory (threads.h, KeepFreedMemory), as `cdcca pretrain` does.
// Each configuration runs in a forked process so the allocator setting is its own.
//
//   fused_ops_bench                       # 1 intra-op thread, 50 timed repetitions
//   fused_ops_bench --threads 2 --reps 200
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "model/runtime/fused_ops.h"
#include "model/runtime/threads.h"

ABSL_FLAG(int, threads, 1, "torch intra-op threads");
ABSL_FLAG(int, reps, 50, "timed repetitions per kernel (after 20 warm-up ones)");

namespace cdcca::model {
namespace {

double Milliseconds(const std::function<void()>& f) {
  const int reps = absl::GetFlag(FLAGS_reps);
  for (int i = 0; i < 20; ++i) f();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3 / reps;
}

void Row(const char* name, const std::function<void()>& fused, const std::function<void()>& plain) {
  const double f = Milliseconds(fused), p = Milliseconds(plain);
  std::printf("  %-34s %8.3f ms %8.3f ms %6.2fx\n", name, f, p, p / f);
}

void RunAll(bool keep_freed) {
  torch::set_num_threads(absl::GetFlag(FLAGS_threads));
  if (keep_freed && !KeepFreedMemory()) std::printf("  (KeepFreedMemory unavailable)\n");
  std::printf("malloc %s, %d intra-op thread(s); forward + backward, fused / plain / ratio\n",
              keep_freed ? "keeps freed memory" : "default", torch::get_num_threads());
  torch::manual_seed(0);

  torch::Tensor gate = torch::randn({2000, 432}).requires_grad_(true);
  torch::Tensor up = torch::randn({2000, 432}).requires_grad_(true);
  torch::Tensor grad_mlp = torch::randn({2000, 432});
  Row(
      "SiluMul [2000, 432]", [&] { SiluMul(gate, up).backward(grad_mlp); },
      [&] { (torch::silu(gate) * up).backward(grad_mlp); });

  torch::Tensor x = torch::randn({2000, 160}).requires_grad_(true);
  torch::Tensor w = torch::rand({160}).requires_grad_(true);
  torch::Tensor grad_x = torch::randn({2000, 160});
  Row(
      "RmsNorm [2000, 160]", [&] { RmsNorm(x, w, 1e-6).backward(grad_x); },
      [&] {
        torch::Tensor h = x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);
        (w * h).backward(grad_x);
      });
  Row(
      "TrainingDropout p=0.1 [2000, 160]", [&] { TrainingDropout(x, 0.1).backward(grad_x); },
      [&] { torch::dropout(x, 0.1, /*train=*/true).backward(grad_x); });

  // Queries as the attention produces them: [B, T, H, D] viewed as [B, H, T, D].
  torch::Tensor q = torch::randn({130, 12, 5, 32}).transpose(1, 2).requires_grad_(true);
  torch::Tensor cos = torch::randn({130, 12, 32}), sin = torch::randn({130, 12, 32});
  torch::Tensor grad_q = torch::randn({130, 5, 12, 32});
  Row(
      "RotaryEmbedding [130, 5, 12, 32]", [&] { RotaryEmbedding(q, cos, sin).backward(grad_q); },
      [&] {
        torch::Tensor rotated = torch::cat({-q.narrow(-1, 16, 16), q.narrow(-1, 0, 16)}, -1);
        (q * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).backward(grad_q);
      });
}

int Main() {
  for (bool keep_freed : {false, true}) {
    std::fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
      RunAll(keep_freed);
      std::fflush(stdout);
      _exit(0);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "fused_ops_bench: a configuration failed\n");
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace cdcca::model

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cdcca::model::Main();
}
