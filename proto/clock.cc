#include "proto/clock.h"

namespace cdcca {
namespace {

class RealClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  bool AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                         absl::Time deadline) override {
    return mu->AwaitWithDeadline(condition, deadline);
  }
};

}  // namespace

Clock* Clock::Real() {
  static Clock* const clock = new RealClock();
  return clock;
}

VirtualClock::VirtualClock(absl::Time start) : now_ns_(absl::ToUnixNanos(start)) {}

absl::Time VirtualClock::Now() {
  return absl::FromUnixNanos(now_ns_.load(std::memory_order_acquire));
}

bool VirtualClock::AwaitWithDeadline(absl::Mutex* mu, const absl::Condition& condition,
                                     absl::Time deadline) {
  while (true) {
    if (mu->AwaitWithTimeout(condition, absl::Milliseconds(1))) return true;
    if (Now() >= deadline) return condition.Eval();
  }
}

void VirtualClock::Advance(absl::Duration d) {
  if (d <= absl::ZeroDuration()) return;
  now_ns_.fetch_add(absl::ToInt64Nanoseconds(d), std::memory_order_acq_rel);
}

void VirtualClock::AdvanceTo(absl::Time t) {
  const int64_t target = absl::ToUnixNanos(t);
  int64_t now = now_ns_.load(std::memory_order_acquire);
  while (now < target && !now_ns_.compare_exchange_weak(now, target, std::memory_order_acq_rel)) {
  }
}

}  // namespace cdcca
