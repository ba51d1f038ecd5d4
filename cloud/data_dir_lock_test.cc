#include "cloud/data_dir_lock.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::cloud {
namespace {

using ::testing::HasSubstr;

TEST(DataDirLockTest, SecondHolderRefusedUntilTheFirstReleases) {
  cdcca::testing::TempDir dir;
  const std::string data_dir = dir.path() + "/data/nested";  // created by Acquire
  {
    auto first = DataDirLock::Acquire(data_dir);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_TRUE(std::filesystem::exists(data_dir + "/LOCK"));
    // flock conflicts between open file descriptions, in one process as across two.
    auto second = DataDirLock::Acquire(data_dir);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(second.status().message(), HasSubstr(data_dir));
    EXPECT_THAT(second.status().message(), HasSubstr(absl::StrCat("pid ", ::getpid())));

    DataDirLock moved = *std::move(first);  // a moved-from lock releases nothing
    EXPECT_FALSE(DataDirLock::Acquire(data_dir).ok());
  }
  // Released with its holder; the LOCK file left behind does not block the next one.
  auto again = DataDirLock::Acquire(data_dir);
  EXPECT_TRUE(again.ok()) << again.status();
}

}  // namespace
}  // namespace cdcca::cloud
