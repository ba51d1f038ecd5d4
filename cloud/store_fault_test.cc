// The cloud's stores under every injected file fault (storage/fault_injection_env.h) at
// every step: an uplink append and its ack (SampleStore, across a segment roll-over), an
// update and snapshot publish (UpdateStore), device registration (DeviceRegistry). After
// each fault the store is opened again on what survived and must hold everything it acked,
// serve nothing half-written, and take the next write. Also: the sealed formats of the
// registry and update files, and their format-1 predecessors.
#include <map>

#include "absl/strings/str_cat.h"
#include "cloud/device_registry.h"
#include "cloud/sample_store.h"
#include "cloud/update_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "storage/fault_injection_env.h"
#include "storage/sealed_file.h"
#include "tests/testing/fault_walk.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::kAllFaults;
using ::cdcca::testing::StatusIs;
using ::cdcca::testing::WalkFault;
using storage::Fault;
using storage::FaultInjectionEnv;

// ---- SampleStore: uplink append + ack ------------------------------------------------------

constexpr char kSamples[] = "/cloud/samples";

std::string Payload(const std::string& device, uint64_t seq) {
  // 24 KiB: three records fill a 64 KiB segment, so the walk crosses a roll-over.
  std::string p(24 << 10, '\0');
  for (size_t i = 0; i < p.size(); ++i)
    p[i] = static_cast<char>((seq * 131 + i + device[0]) & 0xff);
  return p;
}

v1::UplinkBatch Batch(const std::string& device, uint64_t seq) {
  v1::UplinkBatch b;
  b.set_sequence(seq);
  b.set_sample_count(1);
  b.set_codec_version(1);
  b.set_payload(Payload(device, seq));
  return b;
}

absl::StatusOr<std::unique_ptr<SampleStore>> OpenSamples(FaultInjectionEnv& env) {
  SampleStoreOptions o;
  o.dir = kSamples;
  o.segment_bytes = 64 << 10;
  o.env = &env;
  return SampleStore::Open(o);
}

TEST(StoreFaultTest, UplinkAppendKeepsEveryAckedBatchUnderEveryFault) {
  const std::vector<std::pair<std::string, uint64_t>> appends = {
      {"dev-a", 1}, {"dev-b", 1}, {"dev-a", 2}, {"dev-a", 3}, {"dev-b", 2}, {"dev-a", 4}};
  for (Fault fault : kAllFaults) {
    std::map<std::string, uint64_t> acked;
    const uint64_t steps = WalkFault(
        fault,
        [&](FaultInjectionEnv& env) {
          acked.clear();
          // A batch stored before the operation: it must survive everything too.
          ASSERT_OK_AND_ASSIGN(auto store, OpenSamples(env));
          ASSERT_OK(store->AppendAndWait("dev-c", Batch("dev-c", 1)).status());
          acked["dev-c"] = 1;
        },
        [&](FaultInjectionEnv& env) {
          absl::StatusOr<std::unique_ptr<SampleStore>> store = OpenSamples(env);
          if (!store.ok()) return;
          for (const auto& [device, seq] : appends) {
            absl::StatusOr<AppendResult> r = (*store)->AppendAndWait(device, Batch(device, seq));
            if (r.ok()) {
              EXPECT_EQ(r->highest_durable, seq);
              acked[device] = seq;
            }
          }
        },
        [&](FaultInjectionEnv& env) {
          ASSERT_OK_AND_ASSIGN(auto store, OpenSamples(env));
          for (const char* device : {"dev-a", "dev-b", "dev-c"}) {
            const uint64_t highest = store->HighestDurable(device);
            EXPECT_GE(highest, acked[device]) << device << ": an acked batch was lost";
            ASSERT_OK_AND_ASSIGN(auto records, store->Read(device, 1, 100));
            ASSERT_EQ(records.size(), highest) << device;
            for (size_t i = 0; i < records.size(); ++i) {
              EXPECT_EQ(records[i].batch().sequence(), i + 1) << device;
              EXPECT_TRUE(records[i].batch().payload() == Payload(device, i + 1))
                  << device << " batch " << i + 1 << " came back different";
            }
            // The store takes the next batch.
            ASSERT_OK_AND_ASSIGN(AppendResult next,
                                 store->AppendAndWait(device, Batch(device, highest + 1)));
            EXPECT_EQ(next.highest_durable, highest + 1);
            acked[device] = highest + 1;
          }
        });
    EXPECT_GE(steps, fault == Fault::kShortWrite ? 3u : 8u) << storage::FaultName(fault);
  }
}

// A record the process before wrote but never synced (it died first) is found by the next
// open; a resend of it is acked as a duplicate, so the open must make it durable.
TEST(StoreFaultTest, ARecordFoundAfterACrashIsDurableBeforeItsResendIsAcked) {
  FaultInjectionEnv env;
  {
    SampleStoreOptions o;
    o.dir = kSamples;
    o.env = &env;
    o.sync = false;  // as if the process died between the write and the sync
    ASSERT_OK_AND_ASSIGN(auto store, SampleStore::Open(o));
    ASSERT_OK(store->AppendAndWait("dev-a", Batch("dev-a", 1)).status());
  }
  env.Restart();  // a crash: the page cache keeps the record
  {
    ASSERT_OK_AND_ASSIGN(auto store, OpenSamples(env));
    ASSERT_OK_AND_ASSIGN(AppendResult resend, store->AppendAndWait("dev-a", Batch("dev-a", 1)));
    EXPECT_TRUE(resend.duplicate);
    EXPECT_EQ(resend.highest_durable, 1u);
  }
  env.CutPower();
  env.Restart();
  ASSERT_OK_AND_ASSIGN(auto store, OpenSamples(env));
  EXPECT_EQ(store->HighestDurable("dev-a"), 1u) << "an acked batch was lost";
}

// ---- UpdateStore: publish an update and its snapshot ---------------------------------------

constexpr char kUpdates[] = "/cloud/updates";

absl::StatusOr<std::unique_ptr<UpdateStore>> OpenUpdates(FaultInjectionEnv& env) {
  UpdateStoreOptions o;
  o.dir = kUpdates;
  o.keep_per_device = 1;  // a publish also removes the previous file of its kind
  o.env = &env;
  return UpdateStore::Open(o);
}

TEST(StoreFaultTest, UpdatePublishIsAllOrNothingUnderEveryFault) {
  const std::string update2(3000, 'u'), snapshot2(5000, 's');
  for (Fault fault : kAllFaults) {
    bool update_acked = false, snapshot_acked = false;
    const uint64_t steps = WalkFault(
        fault,
        [&](FaultInjectionEnv& env) {
          update_acked = snapshot_acked = false;
          ASSERT_OK_AND_ASSIGN(auto store, OpenUpdates(env));
          ASSERT_OK(store->PutUpdate("dev-a", 0, 1, 10, "update-1"));
          ASSERT_OK(store->PutSnapshot("dev-a", 1, 10, "snapshot-1"));
        },
        [&](FaultInjectionEnv& env) {
          absl::StatusOr<std::unique_ptr<UpdateStore>> store = OpenUpdates(env);
          if (!store.ok()) return;
          update_acked = (*store)->PutUpdate("dev-a", 1, 2, 20, update2).ok();
          if (update_acked) snapshot_acked = (*store)->PutSnapshot("dev-a", 2, 20, snapshot2).ok();
        },
        [&](FaultInjectionEnv& env) {
          ASSERT_OK_AND_ASSIGN(auto store, OpenUpdates(env));
          const uint64_t latest = store->LatestVersion("dev-a");
          EXPECT_TRUE(latest == 1 || latest == 2) << latest;
          if (latest == 1) {
            ASSERT_OK_AND_ASSIGN(StoredUpdate first, store->UpdateAfter("dev-a", 0));
            EXPECT_EQ(*first.payload, "update-1");
          }
          absl::StatusOr<StoredUpdate> second = store->UpdateAfter("dev-a", 1);
          if (update_acked) {
            ASSERT_OK(second.status()) << "an acked update was lost";
          }
          if (second.ok()) {
            EXPECT_EQ(second->new_version, 2u);
            EXPECT_EQ(second->state_digest, 20u);
            EXPECT_EQ(*second->payload, update2);
          }
          ASSERT_OK_AND_ASSIGN(StoredUpdate snap, store->Snapshot("dev-a", 0));
          if (snapshot_acked) {
            EXPECT_EQ(snap.new_version, 2u) << "an acked snapshot was lost";
          }
          EXPECT_EQ(*snap.payload, snap.new_version == 2 ? snapshot2 : "snapshot-1");
          // The store takes the next publish.
          const uint64_t z = store->LatestVersion("dev-z");
          ASSERT_OK(store->PutUpdate("dev-z", z, z + 1, 30, "next"));
        });
    EXPECT_GE(steps, fault == Fault::kShortWrite ? 2u : 10u) << storage::FaultName(fault);
  }
}

// ---- DeviceRegistry: registration and the applied version ---------------------------------

constexpr char kRegistry[] = "/cloud/registry";

TEST(StoreFaultTest, RegistryKeepsEveryAckedRecordUnderEveryFault) {
  for (Fault fault : kAllFaults) {
    bool registered_b = false, applied_a = false;
    const uint64_t steps = WalkFault(
        fault,
        [&](FaultInjectionEnv& env) {
          registered_b = applied_a = false;
          ASSERT_OK_AND_ASSIGN(auto registry, DeviceRegistry::Open(kRegistry, &env));
          ASSERT_OK(registry->Register("dev-a", 7, {}).status());
        },
        [&](FaultInjectionEnv& env) {
          absl::StatusOr<std::unique_ptr<DeviceRegistry>> registry =
              DeviceRegistry::Open(kRegistry, &env);
          if (!registry.ok()) return;
          applied_a = (*registry)->SetApplied("dev-a", 3, 33, true).ok();
          registered_b = (*registry)->Register("dev-b", 8, {}).ok();
        },
        [&](FaultInjectionEnv& env) {
          ASSERT_OK_AND_ASSIGN(auto registry, DeviceRegistry::Open(kRegistry, &env));
          ASSERT_OK_AND_ASSIGN(store::v1::DeviceRecord a, registry->Get("dev-a"));
          EXPECT_EQ(a.model_fingerprint(), 7u);
          if (applied_a) {
            EXPECT_EQ(a.applied_version(), 3u) << "an acked report was lost";
          }
          if (a.applied_version() != 0) {
            EXPECT_EQ(a.applied_digest(), 33u);
          }
          if (registered_b) {
            ASSERT_OK(registry->Get("dev-b").status()) << "dev-b was lost";
          }
          ASSERT_OK(registry->Register("dev-b", 8, {}).status());
        });
    EXPECT_GE(steps, fault == Fault::kShortWrite ? 2u : 10u) << storage::FaultName(fault);
  }
}

// ---- sealed formats ------------------------------------------------------------------------

TEST(StoreFormatTest, AFlippedHeaderFieldOfAnUpdateIsNeverServed) {
  FaultInjectionEnv env;
  {
    ASSERT_OK_AND_ASSIGN(auto store, OpenUpdates(env));
    ASSERT_OK(store->PutUpdate("dev-a", 0, 1, 0x1111, "payload"));
  }
  const std::string path = absl::StrCat(kUpdates, "/dev-a/update-00000000000000000001.pb");
  ASSERT_OK_AND_ASSIGN(std::string bytes, storage::ReadFile(env, path));
  // The state digest is a header field (outside the payload its SHA-256 covers).
  const size_t at = bytes.find(std::string("\x11\x11\0\0", 4));
  ASSERT_NE(at, std::string::npos);
  bytes[at] = 0x13;
  ASSERT_OK(storage::WriteFileAtomically(env, path, bytes));
  ASSERT_OK_AND_ASSIGN(auto store, OpenUpdates(env));
  EXPECT_THAT(store->UpdateAfter("dev-a", 0), StatusIs(absl::StatusCode::kNotFound));
}

TEST(StoreFormatTest, Format1UpdateAndRegistryFilesAreStillRead) {
  FaultInjectionEnv env;
  ASSERT_OK(env.CreateDirs(absl::StrCat(kUpdates, "/dev-a")));
  store::v1::StoredPayload stored;
  stored.set_device_id("dev-a");
  stored.set_base_version(0);
  stored.set_new_version(1);
  stored.set_state_digest(5);
  stored.set_payload("old");
  stored.set_sha256(wire::Sha256("old"));
  ASSERT_OK(storage::WriteFileAtomically(
      env, absl::StrCat(kUpdates, "/dev-a/update-00000000000000000001.pb"),
      stored.SerializeAsString()));
  ASSERT_OK(env.CreateDirs(kRegistry));
  store::v1::DeviceRecord record;
  record.set_device_id("dev-a");
  record.set_model_fingerprint(7);
  ASSERT_OK(storage::WriteFileAtomically(env, absl::StrCat(kRegistry, "/dev-a.pb"),
                                         record.SerializeAsString()));

  ASSERT_OK_AND_ASSIGN(auto updates, OpenUpdates(env));
  ASSERT_OK_AND_ASSIGN(StoredUpdate u, updates->UpdateAfter("dev-a", 0));
  EXPECT_EQ(*u.payload, "old");
  EXPECT_EQ(u.state_digest, 5u);
  ASSERT_OK_AND_ASSIGN(auto registry, DeviceRegistry::Open(kRegistry, &env));
  EXPECT_THAT(registry->Register("dev-a", 8, {}), StatusIs(absl::StatusCode::kFailedPrecondition));
  // The next write seals it.
  ASSERT_OK(registry->SetApplied("dev-a", 1, 5, true));
  ASSERT_OK_AND_ASSIGN(std::string bytes,
                       storage::ReadFile(env, absl::StrCat(kRegistry, "/dev-a.pb")));
  EXPECT_TRUE(storage::IsSealed(bytes));
}

TEST(StoreFormatTest, ADamagedRegistryFileIsDataLossNamingIt) {
  FaultInjectionEnv env;
  {
    ASSERT_OK_AND_ASSIGN(auto registry, DeviceRegistry::Open(kRegistry, &env));
    ASSERT_OK(registry->Register("dev-a", 7, {}).status());
  }
  const std::string path = absl::StrCat(kRegistry, "/dev-a.pb");
  ASSERT_OK_AND_ASSIGN(std::string bytes, storage::ReadFile(env, path));
  bytes[bytes.size() / 2] ^= 0x04;
  ASSERT_OK(storage::WriteFileAtomically(env, path, bytes));
  EXPECT_THAT(DeviceRegistry::Open(kRegistry, &env).status(),
              StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr(path)));
}

}  // namespace
}  // namespace cdcca::cloud
