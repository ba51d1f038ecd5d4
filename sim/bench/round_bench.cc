// round_bench: one whole round of the loop on a Hugging Face pair in one process
// (sim/inprocess_round.h), timed step by step. The GPU
// machine has no gRPC, so this is where the round runs at published shapes:
// scripts/hf_akd_gpu.sh round DIR builds the LLaVA-1.5-13B / 7B-shaped pair
// (scripts/hf_akd_reference.py make) and runs it.
//
// The inputs file needs "prompt_ids" [S, P] (the student's ids of each prompt, the image
// placeholder unexpanded); hf_akd_reference.py make writes it. Progress goes to stderr; one
// JSON line to stdout: the step times, UTS's counts, the uplink and update bytes, the job's
// loss terms, the digests of the device's state and the cloud's mirror after the update,
// whether they agree, and the peak GPU memory. Exit status 2 when the digests differ.
//
// Flags of a round setting carry the programs' names (docs/SETTINGS.md); their defaults are
// the defaults table's (settings/defaults.h) except where the documented round deliberately
// runs another value, which the flag's help says.
//
//   round_bench --teacher DIR --student_base DIR --inputs FILE [--device cuda] [--frames 32]
//       [--uts_keep_fraction 0.5] [--uts_token_ratio 0.5] [--uplink_precision int8]
//       [--max_steps 40] [--batch_size 8] [--max_answer_tokens 16]
//       [--teacher_max_answer_tokens 32] [--bits_per_param 2]
#include <torch/torch.h>

#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "distill/akd.h"
#include "model/hub/safetensors.h"
#include "model/runtime/gpu_memory.h"
#include "nlohmann/json.hpp"
#include "settings/defaults.h"
#include "sim/inprocess_round.h"

ABSL_FLAG(std::string, teacher, "", "teacher's Hugging Face folder");
ABSL_FLAG(std::string, student_base, "", "student's Hugging Face folder (the device's base)");
ABSL_FLAG(std::string, inputs, "", "safetensors with prompt_ids [S, P]");
ABSL_FLAG(std::string, distill_config, "configs/distill/akd.json", "distillation settings");
ABSL_FLAG(std::string, fp8_base, "",
          "how the job's frozen base multiplies: native (FP8 where the GPU runs it natively), on "
          "or off (empty: the distill settings' job key, default native)");
ABSL_FLAG(std::string, teacher_precision, "bf16", "teacher's precision");
ABSL_FLAG(std::string, student_precision, "int4",
          "the device's precision (mirrored); the documented round's int4, where the programs' "
          "default is int8");
ABSL_FLAG(std::string, device, "cuda", "cuda or cpu: where the three models run");
ABSL_FLAG(int, frames, 32, "frames the device answers");
// One process plays both programs here, and the documented round bounds their answers apart:
// the device answers up to 16 tokens (cdcca-device's --max_answer_tokens), the teacher labels
// up to 32 (cdcca-cloud's --max_answer_tokens), the label length akd_bench's job is timed
// at. So the device's bound keeps the programs' name and the teacher's is named for its side.
ABSL_FLAG(int, max_answer_tokens, 16,
          "the device's answer bound, tokens (cdcca-device's --max_answer_tokens); the "
          "documented round's 16, where the programs' default is 6");
ABSL_FLAG(int, teacher_max_answer_tokens, 32,
          "the teacher's pseudo-label bound, tokens (cdcca-cloud's --max_answer_tokens); the "
          "documented round's 32, where the programs' default is 6");
ABSL_FLAG(double, uts_keep_fraction, cdcca::settings::kUtsKeepFraction,
          "UTS stage 1: share of frames kept (running quantile)");
ABSL_FLAG(int, window, 256, "UTS stage 1: entropies the quantile looks at");
ABSL_FLAG(int, uts_mc_passes, cdcca::settings::kUtsMcPasses, "UTS stage 2: MC-dropout passes M");
ABSL_FLAG(double, uts_dropout, cdcca::settings::kUtsDropout,
          "UTS stage 2: token dropout probability");
ABSL_FLAG(double, uts_token_ratio, cdcca::settings::kUtsTokenRatio,
          "UTS stage 2: share of visual tokens kept");
ABSL_FLAG(std::string, uplink_precision, "int8",
          "uplinked features: fp16, int8 or int4; the documented round's int8, where the "
          "programs' default is fp16");
ABSL_FLAG(int, max_steps, 40,
          "the job's training steps; the documented round's 40, where the programs' default is "
          "200");
ABSL_FLAG(int, batch_size, 8,
          "the job's batch size; the documented round's 8, where the programs' default is 16");
ABSL_FLAG(int, lora_rank, cdcca::settings::kLoraRank, "LoRA rank on q and v");
ABSL_FLAG(double, lora_alpha, cdcca::settings::kLoraAlpha, "LoRA alpha");
ABSL_FLAG(double, bits_per_param, cdcca::settings::kBitsPerParam,
          "DWC budget in bits per trainable parameter");
ABSL_FLAG(uint64_t, seed, 1, "frames and MC-dropout masks");

namespace cdcca::sim {
namespace {

using nlohmann::json;

int Run() {
  if (absl::GetFlag(FLAGS_teacher).empty() || absl::GetFlag(FLAGS_student_base).empty() ||
      absl::GetFlag(FLAGS_inputs).empty()) {
    std::cerr << "round_bench: --teacher, --student_base and --inputs are required\n";
    return 1;
  }
  InProcessRoundOptions o;
  o.teacher_dir = absl::GetFlag(FLAGS_teacher);
  o.student_dir = absl::GetFlag(FLAGS_student_base);
  o.teacher_precision = absl::GetFlag(FLAGS_teacher_precision);
  o.student_precision = absl::GetFlag(FLAGS_student_precision);
  o.device = torch::Device(absl::GetFlag(FLAGS_device));
  o.frames = absl::GetFlag(FLAGS_frames);
  o.max_answer_tokens = absl::GetFlag(FLAGS_max_answer_tokens);
  o.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<distill::DistillSettings> settings =
      distill::LoadDistillSettings(absl::GetFlag(FLAGS_distill_config));
  if (!settings.ok()) {
    std::cerr << settings.status() << "\n";
    return 1;
  }
  o.settings = *settings;
  o.settings.job.max_steps = absl::GetFlag(FLAGS_max_steps);
  o.settings.job.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.settings.job.max_answer_tokens = absl::GetFlag(FLAGS_teacher_max_answer_tokens);
  if (!absl::GetFlag(FLAGS_fp8_base).empty())
    o.settings.job.fp8_base = absl::GetFlag(FLAGS_fp8_base);
  o.uts.keep_fraction = static_cast<float>(absl::GetFlag(FLAGS_uts_keep_fraction));
  o.uts.window = absl::GetFlag(FLAGS_window);
  o.uts.mc_passes = absl::GetFlag(FLAGS_uts_mc_passes);
  o.uts.dropout_p = static_cast<float>(absl::GetFlag(FLAGS_uts_dropout));
  o.uts.token_ratio = static_cast<float>(absl::GetFlag(FLAGS_uts_token_ratio));
  absl::StatusOr<compress::FeaturePrecision> precision =
      compress::ParseFeaturePrecision(absl::GetFlag(FLAGS_uplink_precision));
  if (!precision.ok()) {
    std::cerr << "--uplink_precision: " << precision.status() << "\n";
    return 1;
  }
  o.uts.precision = *precision;
  o.adapters.lora_rank = absl::GetFlag(FLAGS_lora_rank);
  o.adapters.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
  o.dwc.bits_per_param = absl::GetFlag(FLAGS_bits_per_param);
  absl::StatusOr<model::SafetensorsContents> inputs =
      model::ReadSafetensors(absl::GetFlag(FLAGS_inputs));
  if (!inputs.ok()) {
    std::cerr << "--inputs: " << inputs.status() << "\n";
    return 1;
  }
  for (const auto& [name, t] : inputs->tensors) {
    if (name == "prompt_ids") o.prompt_ids = t.to(torch::kLong);
  }
  o.log = [](const std::string& line) { std::cerr << line << std::endl; };

  absl::StatusOr<InProcessRoundReport> r = RunHubRound(o);
  if (!r.ok()) {
    std::cerr << "round: " << r.status() << "\n";
    return 1;
  }
  const model::GpuMemoryPeak peak = model::PeakGpuMemory(o.device);
  json terms = json::object();
  for (const distill::LossTerm& t : r->job.terms) {
    terms[t.name] = {{"first", t.first}, {"last", t.last}, {"mean", t.mean}};
  }
  const bool equal = r->device_digest_after == r->mirror_digest_after;
  json row = {
      {"device", o.device.str()},
      {"teacher_precision", o.teacher_precision},
      {"student_precision", o.student_precision},
      {"visual_tokens", r->visual_tokens},
      {"feature_dim", r->feature_dim},
      {"trainable_parameters", r->trainable_parameters},
      {"frames", r->frames},
      {"kept_samples", r->kept_samples},
      {"kept_tokens", r->kept_tokens},
      {"mean_entropy", r->mean_entropy},
      {"load_seconds", r->load_seconds},
      {"answer_seconds_per_frame", r->answer_seconds / r->frames},
      {"stage2_seconds_per_kept_frame", r->stage2_seconds / r->kept_samples},
      {"feature_precision", compress::FeaturePrecisionName(o.uts.precision)},
      {"uplink_bytes", r->uplink_bytes},
      {"uplink_bytes_per_sample", static_cast<double>(r->uplink_bytes) / r->kept_samples},
      {"uplink_encode_seconds", r->uplink_encode_seconds},
      {"uplink_decode_seconds", r->uplink_decode_seconds},
      {"job_steps", r->job.steps},
      {"job_batch", o.settings.job.batch_size},
      {"fp8_base", o.settings.job.fp8_base},
      {"job_prepare_seconds", r->job.prepare_seconds},
      {"job_train_seconds", r->job.train_seconds},
      {"job_train_samples_per_second", r->job.samples_per_second},
      {"kl_used", r->kl_used},
      {"terms", terms},
      {"update_bytes", r->dwc.payload_bytes},
      {"update_bits_per_param", r->dwc.bits_per_param},
      {"update_relative_error", r->dwc.relative_error},
      {"dwc_encode_seconds", r->dwc_encode_seconds},
      {"mirror_apply_seconds", r->mirror_apply_seconds},
      {"device_apply_seconds", r->device_apply_seconds},
      {"digest_before", absl::StrFormat("%016x", r->device_digest_before)},
      {"device_digest_after", absl::StrFormat("%016x", r->device_digest_after)},
      {"mirror_digest_after", absl::StrFormat("%016x", r->mirror_digest_after)},
      {"digests_equal", equal},
      {"agreement_with_teacher_before", r->agreement_before},
      {"agreement_with_teacher_after", r->agreement_after},
      {"answers_changed", r->answers_changed},
      {"agreement_on_kept_tokens_before", r->agreement_kept_before},
      {"agreement_on_kept_tokens_after", r->agreement_kept_after},
      {"agreement_on_kept_tokens_trained_student", r->agreement_kept_trained},
      {"agreement_answers_seconds_per_kept_frame", r->reanswer_seconds / r->kept_samples},
      {"peak_gpu_allocated_bytes", peak.allocated_bytes},
      {"peak_gpu_reserved_bytes", peak.reserved_bytes},
  };
  // The device's answers before and after the update (token ids), kept frame by kept frame.
  json answers = json::array();
  for (const InProcessRoundReport::FrameAnswers& a : r->answers) {
    answers.push_back(
        {{"frame", a.frame}, {"before", a.before}, {"after", a.after}, {"teacher", a.teacher}});
  }
  row["device_answers"] = answers;
  std::cout << row.dump() << std::endl;
  return equal ? 0 : 2;
}

}  // namespace
}  // namespace cdcca::sim

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cdcca::sim::Run();
}
