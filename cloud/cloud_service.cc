#include "cloud/cloud_service.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/wire.h"

namespace cdcca::cloud {
namespace {

constexpr uint64_t kMaxByteBudget = 1ull << 30;
constexpr size_t kMaxAgentVersionBytes = 128;

absl::Status ValidateCapabilities(const v1::Capabilities& caps) {
  if (caps.delta_bit_widths_size() > 6) {
    return absl::InvalidArgumentError("capabilities.delta_bit_widths lists more than 6 widths");
  }
  for (uint32_t bits : caps.delta_bit_widths()) {
    if (bits != 0 && bits != 1 && bits != 2 && bits != 3 && bits != 4 && bits != 8) {
      return absl::InvalidArgumentError(absl::StrCat("capabilities.delta_bit_widths holds ", bits,
                                                     "; supported widths are 0, 1, 2, 3, 4 and 8"));
    }
  }
  if (caps.update_byte_budget() > kMaxByteBudget) {
    return absl::InvalidArgumentError(absl::StrCat("capabilities.update_byte_budget ",
                                                   caps.update_byte_budget(), " exceeds 1 GiB"));
  }
  if (caps.max_chunk_bytes() > wire::kMaxChunkBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("capabilities.max_chunk_bytes ", caps.max_chunk_bytes(), " exceeds 1 MiB"));
  }
  if (caps.max_chunk_bytes() != 0 && caps.max_chunk_bytes() < 1024) {
    return absl::InvalidArgumentError("capabilities.max_chunk_bytes must be at least 1024");
  }
  if (caps.feature_precisions_size() > 8) {
    return absl::InvalidArgumentError("capabilities.feature_precisions lists too many entries");
  }
  return absl::OkStatus();
}

absl::Status ValidateBatch(const v1::UplinkBatch& batch) {
  const auto bad = [](v1::RefusalReason reason, absl::string_view why) {
    return WithRefusalReason(absl::InvalidArgumentError(why), reason);
  };
  if (batch.sequence() == 0) {
    return bad(v1::REFUSAL_REASON_MALFORMED, "uplink sequence numbers start at 1");
  }
  if (batch.sample_count() == 0 || batch.sample_count() > wire::kMaxSamplesPerBatch) {
    return bad(v1::REFUSAL_REASON_MALFORMED,
               absl::StrCat("batch ", batch.sequence(), " has sample_count ", batch.sample_count(),
                            "; allowed 1-", wire::kMaxSamplesPerBatch));
  }
  if (batch.payload().empty()) {
    return bad(v1::REFUSAL_REASON_MALFORMED,
               absl::StrCat("batch ", batch.sequence(), " has no payload"));
  }
  if (batch.payload().size() > wire::kMaxChunkBytes) {
    return bad(v1::REFUSAL_REASON_TOO_LARGE,
               absl::StrCat("batch ", batch.sequence(), " payload is ", batch.payload().size(),
                            " bytes; the limit is 1 MiB"));
  }
  if (batch.codec_version() == 0) {
    return bad(v1::REFUSAL_REASON_CODEC,
               absl::StrCat("batch ", batch.sequence(), " has no codec_version"));
  }
  if (batch.dropped_size() > wire::kMaxDroppedReports) {
    return bad(v1::REFUSAL_REASON_MALFORMED,
               absl::StrCat("batch ", batch.sequence(), " reports ", batch.dropped_size(),
                            " dropped batches; the limit is ", wire::kMaxDroppedReports));
  }
  return absl::OkStatus();
}

// The reason of a refusal: the one the checks attached, else what the store's status code
// means (sequence gap, quota, or a failed write).
v1::RefusalReason ReasonOf(const absl::Status& status) {
  if (v1::RefusalReason reason = RefusalReasonOf(status);
      reason != v1::REFUSAL_REASON_UNSPECIFIED) {
    return reason;
  }
  switch (status.code()) {
    case absl::StatusCode::kFailedPrecondition:
      return v1::REFUSAL_REASON_SEQUENCE_GAP;
    case absl::StatusCode::kResourceExhausted:
      return v1::REFUSAL_REASON_QUOTA;
    case absl::StatusCode::kInvalidArgument:
      return v1::REFUSAL_REASON_MALFORMED;
    default:
      return v1::REFUSAL_REASON_STORAGE;
  }
}

void SetError(const absl::Status& status, v1::Error* error) {
  error->set_code(static_cast<int32_t>(status.code()));
  error->set_message(std::string(status.message()));
}

}  // namespace

CloudService::CloudService(CloudServiceOptions options, const TokenAuthenticator* auth,
                           DeviceStore* registry, SampleLog* samples, UpdateLog* updates,
                           CloudObserver* observer)
    : options_(std::move(options)),
      auth_(auth),
      registry_(registry),
      samples_(samples),
      updates_(updates),
      observer_(observer),
      started_(absl::Now()),
      io_pool_(options_.io_threads) {}

CloudService::~CloudService() = default;

absl::StatusOr<std::string> CloudService::Authenticate(grpc::CallbackServerContext* ctx,
                                                       const std::string& claimed) const {
  absl::string_view authorization;
  const auto& md = ctx->client_metadata();
  if (auto it = md.find(wire::kAuthMetadataKey); it != md.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  absl::StatusOr<std::string> device = auth_->Authenticate(authorization);
  if (!device.ok()) return device.status();
  if (!claimed.empty() && claimed != *device) {
    return absl::PermissionDeniedError(
        absl::StrCat("the token belongs to device ", *device, ", not to ", claimed));
  }
  // Mutual TLS ended at a proxy: the certificate it verified, in the header it sets.
  if (!options_.proxy_client_cert_header.empty()) {
    auto it = md.find(options_.proxy_client_cert_header);
    if (it == md.end() || it->second.empty()) {
      if (!options_.allow_token_only_devices) {
        return absl::UnauthenticatedError(
            "no client certificate came through the proxy: every device needs one here");
      }
    } else {
      absl::StatusOr<std::vector<std::string>> names =
          CertificateNamesFromEscapedPem(absl::string_view(it->second.data(), it->second.size()));
      if (!names.ok()) return absl::UnauthenticatedError(names.status().message());
      if (absl::Status s = CheckCertificateIdentity(*names, options_.client_certificates, *device);
          !s.ok()) {
        return s;
      }
    }
  }
  // Mutual TLS: the certificate must be the device's own, so a leaked token is useless
  // without that device's key, and one device's key cannot carry another's token.
  const std::shared_ptr<const grpc::AuthContext> peer = ctx->auth_context();
  if (peer != nullptr && peer->IsPeerAuthenticated()) {
    std::vector<std::string> names;
    for (const char* property : {GRPC_X509_CN_PROPERTY_NAME, GRPC_X509_SAN_PROPERTY_NAME}) {
      for (const grpc::string_ref& v : peer->FindPropertyValues(property)) {
        names.emplace_back(v.data(), v.size());
      }
    }
    if (absl::Status s = CheckCertificateIdentity(names, options_.client_certificates, *device);
        !s.ok()) {
      return s;
    }
  }
  return device;
}

uint32_t CloudService::ChunkBytesFor(const std::string& device_id) const {
  absl::StatusOr<store::v1::DeviceRecord> record = registry_->Get(device_id);
  if (record.ok() && record->capabilities().max_chunk_bytes() != 0) {
    return record->capabilities().max_chunk_bytes();
  }
  return std::min<uint32_t>(options_.default_chunk_bytes, wire::kMaxChunkBytes);
}

bool CloudService::TakeInjectedCut() {
  if (options_.inject_cut_fetch_after_bytes == 0) return false;
  return !cut_done_.exchange(true);
}

// ---- Register -------------------------------------------------------------------------------

grpc::ServerUnaryReactor* CloudService::Register(grpc::CallbackServerContext* ctx,
                                                 const v1::RegisterRequest* request,
                                                 v1::RegisterReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status bad = wire::ValidateDeviceId(request->device_id());
  if (bad.ok()) bad = ValidateCapabilities(request->capabilities());
  if (bad.ok() && request->agent_version().size() > kMaxAgentVersionBytes) {
    bad = absl::InvalidArgumentError("agent_version exceeds 128 bytes");
  }
  if (bad.ok()) bad = Authenticate(ctx, request->device_id()).status();
  if (bad.ok() && options_.expected_vision_fingerprint != 0 &&
      request->vision_fingerprint() != options_.expected_vision_fingerprint) {
    bad = absl::FailedPreconditionError(
        request->vision_fingerprint() == 0
            ? absl::StrFormat(
                  "device %s did not report its vision tower's fingerprint; the teacher's tower "
                  "is %016x and the tokens a device uplinks must come from it",
                  request->device_id(), options_.expected_vision_fingerprint)
            : absl::StrFormat(
                  "device %s runs vision tower %016x, but the teacher reads tokens of tower "
                  "%016x: a teacher-student pair must share one vision tower (run a student of "
                  "the teacher's family)",
                  request->device_id(), request->vision_fingerprint(),
                  options_.expected_vision_fingerprint));
  }
  if (bad.ok() && options_.expected_fingerprint != 0 &&
      request->model_fingerprint() != options_.expected_fingerprint) {
    bad = absl::FailedPreconditionError(absl::StrFormat(
        "model fingerprint %016x does not match the cloud's student base %016x: install the "
        "base model the cloud serves, at its precision (and, for a Hugging Face folder, with "
        "its adapters: --lora_rank, --lora_alpha, --lora_mlp, --lora_qformer, "
        "--lora_projector, --lora_vision)",
        request->model_fingerprint(), options_.expected_fingerprint));
  }
  if (!bad.ok()) {
    reactor->Finish(wire::ToGrpcStatus(bad));
    return reactor;
  }
  io_pool_.Schedule([this, reactor, request, reply] {
    absl::StatusOr<store::v1::DeviceRecord> record = registry_->Register(
        request->device_id(), request->model_fingerprint(), request->capabilities());
    if (!record.ok()) {
      reactor->Finish(wire::ToGrpcStatus(record.status()));
      return;
    }
    const std::string& id = request->device_id();
    absl::StatusOr<uint64_t> latest = updates_->Newest(id);
    absl::StatusOr<uint64_t> durable = samples_->Durable(id);
    if (!latest.ok() || !durable.ok()) {
      reactor->Finish(wire::ToGrpcStatus(!latest.ok() ? latest.status() : durable.status()));
      return;
    }
    reply->set_assigned_model_version(record->applied_version());
    reply->set_latest_update_version(*latest);
    reply->set_next_uplink_sequence(*durable + 1);
    *reply->mutable_uts() = options_.uts;
    reply->set_guard_holdout_fraction(options_.guard_holdout_fraction);
    absl::StatusOr<StoredUpdate> next = updates_->UpdateAfter(id, request->model_version());
    reply->set_resync_required(next.status().code() == absl::StatusCode::kFailedPrecondition);
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

// ---- Uplink ---------------------------------------------------------------------------------

class CloudService::UplinkReactor : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  UplinkReactor(CloudService* service, grpc::CallbackServerContext* ctx, grpc::ByteBuffer* reply)
      : service_(service), reply_(reply) {
    absl::StatusOr<std::string> device = service_->Authenticate(ctx, "");
    if (!device.ok()) {
      Finish(wire::ToGrpcStatus(device.status()));
      return;
    }
    device_id_ = *device;
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client closed its side: everything it sent is handled
      FinishWithAck();
      return;
    }
    v1::UplinkBatch batch;
    if (!Parse(message_, &batch)) {
      Finish(wire::ToGrpcStatus(
          absl::InvalidArgumentError("uplink message does not parse as a cdcca.v1.UplinkBatch")));
      return;
    }
    message_.Clear();
    if (absl::Status bad = ValidateBatch(batch); !bad.ok()) {
      Reject(bad, batch.sequence());
      return;
    }
    // Decoding a batch costs milliseconds: do it off the reaction thread.
    service_->io_pool_.Schedule(
        [this, batch = std::move(batch)]() mutable { CheckAndStore(std::move(batch)); });
  }

  void OnDone() override { delete this; }

 private:
  static bool Parse(const grpc::ByteBuffer& buffer, v1::UplinkBatch* batch) {
    std::vector<grpc::Slice> slices;
    if (!buffer.Dump(&slices).ok()) return false;
    std::string bytes;
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return batch->ParseFromString(bytes);
  }

  void CheckAndStore(v1::UplinkBatch batch) {
    const uint64_t seq = batch.sequence();
    // A resend of a stored batch was checked when it was stored. The log is asked once per
    // stream; after that this stream's own appends say how far it is.
    if (!durable_.has_value()) {
      absl::StatusOr<uint64_t> durable = service_->samples_->Durable(device_id_);
      if (!durable.ok()) {
        Reject(durable.status(), seq);
        return;
      }
      durable_ = *durable;
    }
    if (seq > *durable_) {
      absl::StatusOr<CheckedBatch> checked =
          CheckUplinkBatch(batch, service_->options_.sample_spec);
      if (!checked.ok()) {
        Reject(checked.status(), seq);
        return;
      }
    }
    // The device's drop reports are about other batches: counted, not stored with this one.
    std::vector<v1::DroppedBatch> dropped(batch.dropped().begin(), batch.dropped().end());
    batch.clear_dropped();
    service_->samples_->Append(device_id_, std::move(batch),
                               [this, seq, dropped = std::move(dropped)](
                                   absl::StatusOr<AppendResult> r) { OnStored(seq, dropped, r); });
  }

  void OnStored(uint64_t seq, const std::vector<v1::DroppedBatch>& dropped,
                const absl::StatusOr<AppendResult>& result) {
    if (!result.ok()) {
      Reject(result.status(), seq);
      return;
    }
    if (result->duplicate) {
      ack_.set_duplicates(ack_.duplicates() + 1);
    } else {
      ack_.set_stored(ack_.stored() + 1);
      // Reported once: a resend of this batch carries the same reports.
      for (const v1::DroppedBatch& d : dropped) service_->RecordDropped(device_id_, d);
    }
    ack_.set_highest_durable_sequence(result->highest_durable);
    durable_ = std::max(durable_.value_or(0), result->highest_durable);
    if (service_->observer_ != nullptr && !result->duplicate) {
      service_->observer_->OnSamplesStored(device_id_, result->highest_durable);
    }
    StartRead(&message_);
  }

  // Ends the stream at a bad batch: what came before it is stored and acked, and the error,
  // what the device should do about it and why, travel as data.
  void Reject(const absl::Status& status, uint64_t seq) {
    const v1::RefusalReason reason = ReasonOf(status);
    SetError(status, ack_.mutable_error());
    ack_.set_rejected_sequence(seq);
    ack_.set_refusal(RefusalFor(reason));
    ack_.set_refusal_reason(reason);
    service_->RecordRefused(device_id_, seq, reason, status);
    FinishWithAck();
  }

  void FinishWithAck() {
    // The highest durable sequence: what this stream's last append said, else the log's
    // (a failure to ask leaves it 0: the device learns it at its next Register).
    if (durable_.has_value()) {
      ack_.set_highest_durable_sequence(*durable_);
    } else if (absl::StatusOr<uint64_t> durable = service_->samples_->Durable(device_id_);
               durable.ok()) {
      ack_.set_highest_durable_sequence(*durable);
    }
    grpc::Slice slice(ack_.SerializeAsString());
    *reply_ = grpc::ByteBuffer(&slice, 1);
    Finish(grpc::Status::OK);
  }

  CloudService* const service_;
  grpc::ByteBuffer* const reply_;
  std::string device_id_;
  grpc::ByteBuffer message_;
  v1::UplinkAck ack_;
  // The device's highest durable sequence as this stream last learned it (the first batch
  // asks the log; each append reports it).
  std::optional<uint64_t> durable_;
};

grpc::ServerReadReactor<grpc::ByteBuffer>* CloudService::Uplink(grpc::CallbackServerContext* ctx,
                                                                grpc::ByteBuffer* ack) {
  return new UplinkReactor(this, ctx, ack);
}

void CloudService::RecordRefused(const std::string& device_id, uint64_t sequence,
                                 v1::RefusalReason reason, const absl::Status& status) {
  {
    absl::MutexLock lock(&refusals_mu_);
    ++refusals_[device_id].refused[wire::RefusalReasonName(reason)];
  }
  if (observer_ != nullptr) {
    observer_->OnUplinkRefused(device_id, sequence, RefusalFor(reason), reason, status);
  }
}

void CloudService::RecordDropped(const std::string& device_id, v1::DroppedBatch dropped) {
  // The device names the reason: one this build does not know counts as unspecified, so a
  // device cannot grow the counters without bound.
  if (!v1::RefusalReason_IsValid(dropped.reason())) {
    dropped.set_reason(v1::REFUSAL_REASON_UNSPECIFIED);
  }
  {
    absl::MutexLock lock(&refusals_mu_);
    ++refusals_[device_id].dropped[wire::RefusalReasonName(dropped.reason())];
  }
  if (observer_ != nullptr) observer_->OnBatchDropped(device_id, dropped);
}

std::map<std::string, DeviceRefusals> CloudService::Refusals() const {
  absl::MutexLock lock(&refusals_mu_);
  return refusals_;
}

// ---- FetchUpdate / FetchSnapshot ------------------------------------------------------------

// Streams one stored payload from an offset, in chunks, info in the first chunk. Created
// idle: the lookup that decides what it sends runs on the I/O pool (a store may be a database
// round trip away), which then starts it with one of the Start* calls.
class CloudService::PayloadWriter : public grpc::ServerWriteReactor<v1::PayloadChunk> {
 public:
  // Finishes at once with `status` (not OK).
  void StartError(const absl::Status& status) { Finish(wire::ToGrpcStatus(status)); }

  // Sends a single chunk saying that nothing newer exists.
  void StartNothingNewer(uint64_t base_version) {
    chunk_.mutable_info()->set_available(false);
    chunk_.mutable_info()->set_base_version(base_version);
    chunk_.mutable_info()->set_new_version(base_version);
    done_after_write_ = true;
    StartWrite(&chunk_);
  }

  void StartPayload(StoredUpdate update, uint64_t offset, uint32_t chunk_bytes,
                    uint64_t cut_after) {
    update_ = std::move(update);
    offset_ = offset;
    chunk_bytes_ = chunk_bytes;
    cut_after_ = cut_after;
    v1::PayloadInfo* info = chunk_.mutable_info();
    info->set_available(true);
    info->set_base_version(update_.base_version);
    info->set_new_version(update_.new_version);
    info->set_total_bytes(update_.payload->size());
    info->set_sha256(update_.sha256);
    info->set_state_digest(update_.state_digest);
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    if (done_after_write_) {
      Finish(grpc::Status::OK);
      return;
    }
    chunk_.clear_info();
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    const std::string& payload = *update_.payload;
    if (cut_after_ != 0 && sent_ >= cut_after_) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "injected fault: stream cut"));
      return;
    }
    const size_t n = std::min<uint64_t>(chunk_bytes_, payload.size() - offset_);
    chunk_.set_offset(offset_);
    chunk_.set_data(payload.data() + offset_, n);
    offset_ += n;
    sent_ += n;
    done_after_write_ = offset_ >= payload.size();
    StartWrite(&chunk_);
  }

  StoredUpdate update_;
  uint64_t offset_ = 0;
  uint32_t chunk_bytes_ = 0;
  uint64_t cut_after_ = 0;  // 0 = never
  uint64_t sent_ = 0;
  bool done_after_write_ = false;
  v1::PayloadChunk chunk_;
};

void CloudService::StartUpdate(PayloadWriter* writer, const v1::FetchUpdateRequest& request) {
  absl::StatusOr<StoredUpdate> update =
      updates_->UpdateAfter(request.device_id(), request.base_version());
  if (update.status().code() == absl::StatusCode::kNotFound) {
    if (request.offset() != 0) {
      writer->StartError(absl::FailedPreconditionError(
          "resume requested, but no update is newer than the base version"));
      return;
    }
    writer->StartNothingNewer(request.base_version());
    return;
  }
  if (!update.ok()) {
    writer->StartError(update.status());
    return;
  }
  if (request.new_version() != 0 && request.new_version() != update->new_version) {
    writer->StartError(absl::AbortedError(
        absl::StrCat("resume asked for version ", request.new_version(),
                     " but the update on top of ", request.base_version(), " is now version ",
                     update->new_version, "; restart from offset 0")));
    return;
  }
  if (request.offset() > update->payload->size()) {
    writer->StartError(absl::InvalidArgumentError(
        absl::StrCat("offset ", request.offset(), " is past the end of the ",
                     update->payload->size(), "-byte update")));
    return;
  }
  const uint64_t cut = TakeInjectedCut() ? options_.inject_cut_fetch_after_bytes : 0;
  writer->StartPayload(*std::move(update), request.offset(), ChunkBytesFor(request.device_id()),
                       cut);
}

void CloudService::StartSnapshot(PayloadWriter* writer, const v1::FetchSnapshotRequest& request) {
  absl::StatusOr<StoredUpdate> snapshot =
      updates_->Snapshot(request.device_id(), request.version());
  if (!snapshot.ok()) {
    writer->StartError(snapshot.status());
    return;
  }
  if (request.offset() > snapshot->payload->size()) {
    writer->StartError(absl::InvalidArgumentError(
        absl::StrCat("offset ", request.offset(), " is past the end of the ",
                     snapshot->payload->size(), "-byte snapshot")));
    return;
  }
  const uint64_t cut = TakeInjectedCut() ? options_.inject_cut_fetch_after_bytes : 0;
  writer->StartPayload(*std::move(snapshot), request.offset(), ChunkBytesFor(request.device_id()),
                       cut);
}

grpc::ServerWriteReactor<v1::PayloadChunk>* CloudService::NewPayloadWriter(
    grpc::CallbackServerContext* ctx, const std::string& device_id,
    std::function<void(PayloadWriter*)> start) {
  auto* writer = new PayloadWriter();
  absl::Status bad = wire::ValidateDeviceId(device_id);
  if (bad.ok()) bad = Authenticate(ctx, device_id).status();
  if (!bad.ok()) {
    writer->StartError(bad);
    return writer;
  }
  io_pool_.Schedule([writer, start = std::move(start)] { start(writer); });
  return writer;
}

// The request lives until the writer's OnDone, which needs the Finish that `start` leads to.
grpc::ServerWriteReactor<v1::PayloadChunk>* CloudService::FetchUpdate(
    grpc::CallbackServerContext* ctx, const v1::FetchUpdateRequest* request) {
  return NewPayloadWriter(ctx, request->device_id(),
                          [this, request](PayloadWriter* w) { StartUpdate(w, *request); });
}

grpc::ServerWriteReactor<v1::PayloadChunk>* CloudService::FetchSnapshot(
    grpc::CallbackServerContext* ctx, const v1::FetchSnapshotRequest* request) {
  return NewPayloadWriter(ctx, request->device_id(),
                          [this, request](PayloadWriter* w) { StartSnapshot(w, *request); });
}

// ---- ReportApplied --------------------------------------------------------------------------

grpc::ServerUnaryReactor* CloudService::ReportApplied(grpc::CallbackServerContext* ctx,
                                                      const v1::ReportAppliedRequest* request,
                                                      v1::ReportAppliedReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status bad = wire::ValidateDeviceId(request->device_id());
  if (bad.ok()) bad = Authenticate(ctx, request->device_id()).status();
  if (!bad.ok()) {
    reactor->Finish(wire::ToGrpcStatus(bad));
    return reactor;
  }
  // Every store call is a round trip away on the shared store: none on the reaction thread.
  io_pool_.Schedule([this, reactor, request, reply] {
    const std::string& id = request->device_id();
    if (absl::Status s = registry_->Get(id).status(); !s.ok()) {
      reactor->Finish(wire::ToGrpcStatus(s));
      return;
    }
    absl::StatusOr<uint64_t> expected = updates_->DigestOf(id, request->version());
    // Version 0 is the pretrained base, whose digest the cloud knows from the model (no
    // update or snapshot of the device records it).
    if (request->version() == 0 && absl::IsNotFound(expected.status()) &&
        options_.base_state_digest != 0) {
      expected = options_.base_state_digest;
    }
    bool in_sync = false;
    if (expected.ok()) {
      in_sync = *expected == request->state_digest();
      if (!in_sync) {
        SetError(absl::DataLossError(absl::StrFormat(
                     "state digest %016x of version %d differs from the cloud mirror's %016x",
                     request->state_digest(), request->version(), *expected)),
                 reply->mutable_error());
      }
    } else if (request->version() == 0 && absl::IsNotFound(expected.status())) {
      in_sync = true;  // the pretrained base, on a cloud without the model: nothing to compare
    } else {
      SetError(expected.status(), reply->mutable_error());
    }
    reply->set_in_sync(in_sync);
    if (!in_sync) {
      absl::StatusOr<StoredUpdate> snapshot = updates_->Snapshot(id, 0);
      reply->set_resync_required(true);
      reply->set_snapshot_version(snapshot.ok() ? snapshot->new_version : 0);
    }
    absl::Status s =
        registry_->SetApplied(id, request->version(), request->state_digest(), in_sync);
    if (!s.ok()) {
      reactor->Finish(wire::ToGrpcStatus(s));
      return;
    }
    if (observer_ != nullptr) observer_->OnApplied(id, request->version(), in_sync);
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

// ---- Rollback -------------------------------------------------------------------------------

grpc::ServerUnaryReactor* CloudService::Rollback(grpc::CallbackServerContext* ctx,
                                                 const v1::RollbackRequest* request,
                                                 v1::RollbackReply* reply) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::Status bad = wire::ValidateDeviceId(request->device_id());
  if (bad.ok()) bad = Authenticate(ctx, request->device_id()).status();
  if (bad.ok()) bad = registry_->Get(request->device_id()).status();
  if (bad.ok() && observer_ == nullptr) {
    bad = absl::UnimplementedError("this cloud trains no model: there is nothing to roll back");
  }
  if (!bad.ok()) {
    reactor->Finish(wire::ToGrpcStatus(bad));
    return reactor;
  }
  // Waits for a job of the device that is running: never on the reaction thread.
  io_pool_.Schedule([this, reactor, request, reply] {
    absl::StatusOr<RollbackResult> result =
        observer_->OnRollback(request->device_id(), request->version(), request->to_version());
    if (!result.ok()) {
      reactor->Finish(wire::ToGrpcStatus(result.status()));
      return;
    }
    reply->set_new_version(result->new_version);
    reply->set_restored_version(result->restored_version);
    reply->set_state_digest(result->state_digest);
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

// ---- Health ---------------------------------------------------------------------------------

grpc::ServerUnaryReactor* CloudService::Health(grpc::CallbackServerContext* ctx,
                                               const v1::HealthRequest* /*request*/,
                                               v1::HealthReply* reply) {
  const SampleStoreStats stats = samples_->Stats();
  reply->set_status(v1::HealthReply::SERVING);
  reply->set_server_version(CDCCA_VERSION);
  reply->set_uptime_seconds(static_cast<uint64_t>(absl::ToInt64Seconds(absl::Now() - started_)));
  reply->set_registered_devices(static_cast<uint32_t>(registry_->size()));
  reply->set_stored_batches(stats.records);
  reply->set_stored_bytes(stats.bytes);
  reply->set_damaged_log_ranges(stats.damaged_ranges);
  reply->set_truncated_tail_bytes(stats.truncated_tail_bytes);
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace cdcca::cloud
