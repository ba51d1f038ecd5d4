// A real nginx for tests, as the gRPC proxy in front of cdcca-cloud processes: one
// cleartext HTTP/2 listener on 127.0.0.1 at a free port, passing every call (grpc_pass) to an
// upstream of the given backends, round robin. The configuration is
// configs/nginx/grpc_proxy.conf.in, the one scripts/cluster.sh starts, filled in with a fresh
// temporary directory for everything nginx writes (pid, error.log, access.log, temporary
// files). When the test runs as root, nginx runs as the user nobody, which owns the
// directory. nginx's own log is <dir>/error.log.
//
//   NginxProxyOptions options;
//   options.backends = {"127.0.0.1:5001", "127.0.0.1:5002"};
//   absl::StatusOr<std::unique_ptr<NginxServer>> nginx = NginxServer::Start(options);
//   ASSERT_TRUE(nginx.ok()) << nginx.status();   // says what is missing
//   // devices dial (*nginx)->address()
//
// The destructor stops nginx and removes the directory. Should the test process die first,
// the kernel stops nginx when the thread that started it ends (setpriv --pdeathsig): call
// Start from a thread that outlives the server, such as the test's main thread. Not
// thread-safe; address() may be used from any thread.
#ifndef CDCCA_TESTS_TESTING_NGINX_SERVER_H_
#define CDCCA_TESTS_TESTING_NGINX_SERVER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::testing {

class Child;

// The nginx program: $CDCCA_NGINX, else /usr/sbin/nginx. NOT_FOUND saying how to install it
// when absent.
absl::StatusOr<std::string> NginxBinary();

struct NginxProxyOptions {
  // host:port of each gRPC backend (cleartext HTTP/2). At least one.
  std::vector<std::string> backends;
  // Worker processes. Default: 1, so round robin alternates strictly between the backends
  // (each worker keeps its own turn).
  int workers = 1;
  // Connections one worker holds at most (worker_connections): one per connected device
  // plus one per open call. Default: 1024.
  int worker_connections = 1024;
  // Longest pause between two reads or two writes on one call, either side of nginx
  // (grpc_read_timeout, grpc_send_timeout, client_body_timeout, send_timeout); never a bound
  // on a whole stream. Default: 10 min.
  absl::Duration stream_idle_timeout = absl::Minutes(10);
  // grpc_connect_timeout: a backend that does not accept within it is skipped for the call.
  // Default: 2 s.
  absl::Duration connect_timeout = absl::Seconds(2);
  // How long a backend that failed a connection is left out before nginx tries it again.
  // Default: 5 s.
  absl::Duration fail_timeout = absl::Seconds(5);
  // TLS towards the devices, ended at nginx: its certificate chain and key (PEM files;
  // empty = cleartext). With client_ca, every device must present a certificate signed by
  // it (ssl_verify_client on), which nginx passes on in the X-Client-Cert header.
  std::string tls_cert;
  std::string tls_key;
  std::string client_ca;
};

class NginxServer {
 public:
  // Writes the configuration and starts nginx; returns once it serves it (its status port
  // answers the configuration's generation) and the proxy port accepts connections.
  // NOT_FOUND when nginx or setpriv is missing; INVALID_ARGUMENT without backends;
  // DEADLINE_EXCEEDED (with the error log's tail) when it is not ready within `timeout`;
  // INTERNAL when nginx exits at start.
  static absl::StatusOr<std::unique_ptr<NginxServer>> Start(
      NginxProxyOptions options, absl::Duration timeout = absl::Seconds(30));

  ~NginxServer();
  NginxServer(const NginxServer&) = delete;
  NginxServer& operator=(const NginxServer&) = delete;

  // The port devices dial, and "127.0.0.1:<port>".
  int port() const { return port_; }
  std::string address() const;
  const std::string& dir() const { return dir_.path(); }
  std::string error_log_path() const { return dir_.file("error.log"); }
  // One line per call: status, upstream address(es) tried and their statuses.
  std::string access_log_path() const { return dir_.file("access.log"); }

  // Replaces the backends: checks the new configuration (nginx -t), then has nginx reload
  // it (SIGHUP) and returns once new connections are served by it. Calls already open run
  // on in the old workers (for at most worker_shutdown_timeout). INVALID_ARGUMENT when the
  // configuration is refused (the old one stays); DEADLINE_EXCEEDED when the reload did
  // not take effect within `timeout`.
  absl::Status Reload(std::vector<std::string> backends,
                      absl::Duration timeout = absl::Seconds(30));

  // Stops nginx (fast shutdown: open calls are cut), waiting up to `timeout`, else kills it
  // and its workers.
  absl::Status Stop(absl::Duration timeout = absl::Seconds(30));
  bool running() const;
  // The master's process id, then its workers' (from /proc); empty when nginx is stopped.
  std::vector<pid_t> Pids() const;

 private:
  explicit NginxServer(NginxProxyOptions options);
  // The configuration for the current ports, backends and generation_.
  std::string Config() const;
  // Writes Config() to `path`, owned by the server's user.
  absl::Status WriteConfig(const std::string& path) const;
  // Starts nginx on port_ and status_port_ and waits until it serves generation_.
  absl::Status Launch(absl::Duration timeout);
  // Whether the status port answers generation_ now.
  bool ServesCurrentGeneration() const;
  // args wrapped in setpriv: stopped when the starting thread ends, and run as the
  // unprivileged user when this process is root.
  std::vector<std::string> AsServerUser(std::vector<std::string> args) const;
  std::string LogTails() const;

  TempDir dir_;  // destroyed last: nginx stops before its directory goes
  NginxProxyOptions options_;
  std::string binary_;
  std::string template_;  // configs/nginx/grpc_proxy.conf.in
  bool drop_privileges_ = false;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
  int port_ = 0;
  int status_port_ = 0;
  int generation_ = 1;
  std::unique_ptr<Child> master_;
};

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_NGINX_SERVER_H_
