// The defaults table: the one place that says what every setting of the collaborative round
// is when nobody sets it. cdcca-cloud's and cdcca-device's flags, the experiment files of
// cdcca-sim (sim/experiment.h), the offline commands (cdcca adapt, adapt-eval) and the
// learner presets (distill/akd.h) all take their defaults from here, so that a program
// started without a setting runs the configuration that the headline tables of
// docs/RESULTS.md measured. docs/SETTINGS.md lists each setting once, with the programs that
// take it and the measurement that chose its default; `cdcca-cloud --print_config`,
// `cdcca-device --print_config` and `cdcca-sim --print_config` print what a run would use,
// under the same names, and tests/settings_e2e_test.cc checks that they agree.
//
// A name here is the setting's one name: kUtsMcPasses is `--uts_mc_passes` in every program
// and "uts_mc_passes" in every JSON file that sets it.
//
// Header-only and dependency-free: every module, the core ones built with LibTorch alone
// included, can read it.
#ifndef CDCCA_SETTINGS_DEFAULTS_H_
#define CDCCA_SETTINGS_DEFAULTS_H_

#include <string_view>

namespace cdcca::settings {

// --- UTS on the device (the cloud sends the uts_* values to its devices at Register) ---

// Stage 1: share of answered frames kept (running entropy quantile). The headline tables and
// the quickstart keep half.
inline constexpr double kUtsKeepFraction = 0.5;
// Stage 1: share of the frames stage 1 passes over that go up all the same, picked by a hash
// of the device and the sample id: an unbiased part of the stream beside the uncertain one
// (0 = none).
inline constexpr double kUtsRandomShare = 0.0;
// Stage 2: share of a kept frame's visual tokens uplinked (the paper's 50 %; Table 4 in
// docs/RESULTS.md compares 25/50/75 % against random tokens).
inline constexpr double kUtsTokenRatio = 0.5;
// Stage 2: MC-dropout passes and the element-wise dropout rate of each pass.
inline constexpr int kUtsMcPasses = 8;
inline constexpr double kUtsDropout = 0.1;
// What a kept sample carries: no single default; see ProfileDefaults below.

// --- The answer and its label ---

// Longest answer, in tokens: the device's answer and the teacher's pseudo-label alike (the
// VQA answers of the benchmark are 1-3 words; captions use datasets::kMaxCaptionTokens).
inline constexpr int kMaxAnswerTokens = 6;

// --- The student and its trainable set (the device and the cloud's mirror must agree) ---

inline constexpr const char* kStudentPrecision = "int8";  // frozen base: per-channel int8
inline constexpr int kLoraRank = 8;                       // LoRA on the LM's q and v
inline constexpr double kLoraAlpha = 16.0;
inline constexpr bool kLoraMlp = false;
inline constexpr bool kLoraQformer = false;
// The student's vision tower trained in the cloud from the uplinked frames (LoRA on its
// attention, its LayerNorms): needs the frames uplinked.
inline constexpr bool kLoraVision = false;
// With kLoraVision, LoRA on the tower's MLP too: `cdcca adapt` and `adapt-eval` only (measured
// not to pay on either family, so the programs do not take it).
inline constexpr bool kLoraVisionMlp = false;
// kLoraProjector: no single default; see ProfileDefaults below.

// --- The cloud's job (AKD, configs/distill/akd.json holds the same values) ---

inline constexpr const char* kLearner = "akd";
inline constexpr int kMaxSteps = 200;  // optimizer steps per job
inline constexpr int kBatchSize = 16;  // samples per step
inline constexpr double kLr = 1e-3;    // AdamW
inline constexpr double kLCe = 1.0;
inline constexpr double kLQuery = 0.1;
inline constexpr double kLRepr = 0.1;
// The temperature-2 logit KL: every cloud learner of the headline tables trains with it (it
// added 1-2 points on both fog seeds measured).
inline constexpr double kLKl = 0.5;
inline constexpr double kTemperature = 2.0;
inline constexpr double kReplayFraction = 0.25;  // share of each batch replayed
inline constexpr int kReplayCapacity = 256;      // replay buffer per device, samples
// The frozen base's products in a job's training steps: in FP8 (e4m3, scaled per row) where
// the GPU runs FP8 products natively (compute capability 8.9 and later), the plain products
// elsewhere ("native"; "on" emulates them off such a GPU, "off" never). Measured on an H100 at
// the LLaVA-1.5-13B / 7B shapes: a training step 1.22x faster than bf16's at the same peak
// memory, and on the CPU through the emulation the jobs of `small` gained what the plain jobs
// gained (docs/BENCHMARKS.md, "FP8 products for the frozen base").
inline constexpr const char* kFp8Base = "native";
// The durable per-device pool: the newest consumed samples, kept in the sample log and
// trained on again by every job (0 = none). Off until measured better than the replay alone.
inline constexpr int kPoolSamples = 0;

// --- When a job runs ---

// The experiments run one job per device and round, on the round's whole uplink (about 270
// samples a round in the quickstart, 450 in the paper's tables). A live cloud has no rounds:
// a job starts once a device has this many new samples, about one round's worth ...
inline constexpr int kTriggerSamples = 256;
// ... or this long after its last job with any new sample, s (0 = never), so that a device
// that uplinks little is still adapted. Not measured: a choice of latency.
inline constexpr double kTriggerIntervalS = 600;
// Most devices' jobs that train together over the one student base when they wait for it at
// the same time: each device's result is what its job alone gives, and a step holds every
// grouped job's batch, so this bounds the step's activation memory. Not measured: a choice of
// memory; it matters only with more than one trainer thread.
inline constexpr int kMaxJobsTogether = 4;

// --- The downlink (DWC) ---

inline constexpr double kBitsPerParam = 2.0;  // update size cap per trainable parameter

// --- The update guard (docs/RESULTS.md, "Every table under today's guard") ---

inline constexpr bool kGuard = true;
inline constexpr double kGuardHoldoutFraction = 0.1;
inline constexpr int kGuardPool = 128;
inline constexpr int kGuardMinPool = 16;
inline constexpr double kGuardZ = 1.0;
inline constexpr double kGuardConfidentFraction = 1.0;
inline constexpr bool kGuardRestoreBase = true;
inline constexpr const char* kGuardMeasure = "teacher_probability";

// --- What depends on the profile and the model family ---

// `--profile` in every program ("profile" in experiment files) picks the defaults of the two
// settings the measurements chose per family, where a setting left unset takes them:
// - "measured" (the default): the frames uplinked as JPEG on every family (docs/RESULTS.md,
//   "The loop on the one path: frames against tokens": `small` contrast +1.04 against -0.09
//   with the tokens, LLaVA fog +6.44 against +1.49; snow level with either), and on LLaVA
//   LoRA on the projector into the LM too ("LoRA where the student reads the image": 55 % of
//   the teacher's lead against 44 % on fog, +0.32 (SE 0.17) over five untuned shifts
//   offline). On BLIP-2-shaped students the projector's LoRA stays off (21 % against 15 %
//   on fog, one linear after the Q-Former: not beyond noise).
// - "paper": the paper's own method, the kept visual tokens uplinked at fp16 and LoRA on the
//   LM alone; the paper's tables (configs/experiments/ but the quickstart) run it.
// A model that cannot send frames (an image processor without a fixed output size) uplinks
// tokens under either profile.
inline constexpr const char* kProfile = "measured";

struct ProfileSettings {
  const char* uplink_precision;
  bool lora_projector;
};

// The profile's settings for a student whose config.json names `model_type` ("llava",
// "blip-2", "instructblip"). An unknown profile reads as "measured" (the programs refuse
// one before they ask: IsProfile).
inline constexpr ProfileSettings ProfileDefaults(std::string_view profile,
                                                 std::string_view model_type) {
  if (profile == "paper") return {"fp16", false};
  return {"jpeg", model_type == "llava"};
}

inline constexpr bool IsProfile(std::string_view profile) {
  return profile == "measured" || profile == "paper";
}

}  // namespace cdcca::settings

#endif  // CDCCA_SETTINGS_DEFAULTS_H_
