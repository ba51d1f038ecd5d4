// Kills a real cdcca-cloud process (SIGKILL) while devices are uplinking, and checks that
// every batch the cloud acked is in its store afterwards and the devices continue.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cloud/sample_store.h"
#include "device/cloud_client.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/transport_fixture.h"
#include "tests/testing/wait.h"

extern char** environ;

namespace cdcca {
namespace {

using ::cdcca::testing::MakeBatch;
using ::cdcca::testing::TempDir;
using ::cdcca::testing::WaitUntil;

class CloudProcess {
 public:
  CloudProcess(const std::string& data_dir, const std::string& tokens, int port)
      : port_file_(data_dir + "/port") {
    ::unlink(port_file_.c_str());
    std::vector<std::string> args = {CDCCA_CLOUD_BINARY,
                                     "--data_dir=" + data_dir,
                                     "--tokens=" + tokens,
                                     "--insecure",
                                     absl::StrCat("--listen=127.0.0.1:", port),
                                     "--port_file=" + port_file_};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ) != 0) pid_ = -1;
  }
  ~CloudProcess() { Kill(); }

  // The port, once the server wrote it; 0 after 20 s without it.
  int WaitForPort() {
    int port = 0;
    WaitUntil(
        [&] {
          std::ifstream in(port_file_);
          return in >> port && port > 0;
        },
        absl::Seconds(20), absl::Milliseconds(10));
    return port;
  }

  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  std::string port_file_;
  pid_t pid_ = -1;
};

TEST(TransportCrashTest, KillDuringUplinkLosesNothingAcked) {
  TempDir dir;
  constexpr int kDevices = 4;
  std::mt19937_64 rng(7);
  std::vector<std::string> tokens;
  {
    std::ofstream out(dir.file("tokens"));
    for (int d = 0; d < kDevices; ++d) {
      tokens.push_back(testing::RandomToken(rng));
      out << "dev-" << d << " " << tokens.back() << "\n";
    }
  }
  auto process = std::make_unique<CloudProcess>(dir.path(), dir.file("tokens"), 0);
  const int port = process->WaitForPort();
  ASSERT_GT(port, 0) << "cdcca-cloud did not start";

  std::vector<std::atomic<uint64_t>> acked(kDevices);
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int d = 0; d < kDevices; ++d) {
    threads.emplace_back([&, d] {
      device::CloudClientOptions o;
      o.target = absl::StrCat("127.0.0.1:", port);
      o.device_id = absl::StrCat("dev-", d);
      o.token = tokens[d];
      o.insecure = true;
      o.max_attempts = 1;
      o.stream_timeout = absl::Seconds(5);
      auto client = std::move(device::CloudClient::Create(o)).value();
      uint64_t seq = 1;
      const absl::Time give_up = absl::Now() + absl::Minutes(2);
      while (!stop.load() && absl::Now() < give_up) {
        // Several batches per stream, so the kill can land mid-stream.
        std::vector<v1::UplinkBatch> batches;
        for (int i = 0; i < 4; ++i) batches.push_back(MakeBatch(d, seq + i, 8192));
        auto ack = client->Uplink(batches);
        if (!ack.ok()) break;  // the cloud is gone
        acked[d] = ack->highest_durable_sequence();
        seq = ack->highest_durable_sequence() + 1;
      }
    });
  }
  // Kill it while every device is in the middle of its uplink: each has had some streams
  // acked and is sending the next.
  EXPECT_TRUE(WaitUntil(
      [&] {
        for (const auto& a : acked) {
          if (a.load() < 12) return false;
        }
        return true;
      },
      absl::Seconds(60)))
      << "the devices got no acks";
  process->Kill();
  stop = true;
  for (auto& t : threads) t.join();

  // Read the store the killed process left behind.
  {
    cloud::SampleStoreOptions so;
    so.dir = dir.path() + "/samples";
    ASSERT_OK_AND_ASSIGN(auto store, cloud::SampleStore::Open(so));
    for (int d = 0; d < kDevices; ++d) {
      const std::string id = absl::StrCat("dev-", d);
      EXPECT_GT(acked[d].load(), 0u) << id << " got no ack before the kill";
      std::printf("%s: acked %lu, stored %lu\n", id.c_str(),
                  static_cast<unsigned long>(acked[d].load()),
                  static_cast<unsigned long>(store->HighestDurable(id)));
      EXPECT_GE(store->HighestDurable(id), acked[d].load()) << id << " lost acked batches";
      ASSERT_OK_AND_ASSIGN(auto records, store->Read(id, 1, 1u << 20));
      ASSERT_GE(records.size(), acked[d].load());
      for (size_t i = 0; i < records.size(); ++i) {
        ASSERT_EQ(records[i].batch().sequence(), i + 1);
        ASSERT_EQ(records[i].batch().payload(), MakeBatch(d, i + 1, 8192).payload());
      }
    }
  }

  // A restarted cloud tells each device where to continue, and takes new batches.
  process = std::make_unique<CloudProcess>(dir.path(), dir.file("tokens"), port);
  ASSERT_GT(process->WaitForPort(), 0);
  for (int d = 0; d < kDevices; ++d) {
    device::CloudClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", port);
    o.device_id = absl::StrCat("dev-", d);
    o.token = tokens[d];
    o.insecure = true;
    auto client = std::move(device::CloudClient::Create(o)).value();
    ASSERT_OK_AND_ASSIGN(v1::RegisterReply reg, client->Register(v1::RegisterRequest()));
    EXPECT_GE(reg.next_uplink_sequence(), acked[d].load() + 1);
    ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack,
                         client->Uplink({MakeBatch(d, reg.next_uplink_sequence(), 8192)}));
    EXPECT_EQ(ack.highest_durable_sequence(), reg.next_uplink_sequence());
  }
}

}  // namespace
}  // namespace cdcca
