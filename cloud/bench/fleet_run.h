// One fleet run against the scaled cloud's real programs: a PostgreSQL server, `cdcca-cloud
// --role front` processes behind nginx and `--role trainer` processes (the test fixtures'
// servers, tests/testing/, and the launcher the cluster tests use), loaded by a simulated
// fleet (cloud/bench/fleet_sim.h), with faults on a timetable, and checked afterwards.
//
// Timeline: the servers start; the fleet runs for `duration` (the faults, when asked, at
// duration * k / 6 for k = 1..5, in this order: kill -9 of a front, kill -9 of a trainer,
// PostgreSQL stopped and started again, nginx reloaded, drop_fraction of the devices cut
// mid-stream and offline for drop_offline); then the devices stop making batches and the
// run waits (at most drain_timeout) for every queue to drain; then the store is checked.
//
// What a run promises to measure (FleetRunResult):
//   lost batches     acked to a device but neither in the sample log nor consumed by a
//                    trainer's committed cursor (must be 0);
//   stuck devices    devices whose queue still holds batches after the drain (must be 0);
//   hung calls       calls still open after the drain well past their deadline
//                    (FleetOptions::hung_after; must be 0: nothing ends them);
//   per fault        when it began, how long its action took, and when the fleet had
//                    recovered: the last failed call of its window (for the trainer, the
//                    first job finished after it; for the drop, when every dropped device
//                    was back with its queue drained), and whether it recovered at all;
//   errors           failed calls (not the contract's refusals) outside every fault window;
//   per process      resident memory and CPU seconds of fronts, trainers, nginx and
//                    PostgreSQL sampled every sample_interval, and whether the memory is flat
//                    after warm-up.
#ifndef CDCCA_CLOUD_BENCH_FLEET_RUN_H_
#define CDCCA_CLOUD_BENCH_FLEET_RUN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cloud/bench/fleet_sim.h"
#include "nlohmann/json.hpp"

namespace cdcca::fleet {

struct FleetRunOptions {
  std::string cloud_binary;  // the cdcca-cloud program
  // The model every process loads; "" = the tiny test family, written into the run's
  // directory.
  std::string checkpoint_dir;
  // Where everything goes (databases, logs, status files); "" = a temporary directory,
  // removed at the end.
  std::string work_dir;
  int devices = 10000;
  int fronts = 1;
  int trainers = 1;
  absl::Duration duration = absl::Minutes(10);
  bool faults = false;
  double drop_fraction = 0.3;
  absl::Duration drop_offline = absl::Seconds(20);
  absl::Duration postgres_down = absl::Seconds(5);
  // PostgreSQL server settings ("name=value") beside the test server's defaults.
  std::vector<std::string> postgres_settings;
  absl::Duration drain_timeout = absl::Minutes(5);
  // How often RSS and CPU time are read; the first warmup_fraction of the run is warm-up.
  absl::Duration sample_interval = absl::Seconds(5);
  double warmup_fraction = 0.25;
  // Flags of every cdcca-cloud process (after the launcher's own).
  std::vector<std::string> cloud_flags;
  // Niceness of the trainers (testing::CloudProcessOptions::trainer_nice): on this one host
  // they would otherwise take a core from the serving path. Default: 10.
  int trainer_nice = 10;
  // The devices' schedule and client settings (target, devices and model are filled in).
  FleetOptions fleet;
};

struct FaultOutcome {
  std::string name;
  double at_s = 0;         // since the fleet started
  double action_s = 0;     // how long the action itself took (kill and restart, ...)
  double recovered_s = 0;  // from `at_s` to recovery
  uint64_t failed_calls = 0;
  bool recovered = false;
};

struct FleetRunResult {
  nlohmann::json report;  // everything below and the fleet's figures, for --json
  uint64_t lost_batches = 0;
  uint64_t checked_batches = 0;  // acked batches compared with the store
  int stuck_devices = 0;
  int hung_calls = 0;
  uint64_t ack_regressions = 0;
  uint64_t errors_outside_faults = 0;
  std::vector<FaultOutcome> faults;
};

// Runs the whole thing. Errors: what cannot start (PostgreSQL, nginx, a program, the
// model), as the servers' starters say it; a finished run is OK whatever it measured.
// Call from a thread that outlives the run (the servers stop when it ends).
absl::StatusOr<FleetRunResult> RunFleet(const FleetRunOptions& options);

}  // namespace cdcca::fleet

#endif  // CDCCA_CLOUD_BENCH_FLEET_RUN_H_
