// The fleet bench's fault run at small N (cloud/bench/fleet_run.h), through the real
// programs: PostgreSQL, one `cdcca-cloud --role front` behind nginx and one `--role trainer`
// on the tiny family, and 50 simulated devices that poll every 2 s and make a batch every
// 2 s. During 42 s (a fault every 7 s) a front and the trainer are killed with SIGKILL,
// PostgreSQL stops and starts again, nginx reloads and 30 % of the devices drop mid-stream.
// Afterwards every batch the cloud acked is in the store (or consumed by a committed job),
// every device's queue drained, no call is left open past its deadline, and the fleet
// recovered from every fault. About 50 s in all, in the default suite (label e2e).
#include <algorithm>
#include <string>

#include "cloud/bench/fleet_run.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca {
namespace {

using fleet::FaultOutcome;
using fleet::FleetRunOptions;
using fleet::FleetRunResult;

FleetRunOptions SmallFaultRun() {
  FleetRunOptions o;
  o.cloud_binary = CDCCA_CLOUD_BINARY;
  o.devices = 50;
  o.fronts = 1;
  o.trainers = 1;
  o.duration = absl::Seconds(42);
  o.faults = true;
  o.drop_offline = absl::Seconds(4);
  o.postgres_down = absl::Seconds(2);
  o.drain_timeout = absl::Seconds(90);
  o.sample_interval = absl::Seconds(1);
  // As the cluster test runs them: small jobs, one thread, short leases, and the guard by
  // its small-pool rule only (tests/cluster_e2e_test.cc says why).
  o.cloud_flags = {"--torch_threads=1",   "--blas_threads=1",       "--store_sessions=2",
                   "--lease_s=3",         "--max_steps=3",          "--batch_size=4",
                   "--trigger_samples=4", "--trigger_interval_s=3", "--guard_min_pool=1000000"};
  o.fleet.poll_interval = absl::Seconds(2);
  o.fleet.batch_interval = absl::Seconds(2);
  o.fleet.offline_probability = 0.05;
  o.fleet.offline_min = absl::Seconds(1);
  o.fleet.offline_max = absl::Seconds(4);
  o.fleet.initial_backoff = absl::Milliseconds(200);
  o.fleet.max_backoff = absl::Seconds(2);
  o.fleet.call_timeout = absl::Seconds(5);
  o.fleet.stream_timeout = absl::Seconds(20);
  o.fleet.slow_call = absl::Milliseconds(20);  // low enough that the faults' calls pass it
  return o;
}

TEST(FleetTest, FiftyDevicesRideOutEveryFaultWithNothingAckedLostAndNoneStuck) {
  ASSERT_OK_AND_ASSIGN(FleetRunResult r, fleet::RunFleet(SmallFaultRun()));
  const std::string report = r.report.dump(2);
  // Each device made ~20 batches in the 42 s: the check covered them.
  EXPECT_GT(r.checked_batches, 50u * 10) << report;
  EXPECT_EQ(r.lost_batches, 0u) << report;
  EXPECT_EQ(r.ack_regressions, 0u) << report;
  EXPECT_EQ(r.stuck_devices, 0) << report;
  EXPECT_EQ(r.hung_calls, 0) << report;
  EXPECT_EQ(r.errors_outside_faults, 0u) << report;
  ASSERT_EQ(r.faults.size(), 5u) << report;
  for (const FaultOutcome& f : r.faults) {
    EXPECT_TRUE(f.recovered) << f.name << "\n" << report;
    EXPECT_GT(f.recovered_s, 0) << f.name << "\n" << report;
  }
  // The faults hit: with the one front away and with PostgreSQL down, calls failed.
  EXPECT_GT(r.faults[0].failed_calls, 0u) << report;
  EXPECT_GT(r.faults[2].failed_calls, 0u) << report;
  // The stall timeline agrees with the latencies: its slowest call is the slowest of all
  // whenever one took longer than the timeline's threshold.
  const nlohmann::json& fleet = r.report["fleet"];
  ASSERT_TRUE(fleet["slow_seconds"].is_array()) << report;
  EXPECT_FALSE(fleet["slow_seconds"].empty()) << report;
  double slowest = 0, slowest_listed = 0;
  for (const auto& [rpc, figures] : fleet["rpcs"].items()) {
    slowest = std::max(slowest, figures.value("max_ms", 0.0));
  }
  for (const nlohmann::json& second : fleet["slow_seconds"]) {
    EXPECT_GT(second.value("calls", 0), 0) << second.dump();
    slowest_listed = std::max(slowest_listed, second.value("max_ms", 0.0));
  }
  EXPECT_EQ(slowest_listed, slowest > fleet.value("slow_call_ms", 0.0) ? slowest : 0.0) << report;
  // The processes' memory was read.
  for (const char* process : {"front-0", "trainer-0", "nginx", "postgres"}) {
    EXPECT_GT(r.report["processes"][process].value("rss_peak_mib", 0.0), 0.0) << process;
  }
}

}  // namespace
}  // namespace cdcca
