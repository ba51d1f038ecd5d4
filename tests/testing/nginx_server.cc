#include "tests/testing/nginx_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tests/testing/child_process.h"
#include "tests/testing/free_port.h"
#include "tests/testing/proc_stats.h"
#include "tests/testing/wait.h"

namespace cdcca::testing {
namespace {

namespace fs = std::filesystem;

constexpr char kSetpriv[] = "/usr/bin/setpriv";
constexpr char kDefaultNginx[] = CDCCA_NGINX_PROGRAM;  // found by the configure step
// The user nginx runs as when the test is root (nginx itself would keep its master as root).
constexpr char kServerUser[] = "nobody";

std::string Tail(const std::string& text, size_t bytes = 2000) {
  return text.size() <= bytes ? text : text.substr(text.size() - bytes);
}

// nginx's time syntax: whole seconds, at least 1 ("600s").
// The server block's certificate directives for `options` (none for cleartext).
std::string TlsDirectives(const NginxProxyOptions& options) {
  if (options.tls_cert.empty()) return "";
  std::string out = absl::StrCat("ssl_certificate ", options.tls_cert, "; ssl_certificate_key ",
                                 options.tls_key, ";");
  if (!options.client_ca.empty()) {
    absl::StrAppend(&out, " ssl_client_certificate ", options.client_ca, "; ssl_verify_client on;");
  }
  return out;
}

std::string NginxSeconds(absl::Duration d) {
  return absl::StrCat(std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(d, absl::Seconds(1)))),
                      "s");
}

// A connected socket to 127.0.0.1:port with send/receive timeouts, or -1.
int ConnectLoopback(int port, absl::Duration timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  const timeval tv = absl::ToTimeval(timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The body of `GET path` over HTTP/1.0 on 127.0.0.1:port, or "" when there is no 200 answer.
std::string HttpGet(int port, const std::string& path) {
  const int fd = ConnectLoopback(port, absl::Seconds(1));
  if (fd < 0) return "";
  const std::string request = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  std::string response;
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
      static_cast<ssize_t>(request.size())) {
    char buf[1024];
    ssize_t n = 0;
    while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, n);
  }
  ::close(fd);
  if (!absl::StartsWith(response, "HTTP/1.1 200") && !absl::StartsWith(response, "HTTP/1.0 200")) {
    return "";
  }
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

}  // namespace

absl::StatusOr<std::string> NginxBinary() {
  if (const char* env = std::getenv("CDCCA_NGINX"); env != nullptr && *env != '\0') {
    if (::access(env, X_OK) == 0) return std::string(env);
    return absl::NotFoundError(absl::StrCat("CDCCA_NGINX=", env, " is not an executable"));
  }
  if (::access(kDefaultNginx, X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat(
        "nginx not found at ", kDefaultNginx,
        ": apt-get install nginx (scripts/setup.sh does), or set CDCCA_NGINX to the nginx "
        "program"));
  }
  return std::string(kDefaultNginx);
}

NginxServer::NginxServer(NginxProxyOptions options) : options_(std::move(options)) {}

NginxServer::~NginxServer() { Stop().IgnoreError(); }

std::string NginxServer::address() const { return absl::StrCat("127.0.0.1:", port_); }

bool NginxServer::running() const { return master_ != nullptr && master_->running(); }

std::vector<pid_t> NginxServer::Pids() const {
  if (!running()) return {};
  std::vector<pid_t> pids = {master_->pid()};
  for (const pid_t worker : ChildrenOf(master_->pid())) pids.push_back(worker);
  return pids;
}

std::vector<std::string> NginxServer::AsServerUser(std::vector<std::string> args) const {
  // The kernel sends SIGTERM (fast shutdown) to the master when the thread that started it
  // ends; the master takes its workers down with it.
  std::vector<std::string> wrapped = {kSetpriv, "--pdeathsig", "SIGTERM"};
  if (drop_privileges_) {
    wrapped.insert(wrapped.end(), {absl::StrCat("--reuid=", uid_), absl::StrCat("--regid=", gid_),
                                   "--clear-groups"});
  }
  wrapped.push_back("--");
  wrapped.insert(wrapped.end(), args.begin(), args.end());
  return wrapped;
}

std::string NginxServer::Config() const {
  // A template line holding @BACKEND@ stands for one line per backend.
  std::string config;
  for (absl::string_view line : absl::StrSplit(template_, '\n')) {
    if (absl::StrContains(line, "@BACKEND@")) {
      for (const std::string& backend : options_.backends) {
        absl::StrAppend(&config, absl::StrReplaceAll(line, {{"@BACKEND@", backend}}), "\n");
      }
    } else {
      absl::StrAppend(&config, line, "\n");
    }
  }
  return absl::StrReplaceAll(config,
                             {{"@PREFIX@", dir()},
                              {"@LISTEN@", absl::StrCat("127.0.0.1:", port_)},
                              {"@STATUS_LISTEN@", absl::StrCat("127.0.0.1:", status_port_)},
                              {"@GENERATION@", absl::StrCat(generation_)},
                              {"@WORKERS@", absl::StrCat(options_.workers)},
                              {"@WORKER_CONNECTIONS@", absl::StrCat(options_.worker_connections)},
                              {"@STREAM_IDLE_TIMEOUT@", NginxSeconds(options_.stream_idle_timeout)},
                              {"@CONNECT_TIMEOUT@", NginxSeconds(options_.connect_timeout)},
                              {"@FAIL_TIMEOUT@", NginxSeconds(options_.fail_timeout)},
                              {"@LISTEN_SSL@", options_.tls_cert.empty() ? "" : "ssl"},
                              {"@TLS@", TlsDirectives(options_)}});
}

absl::Status NginxServer::WriteConfig(const std::string& path) const {
  {
    std::ofstream out(path, std::ios::trunc);
    out << Config();
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  if (drop_privileges_ && ::chown(path.c_str(), uid_, gid_) != 0) {
    return absl::InternalError(absl::StrCat("cannot chown ", path));
  }
  return absl::OkStatus();
}

std::string NginxServer::LogTails() const {
  return absl::StrCat("error.log: ", Tail(ReadText(error_log_path())),
                      "\nstderr: ", Tail(ReadText(dir_.file("nginx.stderr"))));
}

absl::StatusOr<std::unique_ptr<NginxServer>> NginxServer::Start(NginxProxyOptions options,
                                                                absl::Duration timeout) {
  if (options.backends.empty()) return absl::InvalidArgumentError("nginx needs a backend");
  if (options.workers < 1) return absl::InvalidArgumentError("nginx needs a worker");
  absl::StatusOr<std::string> binary = NginxBinary();
  if (!binary.ok()) return binary.status();
  if (!fs::exists(kSetpriv)) return absl::NotFoundError("setpriv (util-linux) is missing");
  auto server = std::unique_ptr<NginxServer>(new NginxServer(std::move(options)));
  server->binary_ = *binary;
  server->template_ = ReadText(CDCCA_NGINX_CONFIG_TEMPLATE);
  if (server->template_.empty()) {
    return absl::NotFoundError(
        absl::StrCat("cannot read the nginx template ", CDCCA_NGINX_CONFIG_TEMPLATE));
  }
  if (::geteuid() == 0) {
    // Run all of nginx unprivileged: it needs no port below 1024, and its files stay in a
    // directory that user owns.
    const passwd* pw = ::getpwnam(kServerUser);
    if (pw == nullptr) return absl::NotFoundError("no user nobody to run nginx as");
    server->drop_privileges_ = true;
    server->uid_ = pw->pw_uid;
    server->gid_ = pw->pw_gid;
    if (::chown(server->dir().c_str(), server->uid_, server->gid_) != 0) {
      return absl::InternalError(absl::StrCat("cannot chown ", server->dir()));
    }
  }
  // A port found free may be taken before nginx binds it: try others.
  absl::Status launched;
  for (int attempt = 0; attempt < 3; ++attempt) {
    absl::StatusOr<int> port = FreeLoopbackPort();
    absl::StatusOr<int> status_port = FreeLoopbackPort();
    if (!port.ok()) return port.status();
    if (!status_port.ok()) return status_port.status();
    if (*port == *status_port) continue;
    server->port_ = *port;
    server->status_port_ = *status_port;
    launched = server->Launch(timeout);
    if (launched.ok() || launched.code() == absl::StatusCode::kDeadlineExceeded) break;
  }
  if (!launched.ok()) return launched;
  return server;
}

bool NginxServer::ServesCurrentGeneration() const {
  return absl::StripAsciiWhitespace(HttpGet(status_port_, "/generation")) ==
         absl::StrCat(generation_);
}

absl::Status NginxServer::Launch(absl::Duration timeout) {
  const std::string config = dir_.file("nginx.conf");
  if (absl::Status s = WriteConfig(config); !s.ok()) return s;
  // -e: where nginx logs before it has read the configuration's error_log.
  master_ = std::make_unique<Child>(
      AsServerUser({binary_, "-p", dir() + "/", "-c", config, "-e", error_log_path()}),
      dir_.file("nginx.stderr"));
  if (!master_->running()) return absl::InternalError("cannot start nginx");
  bool exited = false;
  const bool ready = WaitUntil(
      [&] {
        if (master_->Wait(absl::ZeroDuration()) != -1) {
          exited = true;
          return true;
        }
        return ServesCurrentGeneration();
      },
      timeout, absl::Milliseconds(20));
  if (exited) {
    master_.reset();
    return absl::InternalError(absl::StrCat("nginx exited at start: ", LogTails()));
  }
  const int probe = ready ? ConnectLoopback(port_, absl::Seconds(1)) : -1;
  if (probe >= 0) ::close(probe);
  if (probe < 0) {
    Stop().IgnoreError();
    return absl::DeadlineExceededError(
        absl::StrCat("nginx not ready after ", absl::FormatDuration(timeout), ": ", LogTails()));
  }
  return absl::OkStatus();
}

absl::Status NginxServer::Reload(std::vector<std::string> backends, absl::Duration timeout) {
  if (!running()) return absl::FailedPreconditionError("nginx is not running");
  if (backends.empty()) return absl::InvalidArgumentError("nginx needs a backend");
  std::vector<std::string> previous = std::exchange(options_.backends, std::move(backends));
  ++generation_;
  const std::string next = dir_.file("nginx.conf.next");
  absl::Status written = WriteConfig(next);
  if (written.ok()) {
    const std::string out = dir_.file("nginx-t.out");
    Child check(
        AsServerUser({binary_, "-t", "-q", "-p", dir() + "/", "-c", next, "-e", error_log_path()}),
        out);
    const int code = check.Wait(timeout);
    if (code != 0) {
      written = absl::InvalidArgumentError(absl::StrCat(
          "nginx refused the configuration (nginx -t exit ", code, "): ", Tail(ReadText(out))));
    }
  }
  if (!written.ok()) {
    std::error_code ec;
    fs::remove(next, ec);
    options_.backends = std::move(previous);
    --generation_;
    return written;
  }
  std::error_code ec;
  fs::rename(next, dir_.file("nginx.conf"), ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot replace nginx.conf: ", ec.message()));
  master_->Signal(SIGHUP);
  if (!WaitUntil([&] { return ServesCurrentGeneration(); }, timeout, absl::Milliseconds(20))) {
    return absl::DeadlineExceededError(absl::StrCat(
        "nginx did not reload within ", absl::FormatDuration(timeout), ": ", LogTails()));
  }
  return absl::OkStatus();
}

absl::Status NginxServer::Stop(absl::Duration timeout) {
  if (master_ == nullptr) return absl::OkStatus();
  master_->Signal(SIGTERM);  // fast shutdown: the master stops its workers, then exits
  if (master_->Wait(timeout) != -1) {
    master_.reset();
    return absl::OkStatus();
  }
  // A master killed outright would leave its workers serving: kill them too.
  int master_pid = 0;
  const bool known =
      absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadText(dir_.file("nginx.pid"))), &master_pid);
  const std::vector<pid_t> workers = known ? ChildrenOf(master_pid) : std::vector<pid_t>();
  master_.reset();  // SIGKILL, then reaped
  for (const pid_t worker : workers) ::kill(worker, SIGKILL);
  return absl::DeadlineExceededError(
      absl::StrCat("nginx did not stop within ", absl::FormatDuration(timeout)));
}

}  // namespace cdcca::testing
