#include "device/cloud_client.h"

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/wire.h"

namespace cdcca::device {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("TLS: cannot read ", what, " ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Retryable(const grpc::Status& s) { return s.error_code() == grpc::StatusCode::UNAVAILABLE; }

}  // namespace

absl::StatusOr<std::unique_ptr<CloudClient>> CloudClient::Create(
    const CloudClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("cloud target is empty");
  if (absl::Status s = wire::ValidateDeviceId(options.device_id); !s.ok()) return s;
  if (options.token.empty() || options.token.size() > wire::kMaxTokenBytes) {
    return absl::InvalidArgumentError("device token must be 1-256 bytes");
  }
  if (options.max_attempts < 1) return absl::InvalidArgumentError("max_attempts must be >= 1");
  std::shared_ptr<grpc::ChannelCredentials> creds;
  grpc::ChannelArguments args;
  if (options.insecure) {
    creds = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions ssl;
    if (!options.tls.root_ca_path.empty()) {
      absl::StatusOr<std::string> ca = ReadPem(options.tls.root_ca_path, "root CA");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    if (!options.tls.cert_chain_path.empty()) {
      absl::StatusOr<std::string> cert = ReadPem(options.tls.cert_chain_path, "certificate");
      if (!cert.ok()) return cert.status();
      absl::StatusOr<std::string> key = ReadPem(options.tls.private_key_path, "private key");
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    creds = grpc::SslCredentials(ssl);
    if (!options.tls.server_name_override.empty()) {
      args.SetSslTargetNameOverride(options.tls.server_name_override);
    }
  }
  args.SetMaxReceiveMessageSize(wire::kMaxMessageBytes);
  args.SetMaxSendMessageSize(wire::kMaxMessageBytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30 * 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10 * 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Reconnect quickly after the cloud comes back; our own backoff paces the calls.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  auto channel = grpc::CreateCustomChannel(options.target, creds, args);
  return std::unique_ptr<CloudClient>(new CloudClient(options, v1::Cloud::NewStub(channel)));
}

void CloudClient::Prepare(grpc::ClientContext* ctx, absl::Duration timeout) const {
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  ctx->AddMetadata(wire::kAuthMetadataKey, absl::StrCat(wire::kBearerPrefix, options_.token));
}

void CloudClient::Backoff(int attempt) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  absl::Duration d = options_.initial_backoff;
  for (int i = 1; i < attempt && d < options_.max_backoff; ++i) d *= 2;
  d = std::min(d, options_.max_backoff);
  std::uniform_real_distribution<double> jitter(0.5, 1.0);
  absl::SleepFor(d * jitter(rng));
  absl::MutexLock lock(&mu_);
  ++stats_.retries;
}

template <typename Fn>
auto CloudClient::WithRetries(Fn call) -> decltype(call()) {
  for (int attempt = 1;; ++attempt) {
    auto result = call();
    if (result.ok() || !absl::IsUnavailable(result.status()) || attempt >= options_.max_attempts) {
      return result;
    }
    Backoff(attempt);
  }
}

absl::StatusOr<v1::RegisterReply> CloudClient::Register(v1::RegisterRequest request) {
  request.set_device_id(options_.device_id);
  return WithRetries([&]() -> absl::StatusOr<v1::RegisterReply> {
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.call_timeout);
    v1::RegisterReply reply;
    grpc::Status s = stub_->Register(&ctx, request, &reply);
    if (!s.ok()) return wire::FromGrpcStatus(s);
    return reply;
  });
}

absl::StatusOr<v1::UplinkAck> CloudClient::Uplink(const std::vector<v1::UplinkBatch>& batches) {
  for (const v1::UplinkBatch& b : batches) {
    if (b.payload().size() > wire::kMaxChunkBytes) {
      return absl::InvalidArgumentError(absl::StrCat("batch ", b.sequence(), " payload of ",
                                                     b.payload().size(),
                                                     " bytes exceeds the 1 MiB limit"));
    }
  }
  return WithRetries([&]() -> absl::StatusOr<v1::UplinkAck> {
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.stream_timeout);
    v1::UplinkAck ack;
    std::unique_ptr<grpc::ClientWriter<v1::UplinkBatch>> writer = stub_->Uplink(&ctx, &ack);
    for (const v1::UplinkBatch& b : batches) {
      if (!writer->Write(b)) break;  // the server ended the stream; Finish() says why
    }
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    if (!s.ok()) return wire::FromGrpcStatus(s);
    return ack;
  });
}

template <typename Open>
absl::StatusOr<FetchedPayload> CloudClient::Download(Open open) {
  FetchedPayload out;
  int attempts_without_progress = 0;
  bool have_info = false;
  while (true) {
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.stream_timeout);
    std::unique_ptr<grpc::ClientReader<v1::PayloadChunk>> reader =
        open(&ctx, out.bytes.size(), have_info ? out.info.new_version() : 0);
    const size_t before = out.bytes.size();
    v1::PayloadChunk chunk;
    absl::Status bad;
    while (bad.ok() && reader->Read(&chunk)) {
      if (chunk.has_info()) {
        if (have_info && (chunk.info().new_version() != out.info.new_version() ||
                          chunk.info().sha256() != out.info.sha256())) {
          bad = absl::AbortedError("the payload changed during a resumed download");
          break;
        }
        out.info = chunk.info();
        have_info = true;
        if (out.info.total_bytes() > wire::kMaxPayloadBytes) {
          bad = absl::InvalidArgumentError(absl::StrCat("payload of ", out.info.total_bytes(),
                                                        " bytes exceeds the client's limit"));
          break;
        }
        if (out.bytes.empty()) out.bytes.reserve(out.info.total_bytes());
      }
      if (!have_info) {
        bad = absl::DataLossError("payload stream did not start with its info");
      } else if (chunk.offset() != out.bytes.size()) {
        bad = absl::DataLossError(
            absl::StrCat("chunk at offset ", chunk.offset(), ", expected ", out.bytes.size()));
      } else if (out.bytes.size() + chunk.data().size() > out.info.total_bytes()) {
        bad = absl::DataLossError("payload stream runs past its announced size");
      } else {
        out.bytes += chunk.data();
      }
    }
    if (!bad.ok()) {
      ctx.TryCancel();
      reader->Finish();
      return bad;
    }
    grpc::Status s = reader->Finish();
    if (s.ok()) break;
    if (!Retryable(s)) return wire::FromGrpcStatus(s);
    attempts_without_progress = out.bytes.size() > before ? 1 : attempts_without_progress + 1;
    if (attempts_without_progress >= options_.max_attempts) return wire::FromGrpcStatus(s);
    if (out.bytes.size() > before) {
      ++out.resumes;
      absl::MutexLock lock(&mu_);
      ++stats_.resumes;
    }
    Backoff(attempts_without_progress);
  }
  if (!have_info) return absl::DataLossError("payload stream ended without its info");
  if (!out.info.available()) return out;
  if (out.bytes.size() != out.info.total_bytes()) {
    return absl::DataLossError(absl::StrCat("payload ended at ", out.bytes.size(), " of ",
                                            out.info.total_bytes(), " bytes"));
  }
  if (wire::Sha256(out.bytes) != out.info.sha256()) {
    return absl::DataLossError("payload SHA-256 does not match the announced digest");
  }
  return out;
}

absl::StatusOr<FetchedPayload> CloudClient::FetchUpdate(uint64_t base_version) {
  return Download([&](grpc::ClientContext* ctx, uint64_t offset, uint64_t new_version) {
    v1::FetchUpdateRequest req;
    req.set_device_id(options_.device_id);
    req.set_base_version(base_version);
    req.set_offset(offset);
    req.set_new_version(new_version);
    return stub_->FetchUpdate(ctx, req);
  });
}

absl::StatusOr<FetchedPayload> CloudClient::FetchSnapshot(uint64_t version) {
  return Download([&](grpc::ClientContext* ctx, uint64_t offset, uint64_t resolved) {
    v1::FetchSnapshotRequest req;
    req.set_device_id(options_.device_id);
    req.set_version(resolved != 0 ? resolved : version);
    req.set_offset(offset);
    return stub_->FetchSnapshot(ctx, req);
  });
}

absl::StatusOr<v1::ReportAppliedReply> CloudClient::ReportApplied(uint64_t version,
                                                                  uint64_t state_digest) {
  v1::ReportAppliedRequest req;
  req.set_device_id(options_.device_id);
  req.set_version(version);
  req.set_state_digest(state_digest);
  return WithRetries([&]() -> absl::StatusOr<v1::ReportAppliedReply> {
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.call_timeout);
    v1::ReportAppliedReply reply;
    grpc::Status s = stub_->ReportApplied(&ctx, req, &reply);
    if (!s.ok()) return wire::FromGrpcStatus(s);
    return reply;
  });
}

absl::StatusOr<v1::RollbackReply> CloudClient::Rollback(uint64_t version, uint64_t to_version) {
  v1::RollbackRequest req;
  req.set_device_id(options_.device_id);
  req.set_version(version);
  req.set_to_version(to_version);
  grpc::ClientContext ctx;
  Prepare(&ctx, options_.call_timeout);
  v1::RollbackReply reply;
  grpc::Status s = stub_->Rollback(&ctx, req, &reply);
  if (!s.ok()) return wire::FromGrpcStatus(s);
  return reply;
}

absl::StatusOr<v1::HealthReply> CloudClient::Health() {
  return WithRetries([&]() -> absl::StatusOr<v1::HealthReply> {
    grpc::ClientContext ctx;
    Prepare(&ctx, options_.call_timeout);
    v1::HealthReply reply;
    grpc::Status s = stub_->Health(&ctx, v1::HealthRequest(), &reply);
    if (!s.ok()) return wire::FromGrpcStatus(s);
    return reply;
  });
}

ClientStats CloudClient::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace cdcca::device
