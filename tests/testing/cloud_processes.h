// Starting the scaled cloud's programs: `cdcca-cloud --store=<conninfo> --role=front|trainer`
// processes on one PostgreSQL database, each with its data directory, log, status file and
// port file under one directory. What the cluster tests (tests/cluster_e2e_test.cc) and the
// fleet bench (cloud/bench/fleet_bench.cc) run.
//
//   CloudProcesses cloud({CDCCA_CLOUD_BINARY, dir, conninfo, checkpoint, tokens, flags});
//   int port = 0;
//   std::unique_ptr<Child> front = cloud.Start("front", "front-0", &port);
//   std::unique_ptr<Child> trainer = cloud.Start("trainer", "trainer-0");
//
// Not thread-safe; the returned children may be used from any one thread.
#ifndef CDCCA_TESTS_TESTING_CLOUD_PROCESSES_H_
#define CDCCA_TESTS_TESTING_CLOUD_PROCESSES_H_

#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "tests/testing/child_process.h"

namespace cdcca::testing {

struct CloudProcessOptions {
  std::string binary;          // the cdcca-cloud program
  std::string dir;             // where <name>/, <name>.log, .status and .port go
  std::string conninfo;        // --store
  std::string checkpoint_dir;  // --checkpoint_dir
  std::string tokens_path;     // --tokens, fronts only
  // Flags of every process, after the launcher's own (a later flag wins).
  std::vector<std::string> flags;
  // How long Start waits for a front to write its port. Default: 2 min.
  absl::Duration port_timeout = absl::Minutes(2);
  // --status_interval_s of every process. Default: 0.5 s.
  double status_interval_s = 0.5;
  // Niceness trainers run at (through /usr/bin/nice), so that on a host they share with
  // fronts the serving path comes first and training takes the CPU left over. Default: 0
  // (the caller's).
  int trainer_nice = 0;
};

class CloudProcesses {
 public:
  explicit CloudProcesses(CloudProcessOptions options) : options_(std::move(options)) {}

  // Starts a process of `role` ("front" or "trainer") named `name`, with `exit_at` as its
  // CDCCA_TEST_EXIT_AT (empty = none) and `extra` flags after all others. A front listens
  // on `listen` (its port chosen by the kernel by default) and Start returns once it
  // serves, its port in *port (0 when it exited or did not serve within port_timeout).
  std::unique_ptr<Child> Start(const std::string& role, const std::string& name,
                               int* port = nullptr, const std::string& exit_at = "",
                               const std::vector<std::string>& extra = {},
                               const std::string& listen = "127.0.0.1:0") const {
    const std::string port_file = PortPath(name);
    ::unlink(port_file.c_str());
    std::vector<std::string> args = {
        options_.binary,
        "--store=" + options_.conninfo,
        "--role=" + role,
        "--data_dir=" + DataDir(name),
        "--checkpoint_dir=" + options_.checkpoint_dir,
        "--status_file=" + StatusPath(name),
        "--status_interval_s=" + std::to_string(options_.status_interval_s)};
    if (role != "trainer") {
      args.insert(args.end(), {"--tokens=" + options_.tokens_path, "--insecure",
                               "--listen=" + listen, "--port_file=" + port_file});
    }
    args.insert(args.end(), options_.flags.begin(), options_.flags.end());
    args.insert(args.end(), extra.begin(), extra.end());
    if (role == "trainer" && options_.trainer_nice != 0) {
      args.insert(args.begin(), {"/usr/bin/nice", "-n", std::to_string(options_.trainer_nice)});
    }
    auto child = std::make_unique<Child>(args, Log(name), exit_at);
    if (port != nullptr) *port = WaitForPortFile(port_file, options_.port_timeout, child.get());
    return child;
  }

  std::string DataDir(const std::string& name) const { return options_.dir + "/" + name; }
  std::string Log(const std::string& name) const { return options_.dir + "/" + name + ".log"; }
  std::string StatusPath(const std::string& name) const {
    return options_.dir + "/" + name + ".status";
  }
  std::string PortPath(const std::string& name) const {
    return options_.dir + "/" + name + ".port";
  }
  const CloudProcessOptions& options() const { return options_; }

 private:
  CloudProcessOptions options_;
};

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_CLOUD_PROCESSES_H_
