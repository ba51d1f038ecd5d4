// PgStore against a real PostgreSQL server: the sample log's contract, the registry, the
// update chain, and the job queue's leases and fencing with several trainers at once.
#include "cloud/pg/pg_store.h"

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/wait.h"

namespace cdcca::cloud::pg {
namespace {

using ::cdcca::testing::IsOk;
using ::cdcca::testing::IsOkAndHolds;
using ::cdcca::testing::StatusIs;
using ::cdcca::testing::WaitUntil;
using ::testing::AllOf;
using ::testing::Field;
using ::testing::HasSubstr;
using ::testing::Optional;

v1::UplinkBatch Batch(uint64_t sequence, uint32_t samples = 2) {
  v1::UplinkBatch batch;
  batch.set_sequence(sequence);
  batch.set_model_version(7);
  batch.set_sample_count(samples);
  batch.set_codec_version(1);
  std::string payload = "payload-" + std::to_string(sequence);
  payload.push_back('\0');
  payload.push_back('\xff');
  batch.set_payload(payload);
  return batch;
}

// A LeaseJob answer without a job.
auto NoJob() { return ::testing::Not(Optional(::testing::_)); }

MATCHER_P2(Appended, duplicate, highest, "") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  *result_listener << "duplicate " << arg->duplicate << ", highest " << arg->highest_sequence;
  return arg->duplicate == duplicate && arg->highest_sequence == highest;
}

class PgStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(conninfo_, testing::CreateSharedPostgresDatabase());
    store_ = OpenStore();
    ASSERT_NE(store_, nullptr);
  }

  std::unique_ptr<PgStore> OpenStore(int keep_per_device = 16,
                                     uint64_t max_device_bytes = uint64_t{1} << 30) {
    PgStoreOptions options;
    options.conninfo = conninfo_;
    options.keep_per_device = keep_per_device;
    options.max_device_bytes = max_device_bytes;
    absl::StatusOr<std::unique_ptr<PgStore>> store = PgStore::Open(options);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }

  // A value of the database read with a fresh connection (what another process sees).
  std::string Query(const std::string& sql) {
    absl::StatusOr<std::unique_ptr<Connection>> conn = Connection::Open(conninfo_);
    if (!conn.ok()) return conn.status().ToString();
    absl::StatusOr<Result> r = (*conn)->Exec("SELECT (" + sql + ")::text");
    if (!r.ok()) return r.status().ToString();
    if (r->rows() == 0 || r->IsNull(0, 0)) return "NULL";
    return r->Bytes(0, 0).value_or("?");
  }

  // Waits until the server's clock has passed `t`.
  bool WaitForServerTime(absl::Time t) {
    return WaitUntil(
        [&] {
          return Query("SELECT clock_timestamp() > to_timestamp(" +
                       std::to_string(absl::ToDoubleSeconds(t - absl::UnixEpoch())) + ")") ==
                 "true";
        },
        absl::Seconds(20));
  }

  std::string conninfo_;
  std::unique_ptr<PgStore> store_;
};

// ---- sample log ----------------------------------------------------------------------------

TEST_F(PgStoreTest, AppendStoresEachSequenceOnceAndRefusesSkipAhead) {
  EXPECT_THAT(store_->HighestSequence("d1"), IsOkAndHolds(0u));
  EXPECT_THAT(store_->Append("d1", Batch(1)), Appended(false, 1u));
  EXPECT_THAT(store_->Append("d1", Batch(1)), Appended(true, 1u));  // resend
  EXPECT_THAT(store_->Append("d1", Batch(3)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("skips ahead")));
  EXPECT_THAT(store_->Append("d1", Batch(0)), StatusIs(absl::StatusCode::kInvalidArgument));
  v1::UplinkBatch second = Batch(2, 5);
  second.add_dropped()->set_sequence(9);  // reported once, not stored
  EXPECT_THAT(store_->Append("d1", second), Appended(false, 2u));
  EXPECT_THAT(store_->Append("d1", Batch(1)), Appended(true, 2u));
  EXPECT_THAT(store_->Append("d2", Batch(1)), Appended(false, 1u));  // per device
  EXPECT_EQ(Query("SELECT count(*) FROM samples WHERE device_id = 'd1'"), "2");

  ASSERT_OK_AND_ASSIGN(std::vector<store::v1::SampleRecord> all, store_->ReadBatches("d1", 0, 100));
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].batch().SerializeAsString(), Batch(1).SerializeAsString());
  second.clear_dropped();
  EXPECT_EQ(all[1].batch().SerializeAsString(), second.SerializeAsString());
  EXPECT_EQ(all[1].device_id(), "d1");
  EXPECT_GT(all[1].received_unix_ms(), 0);
  ASSERT_OK_AND_ASSIGN(std::vector<store::v1::SampleRecord> after,
                       store_->ReadBatches("d1", 1, 100));
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].batch().sequence(), 2u);
  EXPECT_THAT(store_->ReadBatches("d1", 0, 1), IsOkAndHolds(::testing::SizeIs(1)));
  EXPECT_THAT(store_->SampleCount("d1", 1, 2), IsOkAndHolds(7u));
  EXPECT_THAT(store_->SampleCount("d1", 2, ~uint64_t{0}), IsOkAndHolds(5u));
}

// Retention: consumed batches are deleted, the newest is kept, and the sequence goes on.
TEST_F(PgStoreTest, ReleaseDeletesConsumedBatchesButTheNewest) {
  for (uint64_t seq = 1; seq <= 4; ++seq) {
    ASSERT_THAT(store_->Append("d", Batch(seq)), Appended(false, seq));
  }
  ASSERT_THAT(store_->Append("e", Batch(1)), Appended(false, 1u));
  EXPECT_THAT(store_->Release("d", 2), IsOkAndHolds(2u));
  EXPECT_EQ(Query("SELECT string_agg(sequence::text, ',' ORDER BY sequence) FROM samples WHERE "
                  "device_id = 'd'"),
            "3,4");
  EXPECT_THAT(store_->Release("d", 10), IsOkAndHolds(1u));  // 4, the newest, stays
  EXPECT_THAT(store_->HighestSequence("d"), IsOkAndHolds(4u));
  EXPECT_THAT(store_->Append("d", Batch(2)), Appended(true, 4u));  // a resend of a released one
  EXPECT_THAT(store_->Append("d", Batch(5)), Appended(false, 5u));
  EXPECT_THAT(store_->ReadBatches("d", 0, 100), IsOkAndHolds(::testing::SizeIs(2)));
  EXPECT_EQ(Query("SELECT count(*) FROM samples WHERE device_id = 'e'"), "1");  // per device
}

// The per-device quota: a batch that would take the device's stored batches past it is refused
// with RESOURCE_EXHAUSTED (the service's transient QUOTA refusal) and not stored, whichever
// front asks; other devices and resends of stored batches are not affected; once a job's
// consumed batches are released the device appends again. 0 = no quota.
TEST_F(PgStoreTest, AppendPastTheDeviceQuotaIsResourceExhaustedUntilReleased) {
  const auto big = [](uint64_t sequence) {
    v1::UplinkBatch batch = Batch(sequence);
    batch.set_payload(std::string(1000, static_cast<char>('a' + sequence % 26)));
    return batch;
  };
  const uint64_t batch_bytes = big(1).ByteSizeLong();
  std::unique_ptr<PgStore> front = OpenStore(16, 3 * batch_bytes + batch_bytes / 2);
  std::unique_ptr<PgStore> other_front = OpenStore(16, 3 * batch_bytes + batch_bytes / 2);
  ASSERT_NE(front, nullptr);
  ASSERT_NE(other_front, nullptr);
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    ASSERT_THAT(front->Append("d", big(seq)), Appended(false, seq));
  }
  EXPECT_THAT(front->Append("d", big(4)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("device d has"), HasSubstr("quota"))));
  // The quota counts what the database holds, not what one front stored.
  EXPECT_THAT(other_front->Append("d", big(4)), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(Query("SELECT count(*) FROM samples WHERE device_id = 'd'"), "3");
  EXPECT_THAT(front->HighestSequence("d"), IsOkAndHolds(3u));
  EXPECT_THAT(front->Append("d", big(2)), Appended(true, 3u));   // a resend is no new byte
  EXPECT_THAT(front->Append("e", big(1)), Appended(false, 1u));  // per device
  // A job consumed 1 and 2: the device appends again.
  ASSERT_THAT(front->Release("d", 2), IsOkAndHolds(2u));
  EXPECT_THAT(other_front->Append("d", big(4)), Appended(false, 4u));
  // Without a quota nothing is refused for size.
  std::unique_ptr<PgStore> unbounded = OpenStore(16, 0);
  ASSERT_NE(unbounded, nullptr);
  for (uint64_t seq = 1; seq <= 8; ++seq) {
    ASSERT_THAT(unbounded->Append("f", big(seq)), Appended(false, seq));
  }
}

// Two fronts receive the same device's stream at once (a reconnect while the old stream
// lives): every batch is stored exactly once and each call reports the truth.
TEST_F(PgStoreTest, ConcurrentResendsAreStoredExactlyOnce) {
  constexpr int kBatches = 60;
  std::unique_ptr<PgStore> other = OpenStore();
  ASSERT_NE(other, nullptr);
  std::vector<std::vector<absl::StatusOr<AppendOutcome>>> outcomes(2);
  absl::Notification go;
  std::vector<std::thread> fronts;
  for (PgStore* front : {store_.get(), other.get()}) {
    const int index = static_cast<int>(fronts.size());
    fronts.emplace_back([&, front, index] {
      go.WaitForNotification();
      for (int s = 1; s <= kBatches; ++s) outcomes[index].push_back(front->Append("d", Batch(s)));
    });
  }
  go.Notify();
  for (std::thread& t : fronts) t.join();
  for (int s = 0; s < kBatches; ++s) {
    ASSERT_THAT(outcomes[0][s], IsOk()) << s;
    ASSERT_THAT(outcomes[1][s], IsOk()) << s;
    EXPECT_NE(outcomes[0][s]->duplicate, outcomes[1][s]->duplicate) << "sequence " << s + 1;
  }
  EXPECT_EQ(Query("SELECT count(*) FROM samples"), std::to_string(kBatches));
  EXPECT_EQ(Query("SELECT count(DISTINCT sequence) FROM samples"), std::to_string(kBatches));
}

// The server restarts between two appends: the call that meets the lost session is
// UNAVAILABLE (never an ack without a commit), a later call reconnects, and a resend of the
// batch is stored once.
TEST_F(PgStoreTest, AppendReconnectsAfterAServerRestart) {
  ASSERT_OK(store_->Append("d", Batch(1)).status());
  ASSERT_OK((*testing::SharedPostgresServer())->Restart());
  EXPECT_THAT(store_->Append("d", Batch(2)), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(store_->Append("d", Batch(2)), Appended(false, 2u));
  EXPECT_THAT(store_->Append("d", Batch(2)), Appended(true, 2u));
  EXPECT_EQ(Query("SELECT count(*) FROM samples"), "2");
}

// ---- registry ------------------------------------------------------------------------------

TEST_F(PgStoreTest, RegistryKeepsFingerprintCapabilitiesAndAppliedVersion) {
  v1::Capabilities caps;
  caps.add_delta_bit_widths(4);
  caps.set_update_byte_budget(1234);
  ASSERT_OK_AND_ASSIGN(store::v1::DeviceRecord first, store_->Register("d1", ~0ull, caps));
  EXPECT_EQ(first.model_fingerprint(), ~0ull);
  EXPECT_TRUE(first.in_sync());
  EXPECT_EQ(first.capabilities().update_byte_budget(), 1234u);
  caps.set_update_byte_budget(99);
  EXPECT_THAT(store_->Register("d1", ~0ull, caps), IsOk());
  EXPECT_THAT(store_->Register("d1", 5, caps),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("different base model")));
  ASSERT_OK(store_->SetApplied("d1", 3, 0x8000000000000001ull, false));
  ASSERT_OK_AND_ASSIGN(store::v1::DeviceRecord got, store_->GetDevice("d1"));
  EXPECT_EQ(got.capabilities().update_byte_budget(), 99u);
  EXPECT_EQ(got.applied_version(), 3u);
  EXPECT_EQ(got.applied_digest(), 0x8000000000000001ull);
  EXPECT_FALSE(got.in_sync());
  EXPECT_EQ(got.registered_unix_ms(), first.registered_unix_ms());
  EXPECT_THAT(store_->GetDevice("nope"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(store_->SetApplied("nope", 1, 1, true), StatusIs(absl::StatusCode::kNotFound));

  const std::string hash(32, '\x5a');
  ASSERT_OK(store_->Register("d2", ~0ull, caps).status());
  ASSERT_OK(store_->SetTokenHash("d1", hash));
  EXPECT_THAT(store_->SetTokenHash("d2", hash), StatusIs(absl::StatusCode::kAlreadyExists));
  EXPECT_THAT(store_->DeviceForTokenHash(hash), IsOkAndHolds("d1"));
  EXPECT_THAT(store_->DeviceForTokenHash(std::string(32, 'x')),
              StatusIs(absl::StatusCode::kNotFound));
}

// ---- job queue and publication -------------------------------------------------------------

Publication FirstJob(uint64_t consumed, const std::string& state = "state-1") {
  Publication p;
  p.base_version = 0;
  p.mirror = MirrorState{1, consumed, state};
  p.update_payload = "abc";
  p.state_digest = 0xfedcba9876543210ull;
  p.snapshot_payload = "snapshot-1";
  return p;
}

// A front's trigger rides in the append's statement: the batch counts itself beside the
// committed ones past the mirror's cursor, and a batch that is not stored schedules nothing.
TEST_F(PgStoreTest, AnAppendsTriggerMakesItsJobDueInTheSameStatement) {
  const AppendTrigger four{4, absl::InfiniteDuration()};
  EXPECT_THAT(store_->Append("d", Batch(1, 2), four), Appended(false, 1));
  EXPECT_EQ(Query("SELECT count(*) FROM jobs WHERE device_id = 'd'"), "0");
  EXPECT_THAT(store_->Append("d", Batch(2, 2), four), Appended(false, 2));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> lease, store_->LeaseJob("t", absl::Minutes(1)));
  ASSERT_TRUE(lease.has_value());
  EXPECT_EQ(lease->device_id, "d");
  // The job consumed both batches: a resend and two new samples leave it not due.
  ASSERT_OK(store_->Publish(*lease, FirstJob(/*consumed=*/2)));
  EXPECT_THAT(store_->Append("d", Batch(2, 2), four), Appended(true, 2));
  EXPECT_THAT(store_->Append("d", Batch(3, 2), four), Appended(false, 3));
  EXPECT_EQ(Query("SELECT due_at IS NULL FROM jobs WHERE device_id = 'd'"), "true");
  EXPECT_THAT(store_->Append("d", Batch(4, 2), four), Appended(false, 4));
  EXPECT_EQ(Query("SELECT due_at <= now() FROM jobs WHERE device_id = 'd'"), "true");

  // With a wait, a batch short of the count makes its job due that long after it.
  EXPECT_THAT(store_->Append("e", Batch(1, 1), AppendTrigger{4, absl::Hours(1)}),
              Appended(false, 1));
  EXPECT_EQ(Query("SELECT due_at > now() + interval '59 minutes' FROM jobs WHERE device_id = 'e'"),
            "true");
  // A batch that skips ahead is not stored, and schedules nothing.
  EXPECT_THAT(store_->Append("f", Batch(2, 8), four),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(Query("SELECT count(*) FROM jobs WHERE device_id = 'f'"), "0");
}

TEST_F(PgStoreTest, PublishStoresTheChainAndEndsTheJob) {
  ASSERT_OK(store_->Append("d", Batch(1)).status());
  ASSERT_OK(store_->Append("d", Batch(2)).status());
  ASSERT_OK(store_->ScheduleJob("d", absl::Now() - absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> lease, store_->LeaseJob("t1", absl::Minutes(1)));
  ASSERT_TRUE(lease.has_value());
  EXPECT_EQ(lease->device_id, "d");
  EXPECT_EQ(lease->fencing_token, 1);
  // It was due a second before this host's clock (the server's) read the lease: its queue wait.
  EXPECT_GE(lease->waited, absl::Seconds(1));
  EXPECT_THAT(store_->LeaseJob("t2", absl::Minutes(1)), IsOkAndHolds(NoJob()));

  // Consumed only batch 1: the job stays due for batch 2.
  ASSERT_OK(store_->Publish(*lease, FirstJob(/*consumed=*/1)));
  EXPECT_THAT(store_->LoadMirror("d"), IsOkAndHolds(Field(&MirrorState::consumed_sequence, 1u)));
  EXPECT_THAT(store_->LatestVersion("d"), IsOkAndHolds(1u));
  ASSERT_OK_AND_ASSIGN(StoredPayload update, store_->UpdateAfter("d", 0));
  EXPECT_EQ(update.payload, "abc");
  EXPECT_EQ(update.new_version, 1u);
  EXPECT_EQ(update.state_digest, 0xfedcba9876543210ull);
  EXPECT_EQ(absl::BytesToHexString(update.sha256),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_THAT(store_->UpdateAfter("d", 1), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(store_->UpdateAfter("d", 2), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(store_->Snapshot("d", 0), IsOkAndHolds(Field(&StoredPayload::payload, "snapshot-1")));
  EXPECT_THAT(store_->Snapshot("d", 2), StatusIs(absl::StatusCode::kNotFound));
  // Publishing ended the lease: it cannot publish twice.
  EXPECT_THAT(store_->Publish(*lease, FirstJob(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no longer held")));

  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> again, store_->LeaseJob("t2", absl::Minutes(1)));
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->fencing_token, 2);
  // A publication must build on the stored mirror.
  EXPECT_THAT(store_->Publish(*again, FirstJob(2)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("stored mirror")));
  // A withheld update: the version stays, the cursor moves, the job is no longer due.
  Publication withheld;
  withheld.base_version = 1;
  withheld.mirror = MirrorState{1, 2, "state-1b"};
  ASSERT_OK(store_->Publish(*again, withheld));
  EXPECT_THAT(store_->LoadMirror("d"), IsOkAndHolds(Field(&MirrorState::state, "state-1b")));
  EXPECT_THAT(store_->LatestVersion("d"), IsOkAndHolds(1u));
  EXPECT_THAT(store_->LeaseJob("t1", absl::Minutes(1)), IsOkAndHolds(NoJob()));
  EXPECT_EQ(Query("SELECT due_at FROM jobs"), "NULL");
}

// A device whose samples keep coming stays due after each job, but behind the devices that
// were due before its job ended: two trainers never keep two busy devices' jobs to
// themselves while a third device waits.
TEST_F(PgStoreTest, AJobWithSamplesLeftGoesBehindTheDevicesDueBeforeItEnded) {
  for (const std::string id : {"a", "b"}) {
    ASSERT_OK(store_->Append(id, Batch(1)).status());
    ASSERT_OK(store_->Append(id, Batch(2)).status());
  }
  ASSERT_OK(store_->ScheduleJob("a", absl::Now() - absl::Seconds(2)));
  ASSERT_OK(store_->ScheduleJob("b", absl::Now() - absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> first, store_->LeaseJob("t", absl::Minutes(1)));
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->device_id, "a");
  ASSERT_OK(store_->Publish(*first, FirstJob(/*consumed=*/1)));  // a's batch 2 is left

  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> second, store_->LeaseJob("t", absl::Minutes(1)));
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->device_id, "b");
  ASSERT_OK(store_->Publish(*second, FirstJob(/*consumed=*/1)));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> third, store_->LeaseJob("t", absl::Minutes(1)));
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->device_id, "a");
}

TEST_F(PgStoreTest, PublishPrunesToTheNewestPerDevice) {
  std::unique_ptr<PgStore> store = OpenStore(/*keep_per_device=*/2);
  ASSERT_NE(store, nullptr);
  for (uint64_t v = 1; v <= 4; ++v) {
    ASSERT_OK(store->Append("d", Batch(v)).status());
    ASSERT_OK(store->ScheduleJob("d", absl::Now() - absl::Seconds(1)));
    ASSERT_OK_AND_ASSIGN(std::optional<JobLease> lease, store->LeaseJob("t", absl::Minutes(1)));
    ASSERT_TRUE(lease.has_value());
    Publication p = FirstJob(v, "state-" + std::to_string(v));
    p.base_version = v - 1;
    p.mirror.version = v;
    ASSERT_OK(store->Publish(*lease, p));
  }
  EXPECT_EQ(Query("SELECT count(*) FROM updates WHERE NOT snapshot"), "2");
  EXPECT_EQ(Query("SELECT min(new_version) FROM updates WHERE snapshot"), "3");
  EXPECT_THAT(store->UpdateAfter("d", 3), IsOkAndHolds(Field(&StoredPayload::new_version, 4u)));
  // Pruned: the device must resync from a snapshot.
  EXPECT_THAT(store->UpdateAfter("d", 1), StatusIs(absl::StatusCode::kFailedPrecondition));
}

// Two trainers, each on its own connection and thread, drain a queue of due jobs: no job
// is handed to both while its first lease lives.
TEST_F(PgStoreTest, ConcurrentTrainersNeverLeaseTheSameJob) {
  constexpr int kJobs = 60;
  for (int i = 0; i < kJobs; ++i) {
    ASSERT_OK(store_->ScheduleJob("d" + std::to_string(i), absl::Now() - absl::Seconds(1)));
  }
  std::unique_ptr<PgStore> trainers[2] = {OpenStore(), OpenStore()};
  std::vector<std::string> leased[2];
  absl::Status errors[2];
  absl::Notification go;
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      go.WaitForNotification();
      // An empty answer may come under contention while jobs remain: a few in a row end it.
      for (int empty = 0; empty < 3;) {
        absl::StatusOr<std::optional<JobLease>> lease =
            trainers[t]->LeaseJob("trainer-" + std::to_string(t), absl::Minutes(5));
        if (!lease.ok()) {
          errors[t] = lease.status();
          return;
        }
        if (!lease->has_value()) {
          ++empty;
          continue;
        }
        empty = 0;
        leased[t].push_back((*lease)->device_id);
      }
    });
  }
  go.Notify();
  for (std::thread& t : threads) t.join();
  ASSERT_OK(errors[0]);
  ASSERT_OK(errors[1]);
  std::multiset<std::string> all(leased[0].begin(), leased[0].end());
  all.insert(leased[1].begin(), leased[1].end());
  EXPECT_EQ(all.size(), static_cast<size_t>(kJobs));
  EXPECT_EQ(std::set<std::string>(all.begin(), all.end()).size(), static_cast<size_t>(kJobs))
      << "a job was leased twice";
  EXPECT_EQ(Query("SELECT max(fencing_token) FROM jobs"), "1");
}

// A trainer that stalls past its lease: another trainer takes the job over with a larger
// fencing token, and the stalled one can neither heartbeat nor publish, before or after the
// new one publishes.
TEST_F(PgStoreTest, AnExpiredLeaseIsTakenOverAndItsHolderCannotPublish) {
  std::unique_ptr<PgStore> second = OpenStore();
  ASSERT_NE(second, nullptr);
  ASSERT_OK(store_->Append("d", Batch(1)).status());
  ASSERT_OK(store_->ScheduleJob("d", absl::Now() - absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> stalled,
                       store_->LeaseJob("stalled", absl::Milliseconds(1500)));
  ASSERT_TRUE(stalled.has_value());
  EXPECT_THAT(second->LeaseJob("fresh", absl::Minutes(1)), IsOkAndHolds(NoJob()));

  std::optional<JobLease> fresh;
  ASSERT_TRUE(WaitUntil(
      [&] {
        absl::StatusOr<std::optional<JobLease>> lease = second->LeaseJob("fresh", absl::Minutes(1));
        if (lease.ok()) fresh = *lease;
        return fresh.has_value();
      },
      absl::Seconds(20)));
  EXPECT_EQ(fresh->device_id, "d");
  EXPECT_GT(fresh->fencing_token, stalled->fencing_token);

  EXPECT_THAT(store_->Heartbeat(&*stalled, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(store_->Publish(*stalled, FirstJob(1, "stale")),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no longer held")));
  EXPECT_THAT(store_->LoadMirror("d"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(store_->LatestVersion("d"), IsOkAndHolds(0u));

  ASSERT_OK(second->Publish(*fresh, FirstJob(1, "fresh")));
  EXPECT_THAT(store_->Publish(*stalled, FirstJob(1, "stale")),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(store_->LoadMirror("d"), IsOkAndHolds(Field(&MirrorState::state, "fresh")));
  EXPECT_EQ(Query("SELECT count(*) FROM updates"), "2");  // one update, one snapshot
}

// An expired lease nobody took over is lost all the same: its holder cannot publish, and
// the job is leasable again.
TEST_F(PgStoreTest, AnExpiredLeaseIsLostEvenIfNobodyTookItOver) {
  ASSERT_OK(store_->ScheduleJob("d", absl::Now() - absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> lease,
                       store_->LeaseJob("t", absl::Milliseconds(200)));
  ASSERT_TRUE(lease.has_value());
  ASSERT_TRUE(WaitForServerTime(lease->expires_at));
  EXPECT_THAT(store_->Publish(*lease, FirstJob(0)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("expired")));
  EXPECT_THAT(store_->Heartbeat(&*lease, absl::Minutes(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(store_->LeaseJob("u", absl::Minutes(1)),
              IsOkAndHolds(Optional(Field(&JobLease::fencing_token, 2))));
}

// Heartbeats keep a lease past its first expiry; a released lease makes the job due again.
TEST_F(PgStoreTest, HeartbeatKeepsTheLeaseAndReleaseGivesItBack) {
  std::unique_ptr<PgStore> other = OpenStore();
  ASSERT_NE(other, nullptr);
  ASSERT_OK(store_->ScheduleJob("d", absl::Now() - absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> lease,
                       store_->LeaseJob("t", absl::Milliseconds(1500)));
  ASSERT_TRUE(lease.has_value());
  const absl::Time first_expiry = lease->expires_at;
  ASSERT_OK(store_->Heartbeat(&*lease, absl::Minutes(1)));
  EXPECT_GT(lease->expires_at, first_expiry);
  ASSERT_TRUE(WaitForServerTime(first_expiry));
  EXPECT_THAT(other->LeaseJob("u", absl::Minutes(1)), IsOkAndHolds(NoJob()));

  ASSERT_OK(store_->ReleaseLease(*lease, absl::Now() - absl::Seconds(1)));
  EXPECT_THAT(store_->ReleaseLease(*lease, absl::Now()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(other->LeaseJob("u", absl::Minutes(1)),
              IsOkAndHolds(Optional(Field(&JobLease::owner, "u"))));
}

// A device's job leased outside the queue (a rollback): exclusive with the queue's leases,
// not due because of it, and ended like any lease.
TEST_F(PgStoreTest, LeaseDeviceJobExcludesTheQueueAndReleasesNotDue) {
  std::unique_ptr<PgStore> other = OpenStore();
  ASSERT_NE(other, nullptr);
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> held,
                       store_->LeaseDeviceJob("d", "front", absl::Minutes(1)));
  ASSERT_TRUE(held.has_value());
  EXPECT_EQ(held->device_id, "d");
  EXPECT_THAT(Query("SELECT due_at FROM jobs WHERE device_id = 'd'"), "NULL");
  // Neither another front nor a trainer gets it while the lease lives, due or not.
  EXPECT_THAT(other->LeaseDeviceJob("d", "front-2", absl::Minutes(1)), IsOkAndHolds(NoJob()));
  ASSERT_OK(other->ScheduleJob("d", absl::Now() - absl::Seconds(1)));
  EXPECT_THAT(other->LeaseJob("t", absl::Minutes(1)), IsOkAndHolds(NoJob()));
  // Given back not due: the queue has nothing; leased again, the fencing token grew.
  ASSERT_OK(store_->ReleaseLease(*held, absl::InfiniteFuture()));
  EXPECT_THAT(Query("SELECT due_at FROM jobs WHERE device_id = 'd'"), "NULL");
  EXPECT_THAT(other->LeaseJob("t", absl::Minutes(1)), IsOkAndHolds(NoJob()));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> again,
                       other->LeaseDeviceJob("d", "front-2", absl::Minutes(1)));
  ASSERT_TRUE(again.has_value());
  EXPECT_GT(again->fencing_token, held->fencing_token);
  EXPECT_THAT(store_->ReleaseLease(*held, absl::Now()),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  // A batch stored while a lease is held keeps the job due when the lease is given back.
  v1::UplinkBatch batch;
  batch.set_sequence(1);
  batch.set_sample_count(1);
  batch.set_payload("x");
  ASSERT_OK(store_->Append("d", batch).status());
  ASSERT_OK(other->ReleaseLease(*again, absl::InfiniteFuture()));
  EXPECT_THAT(store_->LeaseJob("t", absl::Minutes(1)),
              IsOkAndHolds(Optional(Field(&JobLease::device_id, "d"))));
}

// A fault at each statement of a publication in turn (the N-th statement fails, N = 1, 2,
// ... until the publication goes through): after every failure nothing of it is stored
// and the lease is still held, so the same publication can be retried.
TEST_F(PgStoreTest, PublishIsAtomicUnderAFaultAtEveryStatement) {
  ASSERT_OK(store_->Append("d", Batch(1)).status());
  ASSERT_OK(store_->Append("d", Batch(2)).status());
  ASSERT_OK(store_->ScheduleJob("d", absl::Now() - absl::Seconds(1)));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> first, store_->LeaseJob("t", absl::Minutes(5)));
  ASSERT_TRUE(first.has_value());
  ASSERT_OK(store_->Publish(*first, FirstJob(/*consumed=*/1)));
  ASSERT_OK_AND_ASSIGN(std::optional<JobLease> lease, store_->LeaseJob("t", absl::Minutes(5)));
  ASSERT_TRUE(lease.has_value());

  Publication next;
  next.base_version = 1;
  next.mirror = MirrorState{2, 2, "state-2"};
  next.update_payload = "update-2";
  next.state_digest = 22;
  next.snapshot_payload = "snapshot-2";
  Connection* conn = store_->connection_for_testing();
  int fault_at = 1;
  for (; fault_at < 50; ++fault_at) {
    int statements = 0;
    conn->set_statement_hook([&](absl::string_view sql) {
      return ++statements == fault_at ? absl::UnavailableError(absl::StrCat("injected at ", sql))
                                      : absl::OkStatus();
    });
    const absl::Status status = store_->Publish(*lease, next);
    conn->set_statement_hook(nullptr);
    if (status.ok()) break;
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("injected")));
    SCOPED_TRACE(absl::StrCat("fault at statement ", fault_at, ": ", status.ToString()));
    EXPECT_THAT(store_->LoadMirror("d"), IsOkAndHolds(Field(&MirrorState::state, "state-1")));
    EXPECT_THAT(store_->LatestVersion("d"), IsOkAndHolds(1u));
    EXPECT_EQ(Query("SELECT count(*) FROM updates"), "2");
    EXPECT_EQ(Query("SELECT lease_owner || ':' || fencing_token FROM jobs"),
              "t:" + std::to_string(lease->fencing_token));
    EXPECT_NE(Query("SELECT due_at FROM jobs"), "NULL");
  }
  EXPECT_GE(fault_at, 8) << "the publication should have walked every statement";
  EXPECT_THAT(store_->LoadMirror("d"), IsOkAndHolds(Field(&MirrorState::state, "state-2")));
  EXPECT_THAT(store_->UpdateAfter("d", 1),
              IsOkAndHolds(Field(&StoredPayload::payload, "update-2")));
  EXPECT_THAT(store_->Snapshot("d", 0), IsOkAndHolds(Field(&StoredPayload::new_version, 2u)));
  EXPECT_EQ(Query("SELECT lease_owner FROM jobs"), "NULL");
  EXPECT_EQ(Query("SELECT due_at FROM jobs"), "NULL");
}

}  // namespace
}  // namespace cdcca::cloud::pg
