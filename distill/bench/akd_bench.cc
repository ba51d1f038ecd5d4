// akd_bench: one AKD job of the cloud on a Hugging Face teacher-student pair, timed
// (docs/BENCHMARKS.md, "One AKD job at the LLaVA-1.5-13B / 7B shapes"). `scripts/
// hf_akd_reference.py make` builds the pair (random weights at published shapes) and the job's
// inputs; `scripts/hf_akd_reference.py run` runs the same job as a PyTorch + transformers +
// peft loop of the same losses, on the same inputs; scripts/hf_akd_gpu.sh runs both on the GPU
// machine.
//
// The inputs file holds what devices would have uplinked: "tokens" [S, N, D] (the vision
// tower's output tokens) and "prompt_ids" [S, P] (each sample's prompt as the LM's ids, BOS
// and the image token included; both sides share the tokenizer, as LLaVA-1.5-13B / -7B do).
// The text codec is therefore the ids themselves written as decimal text (IdsAsTextSide), so
// this program needs no tokenizer library (the GPU build has none); the KL term applies, as
// for a pair whose tokenizer files are identical.
//
// Prints one JSON line: load, preparation (teacher answers, Q_t / R_t / logits, ridge fit)
// and training times, training samples/s, the loss terms and the peak GPU memory.
//
// --jobs K runs a fleet's round instead: K devices' jobs over the one loaded student, each
// with its own learner state and its samples (the inputs, rotated by K-th parts so devices
// hold them in different orders), from the pretrained trainable set. They run as
// `cdcca-cloud --role trainer` runs jobs that wait for the student at once: in groups of at
// most --max_jobs_together, each group one distill::PairDistiller::RunTogether. The line
// then adds the device-jobs per hour; job_seconds and job_samples_per_second cover every
// device's job, the other figures are the first device's.
//
// Flags of a job setting carry the programs' names (docs/SETTINGS.md, cdcca-cloud's); their
// defaults are the defaults table's (settings/defaults.h) except where the documented job
// deliberately runs another value, which the flag's help says.
//
//   akd_bench --teacher DIR --student_base DIR --inputs FILE
//       [--distill_config configs/distill/akd.json] [--teacher_precision bf16]
//       [--student_precision int4] [--device cuda] [--lora_rank 8] [--lora_alpha 16]
//       [--max_steps 200] [--batch_size 16] [--max_answer_tokens 32]
//       [--jobs 1] [--max_jobs_together 4] [--phase_steps 0] [--prepare_batch 0]
//       [--trace FILE]
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "compress/named_tensors.h"
#include "distill/akd.h"
#include "distill/pair_distiller.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/safetensors.h"
#include "model/runtime/fp8_product.h"
#include "model/runtime/gpu_memory.h"
#include "nlohmann/json.hpp"
#include "settings/defaults.h"

ABSL_FLAG(std::string, teacher, "", "teacher's Hugging Face folder");
ABSL_FLAG(std::string, student_base, "", "student's Hugging Face folder (the devices' base)");
ABSL_FLAG(std::string, inputs, "", "safetensors with tokens [S, N, D] and prompt_ids [S, P]");
ABSL_FLAG(std::string, distill_config, "configs/distill/akd.json", "distillation settings");
ABSL_FLAG(std::string, teacher_precision, "bf16", "teacher's precision");
ABSL_FLAG(std::string, student_precision, "int4",
          "student mirror's precision (the devices'); the documented job's int4, where the "
          "programs' default is int8");
ABSL_FLAG(std::string, device, "cuda", "cuda or cpu");
ABSL_FLAG(int, lora_rank, cdcca::settings::kLoraRank, "LoRA rank on q and v");
ABSL_FLAG(double, lora_alpha, cdcca::settings::kLoraAlpha, "LoRA alpha");
ABSL_FLAG(int, max_steps, cdcca::settings::kMaxSteps, "training steps");
ABSL_FLAG(int, batch_size, cdcca::settings::kBatchSize, "batch size");
ABSL_FLAG(int, max_answer_tokens, 32,
          "the teacher's answer length bound, tokens; the documented job's 32 (rows of 648 LM "
          "positions, as the reference is timed at), where the programs' default is 6");
ABSL_FLAG(int, phase_steps, 0,
          "the job's last N steps timed phase by phase, the device synchronized between phases "
          "(\"phases\" in the line: ms per step of batch, forward, losses, backward, optimizer); "
          "those steps lose the overlap of host and device work");
ABSL_FLAG(int, prepare_batch, 0,
          "samples the teacher labels in one batch while a job prepares (0 = twice --batch_size, "
          "the job's default; 1 = one sample at a time)");
ABSL_FLAG(std::string, fp8_base, cdcca::settings::kFp8Base,
          "how the student's frozen base multiplies in the training steps: native (FP8, e4m3 "
          "scaled per row, where the GPU runs FP8 products natively, compute capability 8.9+), "
          "on (FP8 everywhere) or off (JobOptions::fp8_base)");
ABSL_FLAG(std::string, trace, "",
          "a Chrome trace of the jobs written here (LibTorch's profiler: host operators and CUDA "
          "kernels; each training step named cdcca::train_step); scripts/trace_split.py splits "
          "its steps' kernel time by kind. Tracing slows the run: time a run without it");
ABSL_FLAG(int, jobs, 1, "devices' jobs to run over the one student (a fleet's round)");
ABSL_FLAG(int, max_jobs_together, cdcca::settings::kMaxJobsTogether,
          "most devices' jobs that train together (cdcca-cloud's --max_jobs_together)");

namespace cdcca::distill {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Seconds since `start`, once the device's queued work is done.
double Since(Clock::time_point start, torch::Device device = torch::kCPU) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
  return std::chrono::duration<double>(Clock::now() - start).count();
}

absl::StatusOr<std::unique_ptr<model::MultimodalModel>> Load(const std::string& dir,
                                                             const std::string& precision,
                                                             torch::Device device) {
  model::ModelOptions o;
  o.precision = precision;
  o.device = device;
  return model::LoadModel(dir, o);
}

int Run() {
  if (absl::GetFlag(FLAGS_teacher).empty() || absl::GetFlag(FLAGS_student_base).empty() ||
      absl::GetFlag(FLAGS_inputs).empty()) {
    std::cerr << "akd_bench: --teacher, --student_base and --inputs are required\n";
    return 1;
  }
  const torch::Device device(absl::GetFlag(FLAGS_device));
  absl::StatusOr<DistillSettings> settings =
      LoadDistillSettings(absl::GetFlag(FLAGS_distill_config));
  if (!settings.ok()) {
    std::cerr << settings.status() << "\n";
    return 1;
  }
  JobOptions job = settings->job;
  job.max_steps = absl::GetFlag(FLAGS_max_steps);
  job.batch_size = absl::GetFlag(FLAGS_batch_size);
  job.max_answer_tokens = absl::GetFlag(FLAGS_max_answer_tokens);
  job.phase_steps = absl::GetFlag(FLAGS_phase_steps);
  job.prepare_batch = absl::GetFlag(FLAGS_prepare_batch);
  job.fp8_base = absl::GetFlag(FLAGS_fp8_base);

  absl::StatusOr<model::SafetensorsContents> inputs =
      model::ReadSafetensors(absl::GetFlag(FLAGS_inputs));
  if (!inputs.ok()) {
    std::cerr << inputs.status() << "\n";
    return 1;
  }
  torch::Tensor tokens, prompt_ids;
  for (const auto& [name, t] : inputs->tensors) {
    if (name == "tokens") tokens = t;
    if (name == "prompt_ids") prompt_ids = t;
  }
  if (!tokens.defined() || !prompt_ids.defined() || tokens.dim() != 3 || prompt_ids.dim() != 2 ||
      tokens.size(0) != prompt_ids.size(0)) {
    std::cerr << "the inputs need tokens [S, N, D] and prompt_ids [S, P]\n";
    return 1;
  }
  std::vector<PairSample> samples;
  for (int64_t i = 0; i < tokens.size(0); ++i) {
    PairSample s;
    s.tokens = tokens[i].to(torch::kFloat);
    const torch::Tensor row = prompt_ids[i].to(torch::kLong).contiguous();
    s.prompt = absl::StrJoin(
        std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel()), " ");
    samples.push_back(std::move(s));
  }

  const Clock::time_point load_start = Clock::now();
  auto teacher = Load(absl::GetFlag(FLAGS_teacher), absl::GetFlag(FLAGS_teacher_precision), device);
  if (!teacher.ok()) {
    std::cerr << "teacher: " << teacher.status() << "\n";
    return 1;
  }
  const int64_t teacher_bytes = model::PeakGpuMemory(device).allocated_now_bytes;
  const double teacher_load_seconds = Since(load_start, device);
  auto student =
      Load(absl::GetFlag(FLAGS_student_base), absl::GetFlag(FLAGS_student_precision), device);
  if (!student.ok()) {
    std::cerr << "student: " << student.status() << "\n";
    return 1;
  }
  model::AdapterOptions adapters;
  adapters.lora_rank = absl::GetFlag(FLAGS_lora_rank);
  adapters.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
  if (absl::Status s = (*student)->AddAdapters(adapters); !s.ok()) {
    std::cerr << "adapters: " << s << "\n";
    return 1;
  }
  const double load_seconds = Since(load_start, device);
  const int64_t pair_bytes = model::PeakGpuMemory(device).allocated_now_bytes;
  int64_t trainable = 0;
  for (const auto& [name, t] : (*student)->TrainableParameters()) trainable += t.numel();

  // One distiller per device (its learner state), every device from the pretrained set.
  const int devices = std::max(1, absl::GetFlag(FLAGS_jobs));
  const size_t together = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_jobs_together)));
  const compress::NamedTensors mirror = compress::Fp32Clones((*student)->TrainableParameters());
  std::vector<std::unique_ptr<PairDistiller>> distillers;
  std::vector<std::vector<PairSample>> device_samples;
  for (int d = 0; d < devices; ++d) {
    auto distiller = PairDistiller::Create(IdsAsTextSide(teacher->get()),
                                           IdsAsTextSide(student->get()), settings->learner, job);
    if (!distiller.ok()) {
      std::cerr << distiller.status() << "\n";
      return 1;
    }
    distillers.push_back(*std::move(distiller));
    std::vector<PairSample> mine = samples;
    std::rotate(mine.begin(), mine.begin() + (d * mine.size() / devices) % mine.size(), mine.end());
    device_samples.push_back(std::move(mine));
  }
  // What the pair holds before any job (the student's weights as its trainer holds them):
  // the peak's rest is the jobs' working memory.
  const int64_t resident_bytes = model::PeakGpuMemory(device).allocated_now_bytes;
  const std::string trace = absl::GetFlag(FLAGS_trace);
  if (!trace.empty()) {
    const torch::profiler::impl::ProfilerConfig trace_config(
        torch::profiler::impl::ProfilerState::KINETO);
    const std::set<torch::profiler::impl::ActivityType> traced = {
        torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
    try {
      torch::autograd::profiler::prepareProfiler(trace_config, traced);
      torch::autograd::profiler::enableProfiler(trace_config, traced);
    } catch (const c10::Error& e) {
      std::cerr << "--trace: LibTorch's profiler cannot trace here: " << e.what_without_backtrace()
                << "\n";
      return 1;
    }
  }
  const Clock::time_point job_start = Clock::now();
  std::vector<absl::StatusOr<PairJobResult>> results;
  for (size_t first = 0; first < distillers.size(); first += together) {
    std::vector<PairJobInput> group;
    for (size_t d = first; d < std::min(distillers.size(), first + together); ++d) {
      group.push_back({distillers[d].get(), &mirror, &device_samples[d]});
    }
    for (absl::StatusOr<PairJobResult>& r : PairDistiller::RunTogether(group)) {
      results.push_back(std::move(r));
    }
  }
  const double job_seconds = Since(job_start);
  if (!trace.empty()) {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
    try {
      torch::autograd::profiler::disableProfiler()->save(trace);
    } catch (const c10::Error& e) {
      std::cerr << "--trace: the trace could not be written to " << trace << ": "
                << e.what_without_backtrace() << "\n";
      return 1;
    }
  }
  for (size_t d = 0; d < results.size(); ++d) {
    if (!results[d].ok()) {
      std::cerr << "job of device " << d << ": " << results[d].status() << "\n";
      return 1;
    }
  }
  int64_t samples_seen = 0;
  for (const absl::StatusOr<PairJobResult>& r : results) samples_seen += r->stats.samples_seen;
  const absl::StatusOr<PairJobResult>& result = results[0];
  const model::GpuMemoryPeak peak = model::PeakGpuMemory(device);
  json terms = json::object();
  for (const LossTerm& t : result->stats.terms) {
    terms[t.name] = {{"first", t.first}, {"last", t.last}, {"mean", t.mean}};
  }
  json phases = json::object();
  for (const auto& [name, seconds] : result->stats.phases) {
    phases[name] = 1000.0 * seconds / std::max(1, result->stats.phase_timed_steps);
  }
  json prepare_phases = json::object();
  for (const auto& [name, seconds] : result->stats.prepare_phases) prepare_phases[name] = seconds;
  json phase_bytes = json::object();
  for (const auto& [name, bytes] : result->stats.phase_allocated_bytes) phase_bytes[name] = bytes;
  int64_t answer_tokens = 0;
  for (const std::string& label : result->pseudo_labels) {
    std::vector<absl::string_view> words = absl::StrSplit(label, ' ', absl::SkipEmpty());
    answer_tokens += static_cast<int64_t>(words.size());
  }
  json row = {
      {"implementation", "cdcca"},
      {"device", device.str()},
      {"teacher_precision", absl::GetFlag(FLAGS_teacher_precision)},
      {"student_precision", absl::GetFlag(FLAGS_student_precision)},
      {"samples", samples.size()},
      {"visual_tokens", tokens.size(1)},
      {"prompt_tokens", prompt_ids.size(1)},
      {"mean_answer_tokens", static_cast<double>(answer_tokens) / samples.size()},
      {"trainable_parameters", trainable},
      {"steps", result->stats.steps},
      {"batch", job.batch_size},
      {"prepare_batch", PrepareBatch(job)},
      {"fp8_base", job.fp8_base},
      {"fp8", UsesFp8Base(job, device)},
      {"fp8_native", UsesFp8Base(job, device) && model::NativeFp8Available(device)},
      {"kl_used", result->kl_used},
      {"load_seconds", load_seconds},
      {"teacher_load_seconds", teacher_load_seconds},
      {"prepare_seconds", result->stats.prepare_seconds},
      {"train_seconds", result->stats.train_seconds},
      {"job_seconds", job_seconds},
      {"train_samples_per_second", result->stats.samples_per_second},
      {"job_samples_per_second", samples_seen / job_seconds},
      {"device_jobs", devices},
      {"max_jobs_together", together},
      {"device_jobs_per_hour", devices * 3600.0 / job_seconds},
      {"terms", terms},
      {"phase_timed_steps", result->stats.phase_timed_steps},
      {"phases_ms_per_step", phases},
      {"phase_allocated_bytes", phase_bytes},
      {"prepare_phases_seconds", prepare_phases},
      {"step_seconds", result->stats.step_seconds},
      {"peak_gpu_allocated_bytes", peak.allocated_bytes},
      {"peak_gpu_reserved_bytes", peak.reserved_bytes},
      {"gpu_allocated_before_jobs_bytes", resident_bytes},
      {"gpu_allocated_after_teacher_load_bytes", teacher_bytes},
      {"gpu_allocated_after_student_load_bytes", pair_bytes},
  };
  std::cout << row.dump() << std::endl;
  return 0;
}

}  // namespace
}  // namespace cdcca::distill

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cdcca::distill::Run();
}
