// LinkEmulator: an emulated network link between one device and the cloud, as a TCP proxy
// on loopback. The device's gRPC channel connects to port(); every byte it exchanges with
// the cloud crosses the proxy, which delays it as a link of the configured bandwidth,
// one-way latency and segment loss would:
//
//   - each direction is a serial link: a chunk of n bytes occupies it for n / bandwidth
//     seconds after the previous chunk left;
//   - it arrives `latency` after it finished transmitting (chunks pipeline: latency does
//     not cut throughput);
//   - each 1,460-byte segment is lost with probability `loss`; a lost segment costs one
//     retransmission timeout (`rto`) before it arrives, as TCP would recover it. Delivery
//     stays in order, so a loss delays what follows, like head-of-line blocking.
//
// Stats count the bytes each way and the time the link was busy, so the harness can report
// real transfer sizes and latencies. Deterministic delays given the seed and the chunking
// of the traffic (which the kernel decides, so not bit-for-bit reproducible).
//
// Thread-safe. Each accepted connection runs four threads (read and deliver, each way).
#ifndef CDCCA_SIM_LINK_EMULATOR_H_
#define CDCCA_SIM_LINK_EMULATOR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace cdcca::sim {

struct LinkOptions {
  // Bytes per second each way; 0 = unlimited. Defaults: 2.5 MB/s up, 12.5 MB/s down
  // (20 / 100 Mbit/s, a typical LTE link).
  double up_bytes_per_s = 2.5e6;
  double down_bytes_per_s = 12.5e6;
  absl::Duration latency = absl::Milliseconds(20);  // one way
  double loss = 0.0;                                // per 1,460-byte segment, [0, 1)
  absl::Duration rto = absl::Milliseconds(200);
  uint64_t seed = 1;
};

struct LinkStats {
  uint64_t bytes_up = 0;    // device -> cloud
  uint64_t bytes_down = 0;  // cloud -> device
  uint64_t segments_lost = 0;
  uint64_t connections = 0;
};

class LinkEmulator {
 public:
  // Listens on 127.0.0.1 (an ephemeral port) and forwards to `target_port` on 127.0.0.1.
  // INVALID_ARGUMENT for a negative rate or a loss outside [0, 1); INTERNAL on socket errors.
  static absl::StatusOr<std::unique_ptr<LinkEmulator>> Start(const LinkOptions& options,
                                                             int target_port);
  // Closes the listener and every connection, and joins their threads.
  ~LinkEmulator();

  int port() const;
  LinkStats Stats() const;

  // Transfer time an n-byte message needs on this link, without loss: the figure the
  // harness reports next to the measured one.
  absl::Duration IdealTransferTime(uint64_t bytes, bool up) const;

  struct Impl;

 private:
  explicit LinkEmulator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_LINK_EMULATOR_H_
