// fleet_bench: N simulated devices against the scaled cloud's real programs, with faults.
//
//   fleet_bench [--devices=10000] [--seconds=600] [--poll_s=30] [--batch_s=60]
//               [--fronts=1] [--trainers=1] [--trainer_nice=10] [--faults] [--connections=0]
//               [--checkpoint_dir=] [--cloud_binary=build/cloud/cdcca-cloud]
//               [--json=FILE] [--work_dir=DIR]
//
// Starts PostgreSQL, --fronts `cdcca-cloud --role front` behind nginx and --trainers
// `--role trainer` (cloud/bench/fleet_run.h says how, and what is measured), runs the fleet
// (cloud/bench/fleet_sim.h) for --seconds, drains it, checks the store, and prints the
// report as JSON on stdout (and into --json). A summary goes to stderr. Exits 1 when a
// check fails: an acked batch missing from the store, a device left with queued batches,
// a call left open past its deadline, a fault not recovered from, or (without --faults) a
// failed call.
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "cloud/bench/fleet_run.h"

ABSL_FLAG(int, devices, 10000, "simulated devices");
ABSL_FLAG(double, seconds, 600, "how long the devices make batches, s");
ABSL_FLAG(double, poll_s, 30, "time between two FetchUpdate polls of a device, s");
ABSL_FLAG(double, batch_s, 60, "time between two 4-sample batches of a device, s");
ABSL_FLAG(double, offline_probability, 0.01, "chance a device goes offline after a poll");
ABSL_FLAG(double, offline_min_s, 30, "shortest time a device stays offline, s");
ABSL_FLAG(double, offline_max_s, 120, "longest time a device stays offline, s");
ABSL_FLAG(int, connections, 0, "gRPC connections the devices share (0 = one per device)");
ABSL_FLAG(int, fronts, 1, "cdcca-cloud --role front processes behind nginx");
ABSL_FLAG(int, trainers, 1, "cdcca-cloud --role trainer processes");
ABSL_FLAG(bool, faults, false,
          "kill -9 a front and a trainer, restart PostgreSQL, reload nginx and drop "
          "--drop_fraction of the devices, at 1/6 .. 5/6 of --seconds");
ABSL_FLAG(double, drop_fraction, 0.3, "share of the devices the drop fault cuts");
ABSL_FLAG(double, drop_offline_s, 20, "how long dropped devices stay away, s");
ABSL_FLAG(double, postgres_down_s, 5, "how long PostgreSQL stays down in its fault, s");
ABSL_FLAG(std::string, postgres_settings, "",
          "comma-separated PostgreSQL settings (name=value) beside the test server's "
          "shared_buffers=16MB and max_connections=64, e.g. shared_buffers=256MB");
ABSL_FLAG(double, drain_s, 300, "longest wait for every queue to drain after the run, s");
ABSL_FLAG(double, sample_s, 5, "time between two RSS and CPU readings, s");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "the model every process loads (\"\" = the tiny test family)");
ABSL_FLAG(std::string, cloud_binary, "build/cloud/cdcca-cloud", "the cdcca-cloud program");
// A job per device a minute at most (the program's default waits 10 min, longer than most
// runs), so that the trainers work during the run.
ABSL_FLAG(std::string, cloud_flags,
          "--torch_threads=1,--blas_threads=1,--store_sessions=8,--trigger_interval_s=60",
          "comma-separated flags for every cdcca-cloud process");
ABSL_FLAG(int, trainer_nice, 10,
          "niceness of the trainers, so that the serving path comes first on a shared host");
ABSL_FLAG(std::string, json, "", "also write the report here");
ABSL_FLAG(std::string, work_dir, "", "keep everything here (\"\" = a temporary directory)");

namespace {

cdcca::fleet::FleetRunOptions OptionsFromFlags() {
  cdcca::fleet::FleetRunOptions o;
  o.cloud_binary = absl::GetFlag(FLAGS_cloud_binary);
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.work_dir = absl::GetFlag(FLAGS_work_dir);
  o.devices = absl::GetFlag(FLAGS_devices);
  o.fronts = absl::GetFlag(FLAGS_fronts);
  o.trainers = absl::GetFlag(FLAGS_trainers);
  o.duration = absl::Seconds(absl::GetFlag(FLAGS_seconds));
  o.faults = absl::GetFlag(FLAGS_faults);
  o.drop_fraction = absl::GetFlag(FLAGS_drop_fraction);
  o.drop_offline = absl::Seconds(absl::GetFlag(FLAGS_drop_offline_s));
  o.postgres_down = absl::Seconds(absl::GetFlag(FLAGS_postgres_down_s));
  o.drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_s));
  o.sample_interval = absl::Seconds(absl::GetFlag(FLAGS_sample_s));
  o.trainer_nice = absl::GetFlag(FLAGS_trainer_nice);
  for (absl::string_view f :
       absl::StrSplit(absl::GetFlag(FLAGS_cloud_flags), ',', absl::SkipEmpty())) {
    o.cloud_flags.emplace_back(f);
  }
  for (absl::string_view f :
       absl::StrSplit(absl::GetFlag(FLAGS_postgres_settings), ',', absl::SkipEmpty())) {
    o.postgres_settings.emplace_back(f);
  }
  o.fleet.connections = absl::GetFlag(FLAGS_connections);
  o.fleet.poll_interval = absl::Seconds(absl::GetFlag(FLAGS_poll_s));
  o.fleet.batch_interval = absl::Seconds(absl::GetFlag(FLAGS_batch_s));
  o.fleet.offline_probability = absl::GetFlag(FLAGS_offline_probability);
  o.fleet.offline_min = absl::Seconds(absl::GetFlag(FLAGS_offline_min_s));
  o.fleet.offline_max = absl::Seconds(absl::GetFlag(FLAGS_offline_max_s));
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // The system's Abseil checks every Mutex acquisition against a global lock graph; with a
  // mutex per simulated device that graph lookup took a quarter of the bench's CPU at
  // 10,000 devices (perf), time the devices' calls then spent waiting.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const cdcca::fleet::FleetRunOptions o = OptionsFromFlags();
  absl::StatusOr<cdcca::fleet::FleetRunResult> r = cdcca::fleet::RunFleet(o);
  if (!r.ok()) {
    std::fprintf(stderr, "fleet_bench: %s\n", r.status().ToString().c_str());
    return 1;
  }
  r->report["hardware_threads"] = std::thread::hardware_concurrency();
  const std::string text = r->report.dump(2);
  std::printf("%s\n", text.c_str());
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << text << "\n";
  }
  bool ok = r->lost_batches == 0 && r->stuck_devices == 0 && r->hung_calls == 0 &&
            r->ack_regressions == 0;
  if (!o.faults) ok = ok && r->errors_outside_faults == 0;
  for (const cdcca::fleet::FaultOutcome& f : r->faults) {
    std::fprintf(stderr,
                 "fault %-17s at %6.1f s: action %5.1f s, recovered %s after %6.1f s, "
                 "%llu failed calls\n",
                 f.name.c_str(), f.at_s, f.action_s, f.recovered ? "yes" : "NO", f.recovered_s,
                 static_cast<unsigned long long>(f.failed_calls));
    ok = ok && f.recovered;
  }
  std::fprintf(stderr,
               "%d devices, %.0f s: %llu acked batches checked, %llu lost, %d devices stuck, "
               "%d calls hung, %llu errors outside faults: %s\n",
               o.devices, absl::ToDoubleSeconds(o.duration),
               static_cast<unsigned long long>(r->checked_batches),
               static_cast<unsigned long long>(r->lost_batches), r->stuck_devices, r->hung_calls,
               static_cast<unsigned long long>(r->errors_outside_faults), ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
