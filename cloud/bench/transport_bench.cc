// transport_bench: what the device-cloud transport costs on this machine.
//
//   transport_bench [--payload_mib=64] [--clients=100] [--seconds=5] [--batch_kib=4]
//
// Prints (1) download throughput of one FetchUpdate stream over loopback, plaintext and TLS,
// next to a plain TCP copy of the same bytes (the ceiling); (2) acked uplink batches per
// second with N concurrent device clients and group commit (fdatasync before every ack),
// with p50/p99 ack latency.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_pki.h"
#include "tests/testing/transport_fixture.h"

ABSL_FLAG(int, payload_mib, 64, "size of the downloaded payload, MiB");
ABSL_FLAG(int, clients, 100, "concurrent uplinking devices");
ABSL_FLAG(double, seconds, 5, "duration of the uplink run");
ABSL_FLAG(int, batch_kib, 4, "payload of one uplink batch, KiB");

namespace cdcca {
namespace {

using testing::CloudFixture;
using testing::CloudFixtureOptions;

// Copies `bytes` through a loopback TCP connection; returns MB/s.
double TcpCopyMBps(size_t bytes) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  ::listen(listener, 1);
  std::string data(bytes, 'x');
  absl::Time start = absl::Now();
  std::thread sender([&] {
    int s = ::socket(AF_INET, SOCK_STREAM, 0);
    ::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    size_t sent = 0;
    while (sent < bytes) {
      ssize_t n = ::send(s, data.data() + sent, std::min<size_t>(bytes - sent, 1 << 20), 0);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    ::close(s);
  });
  int conn = ::accept(listener, nullptr, nullptr);
  std::string buf(1 << 20, '\0');
  size_t got = 0;
  while (true) {
    ssize_t n = ::recv(conn, buf.data(), buf.size(), 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  sender.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  ::close(conn);
  ::close(listener);
  return static_cast<double>(got) / 1e6 / secs;
}

double FetchMBps(CloudFixture& cloud, device::CloudClientOptions options, size_t bytes) {
  auto client = cloud.Client(0, options);
  // Warm the connection (and TLS handshake) first.
  (void)client->Health();
  absl::Time start = absl::Now();
  auto fetched = client->FetchUpdate(0);
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  if (!fetched.ok() || fetched->bytes.size() != bytes) {
    std::fprintf(stderr, "fetch failed: %s\n", fetched.status().ToString().c_str());
    return 0;
  }
  return static_cast<double>(bytes) / 1e6 / secs;
}

void Throughput() {
  const size_t bytes = static_cast<size_t>(absl::GetFlag(FLAGS_payload_mib)) << 20;
  std::string payload(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) payload[i] = static_cast<char>(i * 2654435761u >> 13);
  testing::TempDir dir;
  testing::TestPki pki;
  if (!testing::GenerateTestPki(dir.path(), &pki)) return;

  CloudFixtureOptions plain;
  plain.data_dir = dir.path() + "/plain";
  plain.devices = 1;
  plain.server.listen_address = "127.0.0.1:0";
  plain.server.insecure = true;
  CloudFixture insecure_cloud(plain);
  if (!insecure_cloud.Start().ok() ||
      !insecure_cloud.updates()->PutUpdate("dev-0", 0, 1, 0, payload).ok()) {
    return;
  }
  const double insecure_mbps = FetchMBps(insecure_cloud, {}, bytes);
  insecure_cloud.Stop();

  CloudFixtureOptions tls = plain;
  tls.data_dir = dir.path() + "/tls";
  tls.server.insecure = false;
  tls.server.tls = {pki.server_cert, pki.server_key, "", false};
  CloudFixture tls_cloud(tls);
  if (!tls_cloud.Start().ok() || !tls_cloud.updates()->PutUpdate("dev-0", 0, 1, 0, payload).ok()) {
    return;
  }
  device::CloudClientOptions tls_client;
  tls_client.tls.root_ca_path = pki.ca_cert;
  const double tls_mbps = FetchMBps(tls_cloud, tls_client, bytes);
  tls_cloud.Stop();
  const double tcp_mbps = TcpCopyMBps(bytes);

  std::printf("## Download throughput, one FetchUpdate stream of %d MiB over loopback\n\n",
              absl::GetFlag(FLAGS_payload_mib));
  std::printf("| path | MB/s | share of TCP |\n|---|---:|---:|\n");
  std::printf("| plain TCP copy (ceiling) | %.0f | 100%% |\n", tcp_mbps);
  std::printf("| gRPC, plaintext | %.0f | %.0f%% |\n", insecure_mbps,
              100 * insecure_mbps / tcp_mbps);
  std::printf("| gRPC, TLS | %.0f | %.0f%% |\n\n", tls_mbps, 100 * tls_mbps / tcp_mbps);
}

void UplinkLoad() {
  const int clients = absl::GetFlag(FLAGS_clients);
  const size_t batch_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_batch_kib)) << 10;
  testing::TempDir dir;
  CloudFixtureOptions options;
  options.data_dir = dir.path();
  options.devices = clients;
  options.server.listen_address = "127.0.0.1:0";
  options.server.insecure = true;
  CloudFixture cloud(options);
  if (!cloud.Start().ok()) return;
  std::vector<std::unique_ptr<device::CloudClient>> devices;
  for (int d = 0; d < clients; ++d) devices.push_back(cloud.Client(d));
  const uint64_t syncs_before = cloud.samples()->Stats().group_commits;
  std::atomic<bool> stop{false};
  std::vector<std::vector<double>> latencies(clients);
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int d = 0; d < clients; ++d) {
    threads.emplace_back([&, d] {
      uint64_t seq = 1;
      while (!stop.load(std::memory_order_relaxed)) {
        v1::UplinkBatch batch = testing::MakeBatch(d, seq, batch_bytes);
        const absl::Time t0 = absl::Now();
        auto ack = devices[d]->Uplink({batch});
        const double ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
        if (!ack.ok() || ack->has_error() || ack->highest_durable_sequence() != seq) {
          ++errors;
          break;
        }
        latencies[d].push_back(ms);
        ++seq;
      }
    });
  }
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_seconds)));
  stop = true;
  for (auto& t : threads) t.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  std::vector<double> all;
  for (auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  const cloud::SampleStoreStats stats = cloud.samples()->Stats();
  const uint64_t syncs = stats.group_commits - syncs_before;
  auto pct = [&](double p) {
    return all.empty() ? 0.0 : all[static_cast<size_t>(p * (all.size() - 1))];
  };
  std::printf(
      "## Uplink: %d concurrent devices, one %zu KiB batch per Uplink call, fdatasync "
      "before every ack\n\n",
      clients, batch_bytes >> 10);
  std::printf(
      "| acked batches/s | MB/s | batches per fdatasync | ack p50 ms | ack p99 ms | errors |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| %.0f | %.1f | %.1f | %.2f | %.2f | %d |\n\n", all.size() / secs,
              all.size() * batch_bytes / 1e6 / secs,
              syncs == 0 ? 0.0 : static_cast<double>(all.size()) / syncs, pct(0.50), pct(0.99),
              errors.load());
}

}  // namespace
}  // namespace cdcca

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::printf("# transport_bench (%u hardware threads)\n\n", std::thread::hardware_concurrency());
  cdcca::Throughput();
  cdcca::UplinkLoad();
  return 0;
}
