// decode_bench: cdcca's speed and memory on a Hugging Face model folder. Loads the folder, feeds
// the inputs scripts/hf_bench_shapes.py saved beside the weights (bench_inputs.safetensors:
// input_ids after image-token expansion, pixel_values, and for InstructBLIP qformer_input_ids), and
// times greedy generation as that script times transformers: time to first token = a generation of
// one token, decode tokens/s = (N - 1) / (time of N tokens - time of one), medians over --repeats
// pairs of runs after a warm-up pair, with no early stop at eos. Prints one JSON line.
//
//   decode_bench --model DIR [--device cuda|cpu] [--precision bf16|fp32|int8|int4]
//            [--new_tokens 64] [--repeats 3] [--paths static,reference] [--torch_threads N]
//            [--uts_mc_passes 4,8,16] [--weight_pack use|write|ignore] [--load_only]
// --uts_mc_passes (the setting of that name, docs/SETTINGS.md, here a list of values to time)
// adds "uts_stage2": per M, the median time of MultimodalModel::StochasticVisualTokens (M
// passes as one batch, dropout 0.1), the visual tokens it scores, and the peak GPU memory of
// those calls.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/safetensors.h"
#include "model/runtime/gpu_memory.h"
#include "model/runtime/static_decode.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "Hugging Face model folder");
ABSL_FLAG(std::string, inputs, "", "inputs file (default: <model>/bench_inputs.safetensors)");
ABSL_FLAG(std::string, device, "cuda", "cuda or cpu");
ABSL_FLAG(std::string, precision, "bf16", "fp32, bf16, fp16, int8 or int4");
ABSL_FLAG(int, new_tokens, 64, "tokens generated per timed answer");
ABSL_FLAG(int, repeats, 3, "timed runs per measurement (after one warm-up)");
ABSL_FLAG(std::string, paths, "static,reference",
          "decode loops to time: static (the default on CUDA), reference");
ABSL_FLAG(std::string, weight_pack, "use",
          "the folder's weight pack at int8/int4 (cdcca pack): use (where one is there), write "
          "(use, else write one), ignore (quantize at load)");
ABSL_FLAG(bool, load_only, false,
          "print the load's figures and stop (with --weight_pack write: write the pack)");
ABSL_FLAG(int, torch_threads, 0, "torch intra-op threads (0 = LibTorch's default)");
ABSL_FLAG(std::string, uts_mc_passes, "",
          "comma list of M (values of the setting uts_mc_passes): also time UTS stage 2 (M "
          "MC-dropout passes over the visual tokens, one batch, p = 0.1) against one answer's "
          "time to first token; empty = do not");

namespace cdcca::model {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// VmRSS / VmHWM of this process in bytes (0 where /proc is missing).
int64_t ProcStatusBytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  }
  return 0;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run() {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) {
    std::cerr << "decode_bench: --model is required\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_torch_threads) > 0)
    torch::set_num_threads(absl::GetFlag(FLAGS_torch_threads));
  torch::Device device(absl::GetFlag(FLAGS_device) == "cuda" ? torch::kCUDA : torch::kCPU, 0);
  if (device.is_cpu()) device = torch::Device(torch::kCPU);

  ModelOptions options;
  options.precision = absl::GetFlag(FLAGS_precision);
  options.device = device;
  const std::string pack = absl::GetFlag(FLAGS_weight_pack);
  using Use = ModelOptions::WeightPackUse;
  if (pack != "use" && pack != "write" && pack != "ignore") {
    std::cerr << "decode_bench: --weight_pack " << pack << ": not use, write or ignore\n";
    return 2;
  }
  options.weight_pack = pack == "use" ? Use::kUse : pack == "write" ? Use::kWrite : Use::kIgnore;
  ModelOptions::WeightPackReport pack_report;
  options.weight_pack_report = &pack_report;
  const auto load_start = Clock::now();
  absl::StatusOr<std::unique_ptr<MultimodalModel>> model = LoadModel(dir, options);
  if (!model.ok()) {
    std::cerr << "decode_bench: " << model.status() << "\n";
    return 1;
  }
  if (device.is_cuda()) torch::cuda::synchronize();
  const double load_s = std::chrono::duration<double>(Clock::now() - load_start).count();

  const json pack_json = {{"read", pack_report.read},
                          {"read_tensors", pack_report.read_tensors},
                          {"written", pack_report.written},
                          {"written_bytes", pack_report.written_bytes}};
  if (absl::GetFlag(FLAGS_load_only)) {
    std::cout << json{{"model", dir},
                      {"precision", options.precision},
                      {"device", device.str()},
                      {"load_s", load_s},
                      {"weight_pack", pack_json}}
                     .dump()
              << "\n";
    return 0;
  }
  std::string inputs_path = absl::GetFlag(FLAGS_inputs);
  if (inputs_path.empty()) inputs_path = dir + "/bench_inputs.safetensors";
  absl::StatusOr<SafetensorsContents> saved = ReadSafetensors(inputs_path);
  if (!saved.ok()) {
    std::cerr << "decode_bench: " << saved.status() << "\n";
    return 1;
  }
  std::map<std::string, torch::Tensor> named(saved->tensors.begin(), saved->tensors.end());
  MultimodalInputs in;
  in.input_ids = named["input_ids"];
  in.pixel_values = named["pixel_values"];  // the models cast to their dtype and device
  if (named.count("qformer_input_ids") != 0) {
    in.qformer_input_ids = named["qformer_input_ids"];
    in.qformer_attention_mask = torch::ones_like(in.qformer_input_ids);
  }

  const int new_tokens = absl::GetFlag(FLAGS_new_tokens);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  json row;
  row["model"] = dir;
  row["device"] = device.str();
  row["precision"] = options.precision;
  row["threads"] = torch::get_num_threads();
  row["cuda_graphs"] = CudaGraphsCompiledIn();
  row["load_s"] = load_s;
  row["weight_pack"] = pack_json;
  row["resident_weight_bytes"] = (*model)->ResidentBytes();
  row["lm_input_tokens"] = in.input_ids.size(1);
  row["new_tokens"] = new_tokens;

  // One generation of `n` tokens: seconds, and the tokens.
  auto generate = [&](GreedyOptions::DecodePath path, int n,
                      std::vector<int64_t>* tokens) -> absl::StatusOr<double> {
    GreedyOptions g;
    g.max_new_tokens = n;  // no eos ids: never stops early
    g.decode_path = path;
    if (device.is_cuda()) torch::cuda::synchronize();
    const auto start = Clock::now();
    absl::StatusOr<GreedyResult> r = (*model)->Generate(in, g);
    if (!r.ok()) return r.status();
    if (device.is_cuda()) torch::cuda::synchronize();
    if (tokens != nullptr) *tokens = r->tokens[0];
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  std::map<std::string, std::vector<int64_t>> produced;
  for (absl::string_view piece : absl::StrSplit(absl::GetFlag(FLAGS_paths), ',')) {
    const std::string name(piece);
    GreedyOptions::DecodePath path = name == "reference" ? GreedyOptions::DecodePath::kReference
                                                         : GreedyOptions::DecodePath::kStatic;
    // A 1-token and an N-token generation back to back, --repeats times after a warm-up
    // pair: TTFT = median 1-token time; decode = (N - 1) / median of the pairs' differences
    // (adjacent runs, so slow drifts in the prefill time cancel).
    std::vector<double> firsts, fulls, diffs;
    for (int i = 0; i < repeats + 1; ++i) {
      absl::StatusOr<double> one = generate(path, 1, nullptr);
      absl::StatusOr<double> all = one.ok() ? generate(path, new_tokens, &produced[name]) : one;
      if (!all.ok()) {
        std::cerr << "decode_bench: " << all.status() << "\n";
        return 1;
      }
      if (i == 0) continue;
      firsts.push_back(*one);
      fulls.push_back(*all);
      diffs.push_back(*all - *one);
    }
    row[name] = {{"ttft_ms", Median(firsts) * 1e3},
                 {"decode_tokens_per_s", (new_tokens - 1) / std::max(Median(diffs), 1e-9)},
                 {"total_ms", Median(fulls) * 1e3}};
  }
  if (produced.count("static") != 0 && produced.count("reference") != 0) {
    const std::vector<int64_t>& a = produced["static"];
    const std::vector<int64_t>& b = produced["reference"];
    size_t same = 0;
    while (same < a.size() && same < b.size() && a[same] == b[same]) ++same;
    row["static_reference_common_prefix"] = same;
  }
  if (!produced.empty()) row["tokens"] = produced.begin()->second;
  for (absl::string_view piece :
       absl::StrSplit(absl::GetFlag(FLAGS_uts_mc_passes), ',', absl::SkipEmpty())) {
    int passes = 0;
    if (!absl::SimpleAtoi(piece, &passes)) {
      std::cerr << "decode_bench: --uts_mc_passes: '" << piece << "' is not a number\n";
      return 1;
    }
    VisualTokenPassOptions o;
    o.passes = passes;
    std::vector<double> times;
    int64_t tokens = 0;
    for (int i = 0; i < repeats + 1; ++i) {
      o.seed = static_cast<uint64_t>(i);
      if (device.is_cuda()) torch::cuda::synchronize();
      const auto start = Clock::now();
      absl::StatusOr<VisualTokenPasses> p = (*model)->StochasticVisualTokens(in, o);
      if (device.is_cuda()) torch::cuda::synchronize();
      if (!p.ok()) {
        std::cerr << "decode_bench: " << p.status() << "\n";
        return 1;
      }
      tokens = p->variance.size(0);
      if (i > 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    row["uts_stage2"][std::string(piece)] = {{"ms", Median(times) * 1e3},
                                             {"visual_tokens", tokens}};
  }
  row["peak_gpu_allocated_bytes"] = PeakGpuMemory(device).allocated_bytes;
  row["rss_bytes"] = ProcStatusBytes("VmRSS");
  row["peak_rss_bytes"] = ProcStatusBytes("VmHWM");
  std::cout << row.dump() << std::endl;
  return 0;
}

}  // namespace
}  // namespace cdcca::model

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  try {
    return cdcca::model::Run();
  } catch (const c10::Error& e) {
    std::cerr << "decode_bench: " << e.what_without_backtrace() << "\n";
    return 1;
  }
}
