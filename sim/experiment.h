// Experiment definitions for `cdcca-sim`: what the harness runs, read from a JSON file under
// configs/experiments/ (one per table of the paper, plus continual and fleet runs).
//
//   {
//     "name": "image_shift", "profile": "paper", "title": "...", "paper_table": "Table 6",
//     "checkpoint_dir": "models/small", "student_precision": "int8",
//     "devices": 1, "rounds": 3, "stream_frames": 256, "eval_scenes": 200,
//     "schedule": [ {"shift": "fog", "severity": 4}, {"shift": "fog", "severity": 4,
//                    "text": true}, {"continual": true} ],
//     "methods": ["source-only", "tent", "cotta", "pkd", "cwd", "cd-cca"],
//     "uts_keep_fraction": 0.5, "uts_token_ratio": 0.5, "uts_mc_passes": 8,
//     "uts_dropout": 0.1, "uplink_precision": "fp16",
//     "max_steps": 200, "batch_size": 16, "trainer_threads": 1, "guard": true,
//     "link": {"up_mbit_s": 20, "down_mbit_s": 100, "latency_ms": 20, "loss": 0.0},
//     "bits_per_param": 2.0
//   }
//
// A setting of the round has the name of the programs' flag that sets it (docs/SETTINGS.md:
// "uts_keep_fraction" is cdcca-device's and cdcca-cloud's --uts_keep_fraction), and its
// default is the defaults table's (settings/defaults.h), as the programs' is. A key the parser
// does not know is an error naming the nearest one it does. "profile" ("measured", the default,
// or "paper") picks "uplink_precision" and "lora_projector" where the file leaves them out,
// for the student's family (settings::ProfileDefaults), as the programs' --profile does.
//
// "task": "caption" makes it a captioning run (the paper's Table 2, COCO -> nocaps style):
// every round streams the caption prompt on scenes of the three caption categories in turn
// (in-domain, near-domain, out-domain) and scores BLEU-4 and CIDEr-D per category; such an
// experiment has no schedule and needs a family trained with captions (small-caption).
//
// The schedule holds one entry per round; a shorter schedule repeats its last entry. An entry
// is an image shift (shift + severity; "none" = clean), optionally with the text shift
// ("text": true: paraphrased and knowledge questions, all classes), or a step of the
// continual stream ({"continual": true}). Devices of a fleet start at staggered entries
// ("stagger": true) or all on the same one.
//
// A Hugging Face pair instead of a cdcca family: "teacher" and "student_base" name
// the cloud's teacher folder and the devices' student folder (LLaVA, BLIP-2 or InstructBLIP
// sharing the vision tower, `cdcca-cloud --teacher --student_base`); the devices load the
// student with the adapters of "lora_rank", "lora_alpha", "lora_mlp", "lora_qformer" and
// "lora_projector" (default 8, 16, false, false, the profile's), the cloud mirrors them. The
// scenes, rounds, UTS, jobs and scores are the family runs'; stage 2 scores by VIS (Eq. 3), and
// tent and cotta adapt the same trainable set on the device. "device": "cuda" trains the cloud's
// jobs on the GPU.
//
// Methods (see sim/harness.h): source-only, tent, cotta (device-side, no cloud), pl, pkd,
// cwd, akd (cloud learners on the UTS-filtered uplink), cd-cca (= akd with UTS), and the
// UTS ablations akd-all-tokens (stage 1 only), akd-no-uts (every sample, every token),
// akd-random (stage 1, random tokens at the same ratio), and teacher: the device answers with
// the cloud's teacher (fp32, never adapted), the bound each method's gain is measured
// against (the seed summary's "share of the teacher's lead recovered"). "@ratio" after a name
// sets its token ratio ("cd-cca@0.25").
#ifndef CDCCA_SIM_EXPERIMENT_H_
#define CDCCA_SIM_EXPERIMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "settings/defaults.h"

namespace cdcca::sim {

struct RoundDomain {
  std::string shift = "none";  // datasets::ImageShiftName
  int severity = 0;
  bool text = false;       // text shift (A-OKVQA style questions, all classes)
  bool continual = false;  // datasets::ContinualSchedule's step for this round
};

// Every default of an experiment's settings is the defaults table's (settings/defaults.h): an
// experiment file that says nothing runs what cdcca-cloud and cdcca-device run without flags.
struct UtsSettings {
  float keep_fraction = static_cast<float>(settings::kUtsKeepFraction);  // stage 1
  float token_ratio = static_cast<float>(settings::kUtsTokenRatio);      // stage 2
  int mc_passes = settings::kUtsMcPasses;
  float dropout_p = static_cast<float>(settings::kUtsDropout);
  // Share of the frames stage 1 passes over uplinked all the same (device::UtsOptions).
  float random_share = static_cast<float>(settings::kUtsRandomShare);
  // "jpeg" (the frame), or the kept tokens at "fp16", "int8", "int4". A file that leaves it
  // out takes its "profile"'s for the student's family (ApplyProfile).
  std::string precision = settings::ProfileDefaults(settings::kProfile, "").uplink_precision;
  // Stage-2 score (device::TokenScore): "vis" (the device default, VIS on every
  // architecture; the only one for a Hugging Face pair), or the ablations "variance_probe"
  // (the attention variance alone on a family without a token probe), "attention_variance",
  // "attention_cv", "attention_mass", "probe_entropy" (needs the family's token probe).
  std::string score = "vis";
};

struct LinkSettings {
  double up_mbit_s = 20;
  double down_mbit_s = 100;
  double latency_ms = 20;
  double loss = 0;
};

struct JobSettings {
  int max_steps = settings::kMaxSteps;
  int batch_size = settings::kBatchSize;
  double lr = 0;  // every learner's, the cloud's and the device's; 0 = distill_config's
  // The cloud scheduler's workers: jobs of different devices run at once (cdcca-cloud's
  // --trainer_threads). Default 1, the program's default. More than 1 repeats per seed
  // only for learners that draw nothing from LibTorch's generator during a job (AKD with
  // its ridge-initialised projections does not).
  int workers = 1;
  std::string device = "cpu";  // where the cloud's jobs train: "cpu" or "cuda"
  // The cloud's update guard (cdcca-cloud's --guard, --guard_holdout_fraction, --guard_z,
  // --guard_min_pool), under those names. Default: the program's.
  bool guard = settings::kGuard;
  double guard_holdout_fraction = settings::kGuardHoldoutFraction;
  double guard_z = settings::kGuardZ;
  int guard_min_pool = settings::kGuardMinPool;
  int guard_pool = settings::kGuardPool;  // the newest held-out samples the guard judges on
  double guard_confident_fraction = settings::kGuardConfidentFraction;
  bool guard_restore_base = settings::kGuardRestoreBase;
  std::string guard_measure = settings::kGuardMeasure;
  // The durable pool per device (cdcca-cloud's --pool_samples).
  int pool_samples = settings::kPoolSamples;
  // How the job's frozen base multiplies in its steps (cdcca-cloud's --fp8_base: native, on,
  // off).
  std::string fp8_base = settings::kFp8Base;
};

// Where the cloud's state lives for the run (cdcca-cloud --store and --role): "files"
// (default: one in-process cloud on the embedded stores, its scheduler on the harness's
// clock) or "postgresql": a PostgreSQL server started for the run, `fronts` services on it
// behind nginx (the devices' one address) and `trainers` workers leasing jobs from its queue,
// each trainer with its own copy of the models (docs/ARCHITECTURE.md, "Scaling"). With
// "postgresql" the harness makes each round's jobs due once the round's uplink is stored,
// and the trainers run them as the program's trainers do.
struct CloudSettings {
  std::string store = "files";
  int fronts = 1;
  int trainers = 1;
};

struct Experiment {
  std::string name;
  std::string task = "vqa";  // or "caption"
  std::string title;
  std::string paper_table;  // e.g. "Table 6"; empty for runs the paper lacks
  std::string description;
  std::string checkpoint = "models/small";
  // A Hugging Face pair instead of `checkpoint` (both or neither): the cloud's teacher folder
  // and the devices' student folder, with the devices' adapters.
  std::string teacher;
  std::string student_base;
  int64_t lora_rank = settings::kLoraRank;
  double lora_alpha = settings::kLoraAlpha;
  bool lora_mlp = settings::kLoraMlp;
  bool lora_qformer = settings::kLoraQformer;  // the Q-Former's query and value too
  // The projector into the LM too; a file that leaves it out takes its "profile"'s.
  bool lora_projector = settings::ProfileDefaults(settings::kProfile, "").lora_projector;
  // The vision tower's attention LoRA and LayerNorms too, trained from the frames (the file
  // must uplink frames: "uplink_precision": "jpeg").
  bool lora_vision = settings::kLoraVision;
  // "measured" or "paper" (settings::ProfileDefaults), and which of the two settings it
  // picks the file set itself.
  std::string profile = settings::kProfile;
  bool uplink_precision_given = false;
  bool lora_projector_given = false;
  std::string precision = settings::kStudentPrecision;
  int devices = 1;
  int rounds = 3;
  int stream_frames = 256;  // frames each device sees per round
  int eval_scenes = 200;    // held-out test scenes per device and round
  bool stagger = false;
  std::vector<RoundDomain> schedule;
  std::vector<std::string> methods;
  UtsSettings uts;
  JobSettings job;
  CloudSettings cloud;
  LinkSettings link;
  double downlink_bits_per_param = settings::kBitsPerParam;
  // Distill settings every cloud method trains with (configs/distill layout); each method
  // changes only its feature term (distill::WithFeatureTermOf). "" = each learner's preset.
  std::string distill_config = "configs/distill/akd.json";
  int threads = 0;  // LibTorch intra-op threads; 0 = automatic (1; model/runtime/threads.h)

  // The domain device `device` sees in round `round` (0-based).
  RoundDomain DomainFor(int device, int round) const;
  bool captioning() const { return task == "caption"; }
  // A Hugging Face pair (teacher and student_base) rather than a cdcca family.
  bool hub() const { return !student_base.empty(); }
  // Longest answer generated on the device and as the teacher's label: 6 tokens for VQA,
  // datasets::kMaxCaptionTokens for captions.
  int AnswerTokens() const;
};

// The methods the harness knows.
const std::vector<std::string>& KnownMethods();

// A method name with an optional "@ratio" suffix that sets its stage-2 token ratio, e.g.
// "cd-cca@0.25" or "akd-random@0.75" (the paper's Table 4). token_ratio: 0 = no suffix (the
// experiment's uts_token_ratio), -1 = unparsable.
struct MethodName {
  std::string base;
  float token_ratio = 0;
};
MethodName ParseMethodName(const std::string& method);

// Parses and validates. INVALID_ARGUMENT names the file and the field.
absl::StatusOr<Experiment> ParseExperiment(const std::string& json_text,
                                           const std::string& source_name);
absl::StatusOr<Experiment> LoadExperiment(const std::string& path);

// Sets the settings `profile` picks (uplink_precision, lora_projector) that the file left
// out, for the student the experiment runs (student_base, else checkpoint_dir): again after
// command-line overrides of the model. INVALID_ARGUMENT for an unknown profile.
absl::Status ApplyProfile(Experiment* e);

// The checks that span fields, again after command-line overrides (--teacher, --methods):
// a Hugging Face pair names both folders, and runs no device-side method. INVALID_ARGUMENT
// naming `source_name` and the field.
absl::Status CheckExperiment(const Experiment& e, const std::string& source_name);

// The same experiment shrunk for a quick run (--tiny): fewer frames, scenes and steps.
Experiment Shrink(Experiment e);

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_EXPERIMENT_H_
