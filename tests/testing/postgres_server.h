// A real PostgreSQL server for tests: initdb into a fresh temporary directory, the server
// listening on 127.0.0.1 at a free port with its unix socket in that directory, trust
// authentication for the user "cdcca". When the test runs as root, initdb and the server
// run as an unprivileged user (postgres, else nobody) that owns the directory, since
// PostgreSQL refuses to run as root. The server's log is <dir>/postgres.log.
//
//   absl::StatusOr<std::unique_ptr<PostgresServer>> server = PostgresServer::Start();
//   ASSERT_TRUE(server.ok()) << server.status();   // says what is missing
//   absl::StatusOr<std::string> conninfo = (*server)->CreateDatabase();
//
// The destructor stops the server (fast shutdown: open sessions are ended) and removes the
// directory. Should the test process die first, the kernel stops the server when the thread
// that started it ends (setpriv --pdeathsig): call Start and Restart from a thread that
// outlives the server, such as the test's main thread. Not thread-safe; the conninfo
// strings may be used from any thread.
#ifndef CDCCA_TESTS_TESTING_POSTGRES_SERVER_H_
#define CDCCA_TESTS_TESTING_POSTGRES_SERVER_H_

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

// The directory of PostgreSQL's server programs: $CDCCA_POSTGRES_BIN, else
// /usr/lib/postgresql/<newest>/bin. NOT_FOUND saying how to install them when absent.
absl::StatusOr<std::string> PostgresBinDir();

class PostgresServer {
 public:
  // Runs initdb and starts the server; returns once it accepts connections. NOT_FOUND when
  // the PostgreSQL binaries are missing; DEADLINE_EXCEEDED (with the server log's tail) when
  // it is not ready within `timeout`; INTERNAL when initdb or the server fails.
  // `settings` ("name=value") are passed to the server as -c options after the defaults
  // (shared_buffers=16MB, max_connections=64), on every start, restarts too.
  static absl::StatusOr<std::unique_ptr<PostgresServer>> Start(
      absl::Duration timeout = absl::Seconds(60), std::vector<std::string> settings = {});

  ~PostgresServer();
  PostgresServer(const PostgresServer&) = delete;
  PostgresServer& operator=(const PostgresServer&) = delete;

  int port() const { return port_; }
  const std::string& dir() const { return dir_.path(); }
  std::string log_path() const { return dir_.file("postgres.log"); }

  // libpq connection string for `dbname` over TCP loopback.
  std::string ConnInfo(const std::string& dbname = "postgres") const;

  // Creates a database of a new name and returns its ConnInfo.
  absl::StatusOr<std::string> CreateDatabase();

  // Stops the server (fast shutdown), waiting up to `timeout`, else kills it. A stopped
  // server keeps its directory and port; Restart brings it back with its data.
  absl::Status Stop(absl::Duration timeout = absl::Seconds(30));
  absl::Status Restart(absl::Duration timeout = absl::Seconds(60));
  bool running() const;

 private:
  PostgresServer();
  // Starts the server on port_ and waits until it accepts connections.
  absl::Status Launch(absl::Duration timeout);
  // args wrapped in setpriv: stopped when the starting thread ends, and run as the
  // unprivileged user when this process is root.
  std::vector<std::string> AsServerUser(std::vector<std::string> args) const;

  TempDir dir_;  // destroyed last: the server stops before its directory goes
  std::string bin_dir_;
  bool drop_privileges_ = false;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
  int port_ = 0;
  int databases_ = 0;
  std::vector<std::string> settings_;
  std::unique_ptr<Child> server_;
};

// One server for the whole test binary, started on first use (its status, if that failed,
// is returned on every call) and stopped when the binary exits.
absl::StatusOr<PostgresServer*> SharedPostgresServer();

// A new database on SharedPostgresServer(): its ConnInfo, or why there is none.
absl::StatusOr<std::string> CreateSharedPostgresDatabase();

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_POSTGRES_SERVER_H_
