// nginx as the one address in front of several real cdcca-cloud processes
// (configs/nginx/grpc_proxy.conf.in, the configuration scripts/cluster.sh runs): calls reach
// every backend with their bearer token, a long Uplink stream passes whole, and once a
// backend is killed (SIGKILL) calls go on through the others without the device retrying.
// The backends run in the embedded mode, each with its own data directory, so this checks
// the transport through nginx, not a shared store.
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "device/cloud_client.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "proto/cdcca.grpc.pb.h"
#include "proto/wire.h"
#include "tests/testing/child_process.h"
#include "tests/testing/free_port.h"
#include "tests/testing/nginx_server.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_pki.h"
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
  CloudProcess(const std::string& data_dir, const std::string& tokens,
               const std::vector<std::string>& extra = {})
      : log_(data_dir + ".log"), port_file_(data_dir + ".port") {
    std::filesystem::create_directories(data_dir);
    std::vector<std::string> args = {CDCCA_CLOUD_BINARY,     "--data_dir=" + data_dir,
                                     "--tokens=" + tokens,   "--insecure",
                                     "--listen=127.0.0.1:0", "--port_file=" + port_file_};
    args.insert(args.end(), extra.begin(), extra.end());
    child_ = std::make_unique<Child>(args, log_);
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
  std::string StartBackend(const std::string& name, const std::vector<std::string>& extra = {}) {
    backends_.push_back(
        std::make_unique<CloudProcess>(dir_.file(name), dir_.file("tokens"), extra));
    const std::string address = backends_.back()->WaitForAddress();
    EXPECT_NE(address, "") << name << " did not start: " << backends_.back()->log();
    return address;
  }

  // A client of `target` as device `device`. One attempt per call unless told: a call that
  // fails is not hidden by the client's own retries.
  std::unique_ptr<device::CloudClient> Client(const std::string& target, int device,
                                              const std::string& token = "", int max_attempts = 1) {
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

// Mutual TLS ending at nginx: nginx verifies the device's certificate and passes it on in
// X-Client-Cert; the front (--proxy_client_cert_header) binds it to the token's device as it
// binds a certificate of its own TLS session, so a token still needs its device's key.
TEST_F(NginxProxyTest, MutualTlsEndsAtNginxAndTheCertificateStillBindsTheDevice) {
  // A PKI nginx's unprivileged user can read (the keys are throwaway, made by this test).
  const std::string pki_dir = dir_.file("pki");
  std::filesystem::create_directories(pki_dir);
  testing::TestPki pki;
  ASSERT_TRUE(testing::GenerateTestPki(pki_dir, &pki));
  ASSERT_TRUE(testing::IssueClientCert(pki_dir, "dev1", "dev-1"));
  for (const std::string& p : {dir_.path(), pki_dir}) {
    std::filesystem::permissions(p, std::filesystem::perms(0755));
  }
  for (const auto& f : std::filesystem::directory_iterator(pki_dir)) {
    std::filesystem::permissions(f.path(), std::filesystem::perms(0644));
  }
  const std::string front = StartBackend("a", {"--proxy_client_cert_header=x-client-cert"});
  ASSERT_FALSE(front.empty());
  NginxProxyOptions options;
  options.backends = {front};
  options.tls_cert = pki.server_cert;
  options.tls_key = pki.server_key;
  options.client_ca = pki.ca_cert;
  absl::StatusOr<std::unique_ptr<NginxServer>> nginx = NginxServer::Start(options);
  ASSERT_OK(nginx.status());

  const auto client = [&](int device, const std::string& cert, const std::string& key) {
    device::CloudClientOptions o;
    o.target = absl::StrCat("localhost:", (*nginx)->port());
    o.device_id = absl::StrCat("dev-", device);
    o.token = tokens_[device];
    o.max_attempts = 1;
    o.call_timeout = absl::Seconds(10);
    o.tls.root_ca_path = pki.ca_cert;
    o.tls.cert_chain_path = cert;
    o.tls.private_key_path = key;
    return std::move(device::CloudClient::Create(o)).value();
  };
  const std::string dev1_cert = pki_dir + "/dev1.pem", dev1_key = pki_dir + "/dev1.key";
  // Each device with its own certificate and token.
  EXPECT_OK(client(0, pki.client_cert, pki.client_key)->Register(v1::RegisterRequest()).status());
  EXPECT_OK(client(1, dev1_cert, dev1_key)->Register(v1::RegisterRequest()).status());
  // dev-1's token carried by dev-0's key: refused by the front.
  absl::StatusOr<v1::RegisterReply> borrowed =
      client(1, pki.client_cert, pki.client_key)->Register(v1::RegisterRequest());
  EXPECT_EQ(borrowed.status().code(), absl::StatusCode::kPermissionDenied) << borrowed.status();
  // A client cannot bring a certificate of its own choosing in the header: nginx replaces
  // it with the one it verified (dev-0's here), so dev-1's token stays refused.
  {
    const auto pem = [](const std::string& path) { return ReadText(path); };
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = pem(pki.ca_cert);
    ssl.pem_cert_chain = pem(pki.client_cert);
    ssl.pem_private_key = pem(pki.client_key);
    std::unique_ptr<v1::Cloud::Stub> stub = v1::Cloud::NewStub(grpc::CreateChannel(
        absl::StrCat("localhost:", (*nginx)->port()), grpc::SslCredentials(ssl)));
    std::string forged;
    for (unsigned char c : pem(dev1_cert)) absl::StrAppend(&forged, absl::StrFormat("%%%02X", c));
    grpc::ClientContext ctx;
    ctx.AddMetadata(wire::kAuthMetadataKey, absl::StrCat(wire::kBearerPrefix, tokens_[1]));
    ctx.AddMetadata("x-client-cert", forged);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::RegisterRequest request;
    request.set_device_id("dev-1");
    v1::RegisterReply reply;
    const grpc::Status forged_call = stub->Register(&ctx, request, &reply);
    EXPECT_EQ(forged_call.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << forged_call.error_message();
  }
  // No certificate: nginx ends the handshake; nothing reaches the front.
  EXPECT_FALSE(client(0, "", "")->Register(v1::RegisterRequest()).ok());
  // A front behind the proxy refuses a call that brings no certificate through it.
  absl::StatusOr<v1::RegisterReply> direct = Client(front, 0)->Register(v1::RegisterRequest());
  EXPECT_EQ(direct.status().code(), absl::StatusCode::kUnauthenticated) << direct.status();
}

// A FetchUpdate through nginx to a front that is gone, as the fleet's devices make while a
// front restarts: counts how it ended, and when.
struct DeadFrontCall : grpc::ClientReadReactor<v1::PayloadChunk> {
  grpc::ClientContext ctx;
  v1::FetchUpdateRequest request;
  v1::PayloadChunk chunk;
  std::atomic<int>* done = nullptr;
  grpc::Status status;
  absl::Time started;
  absl::Time ended;
  std::atomic<bool> finished{false};
  void OnReadDone(bool ok) override {
    if (ok) StartRead(&chunk);
  }
  void OnDone(const grpc::Status& s) override {
    status = s;
    ended = absl::Now();
    finished = true;
    done->fetch_add(1);
  }
};

// nginx answers a call it cannot pass on (no front listening) in gRPC: every call ends by
// its deadline, UNAVAILABLE. (An HTML error page, nginx's default, left gRPC 1.51's client
// with about one call in a thousand that never ended: neither its deadline nor a cancel
// finished it.)
TEST_F(NginxProxyTest, CallsToAFrontThatIsGoneEndUnavailableByTheirDeadline) {
  ASSERT_OK_AND_ASSIGN(int dead_port, testing::FreeLoopbackPort());
  std::unique_ptr<NginxServer> nginx = StartNginx({absl::StrCat("127.0.0.1:", dead_port)});
  ASSERT_NE(nginx, nullptr);
  constexpr int kChannels = 16, kCalls = 3000;
  const absl::Duration deadline = absl::Seconds(2);
  std::vector<std::unique_ptr<v1::Cloud::Stub>> stubs;
  for (int c = 0; c < kChannels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stubs.push_back(v1::Cloud::NewStub(
        grpc::CreateCustomChannel(nginx->address(), grpc::InsecureChannelCredentials(), args)));
  }
  std::atomic<int> done{0};
  std::vector<std::unique_ptr<DeadFrontCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    auto call = std::make_unique<DeadFrontCall>();
    call->done = &done;
    call->request.set_device_id("dev-0");
    call->ctx.AddMetadata(wire::kAuthMetadataKey, std::string(wire::kBearerPrefix) + tokens_[0]);
    call->started = absl::Now();
    call->ctx.set_deadline(absl::ToChronoTime(call->started + deadline));
    stubs[i % kChannels]->async()->FetchUpdate(&call->ctx, &call->request, call.get());
    call->StartRead(&call->chunk);
    call->StartCall();
    calls.push_back(std::move(call));
    // About 500 calls a second, as the fleet's devices make them.
    if (i % 50 == 49) absl::SleepFor(absl::Milliseconds(100));
  }
  WaitUntil([&] { return done.load() == kCalls; }, deadline + absl::Seconds(20));
  int open = 0, late = 0, not_unavailable = 0;
  std::string example;
  for (const auto& call : calls) {
    if (!call->finished) {
      ++open;
      continue;
    }
    if (call->ended - call->started > deadline + absl::Seconds(2)) ++late;
    // The status nginx's error page gives, not gRPC's reading of an HTTP 502.
    if (call->status.error_code() != grpc::StatusCode::UNAVAILABLE ||
        call->status.error_message().find("no cloud front answered") == std::string::npos) {
      ++not_unavailable;
      example = absl::StrCat(call->status.error_code(), " ", call->status.error_message());
    }
  }
  EXPECT_EQ(open, 0) << "calls never ended";
  EXPECT_EQ(late, 0) << "calls ended well past their deadline";
  EXPECT_EQ(not_unavailable, 0) << "e.g. " << example;
  if (open > 0) {
    // Their reactors may still be called: leave them be.
    for (auto& call : calls) {
      if (!call->finished) (void)call.release();
    }
  }
}

}  // namespace
}  // namespace cdcca
