#include "tests/testing/postgres_server.h"

#include <libpq-fe.h>
#include <pwd.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tests/testing/child_process.h"
#include "tests/testing/free_port.h"
#include "tests/testing/wait.h"

namespace cdcca::testing {
namespace {

namespace fs = std::filesystem;

constexpr char kSetpriv[] = "/usr/bin/setpriv";
constexpr char kUser[] = "cdcca";

std::string Tail(const std::string& text, size_t bytes = 2000) {
  return text.size() <= bytes ? text : text.substr(text.size() - bytes);
}

}  // namespace

absl::StatusOr<std::string> PostgresBinDir() {
  if (const char* env = std::getenv("CDCCA_POSTGRES_BIN"); env != nullptr && *env != '\0') {
    if (fs::exists(fs::path(env) / "postgres")) return std::string(env);
    return absl::NotFoundError(
        absl::StrCat("CDCCA_POSTGRES_BIN=", env, " holds no postgres program"));
  }
  int newest = -1;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/usr/lib/postgresql", ec)) {
    int version = 0;
    if (absl::SimpleAtoi(entry.path().filename().string(), &version) && version > newest &&
        fs::exists(entry.path() / "bin" / "postgres") &&
        fs::exists(entry.path() / "bin" / "initdb")) {
      newest = version;
    }
  }
  if (newest < 0) {
    return absl::NotFoundError(
        "PostgreSQL server programs not found in /usr/lib/postgresql/<version>/bin: install "
        "the Debian package postgresql (scripts/setup.sh does), or set CDCCA_POSTGRES_BIN to "
        "the directory holding initdb and postgres");
  }
  return absl::StrCat("/usr/lib/postgresql/", newest, "/bin");
}

std::vector<std::string> PostgresServer::AsServerUser(std::vector<std::string> args) const {
  // The kernel sends SIGINT (fast shutdown) to the server when the thread that started it
  // ends, so a test process that crashes or is killed leaves no server behind.
  std::vector<std::string> wrapped = {kSetpriv, "--pdeathsig", "SIGINT"};
  if (drop_privileges_) {
    wrapped.insert(wrapped.end(), {absl::StrCat("--reuid=", uid_), absl::StrCat("--regid=", gid_),
                                   "--clear-groups"});
  }
  wrapped.push_back("--");
  wrapped.insert(wrapped.end(), args.begin(), args.end());
  return wrapped;
}

absl::StatusOr<std::unique_ptr<PostgresServer>> PostgresServer::Start(
    absl::Duration timeout, std::vector<std::string> settings) {
  for (const std::string& setting : settings) {
    if (setting.find('=') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("a PostgreSQL setting is name=value, not '", setting, "'"));
    }
  }
  absl::StatusOr<std::string> bin = PostgresBinDir();
  if (!bin.ok()) return bin.status();
  if (!fs::exists(kSetpriv)) return absl::NotFoundError("setpriv (util-linux) is missing");
  auto server = std::unique_ptr<PostgresServer>(new PostgresServer());
  server->bin_dir_ = *bin;
  server->settings_ = std::move(settings);
  if (::geteuid() == 0) {
    // PostgreSQL refuses to run as root: the directory goes to an unprivileged user.
    const passwd* pw = ::getpwnam("postgres");
    if (pw == nullptr) pw = ::getpwnam("nobody");
    if (pw == nullptr)
      return absl::NotFoundError("no user postgres or nobody to run PostgreSQL as");
    server->drop_privileges_ = true;
    server->uid_ = pw->pw_uid;
    server->gid_ = pw->pw_gid;
    if (::chown(server->dir().c_str(), server->uid_, server->gid_) != 0) {
      return absl::InternalError(absl::StrCat("cannot chown ", server->dir()));
    }
  }
  const std::string initdb_log = server->dir_.file("initdb.log");
  Child initdb(
      server->AsServerUser({server->bin_dir_ + "/initdb", "-D", server->dir_.file("data"), "-U",
                            kUser, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"}),
      initdb_log, "", server->dir_.file("initdb.out"));
  if (!initdb.running()) return absl::InternalError("cannot start initdb");
  const int initdb_code = initdb.Wait(timeout);
  if (initdb_code != 0) {
    return absl::InternalError(
        absl::StrCat("initdb failed (exit ", initdb_code, "): ", Tail(ReadText(initdb_log))));
  }
  // A port found free may be taken before the server binds it: try another.
  absl::Status launched;
  for (int attempt = 0; attempt < 3; ++attempt) {
    absl::StatusOr<int> port = FreeLoopbackPort();
    if (!port.ok()) return port.status();
    server->port_ = *port;
    launched = server->Launch(timeout);
    if (launched.ok() || launched.code() == absl::StatusCode::kDeadlineExceeded) break;
  }
  if (!launched.ok()) return launched;
  return server;
}

absl::Status PostgresServer::Launch(absl::Duration timeout) {
  // The unix socket lives in the test's directory (never /var/run/postgresql); fsync and the
  // rest keep their defaults, so a commit is as durable as in production.
  std::vector<std::string> args = {
      bin_dir_ + "/postgres", "-D", dir_.file("data"), "-p", absl::StrCat(port_), "-k", dir()};
  std::vector<std::string> settings = {"listen_addresses=127.0.0.1", "max_connections=64",
                                       "shared_buffers=16MB"};
  settings.insert(settings.end(), settings_.begin(), settings_.end());
  for (std::string& setting : settings) {
    args.push_back("-c");
    args.push_back(std::move(setting));
  }
  server_ = std::make_unique<Child>(AsServerUser(std::move(args)), log_path());
  if (!server_->running()) return absl::InternalError("cannot start postgres");
  const std::string conninfo = ConnInfo() + " connect_timeout=2";
  bool exited = false;
  const bool ready = WaitUntil(
      [&] {
        if (server_->Wait(absl::ZeroDuration()) != -1) {
          exited = true;
          return true;
        }
        return PQping(conninfo.c_str()) == PQPING_OK;
      },
      timeout, absl::Milliseconds(20));
  if (exited) {
    server_.reset();
    return absl::InternalError(
        absl::StrCat("postgres exited at start: ", Tail(ReadText(log_path()))));
  }
  if (!ready) {
    server_.reset();
    return absl::DeadlineExceededError(absl::StrCat("postgres not ready after ",
                                                    absl::FormatDuration(timeout), ": ",
                                                    Tail(ReadText(log_path()))));
  }
  return absl::OkStatus();
}

PostgresServer::PostgresServer() = default;

PostgresServer::~PostgresServer() { Stop().IgnoreError(); }

bool PostgresServer::running() const { return server_ != nullptr && server_->running(); }

absl::Status PostgresServer::Stop(absl::Duration timeout) {
  if (server_ == nullptr) return absl::OkStatus();
  server_->Signal(SIGINT);  // fast shutdown: sessions end, the server checkpoints and exits
  const int code = server_->Wait(timeout);
  server_.reset();  // kills it if it is still there
  if (code == -1) {
    return absl::DeadlineExceededError(
        absl::StrCat("postgres did not stop within ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

absl::Status PostgresServer::Restart(absl::Duration timeout) {
  if (absl::Status s = Stop(); !s.ok()) return s;
  return Launch(timeout);
}

std::string PostgresServer::ConnInfo(const std::string& dbname) const {
  return absl::StrFormat("host=127.0.0.1 port=%d user=%s dbname=%s", port_, kUser, dbname);
}

absl::StatusOr<std::string> PostgresServer::CreateDatabase() {
  const std::string name = absl::StrCat("test_", ++databases_);
  PGconn* conn = PQconnectdb(ConnInfo().c_str());
  if (PQstatus(conn) != CONNECTION_OK) {
    std::string message = PQerrorMessage(conn);
    PQfinish(conn);
    return absl::UnavailableError(absl::StrCat("cannot connect: ", message));
  }
  // The name is ours (test_<n>), so splicing it into the statement is safe.
  PGresult* result = PQexec(conn, absl::StrCat("CREATE DATABASE ", name).c_str());
  const bool ok = PQresultStatus(result) == PGRES_COMMAND_OK;
  std::string message = ok ? "" : PQresultErrorMessage(result);
  PQclear(result);
  PQfinish(conn);
  if (!ok) return absl::InternalError(absl::StrCat("CREATE DATABASE failed: ", message));
  return ConnInfo(name);
}

absl::StatusOr<PostgresServer*> SharedPostgresServer() {
  static absl::StatusOr<std::unique_ptr<PostgresServer>>* const server =
      new absl::StatusOr<std::unique_ptr<PostgresServer>>(PostgresServer::Start());
  // Stopped at exit: the destructor shuts the server down and removes its directory.
  static const int registered = std::atexit([] {
    if (server->ok()) server->value().reset();
  });
  (void)registered;
  if (!server->ok()) return server->status();
  return server->value().get();
}

absl::StatusOr<std::string> CreateSharedPostgresDatabase() {
  absl::StatusOr<PostgresServer*> server = SharedPostgresServer();
  if (!server.ok()) return server.status();
  return (*server)->CreateDatabase();
}

}  // namespace cdcca::testing
