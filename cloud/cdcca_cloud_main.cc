// cdcca-cloud: the cloud service. Serves the wire contract over gRPC (TLS by default),
// stores what devices uplink durably, and serves the updates in its update store.
//
//   cdcca-cloud --data_dir=/var/lib/cdcca --tokens=tokens.txt \
//       --tls_cert=server.pem --tls_key=server.key [--client_ca=ca.pem --require_client_cert]
//   cdcca-cloud --data_dir=/tmp/cdcca --tokens=tokens.txt --insecure   # loopback only
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "cloud/cloud_server.h"
#include "cloud/cloud_service.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "host:port to serve on (port 0 picks one)");
ABSL_FLAG(std::string, data_dir, "", "directory of the sample log, update store and registry");
ABSL_FLAG(std::string, tokens, "", "token file: one `<device_id> <token>` per line");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain");
ABSL_FLAG(std::string, tls_key, "", "PEM server private key");
ABSL_FLAG(std::string, client_ca, "", "PEM CA for client certificates (enables mutual TLS)");
ABSL_FLAG(bool, require_client_cert, false, "refuse devices without a client certificate");
ABSL_FLAG(bool, insecure, false, "serve plaintext (loopback experiments only; prints a warning)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving");
ABSL_FLAG(std::string, expected_fingerprint, "0",
          "hex fingerprint of the student base devices must run (0 = accept any)");

namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "cdcca-cloud: %s\n", std::string(s.ToString()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "cdcca-cloud --data_dir=DIR --tokens=FILE (--tls_cert=F --tls_key=F | --insecure)");
  absl::ParseCommandLine(argc, argv);
  // Block SIGINT/SIGTERM in every thread (they inherit this mask) and wait for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  using namespace cdcca::cloud;  // NOLINT: a program's main
  const std::string data_dir = absl::GetFlag(FLAGS_data_dir);
  if (data_dir.empty()) return Fail(absl::InvalidArgumentError("--data_dir is required"));
  if (absl::GetFlag(FLAGS_tokens).empty()) {
    return Fail(absl::InvalidArgumentError("--tokens is required (see --help)"));
  }
  uint64_t fingerprint = 0;
  if (!absl::SimpleHexAtoi(absl::GetFlag(FLAGS_expected_fingerprint), &fingerprint)) {
    return Fail(absl::InvalidArgumentError("--expected_fingerprint must be hex"));
  }
  auto auth = TokenAuthenticator::FromFile(absl::GetFlag(FLAGS_tokens));
  if (!auth.ok()) return Fail(auth.status());
  auto registry = DeviceRegistry::Open(data_dir + "/registry");
  if (!registry.ok()) return Fail(registry.status());
  SampleStoreOptions sample_options;
  sample_options.dir = data_dir + "/samples";
  auto samples = SampleStore::Open(sample_options);
  if (!samples.ok()) return Fail(samples.status());
  auto updates = UpdateStore::Open({data_dir + "/updates", 16});
  if (!updates.ok()) return Fail(updates.status());

  CloudServiceOptions service_options;
  service_options.expected_fingerprint = fingerprint;
  CloudService service(service_options, auth->get(), registry->get(), samples->get(),
                       updates->get());
  ServerOptions server_options;
  server_options.listen_address = absl::GetFlag(FLAGS_listen);
  server_options.insecure = absl::GetFlag(FLAGS_insecure);
  server_options.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                        absl::GetFlag(FLAGS_client_ca), absl::GetFlag(FLAGS_require_client_cert)};
  auto server = CloudServer::Start(server_options, &service);
  if (!server.ok()) return Fail(server.status());
  std::fprintf(stderr, "cdcca-cloud: serving on port %d, %zu device tokens, data in %s\n",
               (*server)->port(), (*auth)->size(), data_dir.c_str());
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_port_file)) << (*server)->port() << "\n";
  }
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  std::fprintf(stderr, "cdcca-cloud: shutting down\n");
  (*server)->Shutdown(absl::Seconds(5));
  return 0;
}
