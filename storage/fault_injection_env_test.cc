// The fault env's model of a disk (what survives a crash and a power loss), its faults, and
// the walk of every fault over WriteFileAtomically.
#include "storage/fault_injection_env.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fault_walk.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::storage {
namespace {

using ::cdcca::testing::IsOkAndHolds;
using ::cdcca::testing::StatusIs;
using ::testing::UnorderedElementsAre;

void Put(Env& env, const std::string& path, absl::string_view data, bool sync) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> f, env.OpenForAppend(path, false));
  ASSERT_OK(f->Append(data));
  if (sync) {
    ASSERT_OK(f->Sync());
  }
}

TEST(FaultInjectionEnvTest, PowerLossKeepsOnlySyncedBytesAndSyncedEntries) {
  FaultInjectionEnv env;
  ASSERT_OK(env.CreateDirs("/d"));
  Put(env, "/d/synced", "abc", true);
  ASSERT_OK(env.SyncDir("/d"));
  Put(env, "/d/synced", "def", false);               // appended, never synced
  Put(env, "/d/unlisted", "xyz", true);              // synced, but its entry never was
  ASSERT_OK(env.Rename("/d/synced", "/d/renamed"));  // rename never synced
  env.CutPower();
  EXPECT_THAT(env.ListFiles("/d"), StatusIs(absl::StatusCode::kAborted));
  env.Restart();
  EXPECT_THAT(env.ListFiles("/d"), IsOkAndHolds(UnorderedElementsAre("synced")));
  EXPECT_THAT(ReadFile(env, "/d/synced"), IsOkAndHolds(std::string("abc")));
}

TEST(FaultInjectionEnvTest, SyncedRenameAndRemoveSurvivePowerLoss) {
  FaultInjectionEnv env;
  ASSERT_OK(env.CreateDirs("/d"));
  Put(env, "/d/a", "1", true);
  Put(env, "/d/b", "2", true);
  ASSERT_OK(env.SyncDir("/d"));
  ASSERT_OK(env.Rename("/d/a", "/d/b"));
  ASSERT_OK(env.SyncDir("/d"));
  env.CutPower();
  env.Restart();
  EXPECT_THAT(env.ListFiles("/d"), IsOkAndHolds(UnorderedElementsAre("b")));
  EXPECT_THAT(ReadFile(env, "/d/b"), IsOkAndHolds(std::string("1")));
}

TEST(FaultInjectionEnvTest, CrashKeepsEverythingWritten) {
  FaultInjectionEnv env;
  ASSERT_OK(env.CreateDirs("/d"));
  Put(env, "/d/a", "unsynced", false);
  env.Arm(Fault::kCrash, 1);
  EXPECT_THAT(env.Remove("/d/a"), StatusIs(absl::StatusCode::kAborted));
  EXPECT_TRUE(env.fault_hit());
  EXPECT_THAT(ReadFile(env, "/d/a"), StatusIs(absl::StatusCode::kAborted));  // dead
  env.Restart();
  EXPECT_THAT(ReadFile(env, "/d/a"), IsOkAndHolds(std::string("unsynced")));
}

TEST(FaultInjectionEnvTest, OneShotFaultsHitTheNthCountedCallOnce) {
  FaultInjectionEnv env;
  ASSERT_OK(env.CreateDirs("/d"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> f, env.OpenForAppend("/d/f", false));
  env.Arm(Fault::kShortWrite, 2);
  ASSERT_OK(f->Append("1234"));
  EXPECT_FALSE(env.fault_hit());
  ASSERT_OK(f->Sync());  // not an append: not counted
  EXPECT_THAT(f->Append("abcdef"), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(env.fault_hit());
  EXPECT_THAT(ReadFile(env, "/d/f"), IsOkAndHolds(std::string("1234abc")));  // half of it
  ASSERT_OK(f->Append("!"));                                                 // one shot
  env.Arm(Fault::kEnospc, 1);
  EXPECT_THAT(env.ListFiles("/d"), IsOkAndHolds(UnorderedElementsAre("f")));  // not counted
  EXPECT_THAT(env.Rename("/d/f", "/d/g"), StatusIs(absl::StatusCode::kResourceExhausted));
  env.Arm(Fault::kEio, 1);
  EXPECT_THAT(ReadFile(env, "/d/f"), StatusIs(absl::StatusCode::kInternal));
}

TEST(FaultInjectionEnvTest, FailedSyncLosesTheUnsyncedBytes) {
  FaultInjectionEnv env;
  ASSERT_OK(env.CreateDirs("/d"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> f, env.OpenForAppend("/d/f", false));
  ASSERT_OK(f->Append("kept"));
  ASSERT_OK(f->Sync());
  ASSERT_OK(f->Append("lost"));
  env.Arm(Fault::kEio, 1);
  EXPECT_THAT(f->Sync(), StatusIs(absl::StatusCode::kInternal));
  ASSERT_OK(f->Sync());
  EXPECT_THAT(ReadFile(env, "/d/f"), IsOkAndHolds(std::string("kept")));
}

TEST(FaultInjectionEnvTest, FileObjectsFromBeforeARestartFail) {
  FaultInjectionEnv env;
  ASSERT_OK(env.CreateDirs("/d"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> f, env.OpenForAppend("/d/f", false));
  env.Restart();
  EXPECT_THAT(f->Append("x"), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// WriteFileAtomically under every fault at every step: after the restart the file holds the
// old contents or the new ones, never a mix, and the new ones whenever the call said OK.
TEST(FaultInjectionEnvTest, WriteFileAtomicallyLeavesOldOrNewUnderEveryFault) {
  const std::string old_contents = "old contents", new_contents(5000, 'n');
  for (Fault fault : cdcca::testing::kAllFaults) {
    bool acked = false;
    const uint64_t steps = cdcca::testing::WalkFault(
        fault,
        [&](FaultInjectionEnv& env) {
          acked = false;
          ASSERT_OK(env.CreateDirs("/d"));
          ASSERT_OK(WriteFileAtomically(env, "/d/f", old_contents));
        },
        [&](FaultInjectionEnv& env) {
          acked = WriteFileAtomically(env, "/d/f", new_contents).ok();
        },
        [&](FaultInjectionEnv& env) {
          ASSERT_OK_AND_ASSIGN(std::string got, ReadFile(env, "/d/f"));
          if (acked) {
            EXPECT_EQ(got, new_contents);
          } else {
            EXPECT_TRUE(got == old_contents || got == new_contents) << got.substr(0, 32);
          }
        });
    EXPECT_GE(steps, fault == Fault::kShortWrite ? 1u : 5u) << FaultName(fault);
  }
}

}  // namespace
}  // namespace cdcca::storage
