#include "device/agent.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compress/uplink_codec.h"
#include "device/internal/state_file.h"
#include "device/uts_cloud_settings.h"
#include "proto/wire.h"
#include "storage/env.h"

namespace cdcca::device {
namespace {

constexpr uint32_t kCodecVersion = 1;  // compress/uplink_codec.h's format

// The device step of an agent: the device's id keys the held-out choice; the held-out share
// comes with the first Register reply (SampleStep::Reconfigure).
SampleStepOptions StepOptions(const AgentOptions& options, const CloudClient& client) {
  SampleStepOptions o;
  o.uts = options.uts;
  o.device_id = client.device_id();
  o.score_seed = options.score_seed;
  return o;
}

// One JSON log line on stderr: {"event": event, "detail": detail}.
void LogEvent(const char* event, const std::string& detail) {
  std::string escaped;
  for (unsigned char c : detail) {
    if (c == '"' || c == '\\') {
      escaped += '\\';
      escaped += static_cast<char>(c);
    } else if (c >= 0x20) {
      escaped += static_cast<char>(c);
    }
  }
  std::fprintf(stderr, "{\"event\":\"%s\",\"detail\":\"%s\"}\n", event, escaped.c_str());
}

bool LinkError(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) || absl::IsCancelled(s);
}

}  // namespace

DeviceAgent::DeviceAgent(AgentOptions options, InferenceRuntime* runtime, CloudClient* client,
                         std::unique_ptr<UplinkQueue> queue)
    : options_(std::move(options)),
      runtime_(runtime),
      client_(client),
      queue_(std::move(queue)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      step_(StepOptions(options_, *client)) {
  uts_ = options_.uts;
  sent_since_ = clock_->Now();
}

absl::StatusOr<std::unique_ptr<DeviceAgent>> DeviceAgent::Create(const AgentOptions& options,
                                                                 InferenceRuntime* runtime,
                                                                 CloudClient* client) {
  if (options.state_dir.empty()) return absl::InvalidArgumentError("agent needs a state_dir");
  if (options.batch_samples < 1) return absl::InvalidArgumentError("batch_samples must be >= 1");
  if (options.uts.precision == compress::FeaturePrecision::kJpeg && !runtime->CanSendFrames()) {
    return absl::InvalidArgumentError(
        "uplink precision jpeg: this model cannot send frames (it needs a Hugging Face folder "
        "whose image processor has a fixed output size)");
  }
  if (options.env == nullptr) return absl::InvalidArgumentError("agent: env is null");
  if (absl::Status s = options.env->CreateDirs(options.state_dir); !s.ok()) return s;
  UplinkQueueOptions qo;
  qo.env = options.env;
  qo.dir = options.state_dir + "/queue";
  qo.max_bytes = options.queue_max_bytes;
  qo.max_batches = options.queue_max_batches;
  absl::StatusOr<std::unique_ptr<UplinkQueue>> queue = UplinkQueue::Open(qo);
  if (!queue.ok()) return queue.status();
  std::unique_ptr<DeviceAgent> agent(new DeviceAgent(options, runtime, client, *std::move(queue)));
  // The pretrained base the runtime starts on (its Register fingerprint vouches for it): what
  // the device returns to when the cloud holds no snapshot of it.
  if (runtime->version() == 0) {
    absl::StatusOr<std::string> base = runtime->SaveTrainableState();
    if (!base.ok()) return base.status();
    agent->base_state_ = *std::move(base);
  }
  if (absl::Status s = agent->LoadState(); !s.ok()) return s;
  return agent;
}

DeviceAgent::~DeviceAgent() { Stop(); }

// ---- the last good state ------------------------------------------------------------------

absl::Status DeviceAgent::LoadState() {
  // The file found here may be one whose rename never became durable (the process before
  // stopped between the rename and the directory sync): make it durable before its version
  // is reported to the cloud.
  if (absl::Status s = options_.env->SyncDir(options_.state_dir); !s.ok()) return s;
  const std::string path = options_.state_dir + "/trainable.state";
  absl::StatusOr<std::string> bytes = storage::ReadFile(*options_.env, path);
  if (absl::IsNotFound(bytes.status())) {
    absl::MutexLock lock(&mu_);
    stats_.version = runtime_->version();
    stats_.state_digest = runtime_->StateDigest();
    return absl::OkStatus();
  }
  if (!bytes.ok()) return bytes.status();
  absl::StatusOr<internal::TrainableStateFile> file = internal::DecodeTrainableStateFile(*bytes);
  bool valid = file.ok();
  if (valid) {
    absl::Status s = runtime_->LoadTrainableState(file->safetensors, file->version);
    valid = s.ok() && runtime_->StateDigest() == file->digest;
  }
  if (!valid) {
    // Written durably, so damage is not a torn write; go back to the pretrained state (a
    // load that failed its digest check left the file's weights in place) and let the cloud
    // resync us rather than refuse to serve.
    if (!base_state_.empty()) {
      if (absl::Status s = runtime_->LoadTrainableState(base_state_, 0); !s.ok()) return s;
    }
    LogEvent("damaged_state", path + " ignored; the cloud will resync");
  }
  absl::MutexLock lock(&mu_);
  stats_.version = runtime_->version();
  stats_.state_digest = runtime_->StateDigest();
  return absl::OkStatus();
}

absl::Status DeviceAgent::SaveState() {
  absl::StatusOr<std::string> state = runtime_->SaveTrainableState();
  if (!state.ok()) return state.status();
  const uint64_t version = runtime_->version();
  const uint64_t digest = runtime_->StateDigest();
  const std::string out = internal::EncodeTrainableStateFile(version, digest, *state);
  if (absl::Status s =
          storage::WriteFileAtomically(*options_.env, options_.state_dir + "/trainable.state", out);
      !s.ok()) {
    return s;
  }
  absl::MutexLock lock(&mu_);
  stats_.version = version;
  stats_.state_digest = digest;
  return absl::OkStatus();
}

// ---- answering and UTS --------------------------------------------------------------------

absl::StatusOr<std::vector<FrameResult>> DeviceAgent::Process(const std::vector<Frame>& frames) {
  const uint64_t version = runtime_->version();
  absl::StatusOr<std::vector<AnswerResult>> answers = runtime_->Answer(frames);
  if (!answers.ok()) return answers.status();
  UtsOptions uts;
  bool changed = false;
  double holdout_fraction = 0;
  {
    absl::MutexLock lock(&mu_);
    uts = uts_;
    changed = uts_changed_;
    uts_changed_ = false;
    holdout_fraction = holdout_fraction_;
  }
  std::vector<FrameResult> out;
  out.reserve(answers->size());
  absl::MutexLock lock(&batch_mu_);
  // New settings start stage 1 over (so does a new model version: SampleStep::Run).
  if (changed) step_.Reconfigure(uts, holdout_fraction);
  uint64_t kept = 0, held_out = 0;
  for (AnswerResult& a : *answers) {
    FrameResult r;
    r.answer = a.text;
    r.entropy = a.entropy;
    r.model_version = version;
    r.latency_ms = a.latency_ms;
    // Every answer takes an id (the step holds out by it).
    const uint64_t sample_id = (static_cast<uint64_t>(absl::ToUnixMillis(clock_->Now())) << 16) |
                               (step_.next_ordinal() & 0xffff);
    SampleDecision d = step_.Run(AnsweredFrameOf(a, version), FrameModelOf(runtime_, a), sample_id);
    if (d.chosen()) {
      if (!d.status.ok()) {
        // The answer stands; only this sample's uplink is lost.
        CountUnsent(1, d.status.message());
      } else {
        r.uplinked = d.uplinked();
        r.kept_tokens = static_cast<int>(d.sample.kept_indices.size());
        if (r.uplinked) {
          if (d.held_out) ++held_out;
          if (d.stage1_kept || d.random_kept) ++kept;
          if (batch_.empty()) batch_started_ = clock_->Now();
          batch_.push_back(std::move(d.sample));
        }
      }
      if (static_cast<int>(batch_.size()) >= options_.batch_samples) FlushLocked();
    }
    out.push_back(std::move(r));
  }
  if (!batch_.empty() && clock_->Now() - batch_started_ >= options_.batch_max_age) {
    FlushLocked();
  }
  absl::MutexLock stats_lock(&mu_);
  stats_.answered += out.size();
  stats_.kept_samples += kept;
  stats_.held_out_samples += held_out;
  return out;
}

void DeviceAgent::CountUnsent(uint64_t samples, absl::string_view why) {
  LogEvent("sample_not_uplinked", absl::StrCat(samples, " sample(s): ", why));
  absl::MutexLock lock(&mu_);
  stats_.unsent_samples += samples;
}

absl::Status DeviceAgent::Flush() {
  absl::MutexLock lock(&batch_mu_);
  FlushLocked();
  return absl::OkStatus();
}

void DeviceAgent::FlushLocked() {
  if (batch_.empty()) return;
  std::vector<compress::UplinkSample> samples;
  samples.swap(batch_);
  compress::FeaturePrecision precision;
  {
    absl::MutexLock lock(&mu_);
    precision = uts_.precision;
  }
  EnqueueSamples(std::move(samples), precision);
}

void DeviceAgent::EnqueueSamples(std::vector<compress::UplinkSample> samples,
                                 compress::FeaturePrecision precision) {
  absl::StatusOr<std::string> payload = compress::EncodeUplinkBatch(samples, precision);
  if (!payload.ok()) {
    // Every sample was checked on its own (SampleStep::Run); what is left is the codec's
    // failure, and serving goes on without these samples.
    CountUnsent(samples.size(), payload.status().message());
    return;
  }
  if (payload->size() > wire::kMaxChunkBytes) {
    if (samples.size() == 1) {
      CountUnsent(1, absl::StrCat("it encodes to ", payload->size(),
                                  " bytes, more than an uplink batch carries (1 MiB)"));
      return;
    }
    std::vector<compress::UplinkSample> second(
        std::make_move_iterator(samples.begin() + samples.size() / 2),
        std::make_move_iterator(samples.end()));
    samples.resize(samples.size() / 2);
    EnqueueSamples(std::move(samples), precision);
    EnqueueSamples(std::move(second), precision);
    return;
  }
  uint64_t version = 0;
  for (const auto& s : samples) version = std::max(version, s.model_version);
  absl::StatusOr<uint64_t> sequence = queue_->Enqueue(
      version, static_cast<uint32_t>(samples.size()), kCodecVersion, *std::move(payload));
  if (!sequence.ok() && !absl::IsResourceExhausted(sequence.status())) {
    // The queue could not write the batch (its disk): serving goes on without it.
    CountUnsent(samples.size(), sequence.status().ToString());
    return;
  }
  absl::MutexLock lock(&mu_);
  if (!sequence.ok()) {
    // The queue is full (the cloud has been away a long time): these samples are lost
    // to the cloud but serving goes on.
    stats_.dropped_samples += samples.size();
    return;
  }
  ++stats_.batches_queued;
  wake_ = true;
}

// ---- the link -----------------------------------------------------------------------------

absl::Status DeviceAgent::RegisterWithCloud() {
  v1::RegisterRequest request;
  request.set_model_fingerprint(runtime_->BaseFingerprint());
  request.set_vision_fingerprint(runtime_->VisionFingerprint());
  request.set_model_version(runtime_->version());
  request.set_agent_version("cdcca-device/1");
  v1::Capabilities* caps = request.mutable_capabilities();
  for (uint32_t b : {0u, 1u, 2u, 3u, 4u, 8u}) caps->add_delta_bit_widths(b);
  caps->set_update_byte_budget(options_.update_byte_budget);
  caps->add_feature_precisions(v1::FEATURE_PRECISION_FP16);
  caps->add_feature_precisions(v1::FEATURE_PRECISION_INT8);
  caps->add_feature_precisions(v1::FEATURE_PRECISION_INT4);
  if (runtime_->CanSendFrames()) caps->add_feature_precisions(v1::FEATURE_PRECISION_JPEG);
  absl::StatusOr<v1::RegisterReply> reply = client_->Register(request);
  if (!reply.ok()) return reply.status();
  UtsOptions merged = options_.uts;
  absl::Status merge = MergeCloudSettings(reply->uts(), &merged);
  if (merge.ok() && merged.precision == compress::FeaturePrecision::kJpeg &&
      !runtime_->CanSendFrames()) {
    merge = absl::InvalidArgumentError(
        "the cloud asks for frames (jpeg), which this model "
        "cannot send");
  }
  if (!merge.ok()) {
    LogEvent("uts_settings_refused", std::string(merge.message()));
    merged = options_.uts;
  }
  {
    absl::MutexLock lock(&mu_);
    uts_ = merged;
    uts_changed_ = true;
    const double share = reply->guard_holdout_fraction();
    holdout_fraction_ = share > 0 && share < 1 ? share : 0.0;
    stats_.registered = true;
  }
  absl::StatusOr<uint64_t> back = queue_->Reconcile(reply->next_uplink_sequence());
  if (!back.ok()) return back.status();
  if (*back > 0) {
    LogEvent("uplink_renumbered",
             absl::StrCat("the cloud expects sequence ", reply->next_uplink_sequence(),
                          ": it lost the last ", *back,
                          " acked batch(es); the waiting batches continue from there"));
    absl::MutexLock lock(&mu_);
    ++stats_.renumbered;
  }
  const uint64_t acked = queue_->Stats().acked;
  {
    absl::MutexLock lock(&mu_);
    stats_.batches_acked = acked;
  }
  if (reply->resync_required()) return Resync(0);
  // The state is checked against the cloud's mirror right away, the pretrained base
  // (version 0) too: a base whose weights differ from the cloud's would take every update
  // the wrong way.
  return Report(/*allow_resync=*/true);
}

absl::Status DeviceAgent::UplinkQueued() {
  for (int round = 0; round < 8; ++round) {
    std::vector<v1::UplinkBatch> batches =
        queue_->Peek(options_.uplink_max_batches, options_.uplink_max_bytes);
    if (batches.empty()) return absl::OkStatus();
    uint64_t bytes = 0;
    for (const auto& b : batches) bytes += b.payload().size();
    {
      absl::MutexLock lock(&mu_);
      // Backing off after a transient refusal: the rest of the pass (updates) goes on.
      if (clock_->Now() < uplink_not_before_) return absl::OkStatus();
      const size_t n = std::min<size_t>(unreported_drops_.size(), wire::kMaxDroppedReports);
      for (size_t i = 0; i < n; ++i) *batches.front().add_dropped() = unreported_drops_[i];
    }
    if (options_.bandwidth_bytes_per_s > 0) {
      // Pace the sends: each stream may start only when the previous ones, at the cap,
      // would have finished.
      absl::MutexLock lock(&mu_);
      const absl::Time start = sent_since_;
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      clock_->AwaitWithDeadline(&mu_, absl::Condition(&stop), start);
      if (stopping_) return absl::CancelledError("stopping");
      sent_since_ = std::max(clock_->Now(), start) +
                    absl::Seconds(static_cast<double>(bytes) / options_.bandwidth_bytes_per_s);
    }
    const absl::Time sent = absl::Now();
    absl::StatusOr<v1::UplinkAck> ack = client_->Uplink(batches);
    if (!ack.ok()) return ack.status();
    {
      absl::MutexLock lock(&mu_);
      stats_.uplink_seconds += absl::ToDoubleSeconds(absl::Now() - sent);
      stats_.uplink_bytes += bytes;
      stats_.batches_acked = ack->highest_durable_sequence();
      // The reports travelled in a batch the cloud now holds: they are delivered.
      if (batches.front().dropped_size() > 0 &&
          ack->highest_durable_sequence() >= batches.front().sequence()) {
        unreported_drops_.erase(unreported_drops_.begin(),
                                unreported_drops_.begin() + batches.front().dropped_size());
      }
    }
    if (absl::Status s = queue_->Acknowledge(ack->highest_durable_sequence()); !s.ok()) return s;
    if (ack->has_error() && ack->error().code() != 0) {
      // A dropped batch makes way for the next; any other refusal waits (OnRefused).
      if (OnRefused(*ack)) continue;
      return absl::OkStatus();
    }
    absl::MutexLock lock(&mu_);
    refusals_in_row_ = 0;
  }
  return absl::OkStatus();
}

bool DeviceAgent::OnRefused(const v1::UplinkAck& ack) {
  const std::string reason = wire::RefusalReasonName(ack.refusal_reason());
  const std::string what =
      absl::StrCat("batch ", ack.rejected_sequence(), " (", reason, "): ", ack.error().message());
  if (ack.refusal() == v1::UPLINK_REFUSAL_PERMANENT) {
    absl::StatusOr<v1::UplinkBatch> dropped = queue_->DropFront(ack.rejected_sequence());
    if (dropped.ok()) {
      LogEvent("uplink_batch_dropped",
               absl::StrCat(what, "; ", dropped->sample_count(),
                            " sample(s) dropped, the batches behind it renumbered"));
      v1::DroppedBatch report;
      report.set_sequence(dropped->sequence());
      report.set_reason(ack.refusal_reason());
      report.set_sample_count(dropped->sample_count());
      absl::MutexLock lock(&mu_);
      stats_.last_refusal = what;
      ++stats_.dropped_batches;
      ++stats_.dropped_batches_by_reason[reason];
      unreported_drops_.push_back(report);
      return true;
    }
    // Not the batch this queue would drop: ask the cloud where it stands, after a while.
    LogEvent("uplink_refused", absl::StrCat(what, "; not dropped: ", dropped.status().message()));
  } else if (ack.refusal() == v1::UPLINK_REFUSAL_RESEQUENCE) {
    LogEvent("uplink_refused", absl::StrCat(what, "; registering again to renumber"));
  } else {
    LogEvent("uplink_refused", absl::StrCat(what, "; backing off"));
  }
  absl::MutexLock lock(&mu_);
  stats_.last_refusal = what;
  // Registering again reconciles the numbering with the cloud's log; the backoff keeps a
  // refusal that persists from becoming a loop.
  if (ack.refusal() != v1::UPLINK_REFUSAL_TRANSIENT) stats_.registered = false;
  ++stats_.uplink_backoffs;
  ++refusals_in_row_;
  absl::Duration wait = options_.refusal_backoff_initial;
  for (int i = 1; i < refusals_in_row_ && wait < options_.refusal_backoff_max; ++i) wait *= 2;
  wait = std::min(wait, options_.refusal_backoff_max) *
         std::uniform_real_distribution<double>(0.5, 1.0)(jitter_rng_);
  if (ack.refusal() == v1::UPLINK_REFUSAL_RESEQUENCE && refusals_in_row_ == 1) {
    wait = absl::ZeroDuration();  // the first renumbering needs no wait
  }
  uplink_not_before_ = clock_->Now() + wait;
  return false;
}

absl::Status DeviceAgent::PullUpdate() {
  for (int round = 0; round < 16; ++round) {
    const uint64_t base = runtime_->version();
    const absl::Time asked = absl::Now();
    absl::StatusOr<FetchedPayload> fetched = client_->FetchUpdate(base);
    if (absl::IsFailedPrecondition(fetched.status())) return Resync(0);
    if (!fetched.ok()) return fetched.status();
    if (!fetched->info.available()) return absl::OkStatus();
    absl::Status applied = runtime_->ApplyUpdate(fetched->bytes);
    if (!applied.ok()) {
      {
        absl::MutexLock lock(&mu_);
        ++stats_.rejected_updates;
      }
      LogEvent("update_rejected", absl::StrCat("version ", fetched->info.new_version(), ": ",
                                               applied.ToString(), "; resyncing"));
      return Resync(0);
    }
    if (absl::Status s = SaveState(); !s.ok()) return s;
    LogEvent("update_applied",
             absl::StrFormat("version %d digest %016x (%d bytes)", runtime_->version(),
                             runtime_->StateDigest(), fetched->bytes.size()));
    {
      absl::MutexLock lock(&mu_);
      ++stats_.updates_applied;
      stats_.update_seconds += absl::ToDoubleSeconds(absl::Now() - asked);
    }
    if (absl::Status s = Report(/*allow_resync=*/true); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status DeviceAgent::ResyncToBase() {
  if (base_state_.empty()) {
    return absl::FailedPreconditionError(
        "the cloud holds no snapshot of this device and asks it back to the pretrained base, "
        "but the agent did not start on the base (its runtime ran a later version)");
  }
  if (absl::Status s = runtime_->LoadTrainableState(base_state_, 0); !s.ok()) return s;
  if (absl::Status s = SaveState(); !s.ok()) return s;
  LogEvent("resynced", absl::StrFormat("version 0 (the pretrained base) digest %016x",
                                       runtime_->StateDigest()));
  {
    absl::MutexLock lock(&mu_);
    ++stats_.resyncs;
  }
  return Report(/*allow_resync=*/false);
}

absl::Status DeviceAgent::Resync(uint64_t version) {
  const absl::Time asked = absl::Now();
  absl::StatusOr<FetchedPayload> snapshot = client_->FetchSnapshot(version);
  if (!snapshot.ok()) return snapshot.status();
  if (absl::Status s = runtime_->LoadTrainableState(snapshot->bytes, snapshot->info.new_version());
      !s.ok()) {
    return s;
  }
  if (absl::Status s = SaveState(); !s.ok()) return s;
  LogEvent("resynced", absl::StrFormat("version %d digest %016x", runtime_->version(),
                                       runtime_->StateDigest()));
  {
    absl::MutexLock lock(&mu_);
    ++stats_.resyncs;
    stats_.update_seconds += absl::ToDoubleSeconds(absl::Now() - asked);
  }
  return Report(/*allow_resync=*/false);
}

absl::Status DeviceAgent::Report(bool allow_resync) {
  absl::StatusOr<v1::ReportAppliedReply> reply =
      client_->ReportApplied(runtime_->version(), runtime_->StateDigest());
  if (!reply.ok()) return reply.status();
  {
    absl::MutexLock lock(&mu_);
    stats_.in_sync = reply->in_sync();
  }
  if (reply->resync_required()) {
    if (!allow_resync) {
      return absl::DataLossError(absl::StrCat(
          "state differs from the cloud's even after a resync: ", reply->error().message()));
    }
    // No snapshot: the cloud's mirror of this device is the pretrained base.
    if (reply->snapshot_version() == 0) return ResyncToBase();
    return Resync(reply->snapshot_version());
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RollbackReply> DeviceAgent::RollBack(uint64_t to_version) {
  absl::MutexLock link(&link_mu_);
  if (absl::Status s = RegisterWithCloud(); !s.ok()) return s;
  if (absl::Status s = PullUpdate(); !s.ok()) return s;
  const uint64_t from = runtime_->version();
  absl::StatusOr<v1::RollbackReply> reply = client_->Rollback(from, to_version);
  if (!reply.ok()) return reply.status();
  if (absl::Status s = Resync(reply->new_version()); !s.ok()) return s;
  if (runtime_->version() != reply->new_version() ||
      runtime_->StateDigest() != reply->state_digest()) {
    return absl::DataLossError(absl::StrFormat(
        "after the rollback the device runs version %d digest %016x, not the cloud's %d %016x",
        runtime_->version(), runtime_->StateDigest(), reply->new_version(), reply->state_digest()));
  }
  LogEvent("rolled_back", absl::StrFormat("from version %d to the state of version %d as "
                                          "version %d, digest %016x",
                                          from, reply->restored_version(), reply->new_version(),
                                          reply->state_digest()));
  absl::MutexLock lock(&mu_);
  ++stats_.rollbacks;
  return reply;
}

absl::Status DeviceAgent::SyncOnce() {
  absl::MutexLock link(&link_mu_);
  bool registered;
  {
    absl::MutexLock lock(&mu_);
    registered = stats_.registered;
  }
  absl::Status s = registered ? absl::OkStatus() : RegisterWithCloud();
  if (s.ok()) s = UplinkQueued();
  if (s.ok()) s = PullUpdate();
  absl::MutexLock lock(&mu_);
  stats_.link_up = !LinkError(s);
  stats_.link_error = s.ok() ? "" : s.ToString();
  // After a lost link, register again: the cloud may have restarted (or lost data).
  if (LinkError(s)) stats_.registered = false;
  ++stats_.link_passes;
  return s;
}

void DeviceAgent::LinkLoop() {
  while (true) {
    absl::Status s = SyncOnce();
    if (!s.ok() && !absl::IsCancelled(s)) {
      LogEvent("link_error", s.ToString());
    }
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || wake_; };
    // Idle only while it waits: seen with the queue empty, the pass that sent it has ended.
    stats_.link_idle = !ready();
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&ready), options_.poll_interval);
    stats_.link_idle = false;
    wake_ = false;
    if (stopping_) return;
  }
}

void DeviceAgent::Start() {
  absl::MutexLock lock(&mu_);
  if (link_thread_.joinable()) return;
  stopping_ = false;
  link_thread_ = std::thread([this] { LinkLoop(); });
}

void DeviceAgent::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (link_thread_.joinable()) link_thread_.join();
}

AgentStats DeviceAgent::Stats() const {
  AgentStats s;
  {
    absl::MutexLock lock(&mu_);
    s = stats_;
    s.uplink_backing_off = clock_->Now() < uplink_not_before_;
  }
  s.queue = queue_->Stats();
  return s;
}

}  // namespace cdcca::device
