// start_bench: what a cloud holds and how fast it acks right after it starts on a data
// directory with many devices and a backlog, with and without a bound on resident mirrors.
//
//   start_bench --template=DIR --populate [--checkpoint_dir=models/small] [--devices=1000]
//   start_bench --template=DIR [--max_resident_mirrors=64] [--clients=50] [--seconds=10]
//
// --populate makes DIR once: the family's devices each registered, trained once (a mirror
// state file each) and with one more batch stored and not yet trained (the backlog: one
// batch per device). A run then copies DIR to a temporary directory and starts what
// `cdcca-cloud` starts on it (stores, the per-device strategy and its Recover, the job
// scheduler, the gRPC service on loopback), and prints: the time to start, the process's
// RSS after start, then --clients devices uplinking one batch per call for --seconds while
// the scheduler trains the backlog (ack latency p50/p99, errors), the RSS and peak RSS after,
// and the mirrors resident. Run each bound in its own process: RSS does not shrink in one.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cloud/device_registry.h"
#include "cloud/open_cloud.h"
#include "cloud/sample_store.h"
#include "cloud/trainer.h"
#include "cloud/update_store.h"
#include "compress/uplink_codec.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/transport_fixture.h"

ABSL_FLAG(std::string, template_dir, "", "the populated data directory (copied for a run)");
ABSL_FLAG(bool, populate, false, "make --template_dir (registry, mirrors, backlog) and exit");
ABSL_FLAG(std::string, checkpoint_dir, "models/small", "the family the cloud trains");
ABSL_FLAG(int, devices, 1000, "registered devices, each with a mirror and one backlog batch");
ABSL_FLAG(int64_t, max_resident_mirrors, 64, "the bound under test (0 = none)");
ABSL_FLAG(int, clients, 50, "devices uplinking during the timed run");
ABSL_FLAG(double, seconds, 10, "duration of the timed run");

namespace cdcca {
namespace {

using cloud::PerDeviceStrategy;
using cloud::PerDeviceStrategyOptions;

// VmRSS and VmHWM of this process, MiB.
std::pair<double, double> RssMiB() {
  std::ifstream status("/proc/self/status");
  std::string key;
  double rss = 0, hwm = 0;
  while (status >> key) {
    if (key == "VmRSS:") status >> rss;
    if (key == "VmHWM:") status >> hwm;
  }
  return {rss / 1024, hwm / 1024};
}

std::string DeviceId(int i) { return absl::StrCat("dev-", i); }

PerDeviceStrategyOptions StrategyOptions(const std::string& data_dir) {
  PerDeviceStrategyOptions o;
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.state_dir = data_dir + "/trainer";
  o.max_steps = 1;
  o.torch_threads = 1;
  o.guard.enabled = false;
  o.max_resident_mirrors = static_cast<size_t>(absl::GetFlag(FLAGS_max_resident_mirrors));
  return o;
}

int Populate(const std::string& dir) {
  const int devices = absl::GetFlag(FLAGS_devices);
  auto registry = cloud::DeviceRegistry::Open(dir + "/registry");
  cloud::SampleStoreOptions so;
  so.dir = dir + "/samples";
  auto samples = cloud::SampleStore::Open(so);
  auto updates = cloud::UpdateStore::Open({dir + "/updates", 16});
  if (!registry.ok() || !samples.ok() || !updates.ok()) {
    std::fprintf(stderr, "cannot open the stores in %s\n", dir.c_str());
    return 1;
  }
  PerDeviceStrategyOptions options = StrategyOptions(dir);
  options.max_resident_mirrors = 16;  // keep populating itself small
  auto strategy = PerDeviceStrategy::Create(options, samples->get(), updates->get());
  if (!strategy.ok() || !(*strategy)->Recover().ok()) {
    std::fprintf(stderr, "cannot load %s\n", options.checkpoint_dir.c_str());
    return 1;
  }
  const cloud::SampleSpec spec = (*strategy)->Spec();
  for (int i = 0; i < devices; ++i) {
    if (!(*registry)->Register(DeviceId(i), (*strategy)->BaseFingerprint(), {}).ok() ||
        !(*samples)->AppendAndWait(DeviceId(i), testing::MakeModelBatch(spec, i, 1)).ok() ||
        !(*strategy)->RunJob(DeviceId(i)).ok() ||
        !(*samples)->AppendAndWait(DeviceId(i), testing::MakeModelBatch(spec, i, 2)).ok()) {
      std::fprintf(stderr, "populating device %d failed\n", i);
      return 1;
    }
    if ((i + 1) % 100 == 0) std::fprintf(stderr, "populated %d / %d devices\n", i + 1, devices);
  }
  return 0;
}

int Run(const std::string& template_dir) {
  testing::TempDir dir;
  std::filesystem::copy(template_dir, dir.path(), std::filesystem::copy_options::recursive);
  const int devices = absl::GetFlag(FLAGS_devices);
  const int clients = std::min(absl::GetFlag(FLAGS_clients), devices);
  std::mt19937_64 rng(std::random_device{}());
  std::vector<std::string> tokens;
  cloud::CloudOptions o;
  for (int i = 0; i < devices; ++i) {
    tokens.push_back(testing::RandomToken(rng));
    absl::StrAppend(&o.tokens_text, DeviceId(i), " ", tokens.back(), "\n");
  }
  o.data_dir = dir.path();
  o.server.listen_address = "127.0.0.1:0";
  o.server.insecure = true;
  o.strategy = StrategyOptions(dir.path());
  // Every backlog batch is a job at once: training competes with acks.
  o.scheduler.trigger_samples = 4;

  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<cloud::Cloud>> opened = cloud::OpenCloud(o);
  if (!opened.ok()) {
    std::fprintf(stderr, "%s\n", opened.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<cloud::Cloud> cloud = *std::move(opened);
  PerDeviceStrategy* strategy = cloud->strategy();
  const double start_s = absl::ToDoubleSeconds(absl::Now() - t0);
  const auto [rss_start, hwm_start] = RssMiB();
  const size_t resident_start = strategy->ResidentMirrors();

  const cloud::SampleSpec spec = strategy->Spec();
  std::vector<std::unique_ptr<device::CloudClient>> links;
  for (int d = 0; d < clients; ++d) {
    device::CloudClientOptions co;
    co.target = absl::StrCat("localhost:", cloud->port());
    co.device_id = DeviceId(d);
    co.token = tokens[d];
    co.insecure = true;
    links.push_back(std::move(device::CloudClient::Create(co)).value());
  }
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  std::vector<std::vector<double>> latencies(clients);
  std::vector<std::thread> threads;
  for (int d = 0; d < clients; ++d) {
    threads.emplace_back([&, d] {
      for (uint64_t seq = 3; !stop.load(); ++seq) {
        v1::UplinkBatch batch = testing::MakeModelBatch(spec, d, seq);
        const absl::Time sent = absl::Now();
        auto ack = links[d]->Uplink({batch});
        if (!ack.ok() || ack->has_error() || ack->highest_durable_sequence() != seq) {
          ++errors;
          return;
        }
        latencies[d].push_back(absl::ToDoubleMilliseconds(absl::Now() - sent));
      }
    });
  }
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_seconds)));
  stop = true;
  for (std::thread& t : threads) t.join();
  std::vector<double> all;
  for (const auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  const auto pct = [&](double p) {
    return all.empty() ? 0.0 : all[static_cast<size_t>(p * (all.size() - 1))];
  };
  const auto [rss_end, hwm_end] = RssMiB();
  std::printf(
      "| max_resident_mirrors | devices | backlog batches | start s | RSS after start MiB | "
      "acks | ack p50 ms | ack p99 ms | errors | jobs done | RSS after MiB | peak RSS MiB | "
      "resident after start / end | evictions |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n");
  std::printf(
      "| %lld | %d | %d | %.2f | %.0f | %zu | %.1f | %.1f | %d | %llu | %.0f | %.0f | "
      "%zu / %zu | %llu |\n",
      static_cast<long long>(absl::GetFlag(FLAGS_max_resident_mirrors)), devices, devices, start_s,
      rss_start, all.size(), pct(0.5), pct(0.99), errors.load(),
      static_cast<unsigned long long>(cloud->scheduler()->jobs_done()), rss_end,
      std::max(hwm_start, hwm_end), resident_start, strategy->ResidentMirrors(),
      static_cast<unsigned long long>(strategy->MirrorEvictions()));
  cloud->Shutdown();  // waits for a running job
  return errors.load() == 0 ? 0 : 1;
}

}  // namespace
}  // namespace cdcca

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_template_dir);
  if (dir.empty()) {
    std::fprintf(stderr, "give --template_dir\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_populate)) return cdcca::Populate(dir);
  return cdcca::Run(dir);
}
