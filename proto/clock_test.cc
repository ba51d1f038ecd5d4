// The virtual clock stands still until advanced, wakes waiters when their virtual deadline
// passes or their condition holds; the real clock follows absl::Now.
#include "proto/clock.h"

#include <thread>

#include "gtest/gtest.h"

namespace cdcca {
namespace {

TEST(VirtualClockTest, StandsStillUntilAdvanced) {
  VirtualClock clock(absl::FromUnixSeconds(100));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100));
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(100));
  clock.Advance(absl::Seconds(60));
  clock.Advance(-absl::Seconds(5));  // ignored: time never goes back
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(160));
  clock.AdvanceTo(absl::FromUnixSeconds(150));  // earlier: ignored
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(160));
  clock.AdvanceTo(absl::FromUnixSeconds(200));
  EXPECT_EQ(clock.Now(), absl::FromUnixSeconds(200));
}

TEST(VirtualClockTest, AwaitEndsAtTheVirtualDeadlineOrWhenTheConditionHolds) {
  VirtualClock clock(absl::FromUnixSeconds(0));
  absl::Mutex mu;
  bool flag = false;
  bool result = true;
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    result = clock.AwaitWithDeadline(&mu, absl::Condition(&flag), absl::FromUnixSeconds(30));
  });
  absl::SleepFor(absl::Milliseconds(30));  // real time does not end the wait
  clock.Advance(absl::Seconds(29));
  absl::SleepFor(absl::Milliseconds(30));
  clock.Advance(absl::Seconds(1));  // now the virtual deadline is reached
  waiter.join();
  EXPECT_FALSE(result);

  std::thread second([&] {
    absl::MutexLock lock(&mu);
    result = clock.AwaitWithTimeout(&mu, absl::Condition(&flag), absl::Hours(1));
  });
  {
    absl::MutexLock lock(&mu);
    flag = true;
  }
  second.join();
  EXPECT_TRUE(result);
}

TEST(RealClockTest, FollowsAbslNow) {
  const absl::Time before = absl::Now();
  EXPECT_GE(Clock::Real()->Now(), before);
  absl::Mutex mu;
  bool never = false;
  absl::MutexLock lock(&mu);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(
      Clock::Real()->AwaitWithTimeout(&mu, absl::Condition(&never), absl::Milliseconds(20)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(19));
}

}  // namespace
}  // namespace cdcca
