// compress_bench: DWC throughput and rate/error on a realistic synthetic trainable set.
//   build-*/compress/compress_bench [--reps N] [--layout small|llava-7b]
// --layout small (default): the `small` student's set. llava-7b: the paper's set on a
// LLaVA-1.5-7B-shaped student: LoRA rank 8 on q and v of 32 layers of 4096, both
// RMSNorms of every layer and the final one, and the projector's two biases.
// Prints encode MB/s, decode+apply MB/s against memcpy of the same fp32 bytes, and a table
// of bits/parameter vs relative reconstruction error for DWC at several budgets and for
// uniform 8-, 4- and 2-bit and BitDelta-style 1-bit (sign + one scale per tensor).
// MB/s are of the fp32 trainable set (4 bytes per parameter), 1 MB = 1e6 bytes.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "compress/apply.h"
#include "compress/delta_encoder.h"
#include "compress/tensor_view.h"

namespace cdcca::compress {
namespace {

struct Set {
  std::vector<std::vector<float>> buffers;
  std::vector<TensorView> views;
  uint64_t params = 0;
};

// Shaped like the student's trainable set: per LM layer (d = 512, 12 layers) two RMSNorm
// weights, q/v biases, LoRA rank 8 on q, v, gate, up, down, a 10-token adapter prompt and
// its gate; 32 x 512 query tokens; a 6-layer Q-Former (d = 256) with LoRA q/v and norms.
void AddLayout(std::vector<std::pair<std::string, std::vector<int64_t>>>* l) {
  const int64_t d = 512, ff = 2048, r = 8, dq = 256;
  for (int i = 0; i < 12; ++i) {
    const std::string p = "lm.layers." + std::to_string(i) + ".";
    l->push_back({p + "attn_norm.weight", {d}});
    l->push_back({p + "mlp_norm.weight", {d}});
    l->push_back({p + "attn.q.bias", {d}});
    l->push_back({p + "attn.v.bias", {d}});
    for (const char* m : {"attn.q", "attn.v"}) {
      l->push_back({p + m + ".lora_A", {r, d}});
      l->push_back({p + m + ".lora_B", {d, r}});
    }
    for (const char* m : {"mlp.gate", "mlp.up"}) {
      l->push_back({p + m + ".lora_A", {r, d}});
      l->push_back({p + m + ".lora_B", {ff, r}});
    }
    l->push_back({p + "mlp.down.lora_A", {r, ff}});
    l->push_back({p + "mlp.down.lora_B", {d, r}});
    l->push_back({p + "adapter.prompt", {10, d}});
    l->push_back({p + "adapter.gate", {1}});
  }
  l->push_back({"qformer.query_tokens", {32, d}});
  for (int i = 0; i < 6; ++i) {
    const std::string p = "qformer.layers." + std::to_string(i) + ".";
    l->push_back({p + "norm.weight", {dq}});
    for (const char* m : {"attn.q", "attn.v"}) {
      l->push_back({p + m + ".lora_A", {r, dq}});
      l->push_back({p + m + ".lora_B", {dq, r}});
    }
  }
  l->push_back({"lm.final_norm.weight", {d}});
}

// The LLaVA-1.5-7B student's trainable set on Hugging Face names.
void AddLlava7bLayout(std::vector<std::pair<std::string, std::vector<int64_t>>>* l) {
  const int64_t d = 4096, r = 8;
  for (int i = 0; i < 32; ++i) {
    const std::string p = "model.language_model.layers." + std::to_string(i) + ".";
    l->push_back({p + "input_layernorm.weight", {d}});
    l->push_back({p + "post_attention_layernorm.weight", {d}});
    for (const char* m : {"self_attn.q_proj", "self_attn.v_proj"}) {
      l->push_back({p + m + ".lora_A.weight", {r, d}});
      l->push_back({p + m + ".lora_B.weight", {d, r}});
    }
  }
  l->push_back({"model.language_model.norm.weight", {d}});
  l->push_back({"model.multi_modal_projector.linear_1.bias", {d}});
  l->push_back({"model.multi_modal_projector.linear_2.bias", {d}});
}

Set MakeSet(bool zero, const std::string& layout_name) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> layout;
  if (layout_name == "llava-7b") {
    AddLlava7bLayout(&layout);
  } else {
    AddLayout(&layout);
  }
  Set s;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& [name, shape] : layout) {
    TensorView v;
    v.name = name;
    v.shape = shape;
    std::vector<float> data(v.numel(), 0.0f);
    if (!zero) {
      // Real round deltas: Gaussian-ish with a per-tensor scale spread over two decades
      // (norms and gates move little, LoRA B and prompts most) and per-row variation.
      const float tensor_scale =
          1e-5f * std::pow(10.0f, 2.0f * std::uniform_real_distribution<float>(0, 1)(rng));
      const int64_t row = shape.empty() ? 1 : shape.back();
      float row_scale = 1.0f;
      for (size_t i = 0; i < data.size(); ++i) {
        if (i % row == 0) row_scale = std::exp(0.5f * normal(rng));
        data[i] = tensor_scale * row_scale * normal(rng);
      }
    }
    s.params += data.size();
    s.buffers.push_back(std::move(data));
    s.views.push_back(std::move(v));
  }
  for (size_t i = 0; i < s.views.size(); ++i) s.views[i].data = s.buffers[i].data();
  return s;
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

template <typename F>
double MedianSeconds(int reps, F f) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(Seconds(std::chrono::steady_clock::now() - start));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int Run(int reps, const std::string& layout) {
  const Set mirror = MakeSet(true, layout);
  const Set fresh = MakeSet(false, layout);  // mirror = 0, so fresh holds the delta itself
  const double mb = 4.0 * static_cast<double>(mirror.params) / 1e6;
  std::printf("layout %s\n", layout.c_str());
  std::printf("trainable set: %zu tensors, %llu params, %.2f MB fp32\n\n", mirror.views.size(),
              static_cast<unsigned long long>(mirror.params), mb);

  DeltaEncoderOptions def;  // the default policy: 2 bits/param
  def.error_feedback = false;
  UpdatePayload payload;
  const double enc = MedianSeconds(reps, [&] {
    DeltaEncoder e(def);
    payload = *e.Encode(fresh.views, mirror.views, 0, 1);
  });
  Set live = MakeSet(true, layout);
  const double dec = MedianSeconds(reps, [&] {
    if (!ApplyUpdateToViews(payload.bytes, 0, live.views).ok()) std::abort();
  });
  std::vector<float> src(mirror.params, 1.0f), dst(mirror.params, 0.0f);
  const double cpy = MedianSeconds(reps * 5, [&] {
    std::memcpy(dst.data(), src.data(), src.size() * sizeof(float));
    asm volatile("" : : "r"(dst.data()) : "memory");
  });
  std::printf("default policy payload: %zu bytes, %.3f bits/param, rel. error %.4f\n",
              payload.bytes.size(), payload.stats.bits_per_param, payload.stats.relative_error);
  std::printf("%-34s %10s %10s\n", "throughput (median of reps)", "ms", "MB/s");
  std::printf("%-34s %10.2f %10.1f\n", "encode (DWC, 2 bits/param)", enc * 1e3, mb / enc);
  std::printf("%-34s %10.2f %10.1f\n", "decode + apply in place", dec * 1e3, mb / dec);
  std::printf("%-34s %10.2f %10.1f\n", "memcpy of the fp32 set (ceiling)", cpy * 1e3, mb / cpy);
  std::printf("\n");

  struct Row {
    std::string method;
    DeltaEncoderOptions options;
  };
  std::vector<Row> rows;
  for (double b : {1.0, 1.5, 2.0, 3.0, 4.0}) {
    DeltaEncoderOptions o;
    o.bits_per_param = b;
    char label[64];
    std::snprintf(label, sizeof(label), "DWC budget %.1f bits/param", b);
    rows.push_back({label, o});
  }
  for (int b : {8, 4, 2}) {
    DeltaEncoderOptions o;
    o.bits_per_param = 0.0;
    o.allowed_bits = {b};
    o.coarse_groups = false;
    rows.push_back({"uniform " + std::to_string(b) + "-bit (groups of 64)", o});
  }
  {
    DeltaEncoderOptions o;
    o.bits_per_param = 0.0;
    o.allowed_bits = {1};
    o.group_size = 1u << 22;  // one scale per tensor
    o.coarse_groups = false;
    rows.push_back({"BitDelta 1-bit (sign + tensor scale)", o});
  }
  std::printf("%-38s %10s %10s %10s %8s\n", "method", "bytes", "bits/par", "rel.err", "ratio");
  for (Row& r : rows) {
    r.options.error_feedback = false;
    DeltaEncoder e(r.options);
    auto p = e.Encode(fresh.views, mirror.views, 0, 1);
    if (!p.ok()) {
      std::printf("%-38s %s\n", r.method.c_str(), p.status().ToString().c_str());
      continue;
    }
    std::printf("%-38s %10zu %10.3f %10.4f %7.1fx\n", r.method.c_str(), p->bytes.size(),
                p->stats.bits_per_param, p->stats.relative_error,
                mb * 1e6 / static_cast<double>(p->bytes.size()));
  }
  return 0;
}

}  // namespace
}  // namespace cdcca::compress

int main(int argc, char** argv) {
  int reps = 7;
  std::string layout = "small";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--layout") == 0) layout = argv[i + 1];
  }
  if (layout != "small" && layout != "llava-7b") {
    std::fprintf(stderr, "--layout must be small or llava-7b\n");
    return 1;
  }
  return cdcca::compress::Run(reps, layout);
}
