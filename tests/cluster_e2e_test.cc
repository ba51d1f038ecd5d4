// The cloud past one process, end to end: a real PostgreSQL (started by the test, as an
// unprivileged user when root), `cdcca-cloud --store ... --role front` and `--role trainer`
// processes, and real `cdcca-device` processes on loopback with the tiny family.
//   1. Two fronts behind nginx (grpc_pass) and two trainers: every device dials nginx's one
//      address, reaches its updates and ends in sync with the digest the store recorded;
//      nothing acked is lost.
//   1a. Fifty devices (the device agent in this process: its runtime, UTS, encoder, uplink
//      queue and client) through nginx onto two fronts and two trainers: every device ends
//      in sync with the store's digest, and each device's stored batches are its sequences
//      up to the one acked last, each once (the consumed ones below may be released).
//   1b. A front killed (-9) in the middle of the devices' streams: they reconnect through
//      nginx to the other front and resume; nothing acked is lost.
//   2. A trainer dies in the middle of a job (after training, before its commit; and killed
//      with SIGKILL while it trains): it loses only its lease, and another trainer runs the
//      job once the lease expired.
//   3. PostgreSQL stops under load: the front refuses uplinks meanwhile (no ack without a
//      commit), and after the restart the devices resume and nothing acked is lost.
//   4. A device rolls back through a front (the rollback holds the device's job lease).
//   5. A second process on a --data_dir in use refuses to start.
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cloud/pg/connection.h"
#include "cloud/pg/pg_store.h"
#include "datasets/scene.h"
#include "datasets/shifts.h"
#include "datasets/test_images.h"
#include "datasets/tokenizer.h"
#include "device/agent.h"
#include "device/cloud_client.h"
#include "device/inference_runtime.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "opencv2/imgcodecs.hpp"
#include "opencv2/imgproc.hpp"
#include "tests/testing/child_process.h"
#include "tests/testing/cloud_processes.h"
#include "tests/testing/nginx_server.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/program_fixtures.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/wait.h"

namespace cdcca {
namespace {

using ::cdcca::testing::Child;
using ::cdcca::testing::CloudProcesses;
using ::cdcca::testing::CloudProcessOptions;
using ::cdcca::testing::NginxProxyOptions;
using ::cdcca::testing::NginxServer;
using ::cdcca::testing::PostgresServer;
using ::cdcca::testing::ReadJson;
using ::cdcca::testing::ReadText;
using ::cdcca::testing::TempDir;
using ::cdcca::testing::WaitUntil;
using ::testing::HasSubstr;

constexpr int kFleet = 50;
std::string FleetId(int i) { return absl::StrCat("fleet-", i); }
std::string FleetToken(int i) { return absl::StrCat("token-fleet-", 1000 + i, "-xxxxxxxx"); }

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(11);
    checkpoint_ = dir_.path() + "/family";
    ASSERT_OK(testing::SaveRandomTinyFamily(checkpoint_));
    images_ = dir_.path() + "/images";
    ASSERT_OK(testing::WriteShiftedScenes(images_));
    std::ofstream tokens(dir_.path() + "/tokens");
    for (const char c : std::string("abcd")) {
      tokens << "dev-" << c << " token-" << std::string(16, c) << "\n";
    }
    for (int i = 0; i < kFleet; ++i) tokens << FleetId(i) << " " << FleetToken(i) << "\n";
    std::ofstream(dir_.path() + "/prompts") << "what is in the picture?\n";

    absl::StatusOr<std::unique_ptr<PostgresServer>> server = PostgresServer::Start();
    ASSERT_OK(server.status());
    postgres_ = *std::move(server);
    ASSERT_OK_AND_ASSIGN(conninfo_, postgres_->CreateDatabase());
  }

  // A cdcca-cloud process of `role` named `name` (its data dir, log and status file).
  // Fronts return once serving (their port in *port).
  std::unique_ptr<Child> StartCloud(const std::string& role, const std::string& name,
                                    int* port = nullptr, const std::string& exit_at = "",
                                    const std::vector<std::string>& extra = {}) {
    return Processes().Start(role, name, port, exit_at, extra);
  }

  // The launcher of this test's cdcca-cloud processes, with the flags every test runs.
  CloudProcesses Processes() const {
    CloudProcessOptions o;
    o.binary = CDCCA_CLOUD_BINARY;
    o.dir = dir_.path();
    o.conninfo = conninfo_;
    o.checkpoint_dir = checkpoint_;
    o.tokens_path = dir_.path() + "/tokens";
    // The guard holds out and scores in every job, by its small-pool rule only: on this
    // random fixture the teacher's probabilities are ~1e-80 and one sample makes the paired
    // standard error, so the paired rule's decision is a coin flip that, once a slow machine
    // lets the pool pass 16, stops a device's versions. The paired rule is tested in
    // update_guard_test and MirrorTrainerGuardTest.
    o.flags = {"--student_precision=int8", "--trigger_samples=4",
               "--trigger_interval_s=3",   "--max_steps=3",
               "--batch_size=4",           "--torch_threads=1",
               "--bits_per_param=4",       "--lease_s=3",
               "--store_sessions=2",       "--uts_keep_fraction=0.6",
               "--uts_mc_passes=2",        "--guard_min_pool=1000000"};
    return CloudProcesses(std::move(o));
  }

  // nginx passing every call to the fronts at `ports`; null (with the failure recorded)
  // when it cannot start.
  std::unique_ptr<NginxServer> StartNginx(const std::vector<int>& ports) {
    NginxProxyOptions options;
    for (int port : ports) options.backends.push_back(absl::StrCat("127.0.0.1:", port));
    absl::StatusOr<std::unique_ptr<NginxServer>> nginx = NginxServer::Start(options);
    EXPECT_OK(nginx.status());
    return nginx.ok() ? *std::move(nginx) : nullptr;
  }

  std::string Log(const std::string& name) const { return Processes().Log(name); }
  std::string DeviceDir(const std::string& id) const { return dir_.path() + "/" + id; }

  std::unique_ptr<Child> StartDevice(const std::string& id, int port,
                                     const std::vector<std::string>& extra = {}) {
    std::filesystem::create_directories(DeviceDir(id));
    std::vector<std::string> args = {CDCCA_DEVICE_BINARY,
                                     absl::StrCat("--cloud=127.0.0.1:", port),
                                     "--insecure",
                                     "--device_id=" + id,
                                     "--token=token-" + std::string(16, id.back()),
                                     "--checkpoint_dir=" + checkpoint_,
                                     "--student_precision=int8",
                                     "--torch_threads=1",
                                     "--state_dir=" + DeviceDir(id) + "/state",
                                     "--input=" + images_,
                                     "--loop",
                                     "--fps=8",
                                     "--prompts_file=" + dir_.path() + "/prompts",
                                     "--output=" + DeviceDir(id) + "/answers.jsonl",
                                     "--uplink_batch_samples=2",
                                     "--uplink_max_age_s=1",
                                     "--poll_ms=300",
                                     "--max_attempts=2",
                                     "--status_file=" + DeviceDir(id) + "/status.json"};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<Child>(args, DeviceDir(id) + "/device.log");
  }

  nlohmann::json DeviceStatus(const std::string& id) {
    return ReadJson(DeviceDir(id) + "/status.json");
  }

  bool WaitInSync(const std::string& id, uint64_t version, absl::Duration timeout) {
    return testing::WaitStatusInSync(DeviceDir(id) + "/status.json", version, timeout);
  }

  std::unique_ptr<cloud::pg::PgStore> Store() {
    absl::StatusOr<std::unique_ptr<cloud::pg::PgStore>> store =
        cloud::pg::PgStore::Open({conninfo_});
    EXPECT_OK(store.status());
    return store.ok() ? *std::move(store) : nullptr;
  }

  // Stops the device and checks it against the store: its digest is the one recorded for
  // its version, and every batch it saw acked is stored.
  void StopAndCheck(const std::string& id, Child& device) {
    device.Signal(SIGTERM);
    ASSERT_EQ(device.Wait(absl::Seconds(60)), 0) << ReadText(DeviceDir(id) + "/device.log");
    nlohmann::json s = DeviceStatus(id);
    const uint64_t version = s.value("version", 0ull);
    EXPECT_GE(version, 1u) << id;
    std::unique_ptr<cloud::pg::PgStore> store = Store();
    ASSERT_NE(store, nullptr);
    ASSERT_OK_AND_ASSIGN(uint64_t digest, store->DigestOf(id, version));
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(digest));
    EXPECT_EQ(s.value("digest", std::string()), hex) << id << " " << s.dump();
    ASSERT_OK_AND_ASSIGN(uint64_t highest, store->HighestSequence(id));
    EXPECT_GE(highest, s.value("acked", 0ull)) << id;
    EXPECT_GT(s.value("acked", 0ull), 0u) << id;
  }

  TempDir dir_;
  std::string checkpoint_, images_, conninfo_;
  std::unique_ptr<PostgresServer> postgres_;
};

TEST_F(ClusterTest, TwoFrontsAndTwoTrainersBringEveryDeviceInSync) {
  int port0 = 0, port1 = 0;
  std::unique_ptr<Child> front0 = StartCloud("front", "front-0", &port0);
  ASSERT_GT(port0, 0) << ReadText(Log("front-0"));
  std::unique_ptr<Child> front1 = StartCloud("front", "front-1", &port1);
  ASSERT_GT(port1, 0) << ReadText(Log("front-1"));
  std::unique_ptr<NginxServer> nginx = StartNginx({port0, port1});
  ASSERT_NE(nginx, nullptr);
  std::unique_ptr<Child> trainer0 = StartCloud("trainer", "trainer-0");
  std::unique_ptr<Child> trainer1 = StartCloud("trainer", "trainer-1");
  std::vector<std::pair<std::string, std::unique_ptr<Child>>> devices;
  for (const std::string id : {"dev-a", "dev-b", "dev-c", "dev-d"}) {
    devices.emplace_back(id, StartDevice(id, nginx->port()));
  }
  for (auto& [id, device] : devices) {
    ASSERT_TRUE(WaitInSync(id, 2, absl::Minutes(4)))
        << id << "\n"
        << ReadText(DeviceDir(id) + "/device.log") << "\ntrainer-0:\n"
        << ReadText(Log("trainer-0")) << "\ntrainer-1:\n"
        << ReadText(Log("trainer-1"));
  }
  for (auto& [id, device] : devices) StopAndCheck(id, *device);
  // Both trainers took jobs from the one queue.
  // The status files are rewritten every 0.5 s: wait (with a deadline) for the last jobs.
  uint64_t done0 = 0, done1 = 0;
  WaitUntil(
      [&] {
        done0 = ReadJson(dir_.path() + "/trainer-0.status").value("jobs_done", 0ull);
        done1 = ReadJson(dir_.path() + "/trainer-1.status").value("jobs_done", 0ull);
        return done0 + done1 >= 8u;
      },
      absl::Seconds(30));
  EXPECT_GE(done0 + done1, 8u) << done0 << " + " << done1;
  // A front trains nothing; nginx spread the devices' calls over both fronts.
  EXPECT_THAT(ReadText(Log("front-0")), ::testing::Not(HasSubstr("\"event\":\"job\"")));
  const std::string access = ReadText(nginx->access_log_path());
  EXPECT_THAT(access, HasSubstr(absl::StrCat("127.0.0.1:", port0)));
  EXPECT_THAT(access, HasSubstr(absl::StrCat("127.0.0.1:", port1)));
  for (Child* c : {front0.get(), front1.get(), trainer0.get(), trainer1.get()}) {
    c->Signal(SIGTERM);
    EXPECT_EQ(c->Wait(absl::Seconds(60)), 0);
  }
}

TEST_F(ClusterTest, FiftyAgentsThroughNginxEndInSyncWithEachBatchStoredOnce) {
  int port0 = 0, port1 = 0;
  std::unique_ptr<Child> front0 = StartCloud("front", "front-0", &port0);
  ASSERT_GT(port0, 0) << ReadText(Log("front-0"));
  std::unique_ptr<Child> front1 = StartCloud("front", "front-1", &port1);
  ASSERT_GT(port1, 0) << ReadText(Log("front-1"));
  std::unique_ptr<NginxServer> nginx = StartNginx({port0, port1});
  ASSERT_NE(nginx, nullptr);
  std::unique_ptr<Child> trainer0 = StartCloud("trainer", "trainer-0");
  std::unique_ptr<Child> trainer1 = StartCloud("trainer", "trainer-1");

  struct Fleet {
    std::unique_ptr<device::InferenceRuntime> runtime;
    std::unique_ptr<device::CloudClient> client;
    std::unique_ptr<device::DeviceAgent> agent;
  };
  std::vector<Fleet> fleet(kFleet);
  for (int i = 0; i < kFleet; ++i) {
    device::RuntimeOptions ro;
    ro.checkpoint_dir = checkpoint_;
    ro.precision = "int8";
    ro.threads = 1;
    ro.max_answer_tokens = 3;
    ASSERT_OK_AND_ASSIGN(fleet[i].runtime, device::InferenceRuntime::Load(ro));
    device::CloudClientOptions co;
    co.target = nginx->address();
    co.device_id = FleetId(i);
    co.token = FleetToken(i);
    co.insecure = true;
    co.max_attempts = 3;
    co.initial_backoff = absl::Milliseconds(20);
    co.call_timeout = absl::Seconds(10);
    ASSERT_OK_AND_ASSIGN(fleet[i].client, device::CloudClient::Create(co));
    device::AgentOptions ao;
    ao.state_dir = DeviceDir(FleetId(i));
    ao.uts.keep_fraction = 0;  // every answer passes stage 1
    ao.uts.entropy_alpha = 0;
    ao.uts.mc_passes = 2;
    ao.uts.token_ratio = 0.5f;
    ao.batch_samples = 2;
    ASSERT_OK_AND_ASSIGN(fleet[i].agent, device::DeviceAgent::Create(ao, fleet[i].runtime.get(),
                                                                     fleet[i].client.get()));
  }
  const auto frames = [](int seed) {
    std::vector<device::Frame> out(4);
    for (int k = 0; k < 4; ++k) {
      out[k].image = datasets::Image(64, 64);
      for (size_t p = 0; p < out[k].image.pixels.size(); ++p) {
        out[k].image.pixels[p] = static_cast<uint8_t>((p * 131 + (seed + k) * 977) % 251);
      }
      out[k].question = "what is in the picture?";
    }
    return out;
  };
  // Rounds of answering and syncing until every device runs an update and matches.
  const absl::Time deadline = absl::Now() + absl::Minutes(6);
  for (int round = 0;; ++round) {
    int done = 0;
    for (int i = 0; i < kFleet; ++i) {
      device::AgentStats st = fleet[i].agent->Stats();
      if (st.version >= 1 && st.in_sync && round > 1) {
        ++done;
        continue;
      }
      if (round < 3) ASSERT_OK(fleet[i].agent->Process(frames(100 * i + round)).status());
      (void)fleet[i].agent->SyncOnce();  // errors are retried next round
    }
    if (done == kFleet) break;
    ASSERT_LT(absl::Now(), deadline) << done << " of " << kFleet << " in sync\n"
                                     << ReadText(Log("trainer-0")).substr(0, 4000);
  }
  std::unique_ptr<cloud::pg::PgStore> store = Store();
  ASSERT_NE(store, nullptr);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<cloud::pg::Connection> conn,
                       cloud::pg::Connection::Open(conninfo_));
  for (int i = 0; i < kFleet; ++i) {
    const std::string id = FleetId(i);
    device::AgentStats st = fleet[i].agent->Stats();
    ASSERT_OK_AND_ASSIGN(uint64_t digest, store->DigestOf(id, st.version));
    EXPECT_EQ(st.state_digest, digest) << id;
    ASSERT_OK_AND_ASSIGN(cloud::pg::Result rows,
                         conn->Exec("SELECT count(*), coalesce(min(sequence), 1), "
                                    "coalesce(max(sequence), 0) FROM samples WHERE device_id = $1",
                                    cloud::pg::Params().Text(id)));
    ASSERT_OK_AND_ASSIGN(int64_t stored, rows.Int64(0, 0));
    ASSERT_OK_AND_ASSIGN(int64_t lowest, rows.Int64(0, 1));
    ASSERT_OK_AND_ASSIGN(int64_t highest, rows.Int64(0, 2));
    // Sequences lowest..highest, each once (those below were consumed and released).
    EXPECT_EQ(stored, highest - lowest + 1) << id;
    EXPECT_EQ(static_cast<uint64_t>(highest), st.batches_acked) << id;
    EXPECT_GT(st.batches_acked, 0u) << id;
  }
  // The status files are rewritten every 0.5 s: wait (with a deadline) for the last jobs.
  uint64_t done0 = 0, done1 = 0;
  WaitUntil(
      [&] {
        done0 = ReadJson(dir_.path() + "/trainer-0.status").value("jobs_done", 0ull);
        done1 = ReadJson(dir_.path() + "/trainer-1.status").value("jobs_done", 0ull);
        return done0 + done1 >= static_cast<uint64_t>(kFleet);
      },
      absl::Seconds(30));
  EXPECT_GE(done0 + done1, static_cast<uint64_t>(kFleet));
  for (Child* c : {front0.get(), front1.get(), trainer0.get(), trainer1.get()}) {
    c->Signal(SIGTERM);
    EXPECT_EQ(c->Wait(absl::Seconds(60)), 0);
  }
}

TEST_F(ClusterTest, AFrontKilledMidStreamLeavesItsDevicesToTheOtherFront) {
  int port0 = 0, port1 = 0;
  std::unique_ptr<Child> front0 = StartCloud("front", "front-0", &port0);
  ASSERT_GT(port0, 0) << ReadText(Log("front-0"));
  std::unique_ptr<Child> front1 = StartCloud("front", "front-1", &port1);
  ASSERT_GT(port1, 0) << ReadText(Log("front-1"));
  std::unique_ptr<NginxServer> nginx = StartNginx({port0, port1});
  ASSERT_NE(nginx, nullptr);
  std::unique_ptr<Child> trainer = StartCloud("trainer", "trainer-0");
  std::unique_ptr<Child> a = StartDevice("dev-a", nginx->port());
  std::unique_ptr<Child> b = StartDevice("dev-b", nginx->port());
  ASSERT_TRUE(WaitInSync("dev-a", 1, absl::Minutes(3))) << ReadText(Log("trainer-0"));
  ASSERT_TRUE(WaitInSync("dev-b", 1, absl::Minutes(3))) << ReadText(Log("trainer-0"));
  // Kill the front while batches stream through it.
  const std::string upstream0 = absl::StrCat("upstream=127.0.0.1:", port0);
  const auto calls_on_front0 = [&] {
    const std::string log = ReadText(nginx->access_log_path());
    size_t n = 0;
    for (size_t at = log.find(upstream0); at != std::string::npos;
         at = log.find(upstream0, at + 1)) {
      ++n;
    }
    return n;
  };
  const size_t seen = calls_on_front0();
  ASSERT_TRUE(WaitUntil([&] { return calls_on_front0() > seen; }, absl::Minutes(1)));
  front0->Kill();
  const uint64_t va = DeviceStatus("dev-a").value("version", 0ull);
  const uint64_t vb = DeviceStatus("dev-b").value("version", 0ull);
  ASSERT_TRUE(WaitInSync("dev-a", va + 1, absl::Minutes(3)))
      << ReadText(DeviceDir("dev-a") + "/device.log");
  ASSERT_TRUE(WaitInSync("dev-b", vb + 1, absl::Minutes(3)))
      << ReadText(DeviceDir("dev-b") + "/device.log");
  StopAndCheck("dev-a", *a);
  StopAndCheck("dev-b", *b);
  for (Child* c : {front1.get(), trainer.get()}) {
    c->Signal(SIGTERM);
    EXPECT_EQ(c->Wait(absl::Seconds(60)), 0);
  }
}

// A trainer killed (SIGKILL) in a job loses only its lease: a trainer whose jobs take long is
// killed while it holds a job's lease; the other trainer publishes the job once the lease
// expired, and the chain of updates stays one per version.
TEST_F(ClusterTest, ATrainerKilledMidJobLeavesTheJobToTheOther) {
  int port = 0;
  std::unique_ptr<Child> front = StartCloud("front", "front-0", &port);
  ASSERT_GT(port, 0) << ReadText(Log("front-0"));
  std::unique_ptr<Child> slow =
      StartCloud("trainer", "trainer-0", nullptr, "", {"--max_steps=100000"});
  std::unique_ptr<Child> device = StartDevice("dev-a", port);
  // The slow trainer holds the device's job once it leased it.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<cloud::pg::Connection> conn,
                       cloud::pg::Connection::Open(conninfo_));
  const auto holder = [&]() -> std::string {
    absl::StatusOr<cloud::pg::Result> r = conn->Exec(
        "SELECT coalesce(lease_owner, '') FROM jobs WHERE device_id = 'dev-a' AND "
        "lease_expires_at > clock_timestamp()");
    if (!r.ok() || r->rows() == 0) return "";
    return r->Bytes(0, 0).value_or("");
  };
  ASSERT_TRUE(WaitUntil([&] { return !holder().empty(); }, absl::Minutes(2)))
      << ReadText(Log("trainer-0"));
  const std::string slow_owner = holder();
  std::unique_ptr<Child> other = StartCloud("trainer", "trainer-1");
  slow->Kill();  // SIGKILL, mid-job
  ASSERT_TRUE(WaitInSync("dev-a", 1, absl::Minutes(2))) << ReadText(Log("trainer-1"));
  EXPECT_THAT(ReadText(Log("trainer-1")), HasSubstr("\"event\":\"job\""));
  EXPECT_THAT(ReadText(Log("trainer-0")), ::testing::Not(HasSubstr("\"event\":\"job\"")));
  EXPECT_NE(holder(), slow_owner);
  StopAndCheck("dev-a", *device);
  std::unique_ptr<cloud::pg::PgStore> store = Store();
  ASSERT_NE(store, nullptr);
  ASSERT_OK_AND_ASSIGN(uint64_t latest, store->LatestVersion("dev-a"));
  for (uint64_t v = 0; v < latest; ++v) {
    ASSERT_OK_AND_ASSIGN(cloud::pg::StoredPayload update, store->UpdateAfter("dev-a", v));
    EXPECT_EQ(update.new_version, v + 1);
  }
  for (Child* c : {front.get(), other.get()}) {
    c->Signal(SIGTERM);
    EXPECT_EQ(c->Wait(absl::Seconds(60)), 0);
  }
}

// The replay buffer travels with the device's state in the store: the first job that
// another trainer runs for the device replays what the first trainer's jobs trained.
TEST_F(ClusterTest, TheNextTrainerReplaysWhatTheLastOneTrained) {
  int port = 0;
  std::unique_ptr<Child> front = StartCloud("front", "front-0", &port);
  ASSERT_GT(port, 0) << ReadText(Log("front-0"));
  std::unique_ptr<Child> first = StartCloud("trainer", "trainer-0");
  std::unique_ptr<Child> device = StartDevice("dev-a", port);
  ASSERT_TRUE(WaitInSync("dev-a", 1, absl::Minutes(2))) << ReadText(Log("trainer-0"));
  first->Signal(SIGTERM);
  ASSERT_EQ(first->Wait(absl::Seconds(60)), 0) << ReadText(Log("trainer-0"));
  std::unique_ptr<Child> second = StartCloud("trainer", "trainer-1");
  // The second trainer's first job of dev-a.
  nlohmann::json job;
  ASSERT_TRUE(WaitUntil(
      [&] {
        for (nlohmann::json& j : testing::LogEvents(Log("trainer-1"), "job")) {
          if (j.value("device_id", "") == "dev-a") {
            job = std::move(j);
            return true;
          }
        }
        return false;
      },
      absl::Minutes(2)))
      << ReadText(Log("trainer-1"));
  EXPECT_GE(job.value("base_version", 0ull), 1u) << job.dump();
  EXPECT_GT(job.value("replay_samples", 0), 0) << job.dump();
  StopAndCheck("dev-a", *device);
  for (Child* c : {front.get(), second.get()}) {
    c->Signal(SIGTERM);
    EXPECT_EQ(c->Wait(absl::Seconds(60)), 0);
  }
}

TEST_F(ClusterTest, FrontsRefuseUplinksWhilePostgresIsDownAndDevicesResume) {
  int port = 0;
  std::unique_ptr<Child> front = StartCloud("front", "front-0", &port);
  ASSERT_GT(port, 0) << ReadText(Log("front-0"));
  std::unique_ptr<Child> trainer = StartCloud("trainer", "trainer-0");
  std::unique_ptr<Child> a = StartDevice("dev-a", port);
  std::unique_ptr<Child> b = StartDevice("dev-b", port);
  ASSERT_TRUE(WaitInSync("dev-a", 1, absl::Minutes(3))) << ReadText(Log("trainer-0"));
  ASSERT_OK(postgres_->Stop());
  // Calls fail with UNAVAILABLE while the store is away (the front says why); the device
  // backs off and retries, and nothing is acked without a commit between its attempts.
  const auto store_errors = [&] {
    const std::string log = ReadText(DeviceDir("dev-a") + "/device.log");
    size_t n = 0;
    for (size_t at = log.find("reconnect to PostgreSQL"); at != std::string::npos;
         at = log.find("reconnect to PostgreSQL", at + 1)) {
      ++n;
    }
    return n;
  };
  // The status file the device writes after a moment (a write is seen by its count of
  // answers growing): the acks it holds.
  const auto acked_as_of_now = [&] {
    const uint64_t answered = DeviceStatus("dev-a").value("answered", 0ull);
    uint64_t acked = 0;
    EXPECT_TRUE(WaitUntil(
        [&] {
          nlohmann::json st = DeviceStatus("dev-a");
          acked = st.value("acked", 0ull);
          return st.value("answered", 0ull) > answered;
        },
        absl::Minutes(1)));
    return acked;
  };
  // The link thread takes an ack in before it logs its next call's failure, so a status
  // written after the first failure holds every ack the device got before the store went.
  ASSERT_TRUE(WaitUntil([&] { return store_errors() >= 1; }, absl::Minutes(1)))
      << ReadText(DeviceDir("dev-a") + "/device.log");
  const uint64_t acked_while_down = acked_as_of_now();
  const size_t errors = store_errors();
  ASSERT_TRUE(WaitUntil([&] { return store_errors() >= errors + 2; }, absl::Minutes(1)));
  EXPECT_EQ(acked_as_of_now(), acked_while_down) << ReadText(DeviceDir("dev-a") + "/device.log");
  ASSERT_OK(postgres_->Restart());
  const uint64_t before = DeviceStatus("dev-a").value("version", 0ull);
  ASSERT_TRUE(WaitInSync("dev-a", before + 1, absl::Minutes(3)))
      << ReadText(DeviceDir("dev-a") + "/device.log") << ReadText(Log("trainer-0"));
  ASSERT_TRUE(WaitInSync("dev-b", 1, absl::Minutes(3)));
  StopAndCheck("dev-a", *a);
  StopAndCheck("dev-b", *b);
  front->Signal(SIGTERM);
  EXPECT_EQ(front->Wait(absl::Seconds(60)), 0);
  trainer->Signal(SIGTERM);
  EXPECT_EQ(trainer->Wait(absl::Seconds(60)), 0);
}

// `cdcca-device --rollback` through a front: the front leases the device's job and the
// rollback publishes under that lease, as a new version whose digest is the older one's.
TEST_F(ClusterTest, ADeviceRollsBackThroughAFront) {
  int port = 0;
  std::unique_ptr<Child> front = StartCloud("front", "front-0", &port);
  ASSERT_GT(port, 0) << ReadText(Log("front-0"));
  std::unique_ptr<Child> trainer = StartCloud("trainer", "trainer-0");
  {
    std::unique_ptr<Child> a = StartDevice("dev-a", port);
    ASSERT_TRUE(WaitInSync("dev-a", 2, absl::Minutes(3))) << ReadText(Log("trainer-0"));
    a->Signal(SIGTERM);
    ASSERT_EQ(a->Wait(absl::Seconds(60)), 0) << ReadText(DeviceDir("dev-a") + "/device.log");
  }
  // The trainers take what the device left; then its mirror stays where it is.
  std::unique_ptr<cloud::pg::PgStore> store = Store();
  ASSERT_NE(store, nullptr);
  uint64_t newest = 0;
  ASSERT_TRUE(WaitUntil(
      [&] {
        absl::StatusOr<cloud::pg::MirrorState> m = store->MirrorCursor("dev-a");
        absl::StatusOr<uint64_t> highest = store->HighestSequence("dev-a");
        if (!m.ok() || !highest.ok()) return false;
        newest = m->version;
        return m->consumed_sequence == *highest;
      },
      absl::Minutes(2)))
      << ReadText(Log("trainer-0"));
  ASSERT_GE(newest, 2u);
  std::unique_ptr<Child> rolled = StartDevice("dev-a", port, {"--rollback", "--frames=2"});
  ASSERT_EQ(rolled->Wait(absl::Minutes(2)), 0)
      << ReadText(DeviceDir("dev-a") + "/device.log") << ReadText(Log("front-0"));
  EXPECT_THAT(ReadText(DeviceDir("dev-a") + "/device.log"),
              HasSubstr(absl::StrCat("from version ", newest, " to the state of version ",
                                     newest - 1, " as version ", newest + 1)));
  ASSERT_OK_AND_ASSIGN(uint64_t restored, store->DigestOf("dev-a", newest + 1));
  ASSERT_OK_AND_ASSIGN(uint64_t older, store->DigestOf("dev-a", newest - 1));
  EXPECT_EQ(restored, older);
  // On the pretrained base there is nothing to roll back: the program says so and fails.
  std::unique_ptr<Child> fresh = StartDevice("dev-b", port, {"--rollback", "--frames=1"});
  EXPECT_NE(fresh->Wait(absl::Minutes(2)), 0);
  EXPECT_THAT(ReadText(DeviceDir("dev-b") + "/device.log"), HasSubstr("nothing to roll back"));
  for (Child* c : {front.get(), trainer.get()}) {
    c->Signal(SIGTERM);
    EXPECT_EQ(c->Wait(absl::Seconds(60)), 0);
  }
}

TEST_F(ClusterTest, ASecondProcessOnADataDirInUseRefuses) {
  int port = 0;
  std::unique_ptr<Child> first = StartCloud("front", "front-0", &port);
  ASSERT_GT(port, 0) << ReadText(Log("front-0"));
  std::vector<std::string> args = {CDCCA_CLOUD_BINARY, "--data_dir=" + dir_.path() + "/front-0",
                                   "--tokens=" + dir_.path() + "/tokens", "--insecure",
                                   "--listen=127.0.0.1:0"};
  Child second(args, Log("second"));
  EXPECT_EQ(second.Wait(absl::Seconds(60)), 1);
  EXPECT_THAT(ReadText(Log("second")), HasSubstr("in use by another cdcca-cloud process"));
  first->Signal(SIGTERM);
  EXPECT_EQ(first->Wait(absl::Seconds(60)), 0);
}

}  // namespace
}  // namespace cdcca
