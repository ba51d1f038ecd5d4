#include "cloud/cloud_server.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "cloud/internal/file_io.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "proto/wire.h"

namespace cdcca::cloud {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat("TLS: no ", what, " given"));
  absl::StatusOr<std::string> pem = internal::ReadFile(path);
  if (!pem.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS: cannot read ", what, ": ", pem.status().message()));
  }
  if (pem->find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("TLS: ", what, " ", path, " is not PEM"));
  }
  return pem;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const ServerOptions& options) {
  if (options.insecure) {
    std::fprintf(stderr,
                 "WARNING: cdcca cloud is serving PLAINTEXT on %s (--insecure): tokens and "
                 "data cross the network unencrypted. Use this only on loopback.\n",
                 options.listen_address.c_str());
    return grpc::InsecureServerCredentials();
  }
  absl::StatusOr<std::string> cert = ReadPem(options.tls.cert_chain_path, "certificate chain");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(options.tls.private_key_path, "private key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (options.tls.require_client_cert && options.tls.allow_token_only_devices) {
    return absl::InvalidArgumentError(
        "TLS: require_client_cert and allow_token_only_devices contradict each other");
  }
  if (!options.tls.client_ca_path.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(options.tls.client_ca_path, "client CA");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    // A CA means mutual TLS: a device on a token alone only where explicitly allowed.
    ssl.client_certificate_request =
        options.tls.allow_token_only_devices
            ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  } else if (options.tls.require_client_cert || options.tls.allow_token_only_devices) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS: ",
        options.tls.require_client_cert ? "require_client_cert" : "allow_token_only_devices",
        " needs a client CA file"));
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CloudServer>> CloudServer::Start(const ServerOptions& options,
                                                                grpc::Service* service) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = MakeCredentials(options);
  if (!creds.ok()) return creds.status();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen_address, *creds, &port);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(wire::kMaxMessageBytes);
  builder.SetMaxSendMessageSize(wire::kMaxMessageBytes);
  // Keepalive: ping idle connections so dead devices are noticed; let devices ping us.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20 * 1000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10 * 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address, " (in use, or bad address?)"));
  }
  return std::unique_ptr<CloudServer>(new CloudServer(std::move(server), port));
}

CloudServer::~CloudServer() { Shutdown(absl::ZeroDuration()); }

void CloudServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
}

void CloudServer::Wait() { server_->Wait(); }

}  // namespace cdcca::cloud
