// ExitAtEnv ends the process just before the planned changing call, and nowhere else.
#include "storage/exit_at_env.h"

#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/fault_injection_env.h"

namespace cdcca::storage {
namespace {

using ::testing::HasSubstr;

TEST(ExitAtEnvTest, EndsTheProcessBeforeTheNthChangingCallOnAMatchingPath) {
  FaultInjectionEnv files;
  ASSERT_TRUE(files.CreateDirs("/d").ok());
  absl::StatusOr<std::unique_ptr<ExitAtEnv>> env = ExitAtEnv::Parse(&files, "x.mirror@2");
  ASSERT_TRUE(env.ok()) << env.status();
  // Other paths, reads and the first match go through.
  ASSERT_TRUE(WriteFileAtomically(**env, "/d/other", "a").ok());
  ASSERT_TRUE(ReadFile(**env, "/d/other").ok());
  EXPECT_EXIT(
      {
        // The first write of x.mirror opens "x.mirror.tmp" (match 1) and renames it over
        // x.mirror (match 2): the process ends before the rename.
        (void)WriteFileAtomically(**env, "/d/x.mirror", "state");
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(kPlannedCrashExitCode), HasSubstr("planned_crash"));
  // In this process (the death test ran in a child) nothing was counted: the first match
  // passes, so the temp file is written, and the second one is where a child would end.
  absl::StatusOr<std::unique_ptr<WritableFile>> tmp =
      (*env)->OpenForAppend("/d/x.mirror.tmp", true);
  EXPECT_TRUE(tmp.ok());
  EXPECT_EXIT((void)(*env)->Remove("/d/x.mirror.tmp"),
              ::testing::ExitedWithCode(kPlannedCrashExitCode), HasSubstr("\"before\":\"remove\""));
}

TEST(ExitAtEnvTest, RefusesASpecWithoutPatternOrWithABadCount) {
  FaultInjectionEnv files;
  EXPECT_FALSE(ExitAtEnv::Parse(&files, "").ok());
  EXPECT_FALSE(ExitAtEnv::Parse(&files, "@2").ok());
  EXPECT_FALSE(ExitAtEnv::Parse(&files, "x@0").ok());
  EXPECT_FALSE(ExitAtEnv::Parse(&files, "x@two").ok());
  EXPECT_TRUE(ExitAtEnv::Parse(&files, "x").ok());
}

}  // namespace
}  // namespace cdcca::storage
