#include "sim/adapt_command.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cloud/train_round.h"
#include "compress/delta_encoder.h"
#include "compress/named_tensors.h"
#include "datasets/domain.h"
#include "datasets/formats.h"
#include "datasets/shifts.h"
#include "device/sample_step.h"
#include "device/uts.h"
#include "distill/pair_side.h"
#include "model/hub/adapter_state.h"
#include "model/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "settings/defaults.h"
#include "sim/adapt_eval.h"
#include "sim/adapt_eval_pair.h"
#include "storage/event_log.h"

// The flags of adapt and adapt-eval carry cdcca-cloud's and cdcca-device's names for the
// same settings (--uts_mc_passes, --max_steps, --student_precision, ...); their defaults are
// these commands' own.
ABSL_FLAG(std::string, teacher, "", "adapt, adapt-eval: the teacher's Hugging Face folder");
ABSL_FLAG(std::string, student_base, "",
          "adapt, adapt-eval: the student's Hugging Face folder (the device's model, before "
          "adaptation)");
ABSL_FLAG(std::string, student_template, "",
          "adapt, adapt-eval: the student's prompt template (auto, chat, none, llava, vicuna, "
          "chatml); empty = the prompt as given (adapt), auto (adapt-eval)");
ABSL_FLAG(std::string, teacher_template, "",
          "adapt, adapt-eval: the teacher's prompt template (as --student_template); empty = "
          "--student_template");
ABSL_FLAG(std::string, student_precision, "",
          "adapt, adapt-eval: precision of the device student's frozen base (fp32, int8, "
          "int4); empty = int8");
ABSL_FLAG(std::string, teacher_precision, "",
          "adapt, adapt-eval: fp32 | bf16 | fp16 | int8 | int4; empty = bf16 on cuda, fp32 on "
          "cpu");
ABSL_FLAG(std::string, learner, "akd", "adapt: akd | pl | pkd | cwd (the feature term)");
ABSL_FLAG(std::string, distill_config, "",
          "adapt, adapt-eval: distill settings JSON (configs/distill/akd.json layout). "
          "adapt: --learner trains with its settings and only its own feature term; empty = "
          "the learner's preset. adapt-eval: its \"job\" section gives the job options; empty = "
          "configs/distill/akd.json");
ABSL_FLAG(int, max_steps, 0,
          "adapt, adapt-eval: training steps per job (0 = --distill_config's, default 200)");
ABSL_FLAG(int, batch_size, 0,
          "adapt, adapt-eval: samples per training step (0 = --distill_config's, default 16)");
ABSL_FLAG(double, lr, 0, "adapt, adapt-eval: learning rate (0 = --distill_config's, default 1e-3)");
ABSL_FLAG(int, max_answer_tokens, cdcca::settings::kMaxAnswerTokens,
          "adapt: longest answer, in tokens: the student's and the teacher's pseudo-label");
ABSL_FLAG(int64_t, lora_rank, cdcca::settings::kLoraRank,
          "adapt, adapt-eval: LoRA rank on the LM's q and v");
ABSL_FLAG(double, lora_alpha, cdcca::settings::kLoraAlpha,
          "adapt, adapt-eval: LoRA alpha (scale alpha / rank)");
ABSL_FLAG(bool, lora_mlp, cdcca::settings::kLoraMlp,
          "adapt, adapt-eval: LoRA on the LM's MLP projections too");
ABSL_FLAG(bool, lora_qformer, cdcca::settings::kLoraQformer,
          "adapt, adapt-eval: LoRA on the Q-Former's attention query and value too (BLIP-2, "
          "InstructBLIP)");
ABSL_FLAG(bool, lora_projector, false,
          "adapt, adapt-eval: LoRA on the projector into the LM too (LLaVA's "
          "multi_modal_projector, BLIP-2's language_projection). Unset: --profile's (measured: "
          "on for LLaVA, off otherwise; paper: off)");
ABSL_FLAG(bool, lora_vision, cdcca::settings::kLoraVision,
          "adapt, adapt-eval: the vision tower's attention LoRA and LayerNorms too, trained "
          "from each frame as the device would uplink it (JPEG at the tower's input size)");
ABSL_FLAG(bool, lora_vision_mlp, cdcca::settings::kLoraVisionMlp,
          "adapt, adapt-eval: with --lora_vision, LoRA on the vision tower's MLP (fc1, fc2) too");
ABSL_FLAG(std::string, fp8_base, "",
          "adapt, adapt-eval: how the student's frozen base multiplies in the jobs' training "
          "steps: native (FP8 where the GPU runs it natively), on (FP8 everywhere, emulated on "
          "a CPU: what the GPU's FP8 products do to a job) or off (empty: the distill config's "
          "job key \"fp8_base\", default native)");
ABSL_FLAG(bool, ground_truth_arms, false,
          "adapt-eval: add, for every arm, a twin whose job trains on each question's "
          "ground-truth answer instead of the teacher's (the trainable set's ceiling without "
          "label noise)");
ABSL_FLAG(std::string, profile, cdcca::settings::kProfile,
          "adapt, adapt-eval: default of --lora_projector where it is unset: measured (on "
          "for a LLaVA student: the best measured) or paper (LoRA on the LM alone)");
ABSL_FLAG(double, uts_keep_fraction, 0.0,
          "adapt, adapt-eval: UTS stage 1, fraction of the stream kept by answer entropy "
          "(adapt: the running quantile over the frames so far, as on a device); 0 = all");
ABSL_FLAG(double, entropy_alpha, -1.0,
          "adapt: UTS stage 1 with a fixed threshold instead: keep frames whose answer's mean "
          "token entropy (nats) exceeds it; < 0 = off");
ABSL_FLAG(double, uts_token_ratio, cdcca::settings::kUtsTokenRatio,
          "adapt, adapt-eval: fraction of visual tokens UTS stage 2 keeps, (0, 1] "
          "(adapt-eval: the UTS and random arms alike)");
ABSL_FLAG(int, uts_mc_passes, cdcca::settings::kUtsMcPasses,
          "adapt, adapt-eval: MC-dropout passes M of UTS stage 2");
ABSL_FLAG(double, uts_dropout, cdcca::settings::kUtsDropout,
          "adapt, adapt-eval: rate of UTS stage 2's dropout on the visual tokens in each pass");
ABSL_FLAG(double, bits_per_param, cdcca::settings::kBitsPerParam,
          "adapt: the update's DWC budget in bits per trainable parameter (the state written is "
          "the student after applying it, as a device holds it)");
ABSL_FLAG(uint64_t, job_seed, 0, "adapt: seed of the batches and the dropout masks");
ABSL_FLAG(std::string, state, "", "export-adapter: the adapted state folder (adapt --out)");

ABSL_FLAG(std::string, shift, "fog",
          "adapt-eval: image shift name (fog, brightness, ...), 'text', or 'multimodal:NAME'");
ABSL_FLAG(int, severity, 4, "adapt-eval: severity 1-5 of the image shift");
ABSL_FLAG(int, stream_scenes, 1000,
          "adapt-eval: stream scenes the device answers (5 questions each)");
ABSL_FLAG(int, test_scenes, 300, "adapt-eval: held-out shifted test scenes (5 questions each)");
ABSL_FLAG(std::string, token_scores, "vis",
          "adapt-eval: comma-separated UTS stage-2 scores, one arm each; a pair scores by VIS "
          "(the device's score) whatever the name, so arms of one ratio are one arm");
ABSL_FLAG(bool, random_arm, true, "adapt-eval: add the random-token arm at the same ratio");
ABSL_FLAG(bool, teacher_all_arms, false,
          "adapt-eval on a Hugging Face pair: add to each UTS and random arm its twin whose "
          "teacher labels every sample from all its tokens while the student trains on the "
          "kept ones");
ABSL_FLAG(std::string, learners, "pl,akd,akd+l_query=0,akd+l_repr=0,pl+l_kl=0.5,akd+l_kl=0.5",
          "adapt-eval: comma-separated learner specs base[+key=value]...");
ABSL_FLAG(uint64_t, seed, 1, "adapt-eval: scenes, passes, random tokens and jobs");

// Shared with `cdcca generate` / `answer` (model/arch/generate_command.cc) and `cdcca eval`.
ABSL_DECLARE_FLAG(std::string, images);
ABSL_DECLARE_FLAG(std::string, prompt);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, out);
// Defined by the model's or the datasets' commands.
ABSL_DECLARE_FLAG(std::string, checkpoint_dir);
ABSL_DECLARE_FLAG(std::string, fashion_mnist_dir);

namespace cdcca::sim {

using distill::DistillConfig;
using distill::DistillSettings;
using distill::LoadDistillSettings;
using distill::LossTerm;
using distill::PairDistiller;
using distill::PairJobResult;
using distill::PairSample;
using distill::PairSideOf;
using distill::PresetDistillConfig;
using distill::WithFeatureTermOf;

const char* const kAdaptFlags[] = {"teacher",
                                   "student_base",
                                   "images",
                                   "prompt",
                                   "out",
                                   "device",
                                   "student_template",
                                   "teacher_template",
                                   "student_precision",
                                   "teacher_precision",
                                   "learner",
                                   "distill_config",
                                   "max_steps",
                                   "batch_size",
                                   "lr",
                                   "max_answer_tokens",
                                   "job_seed",
                                   "lora_rank",
                                   "lora_alpha",
                                   "lora_mlp",
                                   "lora_qformer",
                                   "lora_projector",
                                   "lora_vision",
                                   "lora_vision_mlp",
                                   "fp8_base",
                                   "profile",
                                   "uts_keep_fraction",
                                   "entropy_alpha",
                                   "uts_token_ratio",
                                   "uts_mc_passes",
                                   "uts_dropout",
                                   "bits_per_param",
                                   nullptr};

const char* const kAdaptEvalFlags[] = {"teacher",
                                       "student_base",
                                       "checkpoint_dir",
                                       "fashion_mnist_dir",
                                       "out",
                                       "device",
                                       "student_template",
                                       "teacher_template",
                                       "student_precision",
                                       "teacher_precision",
                                       "distill_config",
                                       "max_steps",
                                       "batch_size",
                                       "lr",
                                       "lora_rank",
                                       "lora_alpha",
                                       "lora_mlp",
                                       "lora_qformer",
                                       "lora_projector",
                                       "lora_vision",
                                       "lora_vision_mlp",
                                       "fp8_base",
                                       "ground_truth_arms",
                                       "profile",
                                       "uts_keep_fraction",
                                       "uts_token_ratio",
                                       "uts_mc_passes",
                                       "uts_dropout",
                                       "shift",
                                       "severity",
                                       "stream_scenes",
                                       "test_scenes",
                                       "token_scores",
                                       "random_arm",
                                       "teacher_all_arms",
                                       "learners",
                                       "seed",
                                       nullptr};

const char* const kExportAdapterFlags[] = {"state", "out", nullptr};

namespace {

namespace ds = ::cdcca::datasets;

// adapt-eval's job settings when --distill_config is empty (for adapt, empty means the
// learner's preset instead).
constexpr char kAdaptEvalDistillConfig[] = "configs/distill/akd.json";

// --images: a folder (its .png/.jpg/.jpeg/.bmp files in name order) or a comma list of files.
absl::StatusOr<std::vector<std::string>> ImageList(const std::string& spec) {
  std::vector<std::string> out;
  if (std::filesystem::is_directory(spec)) {
    for (const auto& e : std::filesystem::directory_iterator(spec)) {
      std::string ext = e.path().extension().string();
      std::transform(ext.begin(), ext.end(), ext.begin(), ::tolower);
      if (ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp") {
        out.push_back(e.path().string());
      }
    }
    std::sort(out.begin(), out.end());
  } else {
    for (absl::string_view p : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
      out.emplace_back(p);
    }
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--images ", spec, ": no image files"));
  }
  return out;
}

int Fail(const char* command, const absl::Status& s) {
  std::fprintf(stderr, "%s: %s\n", command, std::string(s.message()).c_str());
  return 1;
}

// adapt-eval's shift from --shift and --severity.
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

// adapt-eval's options from its flags (shift, scenes, UTS, arms, learners, job);
// InvalidArgument for a bad shift, errors of the settings file.
absl::StatusOr<AdaptEvalOptions> AdaptEvalOptionsFromFlags() {
  AdaptEvalOptions o;
  o.fashion_mnist_dir = absl::GetFlag(FLAGS_fashion_mnist_dir);
  const char* env = std::getenv("CDCCA_FASHION_MNIST_DIR");
  if (env != nullptr && o.fashion_mnist_dir == "/usr/share/datasets/fashion-mnist")
    o.fashion_mnist_dir = env;
  absl::StatusOr<ds::DomainSpec> domain = DomainFromFlags();
  if (!domain.ok()) return domain.status();
  o.domain = *domain;
  o.stream_scenes = absl::GetFlag(FLAGS_stream_scenes);
  o.test_scenes = absl::GetFlag(FLAGS_test_scenes);
  o.mc_passes = absl::GetFlag(FLAGS_uts_mc_passes);
  o.dropout_p = static_cast<float>(absl::GetFlag(FLAGS_uts_dropout));
  o.keep_fraction = static_cast<float>(absl::GetFlag(FLAGS_uts_keep_fraction));
  const std::string precision = absl::GetFlag(FLAGS_student_precision);
  o.precision = precision.empty() ? std::string("int8") : precision;
  o.seed = absl::GetFlag(FLAGS_seed);
  const std::string distill_config = absl::GetFlag(FLAGS_distill_config);
  absl::StatusOr<DistillSettings> settings =
      LoadDistillSettings(distill_config.empty() ? kAdaptEvalDistillConfig : distill_config);
  if (!settings.ok()) return settings.status();
  o.job = settings->job;
  o.job.seed = o.seed;
  if (absl::GetFlag(FLAGS_max_steps) > 0) o.job.max_steps = absl::GetFlag(FLAGS_max_steps);
  if (absl::GetFlag(FLAGS_lr) > 0) o.job.lr = absl::GetFlag(FLAGS_lr);
  if (absl::GetFlag(FLAGS_batch_size) > 0) o.job.batch_size = absl::GetFlag(FLAGS_batch_size);
  if (!absl::GetFlag(FLAGS_fp8_base).empty()) o.job.fp8_base = absl::GetFlag(FLAGS_fp8_base);
  o.max_answer_tokens = o.job.max_answer_tokens;

  const float ratio = static_cast<float>(absl::GetFlag(FLAGS_uts_token_ratio));
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
  if (absl::GetFlag(FLAGS_ground_truth_arms)) {
    const size_t n = o.arms.size();
    for (size_t i = 0; i < n; ++i) {
      UplinkArm twin = o.arms[i];
      twin.name += "+ground-truth";
      twin.ground_truth = true;
      o.arms.push_back(twin);
    }
  }
  for (absl::string_view l :
       absl::StrSplit(absl::GetFlag(FLAGS_learners), ',', absl::SkipEmpty())) {
    o.learners.emplace_back(l);
  }
  return o;
}

// Prints the report's table on stdout and writes --out.md / --out.json; an error on stderr
// prefixed with `cdcca COMMAND:`. Returns the exit code (0, or 1 for an error).
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

}  // namespace

int AdaptCommand(const std::vector<std::string>& args) {
  constexpr char kName[] = "adapt";
  if (!args.empty()) {
    std::fprintf(stderr, "%s: unexpected argument %s\n", kName, args[0].c_str());
    return 2;
  }
  const std::string teacher_dir = absl::GetFlag(FLAGS_teacher);
  const std::string student_dir = absl::GetFlag(FLAGS_student_base);
  const std::string out = absl::GetFlag(FLAGS_out);
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  if (teacher_dir.empty() || student_dir.empty() || out.empty() || prompt.empty() ||
      absl::GetFlag(FLAGS_images).empty()) {
    std::fprintf(stderr,
                 "%s: --teacher DIR --student_base DIR --images DIR|FILES --prompt TEXT --out DIR "
                 "are required\n",
                 kName);
    return 2;
  }
  const double keep = absl::GetFlag(FLAGS_uts_token_ratio);
  if (!(keep > 0 && keep <= 1)) {
    std::fprintf(stderr, "%s: --uts_token_ratio must be in (0, 1], got %g\n", kName, keep);
    return 2;
  }
  // UTS stage 1 (device/uts.h EntropyGate): a running quantile, a fixed alpha, or off.
  const double keep_fraction = absl::GetFlag(FLAGS_uts_keep_fraction);
  const double alpha = absl::GetFlag(FLAGS_entropy_alpha);
  if (!(keep_fraction >= 0 && keep_fraction <= 1)) {
    std::fprintf(stderr, "%s: --uts_keep_fraction must be in [0, 1], got %g\n", kName,
                 keep_fraction);
    return 2;
  }
  const bool quantile = keep_fraction > 0 && keep_fraction < 1;
  if (alpha >= 0 && quantile) {
    std::fprintf(stderr,
                 "%s: --uts_keep_fraction and --entropy_alpha are two stage-1 rules; give one\n",
                 kName);
    return 2;
  }
  // The device's step (device/sample_step.h) with these UTS settings; stage 2 scores by VIS.
  device::SampleStepOptions step_options;
  device::UtsOptions& uts = step_options.uts;
  uts.keep_fraction = quantile ? static_cast<float>(keep_fraction) : 0.0f;
  uts.entropy_alpha = alpha >= 0 ? static_cast<float>(alpha) : 0.0f;
  uts.token_ratio = static_cast<float>(keep);
  uts.mc_passes = absl::GetFlag(FLAGS_uts_mc_passes);
  uts.dropout_p = static_cast<float>(absl::GetFlag(FLAGS_uts_dropout));
  if (absl::Status s = device::CheckUtsOptions(uts); !s.ok()) return Fail(kName, s);
  if (!quantile && alpha < 0) device::KeepEverySample(&uts);
  absl::StatusOr<std::vector<std::string>> images = ImageList(absl::GetFlag(FLAGS_images));
  if (!images.ok()) return Fail(kName, images.status());

  // The learner's settings: a settings file, else the preset; flags override the job bounds.
  DistillSettings settings;
  const std::string learner = absl::GetFlag(FLAGS_learner);
  if (!absl::GetFlag(FLAGS_distill_config).empty()) {
    absl::StatusOr<DistillSettings> s = LoadDistillSettings(absl::GetFlag(FLAGS_distill_config));
    if (!s.ok()) return Fail(kName, s.status());
    settings = *s;
    absl::StatusOr<DistillConfig> c = WithFeatureTermOf(learner, settings.learner);
    if (!c.ok()) return Fail(kName, c.status());
    settings.learner = *c;
  } else {
    absl::StatusOr<DistillConfig> c = PresetDistillConfig(learner);
    if (!c.ok()) return Fail(kName, c.status());
    settings.learner = *c;
  }
  if (absl::GetFlag(FLAGS_max_steps) > 0) settings.job.max_steps = absl::GetFlag(FLAGS_max_steps);
  if (absl::GetFlag(FLAGS_batch_size) > 0) {
    settings.job.batch_size = absl::GetFlag(FLAGS_batch_size);
  }
  if (absl::GetFlag(FLAGS_lr) > 0) settings.job.lr = absl::GetFlag(FLAGS_lr);
  settings.job.max_answer_tokens = absl::GetFlag(FLAGS_max_answer_tokens);
  settings.job.seed = absl::GetFlag(FLAGS_job_seed);
  if (!absl::GetFlag(FLAGS_fp8_base).empty()) {
    settings.job.fp8_base = absl::GetFlag(FLAGS_fp8_base);
  }

  const std::string device = absl::GetFlag(FLAGS_device);
  std::string teacher_precision = absl::GetFlag(FLAGS_teacher_precision);
  if (teacher_precision.empty()) teacher_precision = device == "cuda" ? "bf16" : "fp32";
  std::string student_precision = absl::GetFlag(FLAGS_student_precision);
  if (student_precision.empty()) student_precision = "int8";
  absl::StatusOr<std::unique_ptr<model::Answerer>> teacher =
      model::Answerer::Load(teacher_dir, teacher_precision, device);
  if (!teacher.ok()) return Fail(kName, teacher.status());
  absl::StatusOr<std::unique_ptr<model::Answerer>> student =
      model::Answerer::Load(student_dir, student_precision, device);
  if (!student.ok()) return Fail(kName, student.status());
  model::AdapterOptions adapters;
  adapters.lora_rank = absl::GetFlag(FLAGS_lora_rank);
  adapters.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
  adapters.lora_mlp = absl::GetFlag(FLAGS_lora_mlp);
  adapters.lora_qformer = absl::GetFlag(FLAGS_lora_qformer);
  adapters.lora_projector = absl::GetFlag(FLAGS_lora_projector);
  adapters.lora_vision = absl::GetFlag(FLAGS_lora_vision);
  adapters.lora_vision_mlp = absl::GetFlag(FLAGS_lora_vision_mlp);
  if (absl::Status s = (*student)->model().AddAdapters(adapters); !s.ok()) return Fail(kName, s);

  const std::string student_name = absl::GetFlag(FLAGS_student_template);
  std::string teacher_name = absl::GetFlag(FLAGS_teacher_template);
  if (teacher_name.empty()) teacher_name = student_name;
  absl::StatusOr<model::PromptFormat> student_template =
      model::ResolvePromptFormat(student_name, (*student)->model_type(), student_dir);
  if (!student_template.ok()) return Fail(kName, student_template.status());
  absl::StatusOr<model::PromptFormat> teacher_template =
      model::ResolvePromptFormat(teacher_name, (*teacher)->model_type(), teacher_dir);
  if (!teacher_template.ok()) return Fail(kName, teacher_template.status());
  absl::StatusOr<std::string> device_prompt = student_template->Apply(prompt);
  if (!device_prompt.ok()) return Fail(kName, device_prompt.status());

  // The device's side: answer from the tower's tokens, then the device step (UTS stage 1 on
  // the answer's entropy, stage 2 on a kept frame).
  absl::StatusOr<std::vector<int32_t>> question =
      (*student)->tokenizer().Encode(prompt, /*add_special_tokens=*/false);
  if (!question.ok()) return Fail(kName, question.status());
  const std::vector<uint32_t> question_ids(question->begin(), question->end());
  // The samples stay here: the codec's bounds must not refuse a long prompt or answer.
  step_options.limits.max_prompt_tokens =
      std::max<uint32_t>(step_options.limits.max_prompt_tokens, question_ids.size());
  step_options.limits.max_answer_tokens = std::max<uint32_t>(
      step_options.limits.max_answer_tokens, std::max(settings.job.max_answer_tokens, 0));
  device::SampleStep step(step_options);
  std::vector<PairSample> samples;
  for (size_t i = 0; i < images->size(); ++i) {
    const std::string& path = (*images)[i];
    absl::StatusOr<datasets::Image> image = datasets::LoadImageRgb(path);
    if (!image.ok()) return Fail(kName, image.status());
    model::VisualTokenReply visual;
    absl::StatusOr<model::GenerateReply> answer =
        (*student)->AnswerRgbFromTokens(image->pixels.data(), image->width, image->height, path,
                                        *device_prompt, settings.job.max_answer_tokens, &visual);
    if (!answer.ok()) return Fail(kName, answer.status());
    const std::vector<uint32_t> answer_ids(answer->tokens.begin(), answer->tokens.end());
    device::AnsweredFrame frame;
    frame.entropy = static_cast<float>(answer->mean_entropy);
    frame.tokens = static_cast<int>(visual.tokens);
    frame.dim = static_cast<int>(visual.dim);
    frame.features = visual.features;
    frame.question_ids = question_ids;
    frame.answer_ids = answer_ids;
    device::FrameModel scorer;
    scorer.scores = [&](int passes, float dropout_p, device::TokenScore,
                        std::optional<uint64_t> seed) -> absl::StatusOr<std::vector<float>> {
      // From the tokens the answer computed, as the device does: no second tower pass.
      absl::StatusOr<model::VisualTokenReply> v = (*student)->VisualTokenVarianceFromTokens(
          visual.features, visual.tokens, visual.dim, *device_prompt, passes, dropout_p,
          seed.value_or(settings.job.seed + i));
      if (!v.ok()) return v.status();
      return std::move(v->variance);
    };
    const device::SampleDecision d = step.Run(frame, scorer, i);
    if (!d.chosen()) {
      nlohmann::json line = {{"event", "frame"},
                             {"image", path},
                             {"answer", answer->text},
                             {"entropy", answer->mean_entropy},
                             {"stage1", "passed over"}};
      std::fprintf(stderr, "%s\n",
                   line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
      continue;
    }
    if (!d.status.ok()) return Fail(kName, d.status);
    const std::vector<uint16_t>& kept = d.sample.kept_indices;
    PairSample s;
    s.tokens = torch::from_blob(visual.features.data(), {visual.tokens, visual.dim}, torch::kFloat)
                   .clone();
    s.present = torch::zeros({visual.tokens}, torch::kBool);
    s.present.index_fill_(0, torch::tensor(std::vector<int64_t>(kept.begin(), kept.end())), true);
    s.prompt = prompt;
    if (adapters.lora_vision) {
      // The frame as the device would uplink it, which the student's own tower reads.
      absl::StatusOr<std::string> jpeg = (*student)->TowerInputJpeg(
          image->pixels.data(), image->width, image->height, device::kFrameJpegQuality);
      if (!jpeg.ok()) return Fail(kName, jpeg.status());
      absl::StatusOr<torch::Tensor> px = distill::FramePixels(**student, *jpeg, path);
      if (!px.ok()) return Fail(kName, px.status());
      s.pixels = *std::move(px);
    }
    samples.push_back(s);
    nlohmann::json line = {{"event", "frame"},       {"image", path},
                           {"answer", answer->text}, {"entropy", answer->mean_entropy},
                           {"stage1", "kept"},       {"visual_tokens", visual.tokens},
                           {"kept", kept.size()}};
    std::fprintf(stderr, "%s\n",
                 line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }

  if (samples.empty()) {
    return Fail(kName, absl::FailedPreconditionError(absl::StrCat(
                           "UTS stage 1 kept none of the ", images->size(),
                           " frames (raise --uts_keep_fraction or lower --entropy_alpha)")));
  }

  // The cloud's side: the round's cloud step (cloud/train_round.h) from the student's
  // pretrained set, as a job of cdcca-cloud runs it: the job, checked, DWC-encoded against the
  // base and applied, so that the state written is what a device holds after the update.
  distill::PairSide student_side = PairSideOf(**student, student_dir, *student_template);
  student_side.reads_pixels = adapters.lora_vision;
  absl::StatusOr<std::unique_ptr<PairDistiller>> job =
      PairDistiller::Create(PairSideOf(**teacher, teacher_dir, *teacher_template), student_side,
                            settings.learner, settings.job);
  if (!job.ok()) return Fail(kName, job.status());
  const compress::NamedTensors base =
      compress::Fp32Clones((*student)->model().TrainableParameters());
  compress::DeltaEncoderOptions dwc;
  dwc.bits_per_param = absl::GetFlag(FLAGS_bits_per_param);
  std::vector<std::string> pseudo_labels;
  bool kl_used = false;
  absl::StatusOr<cloud::TrainedRound> round = cloud::TrainRound(
      [&]() -> absl::StatusOr<cloud::TrainedSet> {
        absl::StatusOr<PairJobResult> result = (*job)->RunFrom(base, samples);
        if (!result.ok()) return result.status();
        pseudo_labels = std::move(result->pseudo_labels);
        kl_used = result->kl_used;
        cloud::TrainedSet set;
        set.trainable = std::move(result->trainable);
        set.stats = std::move(result->stats);
        set.notes = std::move(result->notes);
        return set;
      },
      base, /*version=*/0, compress::DeltaEncoder(dwc));
  if (!round.ok()) return Fail(kName, round.status());
  if (round->outcome != cloud::RoundOutcome::kTrained) {
    return Fail(kName, round->why.ok() ? absl::FailedPreconditionError("no sample was usable")
                                       : round->why);
  }
  const distill::JobStats& stats = round->job.stats;
  const compress::EncodeStats& update = round->next.update.stats;
  nlohmann::json terms = nlohmann::json::object();
  for (const LossTerm& t : stats.terms) {
    terms[t.name] = {{"first", t.first}, {"last", t.last}, {"mean", t.mean}};
  }
  nlohmann::json log = {{"event", "job"},
                        {"learner", settings.learner.name},
                        {"samples", samples.size()},
                        {"steps", stats.steps},
                        {"samples_per_second", stats.samples_per_second},
                        {"prepare_seconds", stats.prepare_seconds},
                        {"train_seconds", stats.train_seconds},
                        {"kl", kl_used},
                        {"same_tokenizer", (*job)->same_tokenizer()},
                        {"terms", terms},
                        {"notes", round->job.notes},
                        {"pseudo_labels", pseudo_labels},
                        {"device", stats.device},
                        {"update_bytes", update.payload_bytes},
                        {"bits_per_param", update.bits_per_param},
                        {"relative_error", update.relative_error}};
  LogEvent(log);

  model::AdapterState state;
  state.base_model = std::filesystem::absolute(student_dir).string();
  state.precision = student_precision;
  state.adapters = adapters;
  state.trainable = std::move(round->next.state);
  state.info = log;
  state.info["teacher"] = std::filesystem::absolute(teacher_dir).string();
  if (absl::Status s = model::SaveHfAdapterState(state, out); !s.ok()) return Fail(kName, s);
  std::printf("%s\n", out.c_str());
  return 0;
}

int AdaptEvalAnyPairCommand(const std::vector<std::string>& args) {
  constexpr char kName[] = "adapt-eval";
  if (!args.empty()) {
    std::fprintf(stderr, "%s: unexpected argument %s\n", kName, args[0].c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_student_base).empty() != absl::GetFlag(FLAGS_teacher).empty()) {
    std::fprintf(stderr, "%s: a pair needs both --teacher DIR and --student_base DIR\n", kName);
    return 2;
  }
  absl::StatusOr<AdaptEvalOptions> o = AdaptEvalOptionsFromFlags();
  if (!o.ok()) return Fail(kName, o.status());
  EvalPairOptions pair;
  pair.teacher_dir = absl::GetFlag(FLAGS_teacher);
  pair.student_base_dir = absl::GetFlag(FLAGS_student_base);
  if (pair.teacher_dir.empty()) {  // a family (--checkpoint): the pair it is
    std::string family = absl::GetFlag(FLAGS_checkpoint_dir);
    if (family.empty()) family = "models/small";
    pair.teacher_dir = family + "/teacher";
    pair.student_base_dir = family;
  }
  pair.teacher_precision = absl::GetFlag(FLAGS_teacher_precision);
  pair.student_template = absl::GetFlag(FLAGS_student_template);
  pair.teacher_template = absl::GetFlag(FLAGS_teacher_template);
  if (pair.teacher_template.empty()) pair.teacher_template = pair.student_template;
  pair.device = absl::GetFlag(FLAGS_device);
  pair.adapters.lora_rank = absl::GetFlag(FLAGS_lora_rank);
  pair.adapters.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
  pair.adapters.lora_mlp = absl::GetFlag(FLAGS_lora_mlp);
  pair.adapters.lora_qformer = absl::GetFlag(FLAGS_lora_qformer);
  pair.adapters.lora_projector = absl::GetFlag(FLAGS_lora_projector);
  pair.adapters.lora_vision = absl::GetFlag(FLAGS_lora_vision);
  pair.adapters.lora_vision_mlp = absl::GetFlag(FLAGS_lora_vision_mlp);
  return WriteAdaptReport(kName, RunHubAdaptEval(*o, pair));
}

int ExportAdapterCommand(const std::vector<std::string>& args) {
  constexpr char kName[] = "export-adapter";
  if (!args.empty()) {
    std::fprintf(stderr, "%s: unexpected argument %s\n", kName, args[0].c_str());
    return 2;
  }
  const std::string state_dir = absl::GetFlag(FLAGS_state);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (state_dir.empty() || out.empty()) {
    std::fprintf(stderr, "%s: --state DIR and --out DIR are required\n", kName);
    return 2;
  }
  absl::StatusOr<model::AdapterState> state = model::LoadHfAdapterState(state_dir);
  if (!state.ok()) return Fail(kName, state.status());
  if (absl::Status s = model::ExportPeftAdapter(*state, out); !s.ok()) return Fail(kName, s);
  std::printf("%s\n", out.c_str());
  return 0;
}

}  // namespace cdcca::sim
