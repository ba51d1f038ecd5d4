#include "distill/commands.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "datasets/domain.h"
#include "distill/adapt_eval.h"

// Shared with the other commands of the `cdcca` tool (defined by the model's commands, or
// by the datasets' in the full build).
ABSL_DECLARE_FLAG(std::string, checkpoint);
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(std::string, fashion_mnist_dir);
ABSL_DECLARE_FLAG(int, threads);
ABSL_DECLARE_FLAG(bool, cpu);

ABSL_FLAG(std::string, shift, "fog",
          "adapt-eval: image shift name (fog, brightness, ...), 'text', or 'multimodal:NAME'");
ABSL_FLAG(int, severity, 4, "adapt-eval: severity 1-5 of the image shift");
ABSL_FLAG(int, stream_scenes, 1000,
          "adapt-eval: stream scenes the device answers (5 questions each)");
ABSL_FLAG(int, test_scenes, 300, "adapt-eval: held-out shifted test scenes (5 questions each)");
ABSL_FLAG(double, token_ratio, 0.5,
          "adapt-eval: fraction of visual tokens the UTS and random arms keep");
ABSL_FLAG(std::string, token_scores, "vis,attention_variance",
          "adapt-eval: comma-separated UTS stage-2 scores, one arm each (vis, the device "
          "default; ablations: variance_probe, attention_variance, attention_cv, attention_mass, "
          "probe_entropy)");
ABSL_FLAG(bool, random_arm, true, "adapt-eval: add the random-token arm at the same ratio");
ABSL_FLAG(bool, teacher_all_arms, false,
          "adapt-eval on a Hugging Face pair: add to each UTS and random arm its twin whose "
          "teacher labels every sample from all its tokens while the student trains on the "
          "kept ones");
ABSL_FLAG(
    double, keep_fraction, 0.0,
    "adapt-eval, hf-adapt: UTS stage 1, keep this fraction of the stream by entropy (0 = all)");
ABSL_FLAG(std::string, learners, "pl,akd,akd+l_query=0,akd+l_repr=0,pl+l_kl=0.5,akd+l_kl=0.5",
          "adapt-eval: comma-separated learner specs base[+key=value]...");
ABSL_FLAG(std::string, distill_config, "configs/distill/akd.json",
          "adapt-eval: its \"job\" section gives the job options");
ABSL_FLAG(int, job_steps, 0, "adapt-eval: steps per job (0 = the config's)");
ABSL_FLAG(double, job_lr, 0, "adapt-eval: learning rate (0 = the config's)");
ABSL_FLAG(int, job_batch, 0, "adapt-eval: batch size (0 = the config's)");
ABSL_FLAG(int, mc_passes, 8, "adapt-eval: UTS stochastic passes M");
ABSL_FLAG(double, dropout_p, 0.1, "adapt-eval: UTS dropout probability");
// --precision is shared with `cdcca generate` / `answer` (model/arch/precision_flag.cc);
// empty = int8 here.
ABSL_DECLARE_FLAG(std::string, precision);
ABSL_FLAG(uint64_t, seed, 1, "adapt-eval: scenes, passes, random tokens and jobs");

namespace cdcca::distill {
namespace {

namespace ds = ::cdcca::datasets;

absl::StatusOr<ds::DomainSpec> DomainFromFlags() {
  const std::string shift = absl::GetFlag(FLAGS_shift);
  const int severity = absl::GetFlag(FLAGS_severity);
  if (shift == "text") return ds::TextShiftDomain();
  std::string image = shift;
  const bool multimodal = absl::StartsWith(shift, "multimodal:");
  if (multimodal) image = shift.substr(std::string("multimodal:").size());
  absl::StatusOr<ds::ImageShift> s = ds::ImageShiftFromName(image);
  if (!s.ok()) return s.status();
  if (severity < 1 || severity > 5) return absl::InvalidArgumentError("severity must be 1-5");
  ds::DomainSpec d =
      multimodal ? ds::MultimodalShiftDomain(*s, severity) : ds::ImageShiftDomain(*s, severity);
  d.name = absl::StrCat(shift, " severity ", severity);
  return d;
}

}  // namespace

absl::StatusOr<AdaptEvalOptions> AdaptEvalOptionsFromFlags() {
  AdaptEvalOptions o;
  if (!absl::GetFlag(FLAGS_checkpoint).empty()) o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint);
  o.fashion_mnist_dir = absl::GetFlag(FLAGS_fashion_mnist_dir);
  const char* env = std::getenv("CDCCA_FASHION_MNIST_DIR");
  if (env != nullptr && o.fashion_mnist_dir == "/usr/share/datasets/fashion-mnist")
    o.fashion_mnist_dir = env;
  absl::StatusOr<ds::DomainSpec> domain = DomainFromFlags();
  if (!domain.ok()) return domain.status();
  o.domain = *domain;
  o.stream_scenes = absl::GetFlag(FLAGS_stream_scenes);
  o.test_scenes = absl::GetFlag(FLAGS_test_scenes);
  o.mc_passes = absl::GetFlag(FLAGS_mc_passes);
  o.dropout_p = static_cast<float>(absl::GetFlag(FLAGS_dropout_p));
  o.keep_fraction = static_cast<float>(absl::GetFlag(FLAGS_keep_fraction));
  const std::string precision = absl::GetFlag(FLAGS_precision);
  o.precision = precision.empty() ? std::string("int8") : precision;
  o.seed = absl::GetFlag(FLAGS_seed);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.force_cpu = absl::GetFlag(FLAGS_cpu);
  absl::StatusOr<DistillSettings> settings =
      LoadDistillSettings(absl::GetFlag(FLAGS_distill_config));
  if (!settings.ok()) return settings.status();
  o.job = settings->job;
  o.job.seed = o.seed;
  if (absl::GetFlag(FLAGS_job_steps) > 0) o.job.max_steps = absl::GetFlag(FLAGS_job_steps);
  if (absl::GetFlag(FLAGS_job_lr) > 0) o.job.lr = absl::GetFlag(FLAGS_job_lr);
  if (absl::GetFlag(FLAGS_job_batch) > 0) o.job.batch_size = absl::GetFlag(FLAGS_job_batch);
  o.max_answer_tokens = o.job.max_answer_tokens;

  const float ratio = static_cast<float>(absl::GetFlag(FLAGS_token_ratio));
  const int pct = static_cast<int>(std::lround(100 * ratio));
  o.arms.push_back({"all", TokenSelection::kAll, 1.0f, ""});
  for (absl::string_view score :
       absl::StrSplit(absl::GetFlag(FLAGS_token_scores), ',', absl::SkipEmpty())) {
    o.arms.push_back(
        {absl::StrCat("uts-", score, "-", pct), TokenSelection::kUts, ratio, std::string(score)});
  }
  if (absl::GetFlag(FLAGS_random_arm)) {
    o.arms.push_back({absl::StrCat("random-", pct), TokenSelection::kRandom, ratio, ""});
  }
  if (absl::GetFlag(FLAGS_teacher_all_arms)) {
    const size_t n = o.arms.size();
    for (size_t i = 0; i < n; ++i) {
      if (o.arms[i].selection == TokenSelection::kAll) continue;
      UplinkArm twin = o.arms[i];
      twin.name += "+teacher-all";
      twin.teacher_all_tokens = true;
      o.arms.push_back(twin);
    }
  }
  for (absl::string_view l :
       absl::StrSplit(absl::GetFlag(FLAGS_learners), ',', absl::SkipEmpty())) {
    o.learners.emplace_back(l);
  }
  return o;
}

int WriteAdaptReport(const std::string& command, const absl::StatusOr<AdaptReport>& report) {
  if (!report.ok()) {
    std::fprintf(stderr, "cdcca %s: %s\n", command.c_str(), report.status().ToString().c_str());
    return 1;
  }
  const std::string md = report->Markdown();
  std::printf("%s", md.c_str());
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    std::ofstream(out + ".md") << md;
    std::ofstream(out + ".json") << report->Json() << "\n";
    std::fprintf(stderr, "wrote %s.md and %s.json\n", out.c_str(), out.c_str());
  }
  return 0;
}

int AdaptEvalCommand(const std::vector<std::string>& args) {
  if (!args.empty()) {
    std::fprintf(stderr,
                 "usage: cdcca adapt-eval [--checkpoint DIR] [--shift fog --severity 4] "
                 "[--out FILE_PREFIX] ...\n");
    return 2;
  }
  absl::StatusOr<AdaptEvalOptions> o = AdaptEvalOptionsFromFlags();
  if (!o.ok()) {
    std::fprintf(stderr, "cdcca adapt-eval: %s\n", o.status().ToString().c_str());
    return 2;
  }
  return WriteAdaptReport("adapt-eval", RunAdaptEval(*o));
}

}  // namespace cdcca::distill
