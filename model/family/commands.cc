#include "model/family/commands.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "model/family/pretrain.h"

ABSL_FLAG(std::string, config, "configs/models/small.json", "pretrain: family config");
// `--out` and `--fashion_mnist_dir` are shared with the datasets commands: in the full build
// they are defined there (cdcca_datasets_io), in the core-only build (GPU machine) here.
#ifdef CDCCA_DATASETS_IO_FLAGS
#include "absl/flags/declare.h"
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(std::string, fashion_mnist_dir);
#else
ABSL_FLAG(std::string, out, "", "output directory (cdcca pretrain: the checkpoint directory)");
ABSL_FLAG(std::string, fashion_mnist_dir, "/usr/share/datasets/fashion-mnist",
          "Fashion-MNIST directory ($CDCCA_FASHION_MNIST_DIR overrides the default)");
#endif
ABSL_FLAG(std::string, checkpoint_dir, "",
          "model-eval: checkpoint directory; adapt-eval: a family read as its pair (DIR/teacher, "
          "DIR; default models/small)");
ABSL_FLAG(std::string, table, "", "model-eval: also write the markdown table here");
ABSL_FLAG(int, scenes, 200, "model-eval: scenes per domain (5 questions each)");
ABSL_FLAG(bool, estimates, false,
          "model-eval: each accuracy is followed, in parentheses, by the one estimated without "
          "answers from the model's probability of its first answer token (average thresholded "
          "confidence, the threshold set on the source test)");
ABSL_FLAG(int, torch_threads, 0,
          "torch intra-op threads (0 = automatic: one, OpenBLAS threads the products)");
ABSL_FLAG(bool, cpu, false, "stay on the CPU even when CUDA is available");
ABSL_FLAG(float, scale_steps, 1.0f, "pretrain: multiply every stage's steps (smoke runs)");
ABSL_FLAG(int, stop_after, 0,
          "pretrain: stop after this many training steps of this run, leaving a resume "
          "checkpoint (0 = run to the end)");

namespace cdcca::model {
namespace {

std::string DataDir() {
  // An explicit flag wins; else the environment (the GPU machine carries the files).
  std::string dir = absl::GetFlag(FLAGS_fashion_mnist_dir);
  const char* env = std::getenv("CDCCA_FASHION_MNIST_DIR");
  if (env != nullptr && dir == "/usr/share/datasets/fashion-mnist") dir = env;
  return dir;
}

}  // namespace

const char* const kPretrainFlags[] = {"config", "out",         "fashion_mnist_dir", "torch_threads",
                                      "cpu",    "scale_steps", "stop_after",        nullptr};

const char* const kModelEvalFlags[] = {
    "checkpoint_dir", "fashion_mnist_dir", "scenes", "torch_threads", "cpu",
    "table",          "estimates",         nullptr};

int PretrainCommand(const std::vector<std::string>& args) {
  if (!args.empty() || absl::GetFlag(FLAGS_out).empty()) {
    std::fprintf(stderr, "usage: cdcca pretrain --config FILE --out DIR\n");
    return 2;
  }
  PretrainOptions o;
  o.config_path = absl::GetFlag(FLAGS_config);
  o.out_dir = absl::GetFlag(FLAGS_out);
  o.fashion_mnist_dir = DataDir();
  o.threads = absl::GetFlag(FLAGS_torch_threads);
  o.force_cpu = absl::GetFlag(FLAGS_cpu);
  o.scale_steps = absl::GetFlag(FLAGS_scale_steps);
  o.stop_after_steps = absl::GetFlag(FLAGS_stop_after);
  absl::Status s = Pretrain(o);
  if (!s.ok()) {
    std::fprintf(stderr, "cdcca pretrain: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

int ModelEvalCommand(const std::vector<std::string>& args) {
  if (!args.empty() || absl::GetFlag(FLAGS_checkpoint_dir).empty()) {
    std::fprintf(stderr,
                 "usage: cdcca model-eval --checkpoint_dir DIR [--scenes N] [--table FILE] "
                 "[--estimates]\n");
    return 2;
  }
  AccuracyOptions o;
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.fashion_mnist_dir = DataDir();
  o.scenes = absl::GetFlag(FLAGS_scenes);
  o.threads = absl::GetFlag(FLAGS_torch_threads);
  o.force_cpu = absl::GetFlag(FLAGS_cpu);
  o.estimates = absl::GetFlag(FLAGS_estimates);
  // A family trained with captions gets the captioning table (and the VQA one only if it
  // also learned VQA).
  absl::StatusOr<FamilyConfig> family = LoadFamilyConfig(o.checkpoint_dir + "/config.json");
  if (!family.ok()) {
    std::fprintf(stderr, "cdcca model-eval: %s\n", family.status().ToString().c_str());
    return 1;
  }
  PretrainSchedule tasks;
  if (!family->pretrain_json.empty()) {
    absl::StatusOr<PretrainSchedule> parsed = ParsePretrainSchedule(family->pretrain_json);
    if (parsed.ok()) tasks = *parsed;
  }
  absl::StatusOr<std::string> table = std::string();
  if (tasks.questions) table = AccuracyTable(o);
  if (table.ok() && tasks.captions) {
    absl::StatusOr<std::string> captions = CaptionTable(o);
    if (captions.ok()) {
      table = absl::StrCat(*table, table->empty() ? "" : "\n", *captions);
    } else {
      table = captions.status();
    }
  }
  if (!table.ok()) {
    std::fprintf(stderr, "cdcca model-eval: %s\n", table.status().ToString().c_str());
    return 1;
  }
  std::printf("%s", table->c_str());
  if (!absl::GetFlag(FLAGS_table).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_table)) << *table;
  }
  return 0;
}

}  // namespace cdcca::model
