// cdcca-sim: runs a round-trip experiment (configs/experiments/*.json) through the real
// cloud service and device agents on this machine and writes its report.
//
//   cdcca-sim --experiment configs/experiments/quickstart.json [--out runs/quickstart]
//             [--seed 1 | --seeds 1,2,3] [--tiny] [--checkpoint_dir DIR] [--torch_threads N]
//             [--teacher DIR --student_base DIR]   (a Hugging Face pair instead of the family)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/flags_help.h"
#include "sim/experiment.h"
#include "sim/harness.h"
#include "sim/report.h"

ABSL_FLAG(std::string, experiment, "configs/experiments/quickstart.json",
          "experiment file (JSON, see sim/experiment.h), or the name of one under "
          "configs/experiments/");
ABSL_FLAG(std::string, out, "", "run directory for the report (default: runs/<experiment name>)");
ABSL_FLAG(uint64_t, seed, 1, "seed of streams, evaluation scenes, dropout and training");
ABSL_FLAG(std::string, seeds, "",
          "comma-separated seeds: runs the experiment once per seed into OUT/seed-N/ and writes "
          "OUT/seeds.md and OUT/seeds.json (every comparison per seed, mean and standard errors)");
ABSL_FLAG(bool, tiny, false,
          "shrink the experiment (64 frames and 48 evaluation scenes per round, 20 steps per "
          "job, at most 2 devices) for a quick check");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "model family directory (overrides the experiment's \"checkpoint_dir\")");
ABSL_FLAG(std::string, teacher, "",
          "Hugging Face teacher folder (with --student_base: runs the experiment on that pair "
          "instead of the experiment's family)");
ABSL_FLAG(std::string, student_base, "",
          "Hugging Face folder of the devices' student (with --teacher)");
ABSL_FLAG(int, torch_threads, -1,
          "LibTorch intra-op threads (overrides the experiment's; 0 = automatic: 1)");
ABSL_FLAG(std::string, profile, "",
          "measured or paper: overrides the experiment's \"profile\" (the defaults of "
          "uplink_precision and lora_projector where the file leaves them out; "
          "docs/SETTINGS.md)");
ABSL_FLAG(std::string, methods, "",
          "comma-separated methods to run (overrides the experiment's list)");
ABSL_FLAG(bool, print_config, false,
          "print the settings of the experiment's CD-CCA round (UTS, student, job, downlink, "
          "guard; under the names cdcca-cloud and cdcca-device print theirs with --print_config) "
          "as JSON on stdout, and exit");

namespace {

// One-line progress bar on stderr, redrawn in place on a terminal.
class ProgressBar {
 public:
  ProgressBar() : tty_(isatty(2) != 0), start_(std::chrono::steady_clock::now()) {}
  void Update(const std::string& what, double fraction) {
    fraction = std::clamp(fraction, 0.0, 1.0);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const int width = 30;
    const int filled = static_cast<int>(fraction * width + 0.5);
    std::string bar = std::string(static_cast<size_t>(filled), '#') +
                      std::string(static_cast<size_t>(width - filled), '.');
    std::string line = absl::StrFormat("[%s] %3.0f%% %5.0fs  %s", bar, 100 * fraction, s, what);
    if (tty_) {
      std::fprintf(stderr, "\r%-110.110s", line.c_str());
      if (fraction >= 1) std::fprintf(stderr, "\n");
    } else if (fraction >= 1 || s - last_print_ >= 5) {  // a log, not a terminal: sparingly
      std::fprintf(stderr, "%s\n", line.c_str());
      last_print_ = s;
    }
  }

 private:
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  double last_print_ = -1e9;
};

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "runs a CD-CCA round-trip experiment through the real services and writes report.md, "
      "results.json, results.csv and report.html");
  cdcca::cli::ParseFlagsOrHelp(argc, argv, [](std::string_view file) {
    return file.find("cdcca_sim_main") != std::string_view::npos;
  });
  std::string path = absl::GetFlag(FLAGS_experiment);
  if (path.find('/') == std::string::npos && path.find(".json") == std::string::npos) {
    path = absl::StrCat("configs/experiments/", path, ".json");
  }
  absl::StatusOr<cdcca::sim::Experiment> experiment = cdcca::sim::LoadExperiment(path);
  if (!experiment.ok()) {
    std::fprintf(stderr, "cdcca-sim: %s\n", experiment.status().ToString().c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_tiny)) *experiment = cdcca::sim::Shrink(*experiment);
  if (!absl::GetFlag(FLAGS_checkpoint_dir).empty())
    experiment->checkpoint = absl::GetFlag(FLAGS_checkpoint_dir);
  if (!absl::GetFlag(FLAGS_teacher).empty() || !absl::GetFlag(FLAGS_student_base).empty()) {
    experiment->teacher = absl::GetFlag(FLAGS_teacher);
    experiment->student_base = absl::GetFlag(FLAGS_student_base);
  }
  if (!absl::GetFlag(FLAGS_profile).empty()) experiment->profile = absl::GetFlag(FLAGS_profile);
  if (absl::Status s = cdcca::sim::ApplyProfile(&*experiment); !s.ok()) {
    std::fprintf(stderr, "cdcca-sim: %s\n", s.ToString().c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_torch_threads) >= 0)
    experiment->threads = absl::GetFlag(FLAGS_torch_threads);
  if (!absl::GetFlag(FLAGS_methods).empty()) {
    experiment->methods = absl::StrSplit(absl::GetFlag(FLAGS_methods), ',', absl::SkipEmpty());
    absl::StatusOr<cdcca::sim::Experiment> checked = cdcca::sim::ParseExperiment(
        absl::StrCat("{\"name\": \"x\", \"schedule\": [{}], \"methods\": [\"",
                     absl::StrJoin(experiment->methods, "\", \""), "\"]}"),
        "--methods");
    if (!checked.ok()) {
      std::fprintf(stderr, "cdcca-sim: %s\n", checked.status().ToString().c_str());
      return 2;
    }
  }
  if (absl::Status s = cdcca::sim::CheckExperiment(*experiment, path); !s.ok()) {
    std::fprintf(stderr, "cdcca-sim: %s\n", s.ToString().c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_print_config)) {
    absl::StatusOr<std::string> settings = cdcca::sim::RoundSettingsJson(*experiment);
    if (!settings.ok()) {
      std::fprintf(stderr, "cdcca-sim: %s\n", settings.status().ToString().c_str());
      return 2;
    }
    std::printf("%s\n", settings->c_str());
    return 0;
  }
  const std::string out = absl::GetFlag(FLAGS_out).empty() ? absl::StrCat("runs/", experiment->name)
                                                           : absl::GetFlag(FLAGS_out);
  std::vector<uint64_t> seeds = {absl::GetFlag(FLAGS_seed)};
  const bool several = !absl::GetFlag(FLAGS_seeds).empty();
  if (several) {
    seeds.clear();
    for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_seeds), ',')) {
      uint64_t seed = 0;
      if (!absl::SimpleAtoi(part, &seed)) {
        std::fprintf(stderr, "cdcca-sim: --seeds: '%s' is not a seed\n", std::string(part).c_str());
        return 2;
      }
      if (std::find(seeds.begin(), seeds.end(), seed) != seeds.end()) {
        std::fprintf(stderr, "cdcca-sim: --seeds: seed %llu given twice\n",
                     static_cast<unsigned long long>(seed));
        return 2;
      }
      seeds.push_back(seed);
    }
  }
  std::vector<cdcca::sim::RunResult> runs;
  for (size_t i = 0; i < seeds.size(); ++i) {
    const std::string dir = several ? absl::StrCat(out, "/seed-", seeds[i]) : out;
    const std::string tag =
        several ? absl::StrCat("seed ", seeds[i], " (", i + 1, "/", seeds.size(), ") ") : "";
    ProgressBar bar;
    cdcca::sim::HarnessOptions options;
    options.work_dir = dir + "/work";
    options.seed = seeds[i];
    options.progress = [&bar, &tag](const std::string& what, double f) {
      bar.Update(tag + what, f);
    };
    absl::StatusOr<cdcca::sim::RunResult> run = cdcca::sim::RunExperiment(*experiment, options);
    if (!run.ok()) {
      std::fprintf(stderr, "\ncdcca-sim: %s\n", run.status().ToString().c_str());
      return 1;
    }
    if (absl::Status s = cdcca::sim::WriteReport(*run, dir); !s.ok()) {
      std::fprintf(stderr, "cdcca-sim: %s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("\n%s%s\nreport: %s/report.md  (plots: %s/report.html)\n", tag.c_str(),
                cdcca::sim::SummaryTable(*run).c_str(), dir.c_str(), dir.c_str());
    std::fflush(stdout);
    runs.push_back(*std::move(run));
  }
  if (several) {
    if (absl::Status s = cdcca::sim::WriteSeedSummary(runs, out); !s.ok()) {
      std::fprintf(stderr, "cdcca-sim: %s\n", s.ToString().c_str());
      return 1;
    }
    std::printf("\n%s\nsummary: %s/seeds.md\n", cdcca::sim::SeedSummaryMarkdown(runs).c_str(),
                out.c_str());
  }
  return 0;
}
