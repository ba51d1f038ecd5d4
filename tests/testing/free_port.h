// A loopback port for a test's server.
#ifndef CDCCA_TESTS_TESTING_FREE_PORT_H_
#define CDCCA_TESTS_TESTING_FREE_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cdcca::testing {

// A port the kernel picks as free on 127.0.0.1. It is free when this returns; a server
// started on it may still lose a race for it, so starters retry with another.
inline absl::StatusOr<int> FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  if (!ok) return absl::InternalError("cannot bind a loopback port");
  return static_cast<int>(ntohs(addr.sin_port));
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_FREE_PORT_H_
