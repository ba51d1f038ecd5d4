// fp8_product_check: on a CUDA GPU that runs FP8 products (compute capability 8.9+), the
// native FP8 product of model/runtime/fp8_product.h against its emulation (the CPU's path: the
// same rounding, fp32 products), and its speed against the bf16 product it replaces in a
// trainer's step, at the LLaVA-1.5-7B student's shapes.
//
//   - agreement: the forward product and the gradient of its input, native against emulated,
//     fp32 and bf16 inputs, a batch whose rows are not a multiple of 16 (the padded path) and
//     one at the 7B shape; within 1e-3 (fp32) and 1e-2 (bf16: the output's rounding) relative
//     L2. The fp32 bound is not fp32's rounding: the first run, at 1e-5, measured 1.3e-4 on an
//     H100 at both shapes, the tensor cores' FP8 accumulation (which keeps fewer bits than an
//     fp32 sum) against the emulation's fp32 sums. The FP8 product's difference from the plain
//     product is printed beside it (the rounding's size, not a bound).
//   - rounding: the native path's rounding (cdcca's kernel where it is built) against the same
//     formula through LibTorch on the CPU, every value and scale equal; and where the
//     emulation's rounding differs (printed, not a bound).
//   - speed: milliseconds of the forward product and of the input's gradient (the frozen
//     base's two products in a step), bf16 (torch::linear) against FP8 (Fp8Linear, its
//     rounding of the input included), rows = 8 x 648 (batch 8 of the AKD benchmark); and the
//     forward's parts: the input's rounding (the kernel, and LibTorch's passes of the same
//     formula) and the GEMM alone.
// Prints one line per figure and a JSON summary; exit 0 when every agreement holds, 1
// otherwise, 77 where there is no CUDA device or it cannot run the native product.
//
//   fp8_product_check [--rows 5184] [--repeats 20]
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "model/bench/cuda_millis.h"
#include "model/runtime/fp8_product.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int64_t, rows, 8 * 648, "rows of the timed products (batch x positions)");
ABSL_FLAG(int, repeats, 20, "timed repeats of each product");

namespace cdcca::model {
namespace {

double RelL2(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor bd = b.to(torch::kDouble);
  return ((a.to(torch::kDouble) - bd).norm() / bd.norm().clamp_min(1e-30)).item<double>();
}

Fp8Weight Emulated(const torch::Tensor& w) {
  Fp8Weight e;
  e.w = QuantizeRowsE4m3(w, /*native=*/false);
  e.wt = QuantizeRowsE4m3(w.t(), /*native=*/false);
  e.native = false;
  return e;
}

// The FP8 forward product's parts, milliseconds: the input's rounding (cdcca's kernel, and
// LibTorch's passes of the same formula), and the GEMM alone on rounded operands, with the
// tensor cores' fast accumulation off (what Fp8Linear runs) and on. Zeros where this LibTorch
// has no FP8 product (the program stops before timing there).
struct ForwardParts {
  double rounding = 0, rounding_passes = 0, gemm = 0, gemm_fast = 0;
};

ForwardParts TimeForwardParts(const torch::Tensor& x, const Fp8Weight& f, int repeats) {
  ForwardParts parts;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5)
  parts.rounding = CudaMillis([&] { return QuantizeRowsE4m3(x, true).values; }, repeats);
  parts.rounding_passes = CudaMillis(
      [&] {
        const torch::Tensor scales =
            x.abs().amax(1).to(torch::kFloat).clamp_min(1e-12 * kE4m3Max) / kE4m3Max;
        return (x.to(torch::kFloat) / scales.unsqueeze(1)).to(torch::kFloat8_e4m3fn);
      },
      repeats);
  const Fp8Rows xq = QuantizeRowsE4m3(x, true);
  const torch::Tensor sa = xq.scales.unsqueeze(1).contiguous();
  const torch::Tensor sb = f.w.scales.unsqueeze(0).contiguous();
  for (bool fast : {false, true}) {
    (fast ? parts.gemm_fast : parts.gemm) = CudaMillis(
        [&] {
          return at::_scaled_mm(xq.values, f.w.values.t(), sa, sb, std::nullopt, std::nullopt,
                                torch::kBFloat16, /*use_fast_accum=*/fast);
        },
        repeats);
  }
#else
  (void)x;
  (void)f;
  (void)repeats;
#endif
  return parts;
}

int Run() {
  if (!torch::cuda::is_available()) {
    std::printf("fp8_product_check: no CUDA device\n");
    return 77;
  }
  const torch::Device cuda(torch::kCUDA, 0);
  if (!NativeFp8Available(cuda)) {
    std::printf("fp8_product_check: this GPU or LibTorch runs no native FP8 product\n");
    return 77;
  }
  torch::manual_seed(0);
  nlohmann::json summary = {{"agreement", nlohmann::json::array()},
                            {"rounding", nlohmann::json::array()},
                            {"speed", nlohmann::json::array()}};
  bool ok = true;
  struct Shape {
    int64_t rows, in, out;
  };
  for (const Shape& s : std::vector<Shape>{{1000, 512, 768}, {5184, 4096, 4096}}) {
    for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
      const auto options = torch::TensorOptions().device(cuda).dtype(dtype);
      const torch::Tensor w = (torch::randn({s.out, s.in}, options) / std::sqrt(s.in));
      const Fp8Weight native = MakeFp8Weight(w.to(torch::kFloat));
      if (!native.native) {
        std::printf("fp8_product_check: [%lld, %lld] did not take the native product\n",
                    static_cast<long long>(s.out), static_cast<long long>(s.in));
        return 1;
      }
      const Fp8Weight emulated = Emulated(w.to(torch::kFloat));
      const torch::Tensor x = torch::randn({s.rows, s.in}, options);
      const torch::Tensor g = torch::randn({s.rows, s.out}, options);
      torch::Tensor xn = x.clone().requires_grad_(true), xe = x.clone().requires_grad_(true);
      const torch::Tensor yn = Fp8Linear(xn, native), ye = Fp8Linear(xe, emulated);
      yn.backward(g);
      ye.backward(g);
      const torch::Tensor plain = torch::matmul(x.to(torch::kFloat), w.to(torch::kFloat).t());
      const torch::Tensor plain_dx = torch::matmul(g.to(torch::kFloat), w.to(torch::kFloat));
      const double bound = dtype == torch::kFloat ? 1e-3 : 1e-2;
      const double fwd = RelL2(yn, ye), bwd = RelL2(xn.grad(), xe.grad());
      const bool within = fwd <= bound && bwd <= bound;
      ok = ok && within;
      const std::string name = torch::toString(dtype);
      std::printf(
          "%s [%lld x %lld] -> %lld: native vs emulated forward %.2e, input gradient %.2e "
          "(bound %.0e) %s; FP8 vs plain %.2e / %.2e\n",
          name.c_str(), static_cast<long long>(s.rows), static_cast<long long>(s.in),
          static_cast<long long>(s.out), fwd, bwd, bound, within ? "ok" : "FAIL", RelL2(yn, plain),
          RelL2(xn.grad(), plain_dx));
      summary["agreement"].push_back({{"dtype", name},
                                      {"rows", s.rows},
                                      {"in", s.in},
                                      {"out", s.out},
                                      {"native_vs_emulated_forward", fwd},
                                      {"native_vs_emulated_input_gradient", bwd},
                                      {"bound", bound},
                                      {"fp8_vs_plain_forward", RelL2(yn, plain)},
                                      {"fp8_vs_plain_input_gradient", RelL2(xn.grad(), plain_dx)},
                                      {"ok", within}});
    }
  }

  // The rounding alone: the native path's on the GPU (cdcca's kernel) against the same formula
  // through LibTorch on the CPU (its float8_e4m3fn cast), value for value and scale for scale,
  // bf16 and fp32 rows of the 7B shapes, one row count not a multiple of 16; and how many values
  // the emulation's rounding (RoundToE4m3, the CPU's products) puts elsewhere.
  for (const Shape& s : std::vector<Shape>{{1000, 4096, 0}, {5184, 11008, 0}}) {
    for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
      const auto options = torch::TensorOptions().device(cuda).dtype(dtype);
      const torch::Tensor m =
          torch::randn({s.rows, s.in}, options) * torch::rand({s.rows, 1}, options) * 100;
      const Fp8Rows native = QuantizeRowsE4m3(m, /*native=*/true);
      const Fp8Rows cpu = QuantizeRowsE4m3(m.cpu(), /*native=*/true);
      const Fp8Rows emulated = QuantizeRowsE4m3(m.cpu(), /*native=*/false);
      const torch::Tensor nv = native.values.to(torch::kFloat).cpu();
      const int64_t values_differ = nv.ne(cpu.values.to(torch::kFloat)).sum().item<int64_t>();
      const int64_t scales_differ = native.scales.cpu().ne(cpu.scales).sum().item<int64_t>();
      const int64_t emulation_differs =
          nv.ne(emulated.values.to(torch::kFloat)).sum().item<int64_t>();
      const bool same = values_differ == 0 && scales_differ == 0;
      ok = ok && same;
      const std::string name = torch::toString(dtype);
      std::printf(
          "rounding %s [%lld x %lld]: values differing %lld, scales differing %lld %s; the "
          "emulation's rounding differs at %lld\n",
          name.c_str(), static_cast<long long>(s.rows), static_cast<long long>(s.in),
          static_cast<long long>(values_differ), static_cast<long long>(scales_differ),
          same ? "ok" : "FAIL", static_cast<long long>(emulation_differs));
      summary["rounding"].push_back({{"dtype", name},
                                     {"rows", s.rows},
                                     {"cols", s.in},
                                     {"values_differing", values_differ},
                                     {"scales_differing", scales_differ},
                                     {"emulation_differing", emulation_differs},
                                     {"ok", same}});
    }
  }

  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  double bf16_total = 0, fp8_total = 0;
  // The 7B student's products per layer: q, k, v, o (4096 -> 4096), gate and up (4096 ->
  // 11008), down (11008 -> 4096).
  struct Product {
    const char* name;
    int64_t in, out, per_layer;
  };
  for (const Product& p : std::vector<Product>{{"attention 4096->4096", 4096, 4096, 4},
                                               {"gate/up 4096->11008", 4096, 11008, 2},
                                               {"down 11008->4096", 11008, 4096, 1}}) {
    const auto options = torch::TensorOptions().device(cuda).dtype(torch::kBFloat16);
    const torch::Tensor w = torch::randn({p.out, p.in}, options) / std::sqrt(p.in);
    const Fp8Weight f = MakeFp8Weight(w.to(torch::kFloat));
    const torch::Tensor x = torch::randn({rows, p.in}, options);
    const torch::Tensor g = torch::randn({rows, p.out}, options);
    const double bf16_fwd = CudaMillis([&] { return torch::linear(x, w); }, repeats);
    const double bf16_bwd = CudaMillis([&] { return torch::matmul(g, w); }, repeats);
    // The FP8 backward as autograd runs it: the gradient's rounding and its product.
    torch::NoGradGuard no_grad;
    const double fp8_fwd = CudaMillis([&] { return Fp8Linear(x, f); }, repeats);
    const Fp8Weight transposed{f.wt, f.w, f.native};
    const double fp8_bwd = CudaMillis([&] { return Fp8Linear(g, transposed); }, repeats);
    bf16_total += p.per_layer * (bf16_fwd + bf16_bwd);
    fp8_total += p.per_layer * (fp8_fwd + fp8_bwd);
    const ForwardParts parts = TimeForwardParts(x, f, repeats);
    std::printf(
        "%s, %lld rows: forward bf16 %.3f ms, FP8 %.3f ms (%.2fx); input gradient bf16 "
        "%.3f ms, FP8 %.3f ms (%.2fx); the forward's parts: rounding %.3f ms (LibTorch's "
        "passes %.3f), GEMM %.3f ms (fast accumulation %.3f)\n",
        p.name, static_cast<long long>(rows), bf16_fwd, fp8_fwd, bf16_fwd / fp8_fwd, bf16_bwd,
        fp8_bwd, bf16_bwd / fp8_bwd, parts.rounding, parts.rounding_passes, parts.gemm,
        parts.gemm_fast);
    summary["speed"].push_back({{"product", p.name},
                                {"rows", rows},
                                {"bf16_forward_ms", bf16_fwd},
                                {"fp8_forward_ms", fp8_fwd},
                                {"bf16_input_gradient_ms", bf16_bwd},
                                {"fp8_input_gradient_ms", fp8_bwd},
                                {"rounding_kernel_ms", parts.rounding},
                                {"rounding_libtorch_passes_ms", parts.rounding_passes},
                                {"fp8_gemm_ms", parts.gemm},
                                {"fp8_gemm_fast_accumulation_ms", parts.gemm_fast}});
  }
  std::printf(
      "one layer's base products, forward and input gradient: bf16 %.2f ms, FP8 %.2f ms "
      "(%.2fx)\n",
      bf16_total, fp8_total, bf16_total / fp8_total);
  summary["layer_bf16_ms"] = bf16_total;
  summary["layer_fp8_ms"] = fp8_total;
  summary["device"] = "cuda";
  summary["ok"] = ok;
  std::printf("%s\n", summary.dump().c_str());
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace cdcca::model

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cdcca::model::Run();
}
