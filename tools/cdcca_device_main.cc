// cdcca-device: the device agent. Reads frames (OpenCV: a camera, a video file or stream
// URL, or a folder of images) and prompts, answers them with the local student, runs UTS,
// uplinks what it is unsure about, and applies the cloud's updates in place while it keeps
// answering.
//
//   cdcca-device --cloud=cloud.example:50051 --device_id=cam-7 --token_file=cam-7.token \
//       --tls_ca=ca.pem --checkpoint_dir=models/small --state_dir=/var/lib/cdcca-device \
//       --input=camera:0 --prompt="what is in the picture?" --output=answers.jsonl
//
// Answers go to --output as JSON lines; events and the final status go to stderr as JSON
// lines. After the input ends the device keeps uplinking what its queue holds for up to
// --linger_s; the final status's "linger" says how that ended, how many batches are left on
// disk (sent at the next start) and why. Exit status: 0 after the input ends (and the linger),
// 1 on a configuration error.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cli/flags_help.h"
#include "cli/print_config.h"
#include "compress/uplink_codec.h"
#include "datasets/fashion_mnist.h"
#include "datasets/scene.h"
#include "datasets/shifts.h"
#include "device/agent.h"
#include "device/inference_runtime.h"
#include "device/internal/student.h"
#include "device/sample_step.h"
#include "model/runtime/threads.h"
#include "nlohmann/json.hpp"
#include "opencv2/imgcodecs.hpp"
#include "opencv2/imgproc.hpp"
#include "opencv2/videoio.hpp"
#include "settings/defaults.h"
#include "storage/env.h"
#include "storage/exit_at_env.h"

ABSL_FLAG(std::string, config, "",
          "JSON file whose keys are these flags' names (e.g. {\"cloud\": \"cloud:50051\", "
          "\"uts_keep_fraction\": 0.5}); flags given on the command line win");
ABSL_FLAG(std::string, cloud, "",
          "host:port of cdcca-cloud; empty = run offline (no uplink, no updates)");
ABSL_FLAG(bool, rollback, false,
          "with --cloud: before answering, return this device to its state before its newest "
          "update (or to --rollback_to_version's) together with the cloud, as a new version; "
          "exits with an error if the cloud refuses");
ABSL_FLAG(int64_t, rollback_to_version, 0,
          "with --rollback: the older version whose state to return to (0 = the one before "
          "the newest)");
ABSL_FLAG(std::string, device_id, "",
          "this device's id (1-64 of [A-Za-z0-9._-]); must match its token");
ABSL_FLAG(std::string, token, "", "bearer token (prefer --token_file: flags show up in ps)");
ABSL_FLAG(std::string, token_file, "", "file holding the bearer token (whitespace trimmed)");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA that signed the cloud's certificate (TLS)");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for mutual TLS (optional)");
ABSL_FLAG(std::string, tls_key, "", "PEM client key, with --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to check the cloud's certificate against (optional)");
ABSL_FLAG(bool, insecure, false, "plaintext to the cloud (loopback experiments only)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "the student's folder: a Hugging Face LLaVA / BLIP-2 / InstructBLIP folder, "
          "downloaded or written by cdcca pretrain (a family's student is a BLIP-2 folder; "
          "without --cloud it answers offline, see --student_template)");
ABSL_FLAG(std::string, student_precision, cdcca::settings::kStudentPrecision,
          "storage of the student's frozen base: fp32, bf16, fp16, int8 or int4 (with --cloud, "
          "the cloud's --student_precision)");
ABSL_FLAG(std::string, student_template, "auto",
          "prompt around each question: auto = the folder's chat "
          "template where it has one, else llava for LLaVA and none for BLIP-2 / InstructBLIP; "
          "chat; llava; vicuna; chatml; none");
ABSL_FLAG(int, max_answer_tokens, cdcca::settings::kMaxAnswerTokens,
          "longest answer, in tokens (1-64; the VQA answers the defaults were "
          "measured on are 1-3 words: raise it for captions or free-form answers)");
ABSL_FLAG(int64_t, lora_rank, cdcca::settings::kLoraRank,
          "with --cloud: LoRA rank on the LM's q and v (the cloud's "
          "--lora_rank; Register refuses a mismatch)");
ABSL_FLAG(double, lora_alpha, cdcca::settings::kLoraAlpha, "with --cloud: LoRA alpha");
ABSL_FLAG(bool, lora_mlp, cdcca::settings::kLoraMlp, "with --cloud: LoRA on the LM's MLP too");
ABSL_FLAG(bool, lora_qformer, cdcca::settings::kLoraQformer,
          "with --cloud: LoRA on the Q-Former's attention query and value too (BLIP-2, "
          "InstructBLIP; the cloud's --lora_qformer)");
ABSL_FLAG(bool, lora_projector, false,
          "with --cloud: LoRA on the projector into the LM too (LLaVA's multi_modal_projector, "
          "BLIP-2's language_projection; the cloud's --lora_projector). Unset: --profile's "
          "(measured: on for LLaVA, off otherwise; paper: off)");
ABSL_FLAG(bool, lora_vision, cdcca::settings::kLoraVision,
          "with --cloud: the vision tower's attention LoRA and LayerNorms too, trained by the "
          "cloud from the frames (the cloud's --lora_vision; uplink frames with it)");
ABSL_FLAG(std::string, profile, cdcca::settings::kProfile,
          "defaults of --uplink_precision and --lora_projector where they are unset: measured "
          "(the frames uplinked, the projector's LoRA on LLaVA: the best measured) or paper "
          "(the paper's fp16 token uplink and LoRA on the LM alone); the cloud's --profile");
ABSL_FLAG(int, torch_threads, 0,
          "LibTorch intra-op threads (0 = automatic: 1, the BLAS threads matrix products over "
          "every core)");
ABSL_FLAG(int, blas_threads, 0,
          "threads of the BLAS that multiplies matrices (OpenBLAS), process-wide (0 = its own "
          "default: one per core); 1 where the program shares its cores with a serving path, "
          "whose idle BLAS workers otherwise spin on them");
ABSL_FLAG(std::string, state_dir, "",
          "directory of the last good trainable state and the uplink queue");
ABSL_FLAG(std::string, input, "",
          "frames: camera:N (camera index N), a folder of images (png/jpg/bmp, name order), "
          "a video file / stream URL, or scenes:SHIFT[:SEVERITY] (an endless stream from the "
          "Fashion-MNIST scene generator with a domain shift, e.g. scenes:fog:3, for demos)");
ABSL_FLAG(bool, loop, false, "start the image folder or video over when it ends");
ABSL_FLAG(int64_t, frames, 0, "stop after this many frames (0 = when the input ends)");
ABSL_FLAG(double, fps, 0,
          "pace the input to this many frames per second (0 = as fast as answered)");
ABSL_FLAG(int, batch, 1, "frames answered together in one batch");
ABSL_FLAG(std::string, prompt, "what is in the picture?", "the question asked about every frame");
ABSL_FLAG(std::string, prompts_file, "",
          "questions, one per line, used in turn (overrides --prompt)");
ABSL_FLAG(std::string, output, "-", "JSONL file of answers; - = stdout");
ABSL_FLAG(int64_t, bandwidth, 0, "uplink bandwidth cap in payload bytes per second (0 = none)");
ABSL_FLAG(int, poll_ms, 2000, "how often to poll the cloud for updates, ms");
ABSL_FLAG(int, uplink_batch_samples, 8, "kept samples per uplink batch");
ABSL_FLAG(double, uplink_max_age_s, 5, "flush a partial uplink batch after this many seconds");
ABSL_FLAG(int64_t, queue_max_mb, 64,
          "most MiB of uplink batches kept on disk while the cloud is away");
ABSL_FLAG(int64_t, update_byte_budget, 0,
          "downlink bytes per update asked of the cloud (0 = its default)");
ABSL_FLAG(double, uts_keep_fraction, cdcca::settings::kUtsKeepFraction,
          "local default: fraction of frames UTS stage 1 keeps (running quantile); the cloud's "
          "Register reply overrides it");
ABSL_FLAG(double, uts_token_ratio, cdcca::settings::kUtsTokenRatio,
          "local default: fraction of visual tokens UTS stage 2 keeps");
ABSL_FLAG(int, uts_mc_passes, cdcca::settings::kUtsMcPasses,
          "local default: MC-dropout passes of UTS stage 2");
ABSL_FLAG(double, uts_random_share, cdcca::settings::kUtsRandomShare,
          "local default: share of the frames UTS stage 1 passes over that go up all the same");
ABSL_FLAG(double, uts_dropout, cdcca::settings::kUtsDropout,
          "rate of UTS stage 2's element-wise dropout on the visual tokens in each pass");
ABSL_FLAG(std::string, uplink_precision, "",
          "precision of the kept visual tokens the device uplinks (fp16 | int8 | int4), or, on a "
          "Hugging Face folder, "
          "jpeg: the frame at the vision tower's input size as JPEG (quality 90) plus the kept "
          "indices, the cloud recomputing the tokens with the tower the pair shares. Unset: "
          "--profile's (measured: jpeg; paper: fp16; fp16 where the model cannot send frames)");
ABSL_FLAG(int, max_attempts, 6, "attempts per cloud call while the link is down");
ABSL_FLAG(double, linger_s, 0,
          "after the input ends, keep uplinking until the uplink queue is empty (batches the "
          "cloud refuses for good are dropped) and the model is in sync, for at most this many "
          "seconds; the exit line says how many batches are left and why");
ABSL_FLAG(int64_t, linger_until_version, 0,
          "with --linger_s: also wait until the model runs at least this version");
ABSL_FLAG(bool, print_config, false,
          "print the configuration this command line runs (every flag; the token hidden) as "
          "JSON on stdout, and exit");
ABSL_FLAG(std::string, status_file, "",
          "write the agent's status as JSON here (atomically) about once a second");

namespace {

using cdcca::device::AgentStats;

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "cdcca-device: %s\n", s.ToString().c_str());
  return 1;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The agent's status; `failed_frames` counts the frames the model could not answer.
// waiting_batches: batches in the durable queue now; queued_batches_total: batches queued
// since the program started. `linger`, once the linger ended: its outcome (LingerOutcome).
std::string StatusJson(const AgentStats& s, int64_t failed_frames, const std::string& linger = "") {
  std::string json = absl::StrFormat(
      "{\"version\":%d,\"digest\":\"%016x\",\"answered\":%d,\"failed_frames\":%d,"
      "\"kept\":%d,\"held_out_samples\":%d,\"dropped\":%d,\"unsent_samples\":%d,"
      "\"queued_batches_total\":%d,\"waiting_batches\":%d,\"acked\":%d,\"uplink_bytes\":%d,"
      "\"dropped_batches\":%d,\"dropped_batches_by_reason\":%s,\"uplink_backoffs\":%d,"
      "\"renumbered\":%d,"
      "\"updates_applied\":%d,\"resyncs\":%d,\"rollbacks\":%d,\"rejected_updates\":%d,"
      "\"registered\":%s,"
      "\"link_up\":%s,\"in_sync\":%s}",
      s.version, s.state_digest, s.answered, failed_frames, s.kept_samples, s.held_out_samples,
      s.dropped_samples, s.unsent_samples, s.batches_queued, s.queue.batches, s.batches_acked,
      s.uplink_bytes, s.dropped_batches, nlohmann::json(s.dropped_batches_by_reason).dump(),
      s.uplink_backoffs, s.renumbered, s.updates_applied, s.resyncs, s.rollbacks,
      s.rejected_updates, s.registered ? "true" : "false", s.link_up ? "true" : "false",
      s.in_sync ? "true" : "false");
  if (!linger.empty()) {
    json.pop_back();
    absl::StrAppend(&json, ",\"linger\":", linger, "}");
  }
  return json;
}

// Frames from OpenCV, converted to RGB datasets::Image.
class FrameSource {
 public:
  static absl::StatusOr<std::unique_ptr<FrameSource>> Open(const std::string& spec, bool loop) {
    auto src = std::unique_ptr<FrameSource>(new FrameSource);
    src->loop_ = loop;
    std::error_code ec;
    if (absl::StartsWith(spec, "scenes:")) {
      std::vector<std::string> parts = absl::StrSplit(spec, ':');
      absl::StatusOr<cdcca::datasets::ImageShift> shift =
          cdcca::datasets::ImageShiftFromName(parts[1]);
      if (!shift.ok()) return shift.status();
      src->shift_ = *shift;
      if (parts.size() > 2 && !absl::SimpleAtoi(parts[2], &src->severity_)) {
        return absl::InvalidArgumentError("--input=scenes:SHIFT:SEVERITY needs a number");
      }
      absl::StatusOr<cdcca::datasets::ImageSet> set =
          cdcca::datasets::LoadFashionMnist(cdcca::datasets::Split::kTest);
      if (!set.ok()) return set.status();
      src->scenes_ = std::make_unique<cdcca::datasets::ImageSet>(*std::move(set));
    } else if (absl::StartsWith(spec, "camera:")) {
      int index = 0;
      if (!absl::SimpleAtoi(spec.substr(7), &index)) {
        return absl::InvalidArgumentError("--input=camera:N needs a number");
      }
      if (!src->capture_.open(index)) {
        return absl::UnavailableError(absl::StrCat("cannot open camera ", index));
      }
    } else if (std::filesystem::is_directory(spec, ec)) {
      for (const auto& e : std::filesystem::directory_iterator(spec)) {
        std::string ext = absl::AsciiStrToLower(e.path().extension().string());
        if (ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp") {
          src->files_.push_back(e.path().string());
        }
      }
      std::sort(src->files_.begin(), src->files_.end());
      if (src->files_.empty()) {
        return absl::NotFoundError(absl::StrCat("no png/jpg/bmp images in ", spec));
      }
    } else {
      src->spec_ = spec;
      if (!src->capture_.open(spec)) {
        return absl::UnavailableError(absl::StrCat("cannot open video or stream ", spec));
      }
    }
    return src;
  }

  // The next frame and its name; false when the input has ended.
  bool Next(cdcca::datasets::Image* image, std::string* name) {
    cv::Mat bgr;
    if (scenes_ != nullptr) {
      const uint64_t seed = 0x5ce9e5 + count_;
      cdcca::datasets::Rng rng(seed);
      cdcca::datasets::Scene scene =
          cdcca::datasets::RenderScene(*scenes_, cdcca::datasets::SceneOptions{}, rng);
      *image = std::move(scene.image);
      if (!cdcca::datasets::ApplyShift(shift_, severity_, seed, *image).ok()) return false;
      *name = absl::StrCat("scene-", count_++);
      return true;
    }
    if (!files_.empty()) {
      if (next_ >= files_.size()) {
        if (!loop_) return false;
        next_ = 0;
      }
      *name = files_[next_++];
      bgr = cv::imread(*name, cv::IMREAD_COLOR);
      if (bgr.empty()) return Next(image, name);  // unreadable file: skip it
    } else {
      if (!capture_.read(bgr) || bgr.empty()) {
        if (!loop_ || spec_.empty()) return false;
        capture_.open(spec_);
        if (!capture_.read(bgr) || bgr.empty()) return false;
      }
      *name = absl::StrCat("frame-", count_);
    }
    ++count_;
    cv::Mat rgb;
    cv::cvtColor(bgr, rgb, cv::COLOR_BGR2RGB);
    *image = cdcca::datasets::Image(rgb.cols, rgb.rows);
    for (int y = 0; y < rgb.rows; ++y) {
      std::memcpy(image->at(0, y), rgb.ptr<uint8_t>(y), static_cast<size_t>(rgb.cols) * 3);
    }
    return true;
  }

 private:
  FrameSource() = default;
  cv::VideoCapture capture_;
  std::string spec_;
  std::vector<std::string> files_;
  size_t next_ = 0;
  uint64_t count_ = 0;
  bool loop_ = false;
  std::unique_ptr<cdcca::datasets::ImageSet> scenes_;  // scenes:SHIFT input
  cdcca::datasets::ImageShift shift_ = cdcca::datasets::ImageShift::kNone;
  int severity_ = 3;
};

// --uplink_precision, or INVALID_ARGUMENT naming the flag.
absl::StatusOr<cdcca::compress::FeaturePrecision> UplinkPrecisionFlag() {
  absl::StatusOr<cdcca::compress::FeaturePrecision> p =
      cdcca::compress::ParseFeaturePrecision(absl::GetFlag(FLAGS_uplink_precision));
  if (!p.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--uplink_precision: ", p.status().message()));
  }
  return p;
}

// The student runtime both paths answer through, from the flags.
absl::StatusOr<cdcca::device::RuntimeOptions> RuntimeOptionsFromFlags() {
  cdcca::device::RuntimeOptions o;
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.precision = absl::GetFlag(FLAGS_student_precision);
  o.threads = absl::GetFlag(FLAGS_torch_threads);
  o.max_answer_tokens = absl::GetFlag(FLAGS_max_answer_tokens);
  if (o.max_answer_tokens < 1 || o.max_answer_tokens > 64) {
    return absl::InvalidArgumentError("--max_answer_tokens must be in 1-64");
  }
  o.student_template = absl::GetFlag(FLAGS_student_template);
  o.lora_rank = absl::GetFlag(FLAGS_lora_rank);
  o.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
  o.lora_mlp = absl::GetFlag(FLAGS_lora_mlp);
  o.lora_qformer = absl::GetFlag(FLAGS_lora_qformer);
  o.lora_projector = absl::GetFlag(FLAGS_lora_projector);
  o.lora_vision = absl::GetFlag(FLAGS_lora_vision);
  return o;
}

// The device's local UTS settings, from --uts_* and --uplink_precision.
absl::StatusOr<cdcca::device::UtsOptions> UtsFromFlags() {
  cdcca::device::UtsOptions uts;
  uts.keep_fraction = static_cast<float>(absl::GetFlag(FLAGS_uts_keep_fraction));
  uts.token_ratio = static_cast<float>(absl::GetFlag(FLAGS_uts_token_ratio));
  uts.mc_passes = absl::GetFlag(FLAGS_uts_mc_passes);
  uts.random_share = static_cast<float>(absl::GetFlag(FLAGS_uts_random_share));
  if (!(uts.random_share >= 0 && uts.random_share < 1)) {
    return absl::InvalidArgumentError("--uts_random_share must be in [0, 1)");
  }
  uts.dropout_p = static_cast<float>(absl::GetFlag(FLAGS_uts_dropout));
  absl::StatusOr<cdcca::compress::FeaturePrecision> precision = UplinkPrecisionFlag();
  if (!precision.ok()) return precision.status();
  uts.precision = *precision;
  return uts;
}

// True when the command line or --config set --uplink_precision (main fills it in): an
// uplink the profile chose falls back to the tokens on a model that cannot send frames, one
// the user chose is refused there.
bool g_uplink_precision_given = false;

// The uplink `uts` asks for, fitted to what `runtime` can send; INVALID_ARGUMENT for frames
// the user asked for from a model that cannot send them.
absl::Status FitUplinkToModel(const cdcca::device::InferenceRuntime& runtime,
                              cdcca::device::UtsOptions* uts) {
  if (uts->precision != cdcca::compress::FeaturePrecision::kJpeg || runtime.CanSendFrames()) {
    return absl::OkStatus();
  }
  if (g_uplink_precision_given) {
    return absl::InvalidArgumentError(
        "--uplink_precision=jpeg: this model cannot send frames (its image processor has no "
        "fixed output size)");
  }
  uts->precision = cdcca::compress::FeaturePrecision::kFp16;
  std::fprintf(stderr,
               "{\"event\":\"uplink_precision\",\"precision\":\"fp16\",\"why\":\"this model "
               "cannot send frames (its image processor has no fixed output size)\"}\n");
  return absl::OkStatus();
}

// cdcca-device without a cloud: answers every frame through the runtime the --cloud path runs
// and runs the device step on it (SampleStep, no update guard: nothing is held out): stage 1
// on the mean answer-token entropy (running quantile, --uts_keep_fraction), stage 2 on the
// frames it keeps (--uts_mc_passes, --uts_dropout, --uts_token_ratio), and the sample the
// agent would uplink encoded at --uplink_precision, with its size in the answer line.
int RunOffline(const std::vector<std::string>& prompts) {
  using cdcca::device::SampleDecision;
  absl::StatusOr<cdcca::device::RuntimeOptions> runtime_options = RuntimeOptionsFromFlags();
  if (!runtime_options.ok()) return Fail(runtime_options.status());
  absl::StatusOr<cdcca::device::UtsOptions> uts = UtsFromFlags();
  if (!uts.ok()) return Fail(uts.status());
  if (!(uts->keep_fraction >= 0 && uts->keep_fraction <= 1)) {
    return Fail(absl::InvalidArgumentError("--uts_keep_fraction must be in [0, 1]"));
  }
  if (!(uts->token_ratio > 0 && uts->token_ratio <= 1)) {
    return Fail(absl::InvalidArgumentError("--uts_token_ratio must be in (0, 1]"));
  }
  if (uts->mc_passes < 1 || uts->mc_passes > 64) {
    return Fail(absl::InvalidArgumentError("--uts_mc_passes must be in 1-64"));
  }
  if (!(uts->dropout_p > 0 && uts->dropout_p < 1)) {
    return Fail(absl::InvalidArgumentError("--uts_dropout must be in (0, 1)"));
  }
  absl::StatusOr<std::unique_ptr<cdcca::device::InferenceRuntime>> runtime =
      cdcca::device::InferenceRuntime::Load(*runtime_options);
  if (!runtime.ok()) return Fail(runtime.status());
  if (absl::Status s = FitUplinkToModel(**runtime, &*uts); !s.ok()) return Fail(s);
  cdcca::device::SampleStepOptions step_options;
  step_options.uts = *uts;
  cdcca::device::SampleStep step(step_options);
  absl::StatusOr<std::unique_ptr<FrameSource>> source =
      FrameSource::Open(absl::GetFlag(FLAGS_input), absl::GetFlag(FLAGS_loop));
  if (!source.ok()) return Fail(source.status());
  FILE* out = stdout;
  if (absl::GetFlag(FLAGS_output) != "-") {
    out = std::fopen(absl::GetFlag(FLAGS_output).c_str(), "a");
    if (out == nullptr) return Fail(absl::NotFoundError("cannot open --output"));
  }
  std::fprintf(stderr,
               "{\"event\":\"start\",\"mode\":\"model_folder\",\"model_type\":%s,"
               "\"uplink\":false,\"blas_threads\":%d}\n",
               JsonString(cdcca::cli::FolderModelType(runtime_options->checkpoint_dir)).c_str(),
               cdcca::model::BlasThreads());
  const int64_t max_frames = absl::GetFlag(FLAGS_frames);
  int64_t frame_index = 0;
  cdcca::device::Frame frame;
  std::string name;
  while (!g_stop && (max_frames == 0 || frame_index < max_frames) &&
         (*source)->Next(&frame.image, &name)) {
    const std::string& question = prompts[static_cast<size_t>(frame_index) % prompts.size()];
    frame.question = question;
    absl::StatusOr<std::vector<cdcca::device::AnswerResult>> answers = (*runtime)->Answer({frame});
    if (!answers.ok()) return Fail(answers.status());
    const cdcca::device::AnswerResult& a = answers->front();
    const SampleDecision d = step.Run(cdcca::device::AnsweredFrameOf(a, (*runtime)->version()),
                                      cdcca::device::FrameModelOf(runtime->get(), a),
                                      static_cast<uint64_t>(frame_index));
    std::string uts_fields = ",\"uts_kept\":false";
    if (d.chosen()) {
      const absl::StatusOr<std::string> payload =
          d.status.ok() ? cdcca::compress::EncodeUplinkBatch({d.sample}, uts->precision)
                        : absl::StatusOr<std::string>(d.status);
      if (!payload.ok()) {
        // The answer stands; the line says why its sample would not be uplinked.
        uts_fields = absl::StrFormat(",\"uts_kept\":true,\"uplink_error\":%s",
                                     JsonString(payload.status().ToString()));
      } else {
        uts_fields = absl::StrFormat(
            ",\"uts_kept\":true,\"tokens_kept\":%zu,\"tokens_total\":%d,\"uplink_bytes\":%zu,"
            "\"stage2_ms\":%.2f",
            d.sample.kept_indices.size(), a.visual.tokens, payload->size(),
            d.stage2_seconds * 1000.0);
      }
    }
    std::fprintf(out,
                 "{\"frame\":%lld,\"source\":%s,\"question\":%s,\"answer\":%s,"
                 "\"entropy\":%.4f,\"tokens\":%zu,\"uplinked\":false%s,\"latency_ms\":%.2f,"
                 "\"unix_ms\":%lld}\n",
                 static_cast<long long>(frame_index), JsonString(name).c_str(),
                 JsonString(question).c_str(), JsonString(a.text).c_str(), a.entropy,
                 a.answer_ids.size(), uts_fields.c_str(), a.latency_ms,
                 static_cast<long long>(absl::ToUnixMillis(absl::Now())));
    std::fflush(out);
    ++frame_index;
  }
  std::fprintf(stderr, "{\"event\":\"exit\",\"frames\":%lld}\n",
               static_cast<long long>(frame_index));
  if (out != stdout) std::fclose(out);
  return 0;
}

// The prompts the frames ask in turn: --prompts_file's non-empty lines, else --prompt.
absl::StatusOr<std::vector<std::string>> PromptsFromFlags() {
  std::vector<std::string> prompts;
  if (absl::GetFlag(FLAGS_prompts_file).empty()) {
    prompts.push_back(absl::GetFlag(FLAGS_prompt));
    return prompts;
  }
  std::ifstream in(absl::GetFlag(FLAGS_prompts_file));
  if (!in) return absl::NotFoundError("cannot read --prompts_file");
  for (std::string line; std::getline(in, line);) {
    line = std::string(absl::StripAsciiWhitespace(line));
    if (!line.empty()) prompts.push_back(line);
  }
  if (prompts.empty()) return absl::InvalidArgumentError("--prompts_file has no prompt");
  return prompts;
}

// The connection to --cloud as the flags describe it.
absl::StatusOr<std::unique_ptr<cdcca::device::CloudClient>> ClientFromFlags() {
  cdcca::device::CloudClientOptions co;
  co.target = absl::GetFlag(FLAGS_cloud);
  co.device_id = absl::GetFlag(FLAGS_device_id);
  co.token = absl::GetFlag(FLAGS_token);
  if (!absl::GetFlag(FLAGS_token_file).empty()) {
    absl::StatusOr<std::string> t =
        cdcca::storage::ReadFile(*cdcca::storage::Env::Default(), absl::GetFlag(FLAGS_token_file));
    if (!t.ok()) return t.status();
    co.token = std::string(absl::StripAsciiWhitespace(*t));
  }
  if (co.device_id.empty() || co.token.empty()) {
    return absl::InvalidArgumentError("--device_id and a token are required with --cloud");
  }
  co.insecure = absl::GetFlag(FLAGS_insecure);
  co.tls = {absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
            absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_server_name)};
  co.max_attempts = std::max(1, absl::GetFlag(FLAGS_max_attempts));
  return cdcca::device::CloudClient::Create(co);
}

// The agent's options as the flags set them.
absl::StatusOr<cdcca::device::AgentOptions> AgentOptionsFromFlags() {
  cdcca::device::AgentOptions ao;
  ao.state_dir = absl::GetFlag(FLAGS_state_dir);
  absl::StatusOr<cdcca::device::UtsOptions> uts = UtsFromFlags();
  if (!uts.ok()) return uts.status();
  ao.uts = *uts;
  ao.batch_samples = absl::GetFlag(FLAGS_uplink_batch_samples);
  ao.batch_max_age = absl::Seconds(absl::GetFlag(FLAGS_uplink_max_age_s));
  ao.bandwidth_bytes_per_s =
      static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_bandwidth)));
  ao.poll_interval = absl::Milliseconds(std::max(10, absl::GetFlag(FLAGS_poll_ms)));
  ao.queue_max_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_queue_max_mb)) << 20;
  ao.update_byte_budget = static_cast<uint64_t>(absl::GetFlag(FLAGS_update_byte_budget));
  ao.env = cdcca::storage::ProgramEnv();
  return ao;
}

// What the agent loop writes: answers to `out` (JSON lines), the status file about once a
// second, frames that failed.
struct AgentOutputs {
  cdcca::device::DeviceAgent* agent = nullptr;
  FILE* out = stdout;
  std::string status_file;
  int64_t failed_frames = 0;
  int64_t frames = 0;
  std::string linger;  // the linger's outcome as JSON, once it ended

  std::string Json() const { return StatusJson(agent->Stats(), failed_frames, linger); }
  void WriteStatus() const {
    if (status_file.empty()) return;
    (void)cdcca::storage::WriteFileAtomically(*cdcca::storage::Env::Default(), status_file,
                                              Json() + "\n");
  }
};

// Feeds --input's frames, --batch at a time at --fps, through the agent until the input
// ends, --frames are done or a signal comes. A batch the model cannot answer is counted and
// passed over: one input does not stop the device.
void StreamFrames(FrameSource& source, const std::vector<std::string>& prompts,
                  AgentOutputs& outputs) {
  using cdcca::device::Frame;
  const int64_t max_frames = absl::GetFlag(FLAGS_frames);
  const double fps = absl::GetFlag(FLAGS_fps);
  const int batch = std::max(1, absl::GetFlag(FLAGS_batch));
  const absl::Time start = absl::Now();
  absl::Time last_status = absl::InfinitePast();
  int64_t& frame_index = outputs.frames;
  bool ended = false;
  while (!g_stop && !ended && (max_frames == 0 || frame_index < max_frames)) {
    std::vector<Frame> frames;
    std::vector<std::string> names;
    while (static_cast<int>(frames.size()) < batch &&
           (max_frames == 0 || frame_index + static_cast<int64_t>(frames.size()) < max_frames)) {
      Frame f;
      std::string name;
      if (!source.Next(&f.image, &name)) {
        ended = true;
        break;
      }
      f.question = prompts[(frame_index + frames.size()) % prompts.size()];
      frames.push_back(std::move(f));
      names.push_back(std::move(name));
    }
    if (frames.empty()) break;
    if (fps > 0) {
      // Frame i is due at start + i / fps.
      absl::SleepFor(start + absl::Seconds((frame_index + frames.size()) / fps) - absl::Now());
    }
    absl::StatusOr<std::vector<cdcca::device::FrameResult>> results =
        outputs.agent->Process(frames);
    if (!results.ok()) {
      outputs.failed_frames += static_cast<int64_t>(frames.size());
      frame_index += static_cast<int64_t>(frames.size());
      std::fprintf(stderr, "{\"event\":\"frame_failed\",\"frames\":%zu,\"error\":%s}\n",
                   frames.size(), JsonString(results.status().ToString()).c_str());
      continue;
    }
    for (size_t i = 0; i < results->size(); ++i) {
      const cdcca::device::FrameResult& r = (*results)[i];
      std::fprintf(outputs.out,
                   "{\"frame\":%lld,\"source\":%s,\"question\":%s,\"answer\":%s,"
                   "\"entropy\":%.4f,\"model_version\":%llu,\"uplinked\":%s,\"kept_tokens\":%d,"
                   "\"latency_ms\":%.2f,\"unix_ms\":%lld}\n",
                   static_cast<long long>(frame_index), JsonString(names[i]).c_str(),
                   JsonString(frames[i].question).c_str(), JsonString(r.answer).c_str(), r.entropy,
                   static_cast<unsigned long long>(r.model_version), r.uplinked ? "true" : "false",
                   r.kept_tokens, r.latency_ms,
                   static_cast<long long>(absl::ToUnixMillis(absl::Now())));
      ++frame_index;
    }
    std::fflush(outputs.out);
    if (absl::Now() - last_status >= absl::Seconds(1)) {
      outputs.WriteStatus();
      last_status = absl::Now();
    }
  }
}

// Why the device is not done after its input (the agent's `s`): batches wait in the queue,
// or the model is not in sync at --linger_until_version or later. "" when it is done.
std::string NotDoneBecause(const AgentStats& s) {
  const auto with = [](std::string what, const std::string& detail) {
    return detail.empty() ? what : absl::StrCat(what, ": ", detail);
  };
  if (s.queue.batches > 0) {
    if (!s.link_up) return with("link down", s.link_error);
    if (!s.registered) return with("not registered with the cloud", s.link_error);
    if (s.uplink_backing_off) {
      return with("the uplink backs off after the cloud's refusal", s.last_refusal);
    }
    if (!s.link_error.empty()) return with("link error", s.link_error);
    return "the uplink is still sending them";
  }
  if (!s.registered) return with("not registered with the cloud", s.link_error);
  if (!s.in_sync) return with("the model is not in sync with the cloud", s.link_error);
  const int64_t until = absl::GetFlag(FLAGS_linger_until_version);
  if (s.version < static_cast<uint64_t>(until)) {
    return absl::StrFormat("the model runs version %d, not yet --linger_until_version=%d",
                           s.version, until);
  }
  return "";
}

// How the linger after the input ended.
struct LingerOutcome {
  // "drained": nothing waits in the queue and the model is in sync (at
  // --linger_until_version or later); "deadline": --linger_s passed first; "signal": SIGINT or
  // SIGTERM came first; "off": --linger_s=0 and the device was not done.
  std::string ended;
  double seconds = 0;          // spent lingering
  size_t waiting_batches = 0;  // left in the durable queue at exit
  std::string why;             // NotDoneBecause at the end ("" when drained)

  std::string Json() const {
    return absl::StrFormat("{\"ended\":\"%s\",\"seconds\":%.3f,\"waiting_batches\":%d,\"why\":%s}",
                           ended, seconds, waiting_batches, JsonString(why));
  }
};

// Keeps the link working after the input ended, until the device is done (NotDoneBecause:
// the queue empty, the batches the cloud refuses for good dropped by the agent, the model in
// sync), --linger_s passes or a signal comes. Stops the agent and returns how it ended, with
// the batches left on disk.
LingerOutcome LingerAndStop(const AgentOutputs& outputs) {
  const absl::Time start = absl::Now();
  const double linger_s = std::max(0.0, absl::GetFlag(FLAGS_linger_s));
  const absl::Time end = start + absl::Seconds(linger_s);
  LingerOutcome out;
  while (true) {
    outputs.WriteStatus();
    out.why = NotDoneBecause(outputs.agent->Stats());
    if (out.why.empty()) {
      out.ended = "drained";
      break;
    }
    if (g_stop) {
      out.ended = "signal";
      break;
    }
    if (absl::Now() >= end) {
      out.ended = linger_s > 0 ? "deadline" : "off";
      break;
    }
    absl::SleepFor(std::min(absl::Milliseconds(200), end - absl::Now()));
  }
  // The call in flight ends inside Stop and may move the queue: count what is left after it.
  outputs.agent->Stop();
  const AgentStats last = outputs.agent->Stats();
  out.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  out.waiting_batches = last.queue.batches;
  if (out.ended != "drained" && NotDoneBecause(last).empty()) {
    out.ended = "drained";
    out.why.clear();
  }
  return out;
}

// The collaborative loop with --cloud: the runtime, the client and the agent, the frames
// streamed through it, then the linger (LingerAndStop).
int RunWithCloud(const std::vector<std::string>& prompts) {
  using namespace cdcca::device;  // NOLINT: the program's own loop
  if (absl::GetFlag(FLAGS_state_dir).empty()) {
    return Fail(absl::InvalidArgumentError("--state_dir is required with --cloud"));
  }
  absl::StatusOr<RuntimeOptions> runtime_options = RuntimeOptionsFromFlags();
  if (!runtime_options.ok()) return Fail(runtime_options.status());
  absl::StatusOr<std::unique_ptr<InferenceRuntime>> runtime =
      InferenceRuntime::Load(*runtime_options);
  if (!runtime.ok()) return Fail(runtime.status());
  absl::StatusOr<std::unique_ptr<CloudClient>> client = ClientFromFlags();
  if (!client.ok()) return Fail(client.status());
  absl::StatusOr<AgentOptions> ao = AgentOptionsFromFlags();
  if (!ao.ok()) return Fail(ao.status());
  if (absl::Status s = FitUplinkToModel(**runtime, &ao->uts); !s.ok()) return Fail(s);
  absl::StatusOr<std::unique_ptr<DeviceAgent>> agent =
      DeviceAgent::Create(*ao, runtime->get(), client->get());
  if (!agent.ok()) return Fail(agent.status());
  absl::StatusOr<std::unique_ptr<FrameSource>> source =
      FrameSource::Open(absl::GetFlag(FLAGS_input), absl::GetFlag(FLAGS_loop));
  if (!source.ok()) return Fail(source.status());

  AgentOutputs outputs;
  outputs.agent = agent->get();
  outputs.status_file = absl::GetFlag(FLAGS_status_file);
  if (absl::GetFlag(FLAGS_output) != "-") {
    outputs.out = std::fopen(absl::GetFlag(FLAGS_output).c_str(), "a");
    if (outputs.out == nullptr) return Fail(absl::UnavailableError("cannot open --output"));
  }
  {
    AgentStats s = (*agent)->Stats();
    std::fprintf(
        stderr,
        "{\"event\":\"start\",\"device_id\":%s,\"cloud\":%s,\"version\":%llu,"
        "\"digest\":\"%016llx\",\"waiting_batches\":%zu,\"token_score\":%s,"
        "\"blas_threads\":%d}\n",
        JsonString(absl::GetFlag(FLAGS_device_id)).c_str(),
        JsonString(absl::GetFlag(FLAGS_cloud)).c_str(), static_cast<unsigned long long>(s.version),
        static_cast<unsigned long long>(s.state_digest), s.queue.batches,
        JsonString(std::string(TokenScoreName((*runtime)->EffectiveScore(ao->uts.score)))).c_str(),
        cdcca::model::BlasThreads());
  }
  if (absl::GetFlag(FLAGS_rollback)) {
    const int64_t to = absl::GetFlag(FLAGS_rollback_to_version);
    if (to < 0) return Fail(absl::InvalidArgumentError("--rollback_to_version must be >= 0"));
    auto rolled = (*agent)->RollBack(static_cast<uint64_t>(to));
    if (!rolled.ok()) return Fail(rolled.status());
  }
  (*agent)->Start();
  StreamFrames(**source, prompts, outputs);
  if (absl::Status s = (*agent)->Flush(); !s.ok()) return Fail(s);
  outputs.linger = LingerAndStop(outputs).Json();
  outputs.WriteStatus();
  std::fprintf(stderr, "{\"event\":\"exit\",\"frames\":%lld,\"status\":%s}\n",
               static_cast<long long>(outputs.frames), outputs.Json().c_str());
  if (outputs.out != stdout) std::fclose(outputs.out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the cdcca device agent.\n"
      "  cdcca-device --cloud=HOST:PORT --device_id=ID --token_file=F (--tls_ca=CA | --insecure)\n"
      "      --checkpoint_dir=DIR --state_dir=DIR --input=(camera:N|FOLDER|VIDEO|URL)\n"
      "      [--prompt=Q | --prompts_file=F] [--output=answers.jsonl]\n"
      "Answers go to --output as JSON lines; events go to stderr. See README (Deploying).");
  // --help lists this file's flags (absl matches the program name, spelt with '-').
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "cdcca_device_main");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  cdcca::cli::ParseFlagsOrHelp(argc, argv, [&usage](std::string_view file) {
    return usage.contains_help_flags(absl::string_view(file.data(), file.size()));
  });
  using namespace cdcca::device;  // NOLINT: a program's main

  const cdcca::cli::FlagFilter own = [&usage](const absl::CommandLineFlag& flag) {
    return usage.contains_help_flags(flag.Filename());
  };
  if (absl::Status s = cdcca::cli::ApplyConfigFile(absl::GetFlag(FLAGS_config), argc, argv, own);
      !s.ok()) {
    return Fail(s);
  }
  const std::set<std::string> given =
      cdcca::cli::GivenFlags(argc, argv, absl::GetFlag(FLAGS_config));
  g_uplink_precision_given = given.count("uplink_precision") > 0;
  if (absl::Status s = cdcca::cli::ApplyProfile(
          absl::GetFlag(FLAGS_profile),
          cdcca::cli::FolderModelType(absl::GetFlag(FLAGS_checkpoint_dir)), given);
      !s.ok()) {
    return Fail(s);
  }
  if (absl::GetFlag(FLAGS_print_config)) {
    nlohmann::json config = cdcca::cli::FlagsJson(own, {"token"});
    config.erase("print_config");
    std::printf("%s\n", config.dump(2).c_str());
    return 0;
  }
  if (absl::GetFlag(FLAGS_checkpoint_dir).empty()) {
    return Fail(absl::InvalidArgumentError("--checkpoint_dir is required"));
  }
  if (absl::Status s = cdcca::model::ApplyBlasThreadsFlag(absl::GetFlag(FLAGS_blas_threads));
      !s.ok()) {
    return Fail(s);
  }
  if (absl::GetFlag(FLAGS_input).empty()) {
    return Fail(absl::InvalidArgumentError("--input is required (see --help)"));
  }
  if (!internal::IsModelFolder(absl::GetFlag(FLAGS_checkpoint_dir))) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint_dir=", absl::GetFlag(FLAGS_checkpoint_dir),
        " is not a model folder: its config.json must name a llava, blip-2 or instructblip "
        "model_type")));
  }
  absl::StatusOr<std::vector<std::string>> prompts = PromptsFromFlags();
  if (!prompts.ok()) return Fail(prompts.status());
  // Without a cloud the device answers offline (and reports what UTS would uplink); with
  // one, it runs the collaborative loop.
  if (absl::GetFlag(FLAGS_cloud).empty()) {
    if (absl::GetFlag(FLAGS_rollback)) {
      return Fail(absl::InvalidArgumentError("--rollback needs --cloud"));
    }
    return RunOffline(*prompts);
  }
  return RunWithCloud(*prompts);
}
