// cluster_bench: what the cloud on PostgreSQL behind nginx costs against the embedded one,
// each figure a ratio measured in one run on this machine.
//
//   cluster_bench [--clients=100] [--seconds=10] [--batch_kib=4]
//                 [--checkpoint_dir=models/small] [--cloud_binary=build/cloud/cdcca-cloud]
//                 [--train_devices=16] [--train_seconds=60] [--max_steps=20]
//
// Uplink: --clients devices each uplinking one batch per call for --seconds, against
//   (1) the embedded store (files, group commit), devices dialing the service directly;
//   (2) the same behind nginx (grpc_pass);
//   (3) one front on PostgreSQL behind nginx; (4) two fronts on PostgreSQL behind nginx.
// The fronts are the program's service (CloudService) on the program's stores, in this
// process; PostgreSQL and nginx are real servers started here (tests/testing/). Prints acked
// batches/s, p50/p99 ack latency, errors, and PostgreSQL's bytes per stored sample (the
// samples table with its index and TOAST, over the samples it holds).
// Trainers: --train_devices devices of --checkpoint_dir, each with a backlog of batches, are
// trained by 1 and then 2 `cdcca-cloud --role trainer` processes (one LibTorch thread and one
// OpenBLAS thread each, one uplink batch per job, --max_steps per job) for --train_seconds;
// prints jobs/hour.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cloud/open_cloud.h"
#include "cloud/pg/connection.h"
#include "cloud/pg/pg_cloud_store.h"
#include "cloud/trainer.h"
#include "compress/uplink_codec.h"
#include "device/cloud_client.h"
#include "tests/testing/child_process.h"
#include "tests/testing/nginx_server.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/transport_fixture.h"

ABSL_FLAG(int, clients, 100, "concurrent uplinking devices");
ABSL_FLAG(double, seconds, 10, "duration of each uplink run, s");
ABSL_FLAG(int, batch_kib, 4, "payload of one uplink batch, KiB");
ABSL_FLAG(std::string, checkpoint_dir, "models/small", "the family the trainers train");
ABSL_FLAG(std::string, cloud_binary, "build/cloud/cdcca-cloud", "the cdcca-cloud program");
ABSL_FLAG(int, train_devices, 16, "devices with a backlog for the trainer run");
ABSL_FLAG(int, train_batches, 60, "backlog batches per device (one job each)");
ABSL_FLAG(double, train_seconds, 60, "duration of each trainer run, s");
ABSL_FLAG(int, max_steps, 20, "training steps per job in the trainer run");
ABSL_FLAG(int, store_sessions, 16, "PostgreSQL sessions per front (cdcca-cloud --store_sessions)");
ABSL_FLAG(bool, uplink, true, "run the uplink part");
ABSL_FLAG(bool, trainers, true, "run the trainer part");

namespace cdcca {
namespace {

using testing::Child;

struct UplinkFigures {
  double acks_per_s = 0;
  double p50_ms = 0;
  double p99_ms = 0;
  int errors = 0;
};

// --clients devices uplinking to `target` for --seconds.
UplinkFigures Load(const std::string& target, const std::vector<std::string>& tokens) {
  const int clients = static_cast<int>(tokens.size());
  const size_t batch_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_batch_kib)) << 10;
  std::vector<std::unique_ptr<device::CloudClient>> links;
  for (int d = 0; d < clients; ++d) {
    device::CloudClientOptions o;
    o.target = target;
    o.device_id = absl::StrCat("dev-", d);
    o.token = tokens[d];
    o.insecure = true;
    links.push_back(std::move(device::CloudClient::Create(o)).value());
  }
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  std::vector<std::vector<double>> latencies(clients);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int d = 0; d < clients; ++d) {
    threads.emplace_back([&, d] {
      for (uint64_t seq = 1; !stop.load(std::memory_order_relaxed); ++seq) {
        v1::UplinkBatch batch = testing::MakeBatch(d, seq, batch_bytes);
        const absl::Time t0 = absl::Now();
        auto ack = links[d]->Uplink({batch});
        if (!ack.ok() || ack->has_error() || ack->highest_durable_sequence() != seq) {
          if (errors.fetch_add(1) == 0) {
            std::fprintf(stderr, "dev-%d batch %llu: %s\n", d, static_cast<unsigned long long>(seq),
                         ack.ok() ? ack->DebugString().c_str() : ack.status().ToString().c_str());
          }
          return;
        }
        latencies[d].push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
      }
    });
  }
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_seconds)));
  stop = true;
  for (std::thread& t : threads) t.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  std::vector<double> all;
  for (const auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  const auto pct = [&](double p) {
    return all.empty() ? 0.0 : all[static_cast<size_t>(p * (all.size() - 1))];
  };
  return {all.size() / secs, pct(0.5), pct(0.99), errors.load()};
}

std::unique_ptr<testing::NginxServer> Nginx(const std::vector<int>& ports) {
  testing::NginxProxyOptions o;
  for (int p : ports) o.backends.push_back(absl::StrCat("127.0.0.1:", p));
  absl::StatusOr<std::unique_ptr<testing::NginxServer>> nginx = testing::NginxServer::Start(o);
  if (!nginx.ok()) {
    std::fprintf(stderr, "nginx: %s\n", nginx.status().ToString().c_str());
    return nullptr;
  }
  return *std::move(nginx);
}

// One front: the program's service on the shared store, serving on loopback, without the
// program's job trigger (no trainer runs here: the figures are the uplink's alone).
absl::StatusOr<std::unique_ptr<cloud::Cloud>> StartFront(const std::string& conninfo,
                                                         const std::string& tokens,
                                                         const std::string& data_dir) {
  static cloud::CloudObserver no_trigger;
  cloud::CloudOptions o;
  o.data_dir = data_dir;
  o.store = conninfo;
  o.role = "front";
  o.tokens_text = tokens;
  o.store_sessions = absl::GetFlag(FLAGS_store_sessions);
  // As cdcca-cloud on --store: as many service threads as sessions, since those threads
  // wait on the database.
  o.service.io_threads = absl::GetFlag(FLAGS_store_sessions);
  o.server.listen_address = "127.0.0.1:0";
  o.server.insecure = true;
  o.observer = &no_trigger;
  return cloud::OpenCloud(o);
}

void PrintRow(const char* what, const UplinkFigures& u, const UplinkFigures& base) {
  std::printf("| %s | %.0f | %.0f%% | %.2f | %.2f | %d |\n", what, u.acks_per_s,
              base.acks_per_s > 0 ? 100 * u.acks_per_s / base.acks_per_s : 0.0, u.p50_ms, u.p99_ms,
              u.errors);
}

int Uplink(testing::PostgresServer& postgres) {
  const int clients = absl::GetFlag(FLAGS_clients);
  testing::TempDir dir;
  testing::CloudFixtureOptions fo;
  fo.data_dir = dir.path() + "/embedded";
  fo.devices = clients;
  fo.server.listen_address = "127.0.0.1:0";
  fo.server.insecure = true;
  testing::CloudFixture embedded(fo);
  if (absl::Status s = embedded.Start(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::vector<std::string> tokens;
  std::string token_text;
  for (int d = 0; d < clients; ++d) {
    tokens.push_back(embedded.token(d));
    absl::StrAppend(&token_text, "dev-", d, " ", tokens.back(), "\n");
  }

  const UplinkFigures direct = Load(absl::StrCat("127.0.0.1:", embedded.port()), tokens);
  UplinkFigures proxied;
  {
    std::unique_ptr<testing::NginxServer> nginx = Nginx({embedded.port()});
    if (nginx == nullptr) return 1;
    // New device ids' sequences continue: the embedded store keeps what the first run stored.
    embedded.Stop();
    std::filesystem::remove_all(fo.data_dir);
    if (!embedded.Start().ok()) return 1;
    if (!nginx->Reload({absl::StrCat("127.0.0.1:", embedded.port())}).ok()) return 1;
    proxied = Load(nginx->address(), tokens);
  }
  embedded.Stop();

  UplinkFigures shared[2];
  double bytes_per_sample = 0;
  for (int fronts = 1; fronts <= 2; ++fronts) {
    absl::StatusOr<std::string> conninfo = postgres.CreateDatabase();
    if (!conninfo.ok()) return 1;
    std::vector<std::unique_ptr<cloud::Cloud>> running;
    std::vector<int> ports;
    for (int i = 0; i < fronts; ++i) {
      absl::StatusOr<std::unique_ptr<cloud::Cloud>> f =
          StartFront(*conninfo, token_text, absl::StrCat(dir.path(), "/front-", fronts, "-", i));
      if (!f.ok()) {
        std::fprintf(stderr, "front: %s\n", f.status().ToString().c_str());
        return 1;
      }
      ports.push_back((*f)->port());
      running.push_back(*std::move(f));
    }
    std::unique_ptr<testing::NginxServer> nginx = Nginx(ports);
    if (nginx == nullptr) return 1;
    shared[fronts - 1] = Load(nginx->address(), tokens);
    if (fronts == 1) {
      auto conn = cloud::pg::Connection::Open(*conninfo);
      if (conn.ok()) {
        auto r = (*conn)->Exec(
            "SELECT pg_total_relation_size('samples'), coalesce(sum(sample_count), 0)::bigint "
            "FROM samples");
        if (r.ok() && r->rows() == 1) {
          const int64_t bytes = r->Int64(0, 0).value_or(0);
          const int64_t samples = r->Int64(0, 1).value_or(0);
          if (samples > 0) bytes_per_sample = static_cast<double>(bytes) / samples;
        }
      }
    }
    for (auto& f : running) f->Shutdown(absl::Seconds(2));
  }
  const size_t batch_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_batch_kib)) << 10;
  std::printf(
      "## Uplink: %d devices, one batch (4 samples, ~%zu KiB) per call, %.0f s each; %d "
      "PostgreSQL sessions per front\n\n",
      clients, batch_bytes >> 10, absl::GetFlag(FLAGS_seconds),
      absl::GetFlag(FLAGS_store_sessions));
  std::printf(
      "| store and path | acked batches/s | of embedded direct | ack p50 ms | ack p99 ms | "
      "errors |\n|---|---:|---:|---:|---:|---:|\n");
  PrintRow("embedded (files), direct", direct, direct);
  PrintRow("embedded (files), through nginx", proxied, direct);
  PrintRow("PostgreSQL, 1 front, through nginx", shared[0], direct);
  PrintRow("PostgreSQL, 2 fronts, through nginx", shared[1], direct);
  std::printf("\nPostgreSQL bytes per stored sample (samples table, index and TOAST): %.0f\n\n",
              bytes_per_sample);
  return 0;
}

uint64_t JobsDone(const std::string& status_path) {
  return testing::ReadJson(status_path).value("jobs_done", 0ull);
}

// Jobs per hour of `trainers` trainer processes on a fresh database with a backlog.
double JobsPerHour(testing::PostgresServer& postgres, const cloud::SampleSpec& spec,
                   uint64_t fingerprint, int trainers) {
  absl::StatusOr<std::string> conninfo = postgres.CreateDatabase();
  if (!conninfo.ok()) return 0;
  {
    auto store = cloud::pg::PgCloudStore::Open({*conninfo, 4, 16});
    if (!store.ok()) return 0;
    cloud::pg::PgCloudStore::Session s = (*store)->Borrow();
    for (int d = 0; d < absl::GetFlag(FLAGS_train_devices); ++d) {
      const std::string id = absl::StrCat("dev-", d);
      if (!s->Register(id, fingerprint, {}).ok()) return 0;
      for (int b = 1; b <= absl::GetFlag(FLAGS_train_batches); ++b) {
        if (!s->Append(id, testing::MakeModelBatch(spec, d, b)).ok()) return 0;
      }
      if (!s->ScheduleJob(id, absl::Now()).ok()) return 0;
    }
  }
  testing::TempDir dir;
  // One core per trainer: its LibTorch thread and one BLAS thread (OpenBLAS would spread
  // each product over every core, and two trainers would then fight over both).
  ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
  std::vector<std::unique_ptr<Child>> running;
  std::vector<std::string> status;
  for (int t = 0; t < trainers; ++t) {
    status.push_back(absl::StrCat(dir.path(), "/trainer-", t, ".status"));
    running.push_back(std::make_unique<Child>(
        std::vector<std::string>{
            absl::GetFlag(FLAGS_cloud_binary), "--store=" + *conninfo, "--role=trainer",
            absl::StrCat("--data_dir=", dir.path(), "/trainer-", t),
            "--checkpoint_dir=" + absl::GetFlag(FLAGS_checkpoint_dir),
            absl::StrCat("--max_steps=", absl::GetFlag(FLAGS_max_steps)), "--max_batches_per_job=1",
            "--torch_threads=1", "--status_file=" + status.back(), "--status_interval_s=0.5"},
        absl::StrCat(dir.path(), "/trainer-", t, ".log")));
  }
  // Counted from the moment every trainer has finished its first job (models loaded).
  const absl::Time deadline = absl::Now() + absl::Minutes(5);
  while (absl::Now() < deadline) {
    bool all = true;
    for (const std::string& s : status) all = all && JobsDone(s) >= 1;
    if (all) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  uint64_t before = 0;
  for (const std::string& s : status) before += JobsDone(s);
  const absl::Time t0 = absl::Now();
  absl::SleepFor(absl::Seconds(absl::GetFlag(FLAGS_train_seconds)));
  uint64_t after = 0;
  for (const std::string& s : status) after += JobsDone(s);
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  for (auto& c : running) {
    c->Signal(SIGTERM);
    c->Wait(absl::Seconds(60));
  }
  return static_cast<double>(after - before) / secs * 3600;
}

int Trainers(testing::PostgresServer& postgres) {
  testing::TempDir dir;
  auto files = cloud::SampleStore::Open({dir.path() + "/samples"});
  auto updates = cloud::UpdateStore::Open({dir.path() + "/updates", 16});
  if (!files.ok() || !updates.ok()) return 1;
  cloud::PerDeviceStrategyOptions o;
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.state_dir = dir.path() + "/trainer";
  auto strategy = cloud::PerDeviceStrategy::Create(o, files->get(), updates->get());
  if (!strategy.ok()) {
    std::fprintf(stderr, "%s\n", strategy.status().ToString().c_str());
    return 1;
  }
  const cloud::SampleSpec spec = (*strategy)->Spec();
  const uint64_t fingerprint = (*strategy)->BaseFingerprint();
  const double one = JobsPerHour(postgres, spec, fingerprint, 1);
  const double two = JobsPerHour(postgres, spec, fingerprint, 2);
  std::printf(
      "## Trainers: %d devices of %s with a backlog, one batch (4 samples) and %d steps per "
      "job, %.0f s each\n\n",
      absl::GetFlag(FLAGS_train_devices), absl::GetFlag(FLAGS_checkpoint_dir).c_str(),
      absl::GetFlag(FLAGS_max_steps), absl::GetFlag(FLAGS_train_seconds));
  std::printf("| trainer processes | jobs/hour | of one |\n|---:|---:|---:|\n");
  std::printf("| 1 | %.0f | 1.00x |\n| 2 | %.0f | %.2fx |\n\n", one, two, one > 0 ? two / one : 0);
  return 0;
}

}  // namespace
}  // namespace cdcca

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::printf("# cluster_bench (%u hardware threads)\n\n", std::thread::hardware_concurrency());
  absl::StatusOr<std::unique_ptr<cdcca::testing::PostgresServer>> postgres =
      cdcca::testing::PostgresServer::Start();
  if (!postgres.ok()) {
    std::fprintf(stderr, "%s\n", postgres.status().ToString().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_uplink)) {
    if (int rc = cdcca::Uplink(**postgres); rc != 0) return rc;
  }
  return absl::GetFlag(FLAGS_trainers) ? cdcca::Trainers(**postgres) : 0;
}
