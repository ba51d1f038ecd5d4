// uts_bench: what UTS costs the device and what it saves the link.
//
//   uts_bench [--checkpoint_dir models/small] [--student_precision int8] [--torch_threads 1]
//       [--frames 64] [--uts_score vis]
//
// Flags of a setting carry the programs' names (docs/SETTINGS.md; --uts_score is the key of
// cdcca-sim's experiment files).
//
// 1. Latency per frame (batch 1, CPU): plain answer vs answer + UTS (stage-2 token scores
//    from M stochastic passes, token selection, uplink encoding) for M = 4, 8, 16.
// 2. Uplink bytes per kept frame for 25/50/75% of the visual tokens at fp16 and int8 (one
//    sample per batch, and amortized in batches of 16), next to the raw frame sizes.
// 3. Where the kept tokens fall on frames whose one half is corrupted (VIS diagnostic): the
//    share of kept patch tokens in the corrupted half per shift and pooled, at 25/50/75% kept,
//    for VIS (the default), the attention ablations, and random tokens.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "compress/uplink_codec.h"
#include "datasets/domain.h"
#include "datasets/fashion_mnist.h"
#include "datasets/shifts.h"
#include "device/inference_runtime.h"
#include "device/uts.h"
#include "settings/defaults.h"

ABSL_FLAG(std::string, checkpoint_dir, "models/small",
          "the student's folder (a family's, or any Hugging Face folder)");
ABSL_FLAG(std::string, student_precision, cdcca::settings::kStudentPrecision,
          "student base: fp32, int8 or int4");
ABSL_FLAG(int, torch_threads, 1,
          "LibTorch intra-op threads; 1, the one-core device the latency rows measure, where "
          "the programs' default is 0 (automatic)");
ABSL_FLAG(int, frames, 64, "frames per measurement (at least 16: one uplink batch)");
ABSL_FLAG(std::string, shift, "fog", "image shift of the stream");
ABSL_FLAG(int, severity, 4, "shift severity");
ABSL_FLAG(std::string, uts_score, "vis",
          "stage-2 score of the latency rows (vis, the device default; attention_variance, ...)");
ABSL_FLAG(int, diagnostic_frames, 32, "VIS diagnostic: half-corrupted frames per shift");

namespace cdcca::device {
namespace {

namespace ds = datasets;

double Ms(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

struct Stats {
  double p50 = 0;
  double mean = 0;
};
Stats Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2],
          std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size())};
}

void Die(const absl::Status& s) {
  std::fprintf(stderr, "uts_bench: %s\n", s.ToString().c_str());
  std::exit(1);
}
template <typename T>
T Must(absl::StatusOr<T> v) {
  if (!v.ok()) Die(v.status());
  return *std::move(v);
}

compress::UplinkSample MakeSample(const AnswerResult& a, const std::vector<uint16_t>& keep,
                                  uint64_t id) {
  compress::UplinkSample s;
  s.sample_id = id;
  s.entropy = a.entropy;
  s.grid_tokens = static_cast<uint32_t>(a.visual.tokens);
  s.feature_dim = static_cast<uint32_t>(a.visual.dim);
  s.kept_indices = keep;
  s.prompt_tokens = a.prompt_ids;
  s.answer_tokens = a.answer_ids;
  for (uint16_t t : keep) {
    const float* row = a.visual.values.data() + static_cast<size_t>(t) * a.visual.dim;
    s.features.insert(s.features.end(), row, row + a.visual.dim);
  }
  return s;
}

ds::Image Splice(const ds::Image& clean, const ds::Image& corrupted, bool left) {
  ds::Image out = clean;
  for (int y = 0; y < clean.height; ++y) {
    for (int x = 0; x < clean.width; ++x) {
      if ((x < clean.width / 2) != left) continue;
      std::copy_n(corrupted.at(x, y), 3, out.at(x, y));
    }
  }
  return out;
}

int Main() {
  RuntimeOptions options;
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.precision = absl::GetFlag(FLAGS_student_precision);
  options.threads = absl::GetFlag(FLAGS_torch_threads);
  std::unique_ptr<InferenceRuntime> runtime = Must(InferenceRuntime::Load(options));
  ds::ImageSet images = Must(ds::LoadFashionMnist(ds::Split::kTest));
  const ds::ImageShift shift = Must(ds::ImageShiftFromName(absl::GetFlag(FLAGS_shift)));
  const int severity = absl::GetFlag(FLAGS_severity);
  ds::SampleGenerator gen =
      Must(ds::SampleGenerator::Create(&images, ds::ImageShiftDomain(shift, severity), 7));
  const int n = absl::GetFlag(FLAGS_frames);
  if (n < 16) {
    // The uplink rows pack frames 16 to a batch, as a device does.
    Die(absl::InvalidArgumentError(absl::StrCat("--frames must be at least 16 (got ", n, ")")));
  }
  std::vector<Frame> frames;
  for (int i = 0; i < n; ++i) {
    ds::Sample s = gen.Generate(static_cast<uint64_t>(i));
    frames.push_back({s.image, s.questions.front().question});
  }
  std::printf("uts_bench: %s (%s base), %d thread(s), %d frames of %s severity %d\n",
              options.checkpoint_dir.c_str(), options.precision.c_str(), options.threads, n,
              std::string(ds::ImageShiftName(shift)).c_str(), severity);

  // --- 1. latency ------------------------------------------------------------------------
  // Interleaved: each frame is answered plain and then with UTS at every M back to back, so
  // a slow spell of the machine (other processes, frequency) hits all rows alike.
  UtsOptions defaults;
  defaults.score = Must(ParseTokenScore(absl::GetFlag(FLAGS_uts_score)));
  std::printf("stage-2 score %s\n",
              std::string(TokenScoreName(runtime->EffectiveScore(defaults.score))).c_str());
  for (int i = 0; i < 4; ++i) Must(runtime->Answer({frames[static_cast<size_t>(i)]}));  // warm-up
  const std::vector<int> passes = {4, 8, 16};
  std::vector<double> plain;
  std::vector<std::vector<double>> with_uts(passes.size());
  std::vector<double> passes_ms(passes.size()), select_ms(passes.size()), encode_ms(passes.size());
  std::vector<AnswerResult> answers;
  for (size_t i = 0; i < frames.size(); ++i) {
    auto t0 = std::chrono::steady_clock::now();
    answers.push_back(Must(runtime->Answer({frames[i]}))[0]);
    plain.push_back(Ms(t0, std::chrono::steady_clock::now()));
    for (size_t j = 0; j < passes.size(); ++j) {
      t0 = std::chrono::steady_clock::now();
      AnswerResult a = Must(runtime->Answer({frames[i]}))[0];
      auto t1 = std::chrono::steady_clock::now();
      std::vector<float> scores =
          Must(runtime->TokenScores(a.visual, passes[j], defaults.dropout_p, defaults.score));
      auto t2 = std::chrono::steady_clock::now();
      std::vector<uint16_t> keep =
          SelectTokens(scores, {}, defaults.token_ratio, defaults.variance_beta);
      compress::UplinkSample sample = MakeSample(a, keep, i);
      auto t3 = std::chrono::steady_clock::now();
      Must(compress::EncodeUplinkBatch({sample}, defaults.precision));
      auto t4 = std::chrono::steady_clock::now();
      with_uts[j].push_back(Ms(t0, t4));
      passes_ms[j] += Ms(t1, t2);
      select_ms[j] += Ms(t2, t3);
      encode_ms[j] += Ms(t3, t4);
    }
  }
  const Stats base = Summarize(plain);
  std::printf(
      "\nlatency per frame (batch 1, interleaved)  p50 ms   mean ms   UTS overhead (p50 / mean)\n");
  std::printf("  answer only                       %8.2f  %8.2f\n", base.p50, base.mean);
  for (size_t j = 0; j < passes.size(); ++j) {
    const Stats s = Summarize(with_uts[j]);
    std::printf("  answer + UTS, M = %-2d              %8.2f  %8.2f   +%.0f%% / +%.0f%%\n",
                passes[j], s.p50, s.mean, 100.0 * (s.p50 - base.p50) / base.p50,
                100.0 * (s.mean - base.mean) / base.mean);
  }
  std::printf("  UTS parts, mean ms: passes + scores / selection + packing / encoding\n");
  const double k = static_cast<double>(frames.size());
  for (size_t j = 0; j < passes.size(); ++j) {
    std::printf("    M = %-2d  %.3f / %.3f / %.3f\n", passes[j], passes_ms[j] / k, select_ms[j] / k,
                encode_ms[j] / k);
  }

  // --- 2. bytes --------------------------------------------------------------------------
  const AnswerResult& first = answers.front();
  const double raw_hd = 1920.0 * 1080 * 3;
  const double raw_input = static_cast<double>(frames.front().image.pixels.size());
  const double fp32_tokens = 4.0 * first.visual.tokens * first.visual.dim;
  std::printf("\nuplink bytes per kept frame (mean of %d; zstd level 3)\n", n);
  std::printf(
      "  reference: raw 1920x1080 RGB frame %.0f B; model-input %dx%d RGB %.0f B; all %d "
      "tokens fp32 %.0f B\n",
      raw_hd, frames.front().image.width, frames.front().image.height, raw_input,
      first.visual.tokens, fp32_tokens);
  std::printf(
      "  ratio  precision  one/batch B  in 16s B/frame  vs 1080p frame  vs model input  rel. error "
      " per channel median / worst\n");
  for (float ratio : {0.25f, 0.5f, 0.75f}) {
    for (auto precision : {compress::FeaturePrecision::kFp16, compress::FeaturePrecision::kInt8}) {
      std::vector<compress::UplinkSample> samples;
      double single = 0;
      for (size_t i = 0; i < answers.size(); ++i) {
        std::vector<float> scores = Must(runtime->TokenScores(answers[i].visual, defaults.mc_passes,
                                                              defaults.dropout_p, defaults.score));
        samples.push_back(MakeSample(answers[i], SelectTokens(scores, {}, ratio, 0), i));
        single += static_cast<double>(
            Must(compress::EncodeUplinkBatch({samples.back()}, precision)).size());
      }
      single /= static_cast<double>(samples.size());
      double batched = 0, err2 = 0, norm2 = 0;
      const size_t dim = static_cast<size_t>(first.visual.dim);
      std::vector<double> channel_err2(dim, 0.0), channel_norm2(dim, 0.0);
      for (size_t i = 0; i + 16 <= samples.size(); i += 16) {
        std::vector<compress::UplinkSample> part(samples.begin() + static_cast<long>(i),
                                                 samples.begin() + static_cast<long>(i) + 16);
        const std::string payload = Must(compress::EncodeUplinkBatch(part, precision));
        batched += static_cast<double>(payload.size());
        // What the cloud reads back: relative L2 error of the features.
        const std::vector<compress::UplinkSample> back = Must(compress::DecodeUplinkBatch(payload));
        for (size_t k = 0; k < part.size(); ++k) {
          for (size_t j = 0; j < part[k].features.size(); ++j) {
            const double x = part[k].features[j];
            const double d = back[k].features[j] - x;
            channel_err2[j % dim] += d * d;
            channel_norm2[j % dim] += x * x;
          }
        }
      }
      batched /= static_cast<double>(samples.size() / 16 * 16);
      // Per channel: a scale per token is set by the token's largest channel, so channels
      // far smaller than the largest lose more of themselves than the overall error says.
      std::vector<double> channel_rel;
      for (size_t c = 0; c < dim; ++c) {
        err2 += channel_err2[c];
        norm2 += channel_norm2[c];
        if (channel_norm2[c] > 0)
          channel_rel.push_back(std::sqrt(channel_err2[c] / channel_norm2[c]));
      }
      std::sort(channel_rel.begin(), channel_rel.end());
      const double channel_median = channel_rel.empty() ? 0 : channel_rel[channel_rel.size() / 2];
      const double channel_worst = channel_rel.empty() ? 0 : channel_rel.back();
      std::printf("  %3.0f%%   %-9s  %11.0f  %14.0f  %13.3f%%  %13.1f%%  %9.4f  %6.4f / %6.4f\n",
                  100 * ratio, precision == compress::FeaturePrecision::kFp16 ? "fp16" : "int8",
                  single, batched, 100 * batched / raw_hd, 100 * batched / raw_input,
                  norm2 > 0 ? std::sqrt(err2 / norm2) : 0.0, channel_median, channel_worst);
    }
  }

  // --- 3. VIS diagnostic -----------------------------------------------------------------
  // Patch tokens row by row after an optional class token: grid^2 or 1 + grid^2 tokens.
  const int tokens = first.visual.tokens;
  int grid = 1;
  while ((grid + 1) * (grid + 1) <= tokens) ++grid;
  const int class_tokens = tokens - grid * grid;
  if (class_tokens > 1 || grid % 2 != 0) {
    Die(absl::FailedPreconditionError(absl::StrCat(
        tokens, " visual tokens are not an even patch grid after at most one class token")));
  }
  std::vector<TokenScore> kinds = {TokenScore::kVis, TokenScore::kVisRelative,
                                   TokenScore::kAttentionVariance, TokenScore::kAttentionMass};
  const std::vector<float> ratios = {0.25f, 0.5f, 0.75f};
  const int per_shift = std::max(2, absl::GetFlag(FLAGS_diagnostic_frames));
  std::printf(
      "\nkept patch tokens in the corrupted half of half-corrupted frames (severity 4, %d "
      "frames a shift, M = %d, p = %.2f; %dx%d patches%s; 50%% = blind to the corruption)\n",
      per_shift, defaults.mc_passes, defaults.dropout_p, grid, grid,
      class_tokens ? " after a class token, which is not counted" : "");
  ds::SampleGenerator source =
      Must(ds::SampleGenerator::Create(&images, ds::StudentSourceDomain(ds::Split::kTest), 17));
  // hit[ratio][column], kept[ratio][column]; columns: kinds..., random.
  const size_t columns = kinds.size() + 1;
  auto zeros = [&] {
    return std::vector<std::vector<double>>(ratios.size(), std::vector<double>(columns, 0.0));
  };
  std::vector<std::vector<double>> pooled_hit = zeros(), pooled_kept = zeros();
  std::vector<std::string> shift_names;
  std::vector<std::vector<std::vector<double>>> shift_share;  // [shift][ratio][column]
  std::mt19937_64 rng(23);
  for (ds::ImageShift s : ds::AllImageShifts()) {
    std::vector<std::vector<double>> hit = zeros(), kept = zeros();
    for (int i = 0; i < per_shift; ++i) {
      ds::Sample sample = source.Generate(static_cast<uint64_t>(i));
      ds::Image corrupted = sample.image;
      if (absl::Status st = ds::ApplyShift(s, 4, 100 + i, corrupted); !st.ok()) Die(st);
      const bool left = i % 2 == 0;
      AnswerResult a = Must(runtime->Answer(
          {{Splice(sample.image, corrupted, left), sample.questions.front().question}}))[0];
      std::vector<std::vector<float>> scores;
      for (TokenScore k : kinds) {
        scores.push_back(Must(runtime->TokenScores(a.visual, defaults.mc_passes, defaults.dropout_p,
                                                   k, /*seed=*/1000 + i)));
      }
      for (size_t r = 0; r < ratios.size(); ++r) {
        for (size_t c = 0; c < columns; ++c) {
          const std::vector<uint16_t> selected =
              c < kinds.size() ? SelectTokens(scores[c], {}, ratios[r], 0)
                               : RandomTokenSelection(tokens, {}, ratios[r], rng);
          for (uint16_t t : selected) {
            if (t < class_tokens) continue;
            const int patch = t - class_tokens;
            hit[r][c] += ((patch % grid) < grid / 2) == left ? 1 : 0;
            kept[r][c] += 1;
          }
        }
      }
    }
    shift_names.emplace_back(ds::ImageShiftName(s));
    shift_share.push_back(zeros());
    for (size_t r = 0; r < ratios.size(); ++r) {
      for (size_t c = 0; c < columns; ++c) {
        shift_share.back()[r][c] = 100 * hit[r][c] / std::max(1.0, kept[r][c]);
        pooled_hit[r][c] += hit[r][c];
        pooled_kept[r][c] += kept[r][c];
      }
    }
  }
  for (size_t r = 0; r < ratios.size(); ++r) {
    std::printf("  top %.0f%%         ", 100 * ratios[r]);
    for (TokenScore k : kinds) std::printf("  %18s", std::string(TokenScoreName(k)).c_str());
    std::printf("  %18s\n", "random");
    for (size_t i = 0; i < shift_names.size(); ++i) {
      std::printf("  %-15s", shift_names[i].c_str());
      for (size_t c = 0; c < columns; ++c) std::printf("  %17.1f%%", shift_share[i][r][c]);
      std::printf("\n");
    }
    std::printf("  %-15s", "pooled");
    for (size_t c = 0; c < columns; ++c) {
      std::printf("  %17.1f%%", 100 * pooled_hit[r][c] / std::max(1.0, pooled_kept[r][c]));
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace cdcca::device

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cdcca::device::Main();
}
