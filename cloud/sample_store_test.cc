#include "cloud/sample_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cloud/internal/record_log.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;
using ::testing::AllOf;
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
    // A crash mid-write: the first 62 bytes of a fourth record's fragment.
    std::string fourth;
    internal::LogWriter writer(static_cast<uint64_t>(good), /*nonce=*/0);
    writer.AddRecord(std::string(200, 'x'), fourth);
    std::ofstream out(seg, std::ios::app | std::ios::binary);
    out << fourth.substr(0, 62);
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
  EXPECT_EQ(store->Damage()[0].offset, internal::kSegmentHeaderBytes);
  EXPECT_FALSE(store->Damage()[0].torn_tail);
}

// A flipped bit in the middle of the newest segment is damage to an acked record, not a torn
// tail: every acked record after it is kept.
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
  EXPECT_EQ(stats.truncated_tail_bytes, 0u);
  ASSERT_EQ(store->Damage().size(), 1u);
  EXPECT_EQ(store->Damage()[0].why, "fragment checksum mismatch");
  // The damaged range is b's record 15 alone: after a's record and its SYNC fragment, up to
  // the SYNC fragment after it.
  const uint64_t pair_bytes = static_cast<uint64_t>(ends[14] - ends[13]);
  EXPECT_GT(store->Damage()[0].offset, static_cast<uint64_t>(ends[13]) + 300);
  EXPECT_GT(stats.damaged_bytes, 300u);
  EXPECT_EQ(store->Damage()[0].offset + stats.damaged_bytes + internal::kSyncFragmentBytes,
            static_cast<uint64_t>(ends[14]));
  EXPECT_LT(stats.damaged_bytes, pair_bytes / 2);
  // New appends continue after the intact tail and survive another reopen.
  ASSERT_OK(store->AppendAndWait("b", Batch(31, 300)));
  store.reset();
  store = OpenStore(dir.path());
  EXPECT_EQ(store->HighestDurable("b"), 31u);
  EXPECT_EQ(store->Stats().records, 60u);
}

// The span of the record of `device`'s batch `seq` in segment 1, found by scanning it.
internal::RecordSpan SpanOf(const std::string& segment, const std::string& device, uint64_t seq) {
  std::ifstream in(segment, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<bool> match;
  auto scan = internal::ScanSegment(data, [&](absl::string_view body) {
    store::v1::SampleRecord r;
    if (!r.ParseFromArray(body.data(), static_cast<int>(body.size()))) return false;
    match.push_back(r.device_id() == device && r.batch().sequence() == seq);
    return true;
  });
  EXPECT_OK(scan);
  for (size_t i = 0; scan.ok() && i < scan->records.size(); ++i) {
    if (match[i]) return scan->records[i].span;
  }
  ADD_FAILURE() << "no record " << seq << " of " << device;
  return {};
}

// A device controls its batches' payloads: one can carry bytes framed as a whole record of
// another device. After damage, recovery never resynchronises inside a payload, so the
// planted record is never taken.
TEST(SampleStoreTest, RecordPlantedInsideAPayloadIsNeverTakenAfterDamage) {
  TempDir dir;
  {
    // The planted bytes: a FULL fragment holding "victim"'s batch 1, framed as the log
    // frames records (a device can compute every checksum of it).
    store::v1::SampleRecord forged;
    forged.set_device_id("victim");
    forged.mutable_batch()->set_sequence(1);
    forged.mutable_batch()->set_sample_count(1);
    forged.mutable_batch()->set_payload("forged");
    std::string planted;
    internal::LogWriter(0, 0).AddRecord(forged.SerializeAsString(), planted);
    auto store = OpenStore(dir.path());
    ASSERT_OK(store->AppendAndWait("mallory", Batch(1)));
    v1::UplinkBatch carrier = Batch(2);
    carrier.set_payload(std::string(40, 'm') + planted + std::string(40, 'm'));
    ASSERT_OK(store->AppendAndWait("mallory", carrier));
    ASSERT_OK(store->AppendAndWait("mallory", Batch(3)));
  }
  const std::string seg = dir.file("seg-00000001.log");
  // Damage in the carrier before the planted bytes (in its device id).
  const internal::RecordSpan carrier = SpanOf(seg, "mallory", 2);
  FlipBit(seg, static_cast<off_t>(carrier.offset + internal::kFragmentHeaderBytes + 3));
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->HighestDurable("victim"), 0u);
  EXPECT_THAT(store->Devices(), ::testing::ElementsAre("mallory"));
  ASSERT_OK_AND_ASSIGN(auto records, store->Read("mallory", 1, 10));
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records[0].batch().sequence(), 1u);
  EXPECT_EQ(records[1].batch().sequence(), 3u);
  EXPECT_EQ(store->Stats().records, 2u);
  EXPECT_EQ(store->Stats().damaged_ranges, 1u);
  ASSERT_EQ(store->Damage().size(), 1u);
  EXPECT_EQ(store->Damage()[0].offset, carrier.offset);
  EXPECT_FALSE(store->Damage()[0].torn_tail);
}

// The last record of the newest segment was acked: a flip in it is damage to acked data
// (reported, counted, the file kept), not a torn tail.
TEST(SampleStoreTest, FlipInTheLastAckedRecordOfTheNewestSegmentIsDamageNotATornTail) {
  TempDir dir;
  {
    auto store = OpenStore(dir.path());
    for (uint64_t seq = 1; seq <= 5; ++seq) ASSERT_OK(store->AppendAndWait("d", Batch(seq, 300)));
  }
  const std::string seg = dir.file("seg-00000001.log");
  const off_t size = FileSize(seg);
  const internal::RecordSpan last = SpanOf(seg, "d", 5);
  FlipBit(seg, static_cast<off_t>((last.offset + last.end) / 2));
  auto store = OpenStore(dir.path());
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(FileSize(seg), size);
  const SampleStoreStats stats = store->Stats();
  EXPECT_EQ(stats.truncated_tail_bytes, 0u);
  EXPECT_EQ(stats.damaged_ranges, 1u);
  EXPECT_EQ(stats.damaged_bytes, last.end - last.offset);
  ASSERT_EQ(store->Damage().size(), 1u);
  EXPECT_FALSE(store->Damage()[0].torn_tail);
  EXPECT_EQ(store->Damage()[0].offset, last.offset);
  // Batch 5 is lost (its device resends it: it is past the durable end), and the log goes on.
  EXPECT_EQ(store->HighestDurable("d"), 4u);
  ASSERT_OK(store->AppendAndWait("d", Batch(5, 300)));
  store.reset();
  store = OpenStore(dir.path());
  EXPECT_EQ(store->HighestDurable("d"), 5u);
  EXPECT_EQ(store->Stats().damaged_ranges, 1u);
}

// A crash can cut the newest segment anywhere in the group commit it was writing: a cut at
// every byte of that group (its record spans a block boundary, then its SYNC fragment) is a
// torn tail, never damage; every record that is whole before the cut is kept, and the log
// takes appends after it.
TEST(SampleStoreTest, TruncationAtEveryByteOfTheTailIsATornTail) {
  TempDir dir;
  const std::string seg = dir.file("seg-00000001.log");
  std::string full;
  off_t acked_end = 0;
  {
    auto store = OpenStore(dir.path());
    ASSERT_OK(store->AppendAndWait("d", Batch(1, 32400)));
    ASSERT_OK(store->AppendAndWait("d", Batch(2, 100)));
    acked_end = FileSize(seg);
    ASSERT_OK(store->AppendAndWait("d", Batch(3, 400)));
  }
  {
    std::ifstream in(seg, std::ios::binary);
    full.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  const internal::RecordSpan third = SpanOf(seg, "d", 3);
  ASSERT_EQ(static_cast<off_t>(third.offset), acked_end);
  ASSERT_LT(third.offset, internal::kLogBlockBytes);
  ASSERT_GT(third.end, internal::kLogBlockBytes) << "the tail must span a block boundary";
  for (uint64_t cut = static_cast<uint64_t>(acked_end); cut <= full.size(); ++cut) {
    SCOPED_TRACE(absl::StrCat("cut at ", cut));
    {
      std::ofstream out(seg, std::ios::binary | std::ios::trunc);
      out << full.substr(0, cut);
    }
    auto store = OpenStore(dir.path());
    ASSERT_NE(store, nullptr);
    const SampleStoreStats stats = store->Stats();
    EXPECT_EQ(stats.damaged_ranges, 0u);
    const bool third_whole = cut >= third.end;
    EXPECT_EQ(store->HighestDurable("d"), third_whole ? 3u : 2u);
    // The whole file ends with the group's SYNC fragment: nothing is torn.
    const uint64_t kept = cut == full.size() ? cut : third_whole ? third.end : third.offset;
    EXPECT_EQ(stats.truncated_tail_bytes, cut - kept);
    EXPECT_EQ(static_cast<uint64_t>(FileSize(seg)), kept);
    ASSERT_OK(store->AppendAndWait("d", Batch(third_whole ? 4 : 3, 50)));
    store.reset();
    store = OpenStore(dir.path());
    EXPECT_EQ(store->HighestDurable("d"), third_whole ? 4u : 3u);
    EXPECT_EQ(store->Stats().damaged_ranges, 0u);
    EXPECT_EQ(store->Stats().truncated_tail_bytes, 0u);
  }
}

// A log in the previous framing (records found by a magic, byte by byte) is refused with a
// message that names the file and its format; it is never scanned.
TEST(SampleStoreTest, SegmentOfFormatOneIsRefusedWithAClearMessage) {
  TempDir dir;
  {
    std::ofstream out(dir.file("seg-00000001.log"), std::ios::binary);
    const char frame[12] = {
        0x11, 0x5a, static_cast<char>(0xca), static_cast<char>(0xcd), 4, 0, 0, 0, 1, 2, 3, 4};
    out.write(frame, sizeof(frame));
    out << "body";
  }
  SampleStoreOptions options;
  options.dir = dir.path();
  EXPECT_THAT(
      SampleStore::Open(options),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("seg-00000001.log"), HasSubstr("format 1"), HasSubstr("aside"))));
}

// Retention: a device at its quota is blocked only until its records are released; segment
// files whose records are all released are deleted, oldest first, and a restart still knows
// each device's highest sequence.
TEST(SampleStoreTest, ReleasedRecordsLeaveTheQuotaAndWhollyReleasedSegmentsAreDeleted) {
  TempDir dir;
  SampleStoreOptions options;
  options.dir = dir.path();
  options.segment_bytes = 64 << 10;
  options.max_device_bytes = 40 << 10;
  {
    ASSERT_OK_AND_ASSIGN(auto store, SampleStore::Open(options));
    uint64_t seq = 1;
    for (; seq <= 100; ++seq) {
      absl::StatusOr<AppendResult> r = store->AppendAndWait("cam", Batch(seq, 4000));
      if (!r.ok()) {
        EXPECT_THAT(r, StatusIs(absl::StatusCode::kResourceExhausted));
        break;
      }
      // Another device shares the segments, released as it goes.
      ASSERT_OK(store->AppendAndWait("other", Batch(seq, 4000)));
      ASSERT_OK(store->Release("other", seq));
    }
    ASSERT_LT(seq, 100u) << "the quota never bit";
    EXPECT_LE(store->DeviceBytes("cam"), options.max_device_bytes);
    // A job consumed everything: the device appends again, and the segments it filled go.
    ASSERT_OK(store->Release("cam", seq - 1));
    EXPECT_EQ(store->HighestDurable("cam"), seq - 1);
    EXPECT_LT(store->DeviceBytes("cam"), 5000u) << "only the newest record is held";
    for (uint64_t more = seq; more < seq + 30; ++more) {
      ASSERT_OK(store->AppendAndWait("cam", Batch(more, 4000)));
      ASSERT_OK(store->Release("cam", more - 1));
    }
    EXPECT_GT(store->Stats().deleted_segments, 0u);
    EXPECT_EQ(FileSize(dir.file("seg-00000001.log")), -1) << "the oldest segment is deleted";
    EXPECT_EQ(store->HighestDurable("cam"), seq + 29);
  }
  ASSERT_OK_AND_ASSIGN(auto store, SampleStore::Open(options));
  ASSERT_OK_AND_ASSIGN(auto records, store->Read("cam", 0, 1000));
  ASSERT_FALSE(records.empty());
  EXPECT_EQ(store->HighestDurable("cam"), records.back().batch().sequence());
  EXPECT_GE(store->HighestDurable("cam"), 30u);
  EXPECT_EQ(store->Stats().damaged_ranges, 0u);
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

// Group commit: appends that arrive while a sync is in flight share the next one. The
// flusher is held inside the first append's callback (callbacks run on it) while devices
// append from their own threads; when it is let go, one sync makes all of them durable.
TEST(SampleStoreTest, ConcurrentAppendsShareOneSync) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  absl::Notification flusher_held, release;
  store->Append("first", Batch(1), [&](absl::StatusOr<AppendResult> r) {
    EXPECT_OK(r);
    flusher_held.Notify();
    release.WaitForNotification();
  });
  ASSERT_TRUE(flusher_held.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(store->Stats().group_commits, 1u);

  constexpr int kDevices = 8;
  absl::Mutex mu;
  int acked = 0;
  std::vector<std::thread> threads;
  for (int d = 0; d < kDevices; ++d) {
    threads.emplace_back([&, d] {
      store->Append(absl::StrCat("dev-", d), Batch(1), [&](absl::StatusOr<AppendResult> r) {
        EXPECT_OK(r);
        absl::MutexLock lock(&mu);
        ++acked;
      });
    });
  }
  for (auto& t : threads) t.join();  // every Append has queued its batch
  release.Notify();
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                        +[](int* n) { return *n == kDevices; }, &acked),
                                    absl::Seconds(30)));
  }
  const SampleStoreStats stats = store->Stats();
  EXPECT_EQ(stats.records, static_cast<uint64_t>(kDevices + 1));
  EXPECT_EQ(stats.group_commits, 2u) << "the " << kDevices << " queued appends share one sync";
  for (int d = 0; d < kDevices; ++d) {
    EXPECT_EQ(store->HighestDurable(absl::StrCat("dev-", d)), 1u);
  }
}

TEST(SampleStoreTest, CallbackRunsAfterDurabilityEvenForBurstOfAsyncAppends) {
  TempDir dir;
  auto store = OpenStore(dir.path());
  absl::Mutex mu;
  int acked = 0;
  uint64_t max_seen = 0;
  for (uint64_t seq = 1; seq <= 200; ++seq) {
    store->Append("burst", Batch(seq), [&](absl::StatusOr<AppendResult> r) {
      ASSERT_TRUE(r.ok()) << r.status();
      absl::MutexLock lock(&mu);
      max_seen = std::max(max_seen, r->highest_durable);
      ++acked;
    });
  }
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                        +[](int* n) { return *n == 200; }, &acked),
                                    absl::Seconds(60)));
    EXPECT_EQ(max_seen, 200u);
  }
  store.reset();
  auto reopened = OpenStore(dir.path());
  EXPECT_EQ(reopened->HighestDurable("burst"), 200u);
}

}  // namespace
}  // namespace cdcca::cloud
