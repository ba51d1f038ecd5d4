#include "sim/link_emulator.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace cdcca::sim {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kSegmentBytes = 1460;
constexpr size_t kReadBytes = 16 * 1024;

absl::Status Errno(const char* what) {
  return absl::InternalError(absl::StrCat("link emulator: ", what, ": ", std::strerror(errno)));
}

Clock::duration ToClock(absl::Duration d) {
  return std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(d));
}

bool WriteAll(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

// One direction of the shared link: when it is next free to transmit.
struct Direction {
  double bytes_per_s = 0;
  Clock::time_point free_at{};
};

struct LinkEmulator::Impl {
  LinkOptions options;
  int listen_fd = -1;
  int target_port = 0;
  int port = 0;
  std::atomic<bool> stopping{false};
  std::thread acceptor;

  std::mutex mu;  // guards everything below
  Direction up, down;
  std::mt19937_64 rng;
  LinkStats stats;
  struct Pipe;
  std::vector<std::unique_ptr<Pipe>> pipes;
  std::vector<int> fds;

  // Schedules n bytes on a direction; returns when they arrive at the far end.
  Clock::time_point Schedule(bool is_up, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    Direction& d = is_up ? up : down;
    const Clock::time_point now = Clock::now();
    Clock::time_point start = std::max(now, d.free_at);
    if (d.bytes_per_s > 0) {
      start += std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(static_cast<double>(n) / d.bytes_per_s));
    }
    d.free_at = start;
    Clock::time_point arrive = start + ToClock(options.latency);
    if (options.loss > 0) {
      std::bernoulli_distribution lost(options.loss);
      const size_t segments = (n + kSegmentBytes - 1) / kSegmentBytes;
      for (size_t i = 0; i < segments; ++i) {
        if (lost(rng)) {
          arrive += ToClock(options.rto);
          ++stats.segments_lost;
        }
      }
    }
    (is_up ? stats.bytes_up : stats.bytes_down) += n;
    return arrive;
  }

  void AcceptLoop();
};

// Bytes read from `src`, delivered to `dst` when the link says they arrive.
struct LinkEmulator::Impl::Pipe {
  Impl* link = nullptr;
  bool is_up = false;
  int src = -1, dst = -1;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<Clock::time_point, std::string>> queue;
  Clock::time_point last_arrival{};
  bool eof = false;
  std::thread reader, writer;

  void Read() {
    std::vector<char> buf(kReadBytes);
    while (true) {
      const ssize_t r = ::recv(src, buf.data(), buf.size(), 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      Clock::time_point at = link->Schedule(is_up, static_cast<size_t>(r));
      std::lock_guard<std::mutex> lock(mu);
      at = std::max(at, last_arrival);  // TCP delivers in order
      last_arrival = at;
      queue.emplace_back(at, std::string(buf.data(), static_cast<size_t>(r)));
      cv.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu);
    eof = true;
    cv.notify_all();
  }

  void Write() {
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      if (queue.empty()) {
        if (eof || link->stopping) break;
        cv.wait(lock);
        continue;
      }
      const Clock::time_point at = queue.front().first;
      if (Clock::now() < at && !link->stopping) {
        cv.wait_until(lock, at);
        continue;
      }
      std::string data = std::move(queue.front().second);
      queue.pop_front();
      lock.unlock();
      const bool ok = link->stopping ? false : WriteAll(dst, data.data(), data.size());
      lock.lock();
      if (!ok) break;
    }
    ::shutdown(dst, SHUT_WR);
    ::shutdown(src, SHUT_RD);  // the reader stops too if the far end went away
  }
};

void LinkEmulator::Impl::AcceptLoop() {
  while (!stopping) {
    pollfd p{listen_fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const int client = ::accept(listen_fd, nullptr, nullptr);
    if (client < 0) continue;
    const int server = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(target_port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      if (server >= 0) ::close(server);
      ::close(client);
      continue;
    }
    const int one = 1;
    ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::setsockopt(server, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::lock_guard<std::mutex> lock(mu);
    ++stats.connections;
    fds.push_back(client);
    fds.push_back(server);
    for (bool is_up : {true, false}) {
      auto pipe = std::make_unique<Pipe>();
      pipe->link = this;
      pipe->is_up = is_up;
      pipe->src = is_up ? client : server;
      pipe->dst = is_up ? server : client;
      Pipe* raw = pipe.get();
      pipe->reader = std::thread([raw] { raw->Read(); });
      pipe->writer = std::thread([raw] { raw->Write(); });
      pipes.push_back(std::move(pipe));
    }
  }
}

LinkEmulator::LinkEmulator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<LinkEmulator>> LinkEmulator::Start(const LinkOptions& options,
                                                                  int target_port) {
  if (options.up_bytes_per_s < 0 || options.down_bytes_per_s < 0) {
    return absl::InvalidArgumentError("link bandwidth must not be negative");
  }
  if (!(options.loss >= 0 && options.loss < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("link loss ", options.loss, " is not in [0, 1)"));
  }
  if (options.latency < absl::ZeroDuration() || options.rto < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("link latency and rto must not be negative");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->target_port = target_port;
  impl->rng.seed(options.seed);
  impl->up.bytes_per_s = options.up_bytes_per_s;
  impl->down.bytes_per_s = options.down_bytes_per_s;
  impl->listen_fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (impl->listen_fd < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(impl->listen_fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(impl->listen_fd, 16) != 0 ||
      ::getsockname(impl->listen_fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    absl::Status s = Errno("listen");
    ::close(impl->listen_fd);
    return s;
  }
  impl->port = ntohs(addr.sin_port);
  Impl* raw = impl.get();
  impl->acceptor = std::thread([raw] { raw->AcceptLoop(); });
  return std::unique_ptr<LinkEmulator>(new LinkEmulator(std::move(impl)));
}

LinkEmulator::~LinkEmulator() {
  impl_->stopping = true;
  impl_->acceptor.join();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    for (int fd : impl_->fds) ::shutdown(fd, SHUT_RDWR);
    for (auto& p : impl_->pipes) {
      std::lock_guard<std::mutex> plock(p->mu);
      p->cv.notify_all();
    }
  }
  for (auto& p : impl_->pipes) {
    p->reader.join();
    p->writer.join();
  }
  for (int fd : impl_->fds) ::close(fd);
  ::close(impl_->listen_fd);
}

int LinkEmulator::port() const { return impl_->port; }

LinkStats LinkEmulator::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

absl::Duration LinkEmulator::IdealTransferTime(uint64_t bytes, bool up) const {
  const double rate = up ? impl_->options.up_bytes_per_s : impl_->options.down_bytes_per_s;
  absl::Duration t = impl_->options.latency;
  if (rate > 0) t += absl::Seconds(static_cast<double>(bytes) / rate);
  return t;
}

}  // namespace cdcca::sim
