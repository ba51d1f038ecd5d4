// Walks an injected file fault over every step of an operation, as SQLite's test VFS does:
// for n = 1, 2, 3, ... a fresh FaultInjectionEnv is set up, the fault is armed at its n-th
// call, the operation runs (its stores opened on the env and destroyed when it returns),
// the env restarts, and `check` opens the stores again and asserts what they promise. The
// walk ends with the first n at which the operation completes with no fault hit (then
// `check` runs once more on the complete result).
//
// After a one-shot fault (EIO, ENOSPC, short write) `check` runs twice: after a restart
// that keeps what was written (a crash), and again after a power loss on top of it, which
// drops whatever the failed call left unsynced: a store that acked on the strength of a
// failed sync loses the ack there.
#ifndef CDCCA_TESTS_TESTING_FAULT_WALK_H_
#define CDCCA_TESTS_TESTING_FAULT_WALK_H_

#include <cstdint>
#include <functional>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "storage/fault_injection_env.h"

namespace cdcca::testing {

inline constexpr storage::Fault kAllFaults[] = {storage::Fault::kEio, storage::Fault::kEnospc,
                                                storage::Fault::kShortWrite,
                                                storage::Fault::kPowerLoss, storage::Fault::kCrash};

// Returns the number of steps walked (the operation's counted calls for `fault`), or 0 if
// a fatal failure stopped the walk. `max_steps` bounds a walk that never ends.
inline uint64_t WalkFault(storage::Fault fault,
                          const std::function<void(storage::FaultInjectionEnv&)>& setup,
                          const std::function<void(storage::FaultInjectionEnv&)>& operation,
                          const std::function<void(storage::FaultInjectionEnv&)>& check,
                          uint64_t max_steps = 2000) {
  const bool one_shot = fault == storage::Fault::kEio || fault == storage::Fault::kEnospc ||
                        fault == storage::Fault::kShortWrite;
  for (uint64_t n = 1; n <= max_steps; ++n) {
    SCOPED_TRACE(absl::StrCat(storage::FaultName(fault), " at step ", n));
    storage::FaultInjectionEnv env;
    setup(env);
    if (::testing::Test::HasFatalFailure()) return 0;
    env.Arm(fault, n);
    operation(env);
    if (::testing::Test::HasFatalFailure()) return 0;
    const bool hit = env.fault_hit();
    env.Restart();
    {
      SCOPED_TRACE(hit ? "after the restart" : "completed with no fault");
      check(env);
    }
    if (::testing::Test::HasFatalFailure()) return 0;
    if (hit && one_shot) {
      SCOPED_TRACE("after a power loss that followed the fault");
      env.CutPower();
      env.Restart();
      check(env);
      if (::testing::Test::HasFatalFailure()) return 0;
    }
    if (!hit) return n - 1;
  }
  ADD_FAILURE() << storage::FaultName(fault) << ": the operation still hits the fault after "
                << max_steps << " steps";
  return 0;
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_FAULT_WALK_H_
