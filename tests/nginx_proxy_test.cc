// nginx as the one address in front of several real cdcca-cloud processes
// (configs/nginx/grpc_proxy.conf.in, the configuration scripts/cluster.sh runs): calls reach
// every backend with their bearer token, a long Uplink stream passes whole, and once a
// backend is killed (SIGKILL) calls go on through the others without the device retrying.
// The backends run in the embedded mode, each with its own data directory, so this checks
// the transport through nginx, not a shared store.
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "device/cloud_client.h"
#include "gtest/gtest.h"
#include "tests/testing/child_process.h"
#include "tests/testing/nginx_server.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/transport_fixture.h"
#include "tests/testing/wait.h"

namespace cdcca {
namespace {

using ::cdcca::testing::Child;
using ::cdcca::testing::MakeBatch;
using ::cdcca::testing::NginxProxyOptions;
using ::cdcca::testing::NginxServer;
using ::cdcca::testing::ReadText;
using ::cdcca::testing::TempDir;
using ::cdcca::testing::WaitUntil;

constexpr int kDevices = 8;

// A cdcca-cloud process in its embedded mode on a loopback port it picks.
class CloudProcess {
 public:
  CloudProcess(const std::string& data_dir, const std::string& tokens)
      : log_(data_dir + ".log"), port_file_(data_dir + ".port") {
    std::filesystem::create_directories(data_dir);
    child_ = std::make_unique<Child>(
        std::vector<std::string>{CDCCA_CLOUD_BINARY, "--data_dir=" + data_dir,
                                 "--tokens=" + tokens, "--insecure", "--listen=127.0.0.1:0",
                                 "--port_file=" + port_file_},
        log_);
  }

  // "127.0.0.1:<port>" once the server wrote its port; "" after 30 s without it.
  std::string WaitForAddress() {
    int port = 0;
    WaitUntil(
        [&] {
          std::ifstream in(port_file_);
          return static_cast<bool>(in >> port) && port > 0;
        },
        absl::Seconds(30));
    return port > 0 ? absl::StrCat("127.0.0.1:", port) : "";
  }

  void Kill() { child_->Kill(); }
  std::string log() const { return ReadText(log_); }

 private:
  std::string log_;
  std::string port_file_;
  std::unique_ptr<Child> child_;
};

class NginxProxyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(38);
    std::ofstream out(dir_.file("tokens"));
    for (int d = 0; d < kDevices; ++d) {
      tokens_.push_back(testing::RandomToken(rng));
      out << "dev-" << d << " " << tokens_.back() << "\n";
    }
  }

  // Starts a backend named `name` and returns its address ("" when it did not start).
  std::string StartBackend(const std::string& name) {
    backends_.push_back(
        std::make_unique<CloudProcess>(dir_.file(name), dir_.file("tokens")));
    const std::string address = backends_.back()->WaitForAddress();
    EXPECT_NE(address, "") << name << " did not start: " << backends_.back()->log();
    return address;
  }

  // A client of `target` as device `device`. One attempt per call unless told: a call that
  // fails is not hidden by the client's own retries.
  std::unique_ptr<device::CloudClient> Client(const std::string& target, int device,
                                              const std::string& token = "",
                                              int max_attempts = 1) {
    device::CloudClientOptions o;
    o.target = target;
    o.device_id = absl::StrCat("dev-", device);
    o.token = token.empty() ? tokens_[device] : token;
    o.insecure = true;
    o.max_attempts = max_attempts;
    o.call_timeout = absl::Seconds(10);
    o.stream_timeout = absl::Seconds(60);
    return std::move(device::CloudClient::Create(o)).value();
  }

  // Devices registered on the backend at `address`, asked directly (not through nginx).
  uint32_t RegisteredOn(const std::string& address) {
    absl::StatusOr<v1::HealthReply> health = Client(address, 0)->Health();
    EXPECT_TRUE(health.ok()) << address << ": " << health.status();
    return health.ok() ? health->registered_devices() : 0;
  }

  std::unique_ptr<NginxServer> StartNginx(std::vector<std::string> backends) {
    NginxProxyOptions options;
    options.backends = std::move(backends);
    absl::StatusOr<std::unique_ptr<NginxServer>> nginx = NginxServer::Start(options);
    EXPECT_TRUE(nginx.ok()) << nginx.status();
    return nginx.ok() ? std::move(*nginx) : nullptr;
  }

  TempDir dir_;
  std::vector<std::string> tokens_;
  std::vector<std::unique_ptr<CloudProcess>> backends_;
};

TEST_F(NginxProxyTest, PassesCallsWithTheirTokenToEveryBackend) {
  const std::string a = StartBackend("a");
  const std::string b = StartBackend("b");
  ASSERT_FALSE(a.empty() || b.empty());
  std::unique_ptr<NginxServer> nginx = StartNginx({a, b});
  ASSERT_NE(nginx, nullptr);

  ASSERT_OK_AND_ASSIGN(v1::HealthReply health, Client(nginx->address(), 0)->Health());
  EXPECT_EQ(health.status(), v1::HealthReply::SERVING);

  // Round robin: four devices registered through nginx land on both backends.
  for (int d = 0; d < 4; ++d) {
    ASSERT_OK_AND_ASSIGN(v1::RegisterReply reply,
                         Client(nginx->address(), d)->Register(v1::RegisterRequest()));
    EXPECT_EQ(reply.next_uplink_sequence(), 1u) << "dev-" << d;
  }
  const uint32_t on_a = RegisteredOn(a);
  const uint32_t on_b = RegisteredOn(b);
  EXPECT_GT(on_a, 0u) << "nginx sent no call to backend a";
  EXPECT_GT(on_b, 0u) << "nginx sent no call to backend b";
  EXPECT_EQ(on_a + on_b, 4u);

  // The backend, not nginx, judges the token, and its status comes back as it was.
  absl::StatusOr<v1::RegisterReply> stranger =
      Client(nginx->address(), 0, "not-the-token-of-dev-0")->Register(v1::RegisterRequest());
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kUnauthenticated) << stranger.status();

  // One Uplink stream of 3 MiB, three times nginx's default limit on a request body.
  std::vector<v1::UplinkBatch> batches;
  for (uint64_t seq = 1; seq <= 12; ++seq) batches.push_back(MakeBatch(0, seq, 256 << 10));
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack, Client(nginx->address(), 0)->Uplink(batches));
  EXPECT_EQ(ack.highest_durable_sequence(), 12u) << ack.DebugString();
}

TEST_F(NginxProxyTest, CallsGoOnThroughTheOtherBackendAfterAKill) {
  const std::string a = StartBackend("a");
  const std::string b = StartBackend("b");
  ASSERT_FALSE(a.empty() || b.empty());
  std::unique_ptr<NginxServer> nginx = StartNginx({a, b});
  ASSERT_NE(nginx, nullptr);
  // Calls on both backends first, so nginx holds kept-alive connections to each.
  for (int i = 0; i < 4; ++i) ASSERT_OK(Client(nginx->address(), 0)->Health().status());

  backends_[0]->Kill();
  // Every call succeeds at its first attempt: nginx moves a call whose connection to the
  // dead backend failed on to the live one.
  for (int d = 0; d < kDevices; ++d) {
    absl::StatusOr<v1::RegisterReply> reply =
        Client(nginx->address(), d)->Register(v1::RegisterRequest());
    EXPECT_TRUE(reply.ok()) << "dev-" << d << " after the kill: " << reply.status();
    EXPECT_OK(Client(nginx->address(), d)->Health().status()) << "dev-" << d;
  }
  EXPECT_EQ(RegisteredOn(b), static_cast<uint32_t>(kDevices));

  // With no backend left, the device sees UNAVAILABLE (nginx's 502), the code it backs off
  // and retries on.
  backends_[1]->Kill();
  absl::StatusOr<v1::HealthReply> none = Client(nginx->address(), 0)->Health();
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();

  // A new backend put in by a reload serves the same address. A connection an old worker
  // still holds answers from the old backends (502, UNAVAILABLE) until that worker closes
  // it, so this call retries as devices do.
  const std::string c = StartBackend("c");
  ASSERT_FALSE(c.empty());
  ASSERT_OK(nginx->Reload({c}));
  absl::StatusOr<v1::RegisterReply> reply =
      Client(nginx->address(), 3, "", /*max_attempts=*/6)->Register(v1::RegisterRequest());
  ASSERT_TRUE(reply.ok()) << reply.status() << "\nnginx's access log:\n"
                          << ReadText(nginx->access_log_path());
  EXPECT_EQ(reply->next_uplink_sequence(), 1u);
  EXPECT_EQ(RegisteredOn(c), 1u);
}

TEST_F(NginxProxyTest, RefusedReloadKeepsTheRunningConfiguration) {
  const std::string a = StartBackend("a");
  ASSERT_FALSE(a.empty());
  std::unique_ptr<NginxServer> nginx = StartNginx({a});
  ASSERT_NE(nginx, nullptr);
  EXPECT_EQ(nginx->Reload({"not an address"}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(nginx->Reload({}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_OK(Client(nginx->address(), 1)->Health().status());
  EXPECT_TRUE(nginx->running());
}

}  // namespace
}  // namespace cdcca
