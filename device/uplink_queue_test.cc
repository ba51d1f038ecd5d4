// UplinkQueue: contiguous sequences, durable across reopen, bounded, acked batches removed,
// reconciled with the cloud's expectation.
#include "device/uplink_queue.h"

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::device {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;

std::vector<uint64_t> Sequences(const std::vector<v1::UplinkBatch>& batches) {
  std::vector<uint64_t> out;
  for (const auto& b : batches) out.push_back(b.sequence());
  return out;
}

TEST(UplinkQueueTest, NumbersBatchesAndSurvivesReopen) {
  TempDir dir;
  UplinkQueueOptions o;
  o.dir = dir.path() + "/q";
  {
    ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open(o));
    for (int i = 1; i <= 3; ++i) {
      ASSERT_OK_AND_ASSIGN(uint64_t seq, q->Enqueue(7, 2, 1, std::string(10 * i, 'x')));
      EXPECT_EQ(seq, static_cast<uint64_t>(i));
    }
    ASSERT_OK(q->Acknowledge(1));
  }
  // A crash mid-write leaves a temp file; it is not a batch.
  std::ofstream(o.dir + "/batch-00000000000000000004.pb.tmp") << "torn";
  ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open(o));
  UplinkQueueStats s = q->Stats();
  EXPECT_EQ(s.batches, 2u);
  EXPECT_EQ(s.bytes, 50u);
  EXPECT_EQ(s.acked, 1u);
  EXPECT_EQ(s.next_sequence, 4u);
  std::vector<v1::UplinkBatch> batches = q->Peek(10, 1 << 20);
  EXPECT_THAT(Sequences(batches), ::testing::ElementsAre(2, 3));
  EXPECT_EQ(batches[0].model_version(), 7u);
  EXPECT_EQ(batches[0].sample_count(), 2u);
  EXPECT_EQ(batches[1].payload(), std::string(30, 'x'));
  EXPECT_FALSE(std::filesystem::exists(o.dir + "/batch-00000000000000000004.pb.tmp"));
  ASSERT_OK(q->Acknowledge(3));
  EXPECT_TRUE(q->Peek(10, 1 << 20).empty());
  ASSERT_OK_AND_ASSIGN(uint64_t next, q->Enqueue(7, 1, 1, "y"));
  EXPECT_EQ(next, 4u);
}

TEST(UplinkQueueTest, PeekRespectsBoundsButReturnsOneBatch) {
  TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
  for (int i = 0; i < 5; ++i) ASSERT_OK(q->Enqueue(0, 1, 1, std::string(100, 'a')).status());
  EXPECT_THAT(Sequences(q->Peek(2, 1 << 20)), ::testing::ElementsAre(1, 2));
  EXPECT_THAT(Sequences(q->Peek(10, 250)), ::testing::ElementsAre(1, 2));
  EXPECT_THAT(Sequences(q->Peek(10, 10)), ::testing::ElementsAre(1));
}

TEST(UplinkQueueTest, FullQueueRefusesNewBatches) {
  TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 250, 100}));
  ASSERT_OK(q->Enqueue(0, 1, 1, std::string(100, 'a')).status());
  ASSERT_OK(q->Enqueue(0, 1, 1, std::string(100, 'a')).status());
  EXPECT_THAT(q->Enqueue(0, 1, 1, std::string(100, 'a')),
              StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(q->Stats().refused, 1u);
  ASSERT_OK(q->Acknowledge(1));
  ASSERT_OK_AND_ASSIGN(uint64_t seq, q->Enqueue(0, 1, 1, std::string(100, 'a')));
  EXPECT_EQ(seq, 3u);  // no hole
}

TEST(UplinkQueueTest, ReconcileWithTheCloud) {
  TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
  for (int i = 0; i < 3; ++i) ASSERT_OK(q->Enqueue(0, 1, 1, "p").status());
  // The cloud stored two of them before our ack was lost.
  ASSERT_OK(q->Reconcile(3).status());
  EXPECT_THAT(Sequences(q->Peek(10, 1 << 20)), ::testing::ElementsAre(3));
  ASSERT_OK(q->Acknowledge(3));
  // The cloud lost everything: continue where it expects.
  ASSERT_OK(q->Reconcile(1).status());
  ASSERT_OK_AND_ASSIGN(uint64_t seq, q->Enqueue(0, 1, 1, "p"));
  EXPECT_EQ(seq, 1u);
}

// A batch the cloud refused for good leaves the queue and the ones behind it take its
// sequence, durably: a reopened queue sends them under the new numbers.
TEST(UplinkQueueTest, DropFrontRenumbersWhatWaitsBehindIt) {
  TempDir dir;
  {
    ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
    for (const char* p : {"a", "b", "c", "d"}) ASSERT_OK(q->Enqueue(0, 1, 1, p).status());
    ASSERT_OK(q->Acknowledge(1));
    // Only the oldest waiting batch can be refused: the cloud stores batches in order.
    EXPECT_THAT(q->DropFront(3), StatusIs(absl::StatusCode::kFailedPrecondition));
    ASSERT_OK_AND_ASSIGN(v1::UplinkBatch dropped, q->DropFront(2));
    EXPECT_EQ(dropped.sequence(), 2u);
    EXPECT_EQ(dropped.payload(), "b");
    std::vector<v1::UplinkBatch> waiting = q->Peek(10, 1 << 20);
    EXPECT_THAT(Sequences(waiting), ::testing::ElementsAre(2, 3));
    EXPECT_EQ(waiting[0].payload(), "c");
    UplinkQueueStats s = q->Stats();
    EXPECT_EQ(s.acked, 1u);
    EXPECT_EQ(s.dropped, 1u);
    EXPECT_EQ(s.next_sequence, 4u);
  }
  ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
  std::vector<v1::UplinkBatch> waiting = q->Peek(10, 1 << 20);
  EXPECT_THAT(Sequences(waiting), ::testing::ElementsAre(2, 3));
  EXPECT_EQ(waiting[1].payload(), "d");
  ASSERT_OK_AND_ASSIGN(uint64_t next, q->Enqueue(0, 1, 1, "e"));
  EXPECT_EQ(next, 4u);
  ASSERT_OK(q->Acknowledge(3));
  EXPECT_THAT(Sequences(q->Peek(10, 1 << 20)), ::testing::ElementsAre(4));
  EXPECT_EQ(q->Stats().acked, 3u);
  EXPECT_EQ(q->Stats().bytes, 1u);
}

// A cloud that lost the tail of its log expects a sequence below what this queue saw acked;
// the batches still waiting continue from there, across a reopen too.
TEST(UplinkQueueTest, ReconcileRenumbersWaitingBatchesAfterALostTail) {
  TempDir dir;
  {
    ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
    for (int i = 0; i < 7; ++i) ASSERT_OK(q->Enqueue(0, 1, 1, std::string(1, 'a' + i)).status());
    ASSERT_OK(q->Acknowledge(5));
    // The cloud holds 3 of the 5 acked batches.
    ASSERT_OK_AND_ASSIGN(uint64_t back, q->Reconcile(4));
    EXPECT_EQ(back, 2u);
    EXPECT_THAT(Sequences(q->Peek(10, 1 << 20)), ::testing::ElementsAre(4, 5));
    EXPECT_EQ(q->Stats().acked, 3u);
    EXPECT_EQ(q->Stats().renumbered, 1u);
    // Told again, nothing moves.
    ASSERT_OK_AND_ASSIGN(back, q->Reconcile(4));
    EXPECT_EQ(back, 0u);
  }
  ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
  std::vector<v1::UplinkBatch> waiting = q->Peek(10, 1 << 20);
  EXPECT_THAT(Sequences(waiting), ::testing::ElementsAre(4, 5));
  EXPECT_EQ(waiting[0].payload(), "f");
  ASSERT_OK_AND_ASSIGN(uint64_t next, q->Enqueue(0, 1, 1, "h"));
  EXPECT_EQ(next, 6u);
}

// The state file of a queue written before renumbering existed holds the acked sequence alone.
TEST(UplinkQueueTest, OpensAStateFileWithoutAnOffset) {
  TempDir dir;
  {
    ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
    for (int i = 0; i < 3; ++i) ASSERT_OK(q->Enqueue(0, 1, 1, "p").status());
  }
  std::ofstream(dir.path() + "/acked", std::ios::trunc) << "1\n";
  ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
  EXPECT_THAT(Sequences(q->Peek(10, 1 << 20)), ::testing::ElementsAre(2, 3));
  std::ofstream(dir.path() + "/acked", std::ios::trunc) << "1 2\n";  // offset past the slot
  EXPECT_THAT(UplinkQueue::Open({dir.path(), 1 << 20, 100}).status(),
              StatusIs(absl::StatusCode::kDataLoss));
}

TEST(UplinkQueueTest, MissingBatchIsDataLoss) {
  TempDir dir;
  {
    ASSERT_OK_AND_ASSIGN(auto q, UplinkQueue::Open({dir.path(), 1 << 20, 100}));
    for (int i = 0; i < 3; ++i) ASSERT_OK(q->Enqueue(0, 1, 1, "p").status());
  }
  std::filesystem::remove(dir.path() + "/batch-00000000000000000002.pb");
  EXPECT_THAT(UplinkQueue::Open({dir.path(), 1 << 20, 100}).status(),
              StatusIs(absl::StatusCode::kDataLoss));
}

}  // namespace
}  // namespace cdcca::device
