#include "sim/link_emulator.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::sim {
namespace {

// A one-connection TCP server on loopback that reads `expect` bytes, then answers with
// `reply` bytes and closes.
class OneShotServer {
 public:
  OneShotServer(size_t expect, size_t reply) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd_, 1), 0);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this, expect, reply] {
      const int c = ::accept(fd_, nullptr, nullptr);
      std::string buf(64 * 1024, '\0');
      size_t got = 0;
      while (got < expect) {
        const ssize_t r = ::recv(c, buf.data(), buf.size(), 0);
        if (r <= 0) break;
        got += static_cast<size_t>(r);
      }
      received_ = got;
      std::string out(reply, 'r');
      size_t sent = 0;
      while (sent < out.size()) {
        const ssize_t w = ::send(c, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
        if (w <= 0) break;
        sent += static_cast<size_t>(w);
      }
      ::close(c);
    });
  }
  ~OneShotServer() {
    thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }
  size_t received() const { return received_; }

 private:
  int fd_ = -1;
  int port_ = 0;
  size_t received_ = 0;
  std::thread thread_;
};

// Sends `send` bytes through the proxy at `port`, reads until EOF; returns (bytes read,
// seconds from the first byte sent to EOF).
std::pair<size_t, double> Exchange(int port, size_t send) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const auto start = std::chrono::steady_clock::now();
  std::string out(send, 's');
  size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t w = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (w <= 0) break;
    sent += static_cast<size_t>(w);
  }
  std::string buf(64 * 1024, '\0');
  size_t got = 0;
  while (true) {
    const ssize_t r = ::recv(fd, buf.data(), buf.size(), 0);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  return {got, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

TEST(LinkEmulatorTest, ForwardsEveryByteAndCountsThem) {
  OneShotServer server(300000, 120000);
  LinkOptions o;
  o.up_bytes_per_s = 0;
  o.down_bytes_per_s = 0;
  o.latency = absl::ZeroDuration();
  ASSERT_OK_AND_ASSIGN(auto link, LinkEmulator::Start(o, server.port()));
  auto [got, seconds] = Exchange(link->port(), 300000);
  EXPECT_EQ(got, 120000u);
  LinkStats s = link->Stats();
  EXPECT_EQ(s.bytes_up, 300000u);
  EXPECT_EQ(s.bytes_down, 120000u);
  EXPECT_EQ(s.connections, 1u);
  EXPECT_EQ(s.segments_lost, 0u);
}

TEST(LinkEmulatorTest, BandwidthAndLatencyDelayTheBytes) {
  // 400 kB up at 2 MB/s takes at least 0.2 s, plus 2 x 50 ms of latency for the reply.
  OneShotServer server(400000, 1000);
  LinkOptions o;
  o.up_bytes_per_s = 2e6;
  o.down_bytes_per_s = 0;
  o.latency = absl::Milliseconds(50);
  ASSERT_OK_AND_ASSIGN(auto link, LinkEmulator::Start(o, server.port()));
  auto [got, seconds] = Exchange(link->port(), 400000);
  EXPECT_EQ(got, 1000u);
  EXPECT_GE(seconds, 0.2 + 0.1);
  EXPECT_EQ(server.received(), 400000u);
  EXPECT_GE(absl::ToDoubleSeconds(link->IdealTransferTime(400000, true)), 0.25);
}

TEST(LinkEmulatorTest, LostSegmentsCostARetransmissionTimeout) {
  OneShotServer server(100000, 10);
  LinkOptions o;
  o.up_bytes_per_s = 0;
  o.down_bytes_per_s = 0;
  o.latency = absl::ZeroDuration();
  o.loss = 0.2;
  o.rto = absl::Milliseconds(20);
  o.seed = 3;
  ASSERT_OK_AND_ASSIGN(auto link, LinkEmulator::Start(o, server.port()));
  auto [got, seconds] = Exchange(link->port(), 100000);
  EXPECT_EQ(got, 10u);
  const uint64_t lost = link->Stats().segments_lost;
  EXPECT_GT(lost, 0u);  // ~69 segments at 20%: P(no loss) < 1e-6
  // Delivery is in order, so losses on one pipe add up.
  EXPECT_GE(seconds, 0.02);
}

TEST(LinkEmulatorTest, RejectsBadOptions) {
  LinkOptions o;
  o.loss = 1.0;
  EXPECT_THAT(LinkEmulator::Start(o, 1).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  o.loss = 0;
  o.up_bytes_per_s = -1;
  EXPECT_THAT(LinkEmulator::Start(o, 1).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace cdcca::sim
