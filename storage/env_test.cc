// The POSIX Env and the helpers over any Env, on a real temporary directory.
#include "storage/env.h"

#include <algorithm>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::storage {
namespace {

using ::cdcca::testing::IsOkAndHolds;
using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;
using ::testing::UnorderedElementsAre;

TEST(PosixEnvTest, AppendSyncReadRenameRemoveAndList) {
  TempDir dir;
  Env& env = *Env::Default();
  const std::string sub = dir.path() + "/a/b";
  ASSERT_OK(env.CreateDirs(sub));
  ASSERT_OK(env.CreateDirs(sub));  // exists: fine
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> f, env.OpenForAppend(sub + "/x", false));
    ASSERT_OK(f->Append("hello "));
    ASSERT_OK(f->Append("world"));
    ASSERT_OK(f->Sync());
    EXPECT_EQ(f->Size(), 11u);
  }
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<WritableFile> f, env.OpenForAppend(sub + "/x", false));
    EXPECT_EQ(f->Size(), 11u);  // reopened for appending, not emptied
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> r, env.OpenForRead(sub + "/x"));
  char buf[5];
  ASSERT_OK(r->Read(6, 5, buf));
  EXPECT_EQ(std::string(buf, 5), "world");
  EXPECT_THAT(r->Read(8, 5, buf), StatusIs(absl::StatusCode::kDataLoss));
  ASSERT_OK(env.Truncate(sub + "/x", 5));
  EXPECT_THAT(ReadFile(env, sub + "/x"), IsOkAndHolds(std::string("hello")));

  ASSERT_OK(env.Rename(sub + "/x", sub + "/y"));
  ASSERT_OK(env.SyncDir(sub));
  ASSERT_OK(env.CreateDirs(sub + "/c"));
  EXPECT_THAT(env.ListFiles(sub), IsOkAndHolds(UnorderedElementsAre("y")));
  EXPECT_THAT(env.ListDirs(sub), IsOkAndHolds(UnorderedElementsAre("c")));
  EXPECT_THAT(env.OpenForRead(sub + "/x"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(env.Remove(sub + "/x"), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(RemoveDurably(env, sub + "/y"));
  ASSERT_OK(RemoveDurably(env, sub + "/y"));  // already gone: fine
  EXPECT_THAT(env.ListFiles(dir.path() + "/none"), StatusIs(absl::StatusCode::kNotFound));
}

TEST(PosixEnvTest, WriteFileAtomicallyReplacesTheFileAndLeavesNoTempFile) {
  TempDir dir;
  Env& env = *Env::Default();
  ASSERT_OK(WriteFileAtomically(env, dir.file("f"), "one"));
  ASSERT_OK(WriteFileAtomically(env, dir.file("f"), "two, longer"));
  EXPECT_THAT(ReadFile(env, dir.file("f")), IsOkAndHolds(std::string("two, longer")));
  EXPECT_THAT(env.ListFiles(dir.path()), IsOkAndHolds(UnorderedElementsAre("f")));
  // A directory that is gone: the error names the path, and nothing is left behind.
  EXPECT_THAT(WriteFileAtomically(env, dir.path() + "/gone/f", "x"),
              StatusIs(absl::StatusCode::kNotFound, ::testing::HasSubstr("/gone/f.tmp")));
}

TEST(PosixEnvTest, ReadFileOfAPipeIsRefusedNotEmpty) {
  EXPECT_THAT(ReadFile(*Env::Default(), "/dev/null"),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("/dev/null")));
}

TEST(PosixEnvTest, DirNameOfPaths) {
  EXPECT_EQ(DirName("/a/b"), "/a");
  EXPECT_EQ(DirName("/a"), "/");
  EXPECT_EQ(DirName("a"), ".");
}

}  // namespace
}  // namespace cdcca::storage
