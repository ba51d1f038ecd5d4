// Waiting for a condition in tests: polled, with a deadline, never a bare sleep.
#ifndef CDCCA_TESTS_TESTING_WAIT_H_
#define CDCCA_TESTS_TESTING_WAIT_H_

#include <functional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace cdcca::testing {

// Polls `done` every `poll` until it holds or `timeout` passes; returns its last value. A
// test that expects something NOT to happen waits for it with a short timeout and expects
// false.
inline bool WaitUntil(const std::function<bool()>& done, absl::Duration timeout,
                      absl::Duration poll = absl::Milliseconds(20)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(poll);
  }
  return true;
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_WAIT_H_
