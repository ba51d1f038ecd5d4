// elementwise_check: on a CUDA GPU, the training forms of model/runtime/fused_ops.h (RMSNorm
// through at::rms_norm; the rotary embedding, the SwiGLU gate and the residual addition with
// its RMSNorm through cdcca's CUDA kernels where the build has them, model/runtime/cuda_kernels.h,
// else the rotary embedding's rolled form, LibTorch's silu and the addition then RMSNorm)
// against the plain formulas that transformers computes, at the
// LLaVA-1.5-7B student's shapes (8 x 648 rows of 4096, an MLP of 11008; 32 heads of 128).
//
//   - agreement: output and input gradients (and RMSNorm's weight gradient), fp32 and bf16,
//     within 1e-5 (fp32) and 1e-2 (bf16: a rounding moves between the weight's product and
//     the cast back) relative L2;
//   - speed: milliseconds of forward and backward, each form, and of each form's first call
//     (its kernels' loading included).
// Prints one line per figure and a JSON summary; exit 0 when every agreement holds, 1
// otherwise, 77 without a CUDA device.
//
//   elementwise_check [--rows 5184] [--repeats 20]
#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "model/bench/cuda_millis.h"
#include "model/runtime/fused_ops.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int64_t, rows, 8 * 648, "rows (batch x positions); a multiple of --positions");
ABSL_FLAG(int64_t, positions, 648, "positions per row of the rotary embedding's batch");
ABSL_FLAG(int, repeats, 20, "timed repeats of each form");

namespace cdcca::model {
namespace {

using Form = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

double RelL2(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor bd = b.to(torch::kDouble);
  return ((a.to(torch::kDouble) - bd).norm() / bd.norm().clamp_min(1e-30)).item<double>();
}

torch::Tensor PlainRmsNorm(const std::vector<torch::Tensor>& v) {
  torch::Tensor h = v[0].to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + 1e-5);
  return v[1] * h.to(v[0].scalar_type());
}

torch::Tensor PlainRotary(const std::vector<torch::Tensor>& v) {
  const torch::Tensor& x = v[0];
  const int64_t half = x.size(-1) / 2;
  torch::Tensor rotated = torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * v[1].unsqueeze(1) + rotated * v[2].unsqueeze(1);
}

// Output and gradients of `form` on copies of `inputs` (those that require a gradient get
// one) under the upstream gradient `g`.
std::vector<torch::Tensor> Run(const Form& form, const std::vector<torch::Tensor>& inputs,
                               const torch::Tensor& g) {
  std::vector<torch::Tensor> in;
  for (const torch::Tensor& t : inputs) {
    in.push_back(t.detach().clone().requires_grad_(t.requires_grad()));
  }
  torch::Tensor out = form(in);
  out.backward(g);
  std::vector<torch::Tensor> result{out.detach()};
  for (const torch::Tensor& t : in) {
    if (t.requires_grad()) result.push_back(t.grad());
  }
  return result;
}

int Main() {
  if (!torch::cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 77;
  }
  torch::manual_seed(0);
  const int64_t rows = absl::GetFlag(FLAGS_rows), positions = absl::GetFlag(FLAGS_positions);
  const int64_t batch = rows / positions, heads = 32, head_dim = 128, dim = heads * head_dim;
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  nlohmann::json summary = nlohmann::json::object();
  bool ok = true;
  struct Case {
    std::string name;
    Form ours, plain;
    std::vector<torch::Tensor> inputs;
    torch::Tensor grad;
  };
  for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
    const std::string dname = dtype == torch::kFloat ? "fp32" : "bf16";
    const double bound = dtype == torch::kFloat ? 1e-5 : 1e-2;
    const auto o = cuda.dtype(dtype);
    torch::Tensor angle = torch::rand({batch, positions, head_dim / 2}, cuda) * 6;
    std::vector<Case> cases;
    cases.push_back({"rms_norm",
                     [](const auto& v) { return RmsNorm(v[0], v[1], 1e-5); },
                     PlainRmsNorm,
                     {torch::randn({rows, dim}, o).requires_grad_(true),
                      (torch::rand({dim}, o) + 0.5).requires_grad_(true)},
                     torch::randn({rows, dim}, o)});
    cases.push_back(
        {"rotary",
         [](const auto& v) { return RotaryEmbedding(v[0], v[1], v[2]); },
         PlainRotary,
         {torch::randn({batch, positions, heads, head_dim}, o).transpose(1, 2).requires_grad_(true),
          torch::cat({angle, angle}, -1).cos().to(dtype),
          torch::cat({angle, angle}, -1).sin().to(dtype)},
         torch::randn({batch, heads, positions, head_dim}, o)});
    cases.push_back({"silu_mul",
                     [](const auto& v) { return SiluMul(v[0], v[1]); },
                     [](const auto& v) { return torch::silu(v[0]) * v[1]; },
                     {torch::randn({rows, 11008}, o).requires_grad_(true),
                      torch::randn({rows, 11008}, o).requires_grad_(true)},
                     torch::randn({rows, 11008}, o)});
    // A decoder layer's residual addition and the RMSNorm of its result, both outputs (h, y)
    // stacked so that the gradient reaches each: one pass each way against the addition and
    // the RMSNorm formula.
    cases.push_back({"add_rms_norm",
                     [](const auto& v) {
                       auto [h, y] = AddRmsNorm(v[0], v[1], v[2], 1e-5);
                       return torch::stack({h, y});
                     },
                     [](const auto& v) {
                       const torch::Tensor h = v[0] + v[1];
                       return torch::stack({h, PlainRmsNorm({h, v[2]})});
                     },
                     {torch::randn({rows, dim}, o).requires_grad_(true),
                      torch::randn({rows, dim}, o).requires_grad_(true),
                      (torch::rand({dim}, o) + 0.5).requires_grad_(true)},
                     torch::randn({2, rows, dim}, o)});
    for (const Case& c : cases) {
      // The first call of each form, its kernels' loading included.
      const double ours_first = CudaMillis([&] { Run(c.ours, c.inputs, c.grad); }, 1, 0),
                   plain_first = CudaMillis([&] { Run(c.plain, c.inputs, c.grad); }, 1, 0);
      const std::vector<torch::Tensor> a = Run(c.ours, c.inputs, c.grad),
                                       b = Run(c.plain, c.inputs, c.grad);
      nlohmann::json entry;
      entry["ours_first_call_ms"] = ours_first;
      entry["plain_first_call_ms"] = plain_first;
      std::printf("%s %s: first call %.1f ms against the plain formula's %.1f ms\n", c.name.c_str(),
                  dname.c_str(), ours_first, plain_first);
      for (size_t i = 0; i < a.size(); ++i) {
        const double e = RelL2(a[i], b[i]);
        ok = ok && e <= bound;
        entry[i == 0 ? "output_rel_l2" : "grad" + std::to_string(i - 1) + "_rel_l2"] = e;
        std::printf("%s %s %s: rel L2 %.2e (bound %.0e)\n", c.name.c_str(), dname.c_str(),
                    i == 0 ? "output" : ("gradient " + std::to_string(i - 1)).c_str(), e, bound);
      }
      const int repeats = absl::GetFlag(FLAGS_repeats);
      const double ours_ms = CudaMillis([&] { c.ours(c.inputs).backward(c.grad); }, repeats),
                   plain_ms = CudaMillis([&] { c.plain(c.inputs).backward(c.grad); }, repeats);
      entry["ours_ms"] = ours_ms;
      entry["plain_ms"] = plain_ms;
      std::printf("%s %s: forward and backward %.3f ms against the plain formula's %.3f ms\n",
                  c.name.c_str(), dname.c_str(), ours_ms, plain_ms);
      summary[c.name + "_" + dname] = entry;
    }
  }
  summary["rows"] = rows;
  summary["device"] = "cuda";
  summary["ok"] = ok;
  std::printf("%s\n", summary.dump().c_str());
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace cdcca::model

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cdcca::model::Main();
}
