#include "cloud/sample_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;
using ::testing::HasSubstr;

v1::UplinkBatch Batch(uint64_t seq, size_t payload_bytes = 100) {
  v1::UplinkBatch b;
  b.set_sequence(seq);
  b.set_model_version(3);
  b.set_sample_count(2);
  b.set_codec_version(1);
  std::string payload(payload_bytes, '\0');
  for (size_t i = 0; i < payload_bytes; ++i) payload[i] = static_cast<char>((seq * 31 + i) & 0xff);
  b.set_payload(payload);
  return b;
}

std::unique_ptr<SampleStore> OpenStore(const std::string& dir, uint64_t segment_bytes = 64 << 20) {
  SampleStoreOptions options;
  options.dir = dir;
  options.segment_bytes = segment_bytes;
  auto store = SampleStore::Open(options);
  EXPECT_OK(store);
  return store.ok() ? std::move(*store) : nullptr;
}

off_t FileSize(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

TEST(SampleStoreTest, AppendsAndReadsBackInOrder) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  for (uint64_t seq = 1; seq <= 5; ++seq) {
    ASSERT_OK_AND_ASSIGN(AppendResult r, store->AppendAndWait("cam-1", Batch(seq)));
    EXPECT_FALSE(r.duplicate);
    EXPECT_EQ(r.highest_durable, seq);
  }
  EXPECT_EQ(store->HighestDurable("cam-1"), 5u);
  EXPECT_EQ(store->HighestDurable("cam-2"), 0u);
  ASSERT_OK_AND_ASSIGN(auto records, store->Read("cam-1", 2, 10));
  ASSERT_EQ(records.size(), 4u);
  for (size_t i = 0; i < records.size(); ++i) {
    EXPECT_EQ(records[i].batch().sequence(), i + 2);
    EXPECT_EQ(records[i].batch().payload(), Batch(i + 2).payload());
    EXPECT_EQ(records[i].device_id(), "cam-1");
  }
  ASSERT_OK_AND_ASSIGN(auto two, store->Read("cam-1", 1, 2));
  EXPECT_EQ(two.size(), 2u);
}

TEST(SampleStoreTest, ResentBatchIsAckedButNotStoredTwice) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_OK(store->AppendAndWait("d", Batch(1)));
  ASSERT_OK(store->AppendAndWait("d", Batch(2)));
  ASSERT_OK_AND_ASSIGN(AppendResult again, store->AppendAndWait("d", Batch(1)));
  EXPECT_TRUE(again.duplicate);
  EXPECT_EQ(again.highest_durable, 2u);
  EXPECT_EQ(store->Stats().records, 2u);
  ASSERT_OK_AND_ASSIGN(auto records, store->Read("d", 0, 100));
  EXPECT_EQ(records.size(), 2u);
}

TEST(SampleStoreTest, RejectsSequenceGapsAndZero) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  ASSERT_OK(store->AppendAndWait("d", Batch(1)));
  EXPECT_THAT(store->AppendAndWait("d", Batch(3)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("next expected is 2")));
  EXPECT_THAT(store->AppendAndWait("d", Batch(0)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(store->HighestDurable("d"), 1u);
}

TEST(SampleStoreTest, ReopenRecoversEveryDeviceAndContinuesSequences) {
  TempDir dir;
  {
    auto store = OpenStore(dir.path());
    for (uint64_t seq = 1; seq <= 20; ++seq) {
      ASSERT_OK(store->AppendAndWait("a", Batch(seq)));
      if (seq <= 7) ASSERT_OK(store->AppendAndWait("b", Batch(seq)));
    }
  }
  auto store = OpenStore(dir.path());
  EXPECT_EQ(store->HighestDurable("a"), 20u);
  EXPECT_EQ(store->HighestDurable("b"), 7u);
  EXPECT_THAT(store->Devices(), ::testing::ElementsAre("a", "b"));
  ASSERT_OK_AND_ASSIGN(AppendResult r, store->AppendAndWait("b", Batch(8)));
  EXPECT_EQ(r.highest_durable, 8u);
  ASSERT_OK_AND_ASSIGN(auto records, store->Read("a", 0, 100));
  ASSERT_EQ(records.size(), 20u);
  EXPECT_EQ(records[19].batch().payload(), Batch(20).payload());
}

TEST(SampleStoreTest, TornTailIsTruncatedOnOpen) {
  TempDir dir;
  {
    auto store = OpenStore(dir.path());
    for (uint64_t seq = 1; seq <= 3; ++seq) ASSERT_OK(store->AppendAndWait("d", Batch(seq)));
  }
  const std::string seg = dir.file("seg-00000001.log");
  const off_t good = FileSize(seg);
  {
    // A crash mid-write: the frame of a fourth record and half of its body.
    std::ofstream out(seg, std::ios::app | std::ios::binary);
    const char frame[12] = {0x11, 0x5a, static_cast<char>(0xca), static_cast<char>(0xcd),
                            static_cast<char>(200), 0, 0, 0, 1, 2, 3, 4};
    out.write(frame, sizeof(frame));
    out << std::string(50, 'x');
  }
  auto store = OpenStore(dir.path());
  EXPECT_EQ(store->Stats().truncated_tail_bytes, 62u);
  EXPECT_EQ(store->Stats().damaged_ranges, 0u);
  ASSERT_EQ(store->Damage().size(), 1u);
  EXPECT_TRUE(store->Damage()[0].torn_tail);
  EXPECT_EQ(store->Damage()[0].offset, static_cast<uint64_t>(good));
  EXPECT_EQ(store->Damage()[0].bytes, 62u);
  EXPECT_EQ(FileSize(seg), good);
  EXPECT_EQ(store->HighestDurable("d"), 3u);
  ASSERT_OK(store->AppendAndWait("d", Batch(4)));
  ASSERT_OK_AND_ASSIGN(auto records, store->Read("d", 0, 100));
  EXPECT_EQ(records.size(), 4u);
}

// Flips one bit of `path` at `offset`.
void FlipBit(const std::string& path, off_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x10));
}

TEST(SampleStoreTest, CorruptRecordInOlderSegmentIsSkippedAndEveryIntactRecordKept) {
  TempDir dir;
  {
    auto store = OpenStore(dir.path(), /*segment_bytes=*/64 << 10);
    for (uint64_t seq = 1; seq <= 40; ++seq) {
      ASSERT_OK(store->AppendAndWait("d", Batch(seq, 4000)));
    }
  }
  ASSERT_GT(FileSize(dir.file("seg-00000002.log")), 0) << "expected several segments";
  FlipBit(dir.file("seg-00000001.log"), 100);  // inside record 1's payload
  auto store = OpenStore(dir.path(), 64 << 10);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->HighestDurable("d"), 40u);
  ASSERT_OK_AND_ASSIGN(auto records, store->Read("d", 1, 100));
  ASSERT_EQ(records.size(), 39u);
  EXPECT_EQ(records.front().batch().sequence(), 2u);
  EXPECT_EQ(store->Stats().damaged_ranges, 1u);
  ASSERT_EQ(store->Damage().size(), 1u);
  EXPECT_THAT(store->Damage()[0].path, HasSubstr("seg-00000001.log"));
  EXPECT_EQ(store->Damage()[0].offset, 0u);
  EXPECT_FALSE(store->Damage()[0].torn_tail);
}

// Regression (issue 20, attack finding 1): a flipped bit in the middle of the newest segment
// was taken for a torn tail, and every acked record after it was cut off without a word.
TEST(SampleStoreTest, FlippedBitMidNewestSegmentLosesOnlyThatRecordAndIsReported) {
  TempDir dir;
  std::vector<off_t> ends;  // file size after each record
  {
    auto store = OpenStore(dir.path());
    for (uint64_t seq = 1; seq <= 30; ++seq) {
      ASSERT_OK(store->AppendAndWait("a", Batch(seq, 300)));
      ASSERT_OK(store->AppendAndWait("b", Batch(seq, 300)));
      ends.push_back(FileSize(dir.file("seg-00000001.log")));
    }
  }
  const std::string seg = dir.file("seg-00000001.log");
  const off_t size = FileSize(seg);
  // Inside the body of "b"'s 15th batch (the second record after ends[13]).
  FlipBit(seg, ends[13] + (ends[14] - ends[13]) * 3 / 4);
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(FileSize(seg), size) << "corruption is not a torn tail: nothing is truncated";
  EXPECT_EQ(store->HighestDurable("a"), 30u);
  EXPECT_EQ(store->HighestDurable("b"), 30u);
  ASSERT_OK_AND_ASSIGN(auto a, store->Read("a", 1, 100));
  EXPECT_EQ(a.size(), 30u);
  ASSERT_OK_AND_ASSIGN(auto b, store->Read("b", 1, 100));
  ASSERT_EQ(b.size(), 29u);
  for (const auto& r : b) {
    EXPECT_NE(r.batch().sequence(), 15u);
    EXPECT_EQ(r.batch().payload(), Batch(r.batch().sequence(), 300).payload());
  }
  const SampleStoreStats stats = store->Stats();
  EXPECT_EQ(stats.records, 59u);
  EXPECT_EQ(stats.damaged_ranges, 1u);
  const uint64_t record_bytes = static_cast<uint64_t>(ends[14] - ends[13]) / 2;
  EXPECT_EQ(stats.damaged_bytes, record_bytes)
      << "the damaged range is b's record 15";
  EXPECT_EQ(stats.truncated_tail_bytes, 0u);
  ASSERT_EQ(store->Damage().size(), 1u);
  EXPECT_EQ(store->Damage()[0].why, "record checksum mismatch");
  EXPECT_EQ(store->Damage()[0].offset, static_cast<uint64_t>(ends[13]) + record_bytes);
  // New appends continue after the intact tail and survive another reopen.
  ASSERT_OK(store->AppendAndWait("b", Batch(31, 300)));
  store.reset();
  store = OpenStore(dir.path());
  EXPECT_EQ(store->HighestDurable("b"), 31u);
  EXPECT_EQ(store->Stats().records, 60u);
}

TEST(SampleStoreTest, RotatesSegmentsAndReadsAcrossThem) {
  TempDir dir;
  {
    auto store = OpenStore(dir.path(), 64 << 10);
    for (uint64_t seq = 1; seq <= 50; ++seq) ASSERT_OK(store->AppendAndWait("d", Batch(seq, 5000)));
  }
  auto store = OpenStore(dir.path(), 64 << 10);
  EXPECT_GE(FileSize(dir.file("seg-00000003.log")), 0);
  ASSERT_OK_AND_ASSIGN(auto records, store->Read("d", 1, 1000));
  ASSERT_EQ(records.size(), 50u);
  for (size_t i = 0; i < 50; ++i) EXPECT_EQ(records[i].batch().sequence(), i + 1);
}

TEST(SampleStoreTest, ConcurrentDevicesShareGroupCommits) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  constexpr int kDevices = 8, kBatches = 40;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int d = 0; d < kDevices; ++d) {
    threads.emplace_back([&, d] {
      for (uint64_t seq = 1; seq <= kBatches; ++seq) {
        if (!store->AppendAndWait(absl::StrCat("dev-", d), Batch(seq)).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  const SampleStoreStats stats = store->Stats();
  EXPECT_EQ(stats.records, static_cast<uint64_t>(kDevices * kBatches));
  // Group commit: concurrent appends share fsyncs (never more syncs than records).
  EXPECT_LE(stats.group_commits, stats.records);
  for (int d = 0; d < kDevices; ++d) {
    EXPECT_EQ(store->HighestDurable(absl::StrCat("dev-", d)), static_cast<uint64_t>(kBatches));
  }
}

TEST(SampleStoreTest, CallbackRunsAfterDurabilityEvenForBurstOfAsyncAppends) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  std::atomic<int> acked{0};
  std::atomic<uint64_t> max_seen{0};
  for (uint64_t seq = 1; seq <= 200; ++seq) {
    store->Append("burst", Batch(seq), [&](absl::StatusOr<AppendResult> r) {
      ASSERT_TRUE(r.ok()) << r.status();
      uint64_t prev = max_seen.load();
      while (r->highest_durable > prev && !max_seen.compare_exchange_weak(prev, r->highest_durable)) {
      }
      ++acked;
    });
  }
  while (acked.load() < 200) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(max_seen.load(), 200u);
  // 200 appends queued at once are made durable by far fewer than 200 syncs.
  EXPECT_LT(store->Stats().group_commits, 200u);
  store.reset();
  auto reopened = OpenStore(dir.path());
  EXPECT_EQ(reopened->HighestDurable("burst"), 200u);
}

}  // namespace
}  // namespace cdcca::cloud
