// UplinkQueue: contiguous sequences, durable across reopen, bounded, acked batches removed,
// reconciled with the cloud's expectation; every injected file fault at every step of
// enqueue and ack; checksummed files, and their format-1 predecessors.
#include "device/uplink_queue.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/fault_injection_env.h"
#include "storage/sealed_file.h"
#include "tests/testing/fault_walk.h"
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

std::string Payload(uint64_t seq) { return std::string(100 + seq, static_cast<char>('a' + seq)); }

absl::StatusOr<std::unique_ptr<UplinkQueue>> OpenQueue(storage::Env& env) {
  UplinkQueueOptions o;
  o.dir = "/device/queue";
  o.env = &env;
  return UplinkQueue::Open(o);
}

// Enqueue, ack, enqueue, ack under every fault at every step. After the restart: the queue
// opens; every batch whose Enqueue said OK and that was not acked is there, unchanged; an
// Acknowledge that said OK stays acked (its batches are never resent); the numbering is
// contiguous and the next Enqueue continues it.
TEST(UplinkQueueTest, NothingQueuedIsLostAndNothingAckedIsResentUnderEveryFault) {
  for (storage::Fault fault : cdcca::testing::kAllFaults) {
    uint64_t enqueued = 0, acked = 0;  // highest sequence each call said OK for
    const uint64_t steps = cdcca::testing::WalkFault(
        fault,
        [&](storage::FaultInjectionEnv& env) {
          ASSERT_OK_AND_ASSIGN(auto q, OpenQueue(env));
          ASSERT_OK_AND_ASSIGN(enqueued, q->Enqueue(0, 1, 1, Payload(1)));
          acked = 0;
        },
        [&](storage::FaultInjectionEnv& env) {
          absl::StatusOr<std::unique_ptr<UplinkQueue>> q = OpenQueue(env);
          if (!q.ok()) return;
          const auto enqueue = [&] {
            const uint64_t next = (*q)->Stats().next_sequence;
            absl::StatusOr<uint64_t> seq = (*q)->Enqueue(0, 1, 1, Payload(next));
            if (seq.ok()) {
              EXPECT_EQ(*seq, next);
              enqueued = *seq;
            }
          };
          const auto ack = [&](uint64_t upto) {
            if ((*q)->Acknowledge(upto).ok()) acked = std::max(acked, upto);
          };
          enqueue();
          enqueue();
          ack(std::min<uint64_t>(2, enqueued));
          enqueue();
          ack((*q)->Stats().next_sequence - 1);
        },
        [&](storage::FaultInjectionEnv& env) {
          ASSERT_OK_AND_ASSIGN(auto q, OpenQueue(env));
          const UplinkQueueStats s = q->Stats();
          EXPECT_GE(s.acked, acked) << "an acked ack was lost";
          std::vector<v1::UplinkBatch> batches = q->Peek(100, 1 << 30);
          uint64_t expect = s.acked + 1;
          for (const v1::UplinkBatch& b : batches) {
            EXPECT_EQ(b.sequence(), expect++);
            EXPECT_TRUE(b.payload() == Payload(b.sequence())) << "batch " << b.sequence();
          }
          EXPECT_GE(std::max(s.acked, expect - 1), enqueued) << "a queued batch was lost";
          ASSERT_OK_AND_ASSIGN(uint64_t next, q->Enqueue(0, 1, 1, Payload(expect)));
          EXPECT_EQ(next, expect);
          enqueued = next;
        });
    EXPECT_GE(steps, fault == storage::Fault::kShortWrite ? 5u : 20u) << storage::FaultName(fault);
  }
}

TEST(UplinkQueueTest, QueueFilesAreChecksummedAndFormat1FilesAreStillRead) {
  storage::FaultInjectionEnv env;
  const std::string dir = "/device/queue";
  {
    ASSERT_OK_AND_ASSIGN(auto q, OpenQueue(env));
    ASSERT_OK(q->Enqueue(0, 1, 1, "sealed").status());
  }
  const std::string first = dir + "/batch-00000000000000000001.pb";
  ASSERT_OK_AND_ASSIGN(std::string bytes, storage::ReadFile(env, first));
  EXPECT_TRUE(storage::IsSealed(bytes));
  // Format 1: the bare message and a bare number.
  v1::UplinkBatch old;
  old.set_sequence(2);
  old.set_payload("bare");
  ASSERT_OK(storage::WriteFileAtomically(env, dir + "/batch-00000000000000000002.pb",
                                         old.SerializeAsString()));
  ASSERT_OK(storage::WriteFileAtomically(env, dir + "/acked", "0\n"));
  {
    ASSERT_OK_AND_ASSIGN(auto q, OpenQueue(env));
    std::vector<v1::UplinkBatch> batches = q->Peek(10, 1 << 20);
    ASSERT_EQ(batches.size(), 2u);
    EXPECT_EQ(batches[0].payload(), "sealed");
    EXPECT_EQ(batches[1].payload(), "bare");
  }
  // One flipped bit anywhere in a sealed file is DATA_LOSS naming it.
  bytes[bytes.size() / 2] ^= 0x10;
  ASSERT_OK(storage::WriteFileAtomically(env, first, bytes));
  EXPECT_THAT(OpenQueue(env).status(),
              StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr(first)));
}

}  // namespace
}  // namespace cdcca::device
