#include "cloud/update_store.h"

#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;

std::unique_ptr<UpdateStore> OpenStore(const std::string& dir, size_t keep = 16) {
  auto store = UpdateStore::Open({dir, keep});
  EXPECT_OK(store);
  return store.ok() ? std::move(*store) : nullptr;
}

TEST(UpdateStoreTest, ServesTheChainOfUpdates) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  EXPECT_THAT(store->UpdateAfter("d", 0), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(store->PutUpdate("d", 0, 1, 111, "one"));
  ASSERT_OK(store->PutUpdate("d", 1, 2, 222, "two"));
  ASSERT_OK_AND_ASSIGN(StoredUpdate u, store->UpdateAfter("d", 0));
  EXPECT_EQ(u.new_version, 1u);
  EXPECT_EQ(*u.payload, "one");
  EXPECT_EQ(u.sha256, wire::Sha256("one"));
  ASSERT_OK_AND_ASSIGN(StoredUpdate v, store->UpdateAfter("d", 1));
  EXPECT_EQ(*v.payload, "two");
  EXPECT_EQ(v.state_digest, 222u);
  EXPECT_THAT(store->UpdateAfter("d", 2), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(store->UpdateAfter("d", 7), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(store->LatestVersion("d"), 2u);
  ASSERT_OK_AND_ASSIGN(uint64_t digest, store->DigestOf("d", 2));
  EXPECT_EQ(digest, 222u);
}

TEST(UpdateStoreTest, RefusesVersionsThatDoNotMoveForward) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_OK(store->PutUpdate("d", 0, 2, 1, "x"));
  EXPECT_THAT(store->PutUpdate("d", 1, 2, 1, "y"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(store->PutUpdate("d", 3, 3, 1, "y"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(store->PutUpdate("../evil", 0, 1, 1, "y"),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(UpdateStoreTest, SurvivesReopenAndKeepsOnlyTheNewest) {
  TempDir dir;
  {
    auto store = OpenStore(dir.path(), /*keep=*/3);
    for (uint64_t v = 1; v <= 5; ++v) ASSERT_OK(store->PutUpdate("d", v - 1, v, v * 10, "p"));
    ASSERT_OK(store->PutSnapshot("d", 5, 50, "state-5"));
  }
  auto store = OpenStore(dir.path(), 3);
  EXPECT_EQ(store->LatestVersion("d"), 5u);
  EXPECT_THAT(store->UpdateAfter("d", 0), StatusIs(absl::StatusCode::kFailedPrecondition));
  ASSERT_OK_AND_ASSIGN(StoredUpdate u, store->UpdateAfter("d", 3));
  EXPECT_EQ(u.new_version, 4u);
  ASSERT_OK_AND_ASSIGN(StoredUpdate snap, store->Snapshot("d", 0));
  EXPECT_EQ(*snap.payload, "state-5");
  EXPECT_EQ(snap.state_digest, 50u);
  EXPECT_THAT(store->Snapshot("d", 4), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(store->Snapshot("other", 0), StatusIs(absl::StatusCode::kNotFound));
}

TEST(UpdateStoreTest, DamagedFileIsNeverServed) {
  TempDir dir;
  {
    auto store = OpenStore(dir.path());
    ASSERT_OK(store->PutUpdate("d", 0, 1, 1, std::string(1000, 'a')));
  }
  {
    std::fstream f(dir.path() + "/d/update-00000000000000000001.pb",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-10, std::ios::end);
    f.put('b');
  }
  auto store = OpenStore(dir.path());
  EXPECT_THAT(store->UpdateAfter("d", 0), StatusIs(absl::StatusCode::kNotFound));
}

}  // namespace
}  // namespace cdcca::cloud
