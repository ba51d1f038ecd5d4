// CloudServer: a running gRPC server around a CloudService, with TLS (optionally mutual)
// or, for loopback experiments only, plaintext.
#ifndef CDCCA_CLOUD_CLOUD_SERVER_H_
#define CDCCA_CLOUD_CLOUD_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"

namespace cdcca::cloud {

struct ServerTlsFiles {
  std::string cert_chain_path;   // PEM server certificate chain
  std::string private_key_path;  // PEM private key
  // PEM CA bundle for client certificates (mutual TLS). With it, a client must present a
  // certificate signed by that CA unless allow_token_only_devices.
  std::string client_ca_path;
  // With client_ca_path: refuse clients without a certificate (the default with a CA; kept
  // for callers that say so). Contradicts allow_token_only_devices.
  bool require_client_cert = false;
  // With client_ca_path: also accept clients that present no certificate (their token alone
  // identifies them); a certificate that is presented must still verify. Default: false.
  bool allow_token_only_devices = false;
};

struct ServerOptions {
  // host:port to listen on; port 0 picks a free one (see CloudServer::port()).
  std::string listen_address = "127.0.0.1:50051";
  // Plaintext: only for loopback experiments. Starting with it prints a warning.
  bool insecure = false;
  ServerTlsFiles tls;
  // Threads for gRPC's callback reactions (0 = gRPC's default).
  int reaction_threads = 0;
};

class CloudServer {
 public:
  // Starts serving `service`, which must outlive the server. INVALID_ARGUMENT for missing or
  // unreadable TLS files; UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<CloudServer>> Start(const ServerOptions& options,
                                                            grpc::Service* service);
  ~CloudServer();

  int port() const { return port_; }
  // Stops accepting calls; in-flight calls get until `grace` to finish, then are cancelled.
  void Shutdown(absl::Duration grace = absl::Seconds(2));
  // Blocks until the server has shut down.
  void Wait();

 private:
  CloudServer(std::unique_ptr<grpc::Server> server, int port)
      : server_(std::move(server)), port_(port) {}
  std::unique_ptr<grpc::Server> server_;
  int port_;
  bool shut_down_ = false;
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_CLOUD_SERVER_H_
