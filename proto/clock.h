// Time as the programs' schedulers and loops see it, behind an interface (absl-style) so
// that the harness (sim/) can run the deployed scheduler and sync loops on a deterministic
// virtual clock while `cdcca-cloud` and `cdcca-device` run on the real one.
//
//   Clock::Real()   absl::Now(), and waits that end at a real deadline.
//   VirtualClock    time stands still until Advance(); waits on it end when the virtual
//                   deadline is reached (or their condition holds, as with the real one).
//
// Shared by both ends (JobScheduler, DeviceAgent); torch-free.
#ifndef CDCCA_PROTO_CLOCK_H_
#define CDCCA_PROTO_CLOCK_H_

#include <atomic>
#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace cdcca {

class Clock {
 public:
  virtual ~Clock() = default;
  // The process's real clock (never deleted).
  static Clock* Real();

  virtual absl::Time Now() = 0;
  // With `mu` held: waits until `condition` holds or this clock reaches `deadline`, then
  // returns whether `condition` holds. `mu` is released while waiting, as in
  // absl::Mutex::AwaitWithDeadline.
  virtual bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                                 absl::Time deadline) = 0;
  bool AwaitWithTimeout(absl::Mutex* mu, const absl::Condition& condition, absl::Duration timeout) {
    return AwaitWithDeadline(mu, condition, Now() + timeout);
  }
};

// A clock that moves only when told. Thread-safe. Waiters re-check their condition and the
// virtual time every millisecond of real time, so an Advance() or a condition change wakes
// them within about a millisecond.
class VirtualClock final : public Clock {
 public:
  // Starts at `start` (default: 2025-01-01T00:00:00Z, any fixed point will do).
  explicit VirtualClock(absl::Time start = absl::FromUnixSeconds(1735689600));

  absl::Time Now() override;
  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                         absl::Time deadline) override;
  // Moves time forward by `d` (>= 0; a negative `d` is ignored).
  void Advance(absl::Duration d);
  // Moves time forward to `t` (if it is later than now).
  void AdvanceTo(absl::Time t);

 private:
  std::atomic<int64_t> now_ns_;  // since the Unix epoch
};

}  // namespace cdcca

#endif  // CDCCA_PROTO_CLOCK_H_
