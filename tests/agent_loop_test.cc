// DeviceAgent against an in-process cloud (CloudService over loopback gRPC) with the real
// PerDeviceStrategy, on a random-init `tiny` family: the round trip lands the device on the
// mirror's digest, a device whose state differs is resynced from the snapshot, the agent
// keeps answering while the cloud is away and uplinks later, and the bandwidth cap paces
// the uplink.
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/time/clock.h"
#include "cloud/trainer.h"
#include "compress/hash64.h"
#include "compress/uplink_codec.h"
#include "datasets/formats.h"
#include "datasets/tokenizer.h"
#include "device/agent.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/arch/answerer.h"
#include "storage/fault_injection_env.h"
#include "tests/testing/fault_walk.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_family.h"
#include "tests/testing/transport_fixture.h"
#include "tests/testing/wait.h"

namespace cdcca {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;
using ::cdcca::testing::WaitUntil;
using ::testing::HasSubstr;

// What the program's JobScheduler does for a Rollback RPC: the strategy's Rollback.
class RollbackToStrategy final : public cloud::CloudObserver {
 public:
  cloud::PerDeviceStrategy* strategy = nullptr;
  absl::StatusOr<cloud::RollbackResult> OnRollback(const std::string& device_id,
                                                   uint64_t device_version,
                                                   uint64_t to_version) override {
    return strategy->Rollback(device_id, device_version, to_version);
  }
};

class AgentLoopTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(21);
    checkpoint_ = dir_.path() + "/family";
    ASSERT_OK(testing::WriteTinyFamily(checkpoint_));

    device::RuntimeOptions ro;
    ro.checkpoint_dir = checkpoint_;
    ro.precision = "int8";
    ro.threads = 1;
    ro.max_answer_tokens = 3;
    ASSERT_OK_AND_ASSIGN(runtime_, device::InferenceRuntime::Load(ro));

    testing::CloudFixtureOptions fo;
    fo.data_dir = dir_.path() + "/cloud";
    fo.devices = 1;
    fo.server.listen_address = "127.0.0.1:0";
    fo.server.insecure = true;
    fo.observer = &rollback_;
    fo.service.guard_holdout_fraction = service_holdout_fraction_;
    // As a cloud with the model serves it (OpenCloud: the strategy's BaseDigest, checked
    // equal below).
    fo.service.base_state_digest = runtime_->StateDigest();
    cloud_ = std::make_unique<testing::CloudFixture>(fo);
    ASSERT_OK(cloud_->Start());
    ASSERT_OK_AND_ASSIGN(strategy_, cloud::PerDeviceStrategy::Create(
                                        StrategyOptions(), cloud_->samples(), cloud_->updates()));
    ASSERT_EQ(strategy_->BaseDigest(), fo.service.base_state_digest);
    rollback_.strategy = strategy_.get();
    device::CloudClientOptions co;
    co.max_attempts = 2;
    co.initial_backoff = absl::Milliseconds(10);
    co.call_timeout = absl::Seconds(5);
    client_ = cloud_->Client(0, co);
  }

  cloud::PerDeviceStrategyOptions StrategyOptions() const {
    cloud::PerDeviceStrategyOptions so;
    so.checkpoint_dir = checkpoint_;
    so.student_precision = "int8";
    so.state_dir = dir_.path() + "/cloud/trainer";
    so.max_steps = 3;
    so.batch_size = 4;
    so.torch_threads = 1;
    // The loop under test moves every uplinked sample into a job and every job's update to
    // the device; whether an update helps is the guard's test (cloud/trainer_test.cc).
    so.guard.enabled = false;
    return so;
  }

  device::AgentOptions Options() const {
    device::AgentOptions o;
    o.state_dir = dir_.path() + "/device";
    o.uts.keep_fraction = 0;  // fixed alpha 0: every answer passes stage 1
    o.uts.entropy_alpha = 0;
    o.uts.mc_passes = 2;
    o.uts.token_ratio = 0.5f;
    o.batch_samples = 4;
    return o;
  }

  static std::vector<device::Frame> Frames(int n, int seed) {
    std::vector<device::Frame> frames(n);
    for (int i = 0; i < n; ++i) {
      frames[i].image = datasets::Image(64, 64);
      for (size_t k = 0; k < frames[i].image.pixels.size(); ++k) {
        frames[i].image.pixels[k] = static_cast<uint8_t>((k * 131 + (seed + i) * 977) % 251);
      }
      frames[i].question = i % 2 == 0 ? "what is in the picture?" : "how many items?";
    }
    return frames;
  }

  TempDir dir_;
  std::string checkpoint_;
  // What the cloud tells devices it holds out for its update guard (0: no guard).
  double service_holdout_fraction_ = 0;
  RollbackToStrategy rollback_;
  std::unique_ptr<testing::CloudFixture> cloud_;
  std::unique_ptr<cloud::PerDeviceStrategy> strategy_;
  std::unique_ptr<device::InferenceRuntime> runtime_;
  std::unique_ptr<device::CloudClient> client_;
};

TEST_F(AgentLoopTest, RoundTripAndResyncOfADivergedState) {
  ASSERT_OK_AND_ASSIGN(std::string pretrained, runtime_->SaveTrainableState());
  {
    ASSERT_OK_AND_ASSIGN(auto agent,
                         device::DeviceAgent::Create(Options(), runtime_.get(), client_.get()));
    ASSERT_OK_AND_ASSIGN(auto results, agent->Process(Frames(8, 1)));
    ASSERT_EQ(results.size(), 8u);
    for (const auto& r : results) {
      EXPECT_TRUE(r.uplinked);
      EXPECT_GT(r.kept_tokens, 0);
      EXPECT_EQ(r.model_version, 0u);
    }
    EXPECT_EQ(agent->Stats().queue.batches, 2u);
    ASSERT_OK(agent->SyncOnce());
    device::AgentStats s = agent->Stats();
    EXPECT_EQ(s.batches_acked, 2u);
    EXPECT_EQ(s.queue.batches, 0u);
    EXPECT_EQ(cloud_->samples()->HighestDurable("dev-0"), 2u);

    ASSERT_OK_AND_ASSIGN(cloud::JobReport report, strategy_->RunJob("dev-0"));
    EXPECT_EQ(report.samples, 8);
    ASSERT_OK(agent->SyncOnce());
    s = agent->Stats();
    EXPECT_EQ(s.version, 1u);
    EXPECT_EQ(s.updates_applied, 1u);
    EXPECT_EQ(s.state_digest, report.state_digest);
    EXPECT_EQ(runtime_->StateDigest(), report.state_digest);
    EXPECT_TRUE(s.in_sync);
    ASSERT_OK_AND_ASSIGN(results, agent->Process(Frames(2, 9)));
    EXPECT_EQ(results[0].model_version, 1u);
  }

  // A state file that claims version 1 but holds other weights (as a device whose disk
  // was restored from an old image would): the digest check catches it at Register and
  // the snapshot puts the device back on the mirror.
  ASSERT_OK(runtime_->LoadTrainableState(pretrained, 1));
  const uint64_t wrong = runtime_->StateDigest();
  std::string file;
  const uint64_t version = 1;
  file.append(reinterpret_cast<const char*>(&version), 8);
  file.append(reinterpret_cast<const char*>(&wrong), 8);
  file += pretrained;
  const uint64_t hash = compress::Hash64(file.data(), file.size());
  file.append(reinterpret_cast<const char*>(&hash), 8);
  { std::ofstream(Options().state_dir + "/trainable.state", std::ios::binary) << file; }
  ASSERT_OK_AND_ASSIGN(auto agent,
                       device::DeviceAgent::Create(Options(), runtime_.get(), client_.get()));
  EXPECT_EQ(agent->Stats().state_digest, wrong);
  ASSERT_OK(agent->SyncOnce());
  device::AgentStats s = agent->Stats();
  EXPECT_EQ(s.resyncs, 1u);
  EXPECT_TRUE(s.in_sync);
  EXPECT_EQ(s.state_digest, strategy_->State("dev-0").state_digest);
  EXPECT_NE(s.state_digest, wrong);
}

// A state file at version 0 whose weights are not the pretrained base's (intact framing, its
// own digest: a base state damaged before it was written, or another model's): the device
// reports it at Register, the cloud checks it against the base digest it knows, and the
// device returns to the base, before any update and after one alike.
TEST_F(AgentLoopTest, AVersionZeroStateThatIsNotTheBaseIsResynced) {
  ASSERT_OK_AND_ASSIGN(const std::string pretrained, runtime_->SaveTrainableState());
  const uint64_t base = runtime_->StateDigest();
  // The base with one weight moved a little: the lowest byte of the last float32 of the
  // safetensors blob (its data ends it).
  std::string damaged = pretrained;
  damaged[damaged.size() - 4] ^= 0x01;
  ASSERT_OK(runtime_->LoadTrainableState(damaged, 0));
  const uint64_t wrong = runtime_->StateDigest();
  ASSERT_NE(wrong, base);
  ASSERT_OK(runtime_->LoadTrainableState(pretrained, 0));
  const auto write_state = [&] {
    std::string file;
    const uint64_t version = 0;
    file.append(reinterpret_cast<const char*>(&version), 8);
    file.append(reinterpret_cast<const char*>(&wrong), 8);
    file += damaged;
    const uint64_t hash = compress::Hash64(file.data(), file.size());
    file.append(reinterpret_cast<const char*>(&hash), 8);
    std::filesystem::create_directories(Options().state_dir);
    std::ofstream(Options().state_dir + "/trainable.state", std::ios::binary) << file;
  };

  // No update yet: the cloud holds no snapshot, so the device goes back to the base.
  write_state();
  {
    ASSERT_OK_AND_ASSIGN(auto agent,
                         device::DeviceAgent::Create(Options(), runtime_.get(), client_.get()));
    EXPECT_EQ(agent->Stats().state_digest, wrong);
    ASSERT_OK(agent->SyncOnce());
    const device::AgentStats s = agent->Stats();
    EXPECT_EQ(s.resyncs, 1u);
    EXPECT_TRUE(s.in_sync);
    EXPECT_EQ(s.version, 0u);
    EXPECT_EQ(s.state_digest, base);
    EXPECT_EQ(runtime_->StateDigest(), base);
    ASSERT_OK_AND_ASSIGN(auto record, cloud_->registry()->Get("dev-0"));
    EXPECT_TRUE(record.in_sync());
    EXPECT_EQ(record.applied_digest(), base);
    // Its uplink and the update on the base go on as for any device.
    ASSERT_OK(agent->Process(Frames(4, 3)).status());
    ASSERT_OK(agent->SyncOnce());
    ASSERT_OK_AND_ASSIGN(cloud::JobReport report, strategy_->RunJob("dev-0"));
    ASSERT_OK(agent->SyncOnce());
    EXPECT_EQ(agent->Stats().version, 1u);
    EXPECT_EQ(runtime_->StateDigest(), report.state_digest);
    EXPECT_TRUE(agent->Stats().in_sync);
  }

  // After an update: the same file (version 0, not the base) is resynced to the snapshot.
  ASSERT_OK(runtime_->LoadTrainableState(pretrained, 0));
  write_state();
  ASSERT_OK_AND_ASSIGN(auto agent,
                       device::DeviceAgent::Create(Options(), runtime_.get(), client_.get()));
  EXPECT_EQ(agent->Stats().state_digest, wrong);
  ASSERT_OK(agent->SyncOnce());
  const device::AgentStats s = agent->Stats();
  EXPECT_EQ(s.resyncs, 1u);
  EXPECT_TRUE(s.in_sync);
  EXPECT_EQ(s.version, 1u);
  EXPECT_EQ(s.state_digest, strategy_->State("dev-0").state_digest);
}

// A device returns to the state before its newest update together with the cloud: a new
// version whose state is exactly the older one, on the device and the mirror alike, and the
// next update trains from there. Refused on the pretrained base, and for a version the device
// does not run; durable across a restart of the cloud's trainer.
TEST_F(AgentLoopTest, RollsBackToTheStateBeforeTheNewestUpdateWithTheCloud) {
  ASSERT_OK_AND_ASSIGN(auto agent,
                       device::DeviceAgent::Create(Options(), runtime_.get(), client_.get()));
  EXPECT_THAT(agent->RollBack(0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("nothing to roll back")));
  std::vector<uint64_t> digests;
  for (int round = 0; round < 2; ++round) {
    ASSERT_OK(agent->Process(Frames(8, 1 + 10 * round)).status());
    ASSERT_OK(agent->SyncOnce());
    ASSERT_OK_AND_ASSIGN(cloud::JobReport report, strategy_->RunJob("dev-0"));
    digests.push_back(report.state_digest);
    ASSERT_OK(agent->SyncOnce());
  }
  ASSERT_NE(digests[0], digests[1]);
  ASSERT_EQ(agent->Stats().version, 2u);

  ASSERT_OK_AND_ASSIGN(v1::RollbackReply reply, agent->RollBack(0));
  EXPECT_EQ(reply.new_version(), 3u);
  EXPECT_EQ(reply.restored_version(), 1u);
  EXPECT_EQ(reply.state_digest(), digests[0]);
  device::AgentStats s = agent->Stats();
  EXPECT_EQ(s.version, 3u);
  EXPECT_EQ(s.state_digest, digests[0]);
  EXPECT_EQ(runtime_->StateDigest(), digests[0]);
  EXPECT_TRUE(s.in_sync);
  EXPECT_EQ(s.rollbacks, 1u);
  cloud::DeviceTrainingState mirror = strategy_->State("dev-0");
  EXPECT_EQ(mirror.version, 3u);
  EXPECT_EQ(mirror.state_digest, digests[0]);
  EXPECT_EQ(mirror.rollbacks, 1u);
  // The cloud refuses a rollback from a version the device does not run.
  EXPECT_THAT(client_->Rollback(2, 0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("mirror is at version 3")));

  // The next update trains from the restored state and lands the device on the mirror.
  ASSERT_OK(agent->Process(Frames(8, 31)).status());
  ASSERT_OK(agent->SyncOnce());
  ASSERT_OK_AND_ASSIGN(cloud::JobReport next, strategy_->RunJob("dev-0"));
  EXPECT_EQ(next.base_version, 3u);
  ASSERT_OK(agent->SyncOnce());
  EXPECT_EQ(agent->Stats().version, 4u);
  EXPECT_EQ(agent->Stats().state_digest, next.state_digest);
  EXPECT_TRUE(agent->Stats().in_sync);

  // A rollback the agent did not ask for (another caller with the device's token): the
  // agent's next rollback first catches up, through the update, whose digest differs from
  // the restored state's, and the snapshot it then resyncs to.
  ASSERT_OK_AND_ASSIGN(reply, client_->Rollback(4, 0));
  EXPECT_EQ(reply.new_version(), 5u);
  EXPECT_EQ(reply.state_digest(), digests[0]);
  ASSERT_OK_AND_ASSIGN(reply, agent->RollBack(0));
  EXPECT_EQ(reply.new_version(), 6u);
  EXPECT_EQ(reply.restored_version(), 4u);
  EXPECT_EQ(reply.state_digest(), next.state_digest);
  EXPECT_EQ(agent->Stats().state_digest, next.state_digest);
  EXPECT_TRUE(agent->Stats().in_sync);
  EXPECT_THAT(client_->Rollback(6, 6), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_OK(client_->Rollback(6, 0).status());  // to the state of 5, digests[0]

  // The trainer restarted on its state files holds the last rollback.
  ASSERT_OK_AND_ASSIGN(strategy_, cloud::PerDeviceStrategy::Create(
                                      StrategyOptions(), cloud_->samples(), cloud_->updates()));
  rollback_.strategy = strategy_.get();
  ASSERT_OK(strategy_->Recover());
  mirror = strategy_->State("dev-0");
  EXPECT_EQ(mirror.version, 7u);
  EXPECT_EQ(mirror.state_digest, digests[0]);
}

// Applying an update under every injected file fault at every step of the device's state
// directory, the device "process" restarted after each (a new runtime and agent on what
// survived): the agent starts; it runs the old version or the new one, never a mix (its
// digest is the mirror's for that version), and never one older than it reported to the
// cloud; an update it holds is not applied again; and the next sync brings it to the new
// version.
TEST_F(AgentLoopTest, ApplyingAnUpdateIsAllOrNothingUnderEveryFileFault) {
  {
    ASSERT_OK_AND_ASSIGN(auto agent,
                         device::DeviceAgent::Create(Options(), runtime_.get(), client_.get()));
    ASSERT_OK(agent->Process(Frames(4, 1)).status());
    ASSERT_OK(agent->SyncOnce());
  }
  ASSERT_OK_AND_ASSIGN(cloud::JobReport report, strategy_->RunJob("dev-0"));
  device::RuntimeOptions ro;
  ro.checkpoint_dir = checkpoint_;
  ro.precision = "int8";
  ro.threads = 1;
  ro.max_answer_tokens = 3;
  const auto options = [&](storage::Env& env) {
    device::AgentOptions o = Options();
    o.state_dir = "/device";  // a fresh device at version 0 on `env`
    o.env = &env;
    return o;
  };
  for (storage::Fault fault : cdcca::testing::kAllFaults) {
    const uint64_t steps = cdcca::testing::WalkFault(
        fault,
        [&](storage::FaultInjectionEnv&) {
          ASSERT_OK(cloud_->registry()->SetApplied("dev-0", 0, strategy_->BaseDigest(), true));
        },
        [&](storage::FaultInjectionEnv& env) {
          ASSERT_OK_AND_ASSIGN(auto runtime, device::InferenceRuntime::Load(ro));
          auto agent = device::DeviceAgent::Create(options(env), runtime.get(), client_.get());
          if (agent.ok()) (void)(*agent)->SyncOnce();
        },
        [&](storage::FaultInjectionEnv& env) {
          ASSERT_OK_AND_ASSIGN(auto runtime, device::InferenceRuntime::Load(ro));
          ASSERT_OK_AND_ASSIGN(
              auto agent, device::DeviceAgent::Create(options(env), runtime.get(), client_.get()));
          const uint64_t version = agent->Stats().version;
          ASSERT_TRUE(version == 0 || version == 1) << version;
          ASSERT_OK_AND_ASSIGN(store::v1::DeviceRecord record, cloud_->registry()->Get("dev-0"));
          EXPECT_GE(version, record.applied_version()) << "the device reported a version it lost";
          EXPECT_EQ(runtime->StateDigest(),
                    version == 1 ? report.state_digest : strategy_->BaseDigest());
          ASSERT_OK(agent->SyncOnce());
          const device::AgentStats s = agent->Stats();
          EXPECT_EQ(s.version, 1u);
          EXPECT_EQ(s.state_digest, report.state_digest);
          EXPECT_EQ(s.updates_applied, version == 1 ? 0u : 1u);
        });
    EXPECT_GE(steps, fault == storage::Fault::kShortWrite ? 1u : 8u) << storage::FaultName(fault);
  }
}

// A batch the queue cannot write (an I/O error, a full disk) is not uplinked and counted as
// unsent; answering goes on and the next batch is queued.
TEST_F(AgentLoopTest, AQueueWriteThatFailsDropsTheBatchAndServingGoesOn) {
  storage::FaultInjectionEnv env;
  device::AgentOptions o = Options();
  o.state_dir = "/device";
  o.env = &env;
  ASSERT_OK_AND_ASSIGN(auto agent, device::DeviceAgent::Create(o, runtime_.get(), client_.get()));
  env.Arm(storage::Fault::kEio, 1);  // the new batch file's open
  ASSERT_OK_AND_ASSIGN(auto results, agent->Process(Frames(4, 1)));
  EXPECT_EQ(results.size(), 4u);
  EXPECT_TRUE(env.fault_hit());
  EXPECT_EQ(agent->Stats().unsent_samples, 4u);
  EXPECT_EQ(agent->Stats().queue.batches, 0u);
  ASSERT_OK(agent->Process(Frames(4, 2)).status());
  EXPECT_EQ(agent->Stats().queue.batches, 1u);
}

TEST_F(AgentLoopTest, ServesWhileTheCloudIsAwayThenUplinksUnderTheCap) {
  cloud_->Stop();
  device::AgentOptions o = Options();
  o.uplink_max_batches = 1;  // one batch per stream, so the pacing shows between streams
  uint64_t batch_bytes = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto agent, device::DeviceAgent::Create(o, runtime_.get(), client_.get()));
    ASSERT_OK_AND_ASSIGN(auto results, agent->Process(Frames(12, 3)));
    EXPECT_EQ(results.size(), 12u);
    EXPECT_FALSE(agent->SyncOnce().ok());
    device::AgentStats s = agent->Stats();
    EXPECT_FALSE(s.link_up);
    EXPECT_EQ(s.answered, 12u);
    EXPECT_EQ(s.queue.batches, 3u);
    batch_bytes = s.queue.bytes;
  }
  // The queue survived the agent; the cloud comes back on the same port.
  ASSERT_OK(cloud_->Start());
  o.bandwidth_bytes_per_s = batch_bytes / 3;  // about one batch per second
  ASSERT_OK_AND_ASSIGN(auto agent, device::DeviceAgent::Create(o, runtime_.get(), client_.get()));
  EXPECT_EQ(agent->Stats().queue.batches, 3u);
  // gRPC reconnects with its own backoff after the refused connections; the agent's loop
  // simply tries again next poll.
  double seconds = 0;
  absl::Status synced = absl::UnavailableError("not tried");
  for (int attempt = 0; attempt < 100 && !synced.ok(); ++attempt) {
    const absl::Time start = absl::Now();
    synced = agent->SyncOnce();
    seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (!synced.ok()) absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_OK(synced);
  device::AgentStats s = agent->Stats();
  EXPECT_TRUE(s.link_up);
  EXPECT_EQ(s.queue.batches, 0u);
  EXPECT_EQ(cloud_->samples()->HighestDurable("dev-0"), 3u);
  // Three streams at the cap: the third may start only after the first two's bytes would
  // have taken at the cap (a lower bound; a slow machine only makes it longer).
  EXPECT_GE(seconds, 1.5);
}

// The link thread on an injected clock (the harness's virtual one): a flush wakes it at
// once, so the uplink does not wait for time, but its next poll for an update comes only
// once that clock has moved by the poll interval, however much real time passes.
TEST_F(AgentLoopTest, TheLinkLoopPollsOnItsClock) {
  VirtualClock clock;
  device::AgentOptions o = Options();
  o.clock = &clock;
  // Shorter than the real time the test watches: a loop that polled on real time would show.
  o.poll_interval = absl::Milliseconds(100);
  ASSERT_OK_AND_ASSIGN(auto agent, device::DeviceAgent::Create(o, runtime_.get(), client_.get()));
  agent->Start();
  ASSERT_OK(agent->Process(Frames(8, 1)).status());  // two full batches, queued
  // The pass that uplinked them has ended once the thread waits with the queue empty.
  ASSERT_TRUE(WaitUntil(
      [&] {
        device::AgentStats s = agent->Stats();
        return s.queue.batches == 0 && s.link_idle;
      },
      absl::Seconds(60)));
  const uint64_t passes = agent->Stats().link_passes;
  ASSERT_OK_AND_ASSIGN(cloud::JobReport report, strategy_->RunJob("dev-0"));
  // The clock stands still: no pass starts, however long real time runs.
  EXPECT_FALSE(
      WaitUntil([&] { return agent->Stats().link_passes > passes; }, absl::Milliseconds(500)));
  EXPECT_EQ(agent->Stats().version, 0u);
  clock.Advance(absl::Milliseconds(100));
  ASSERT_TRUE(WaitUntil([&] { return agent->Stats().version == 1; }, absl::Seconds(60)));
  EXPECT_EQ(agent->Stats().state_digest, report.state_digest);
  EXPECT_GT(agent->Stats().uplink_seconds, 0);
  EXPECT_GT(agent->Stats().update_seconds, 0);
  agent->Stop();
}

// A refusal that may pass later (the device's quota on the cloud) holds the uplink back for a
// bounded, growing while on the agent's clock: no resend loop, and updates still come.
TEST_F(AgentLoopTest, ATransientRefusalBacksOffOnTheAgentsClock) {
  testing::CloudFixtureOptions fo;
  fo.data_dir = dir_.path() + "/full-cloud";
  fo.devices = 1;
  fo.server.listen_address = "127.0.0.1:0";
  fo.server.insecure = true;
  fo.device_quota_bytes = 1;  // refuses every batch
  testing::CloudFixture full(fo);
  ASSERT_OK(full.Start());
  device::CloudClientOptions co;
  co.max_attempts = 2;
  co.initial_backoff = absl::Milliseconds(10);
  std::unique_ptr<device::CloudClient> client = full.Client(0, co);
  VirtualClock clock;
  device::AgentOptions o = Options();
  o.clock = &clock;
  o.refusal_backoff_initial = absl::Seconds(10);
  o.refusal_backoff_max = absl::Seconds(40);
  ASSERT_OK_AND_ASSIGN(auto agent, device::DeviceAgent::Create(o, runtime_.get(), client.get()));
  ASSERT_OK(agent->Process(Frames(8, 1)).status());
  auto refusals = [&] { return full.service()->Refusals()["dev-0"].refused["quota"]; };
  // Each SyncOnce below is a whole pass, on a clock that moves only when told.
  ASSERT_OK(agent->SyncOnce());
  EXPECT_EQ(refusals(), 1u);
  for (int i = 0; i < 3; ++i) ASSERT_OK(agent->SyncOnce());
  EXPECT_EQ(refusals(), 1u) << "resent before its backoff ended";
  // Waits of at most 10 s, then 20 s, then 40 s, each at least half of that.
  clock.Advance(absl::Seconds(10));
  ASSERT_OK(agent->SyncOnce());
  EXPECT_EQ(refusals(), 2u);
  clock.Advance(absl::Seconds(20));
  ASSERT_OK(agent->SyncOnce());
  EXPECT_EQ(refusals(), 3u);
  clock.Advance(absl::Seconds(19));
  ASSERT_OK(agent->SyncOnce());
  EXPECT_EQ(refusals(), 3u) << "the backoff did not grow";
  clock.Advance(absl::Seconds(21));
  ASSERT_OK(agent->SyncOnce());
  EXPECT_EQ(refusals(), 4u);
  device::AgentStats s = agent->Stats();
  EXPECT_EQ(s.uplink_backoffs, 4u);
  EXPECT_EQ(s.dropped_batches, 0u);  // waiting, not dropped
  EXPECT_EQ(s.queue.batches, 2u);
  EXPECT_TRUE(s.registered);
}

// On a Hugging Face folder the device sends the frame at the tower's input size, and the
// tokens the cloud recomputes from it (Answerer::TowerTokensOfJpeg, what the Hub mirror
// trainer runs) are the device's own up to the JPEG's loss; a frame of another size is refused
// before it is decoded.
TEST(PairFramesTest, TheCloudRecomputesTheDevicesTokensFromItsFrame) {
  const std::string folder =
      std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/llava_clip_llama";
  device::RuntimeOptions ro;
  ro.checkpoint_dir = folder;
  ro.precision = "fp32";
  ro.threads = 1;
  ro.max_answer_tokens = 2;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<device::InferenceRuntime> runtime,
                       device::InferenceRuntime::Load(ro));
  ASSERT_TRUE(runtime->CanSendFrames());
  device::Frame frame;
  frame.image = datasets::Image(120, 90);
  for (int y = 0; y < 90; ++y) {
    for (int x = 0; x < 120; ++x) {  // smooth gradients: what JPEG codes well
      uint8_t* p = frame.image.at(x, y);
      p[0] = static_cast<uint8_t>(2 * x);
      p[1] = static_cast<uint8_t>(2 * y);
      p[2] = static_cast<uint8_t>(x + y);
    }
  }
  frame.question = "what is shown?";
  ASSERT_OK_AND_ASSIGN(std::vector<device::AnswerResult> a, runtime->Answer({frame}));
  ASSERT_OK_AND_ASSIGN(std::string jpeg, runtime->FrameJpeg(a[0].visual));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Answerer> cloud,
                       model::Answerer::Load(folder, "fp32", "cpu"));
  using Size = std::pair<int, int>;
  ASSERT_OK_AND_ASSIGN(Size size, cloud->TowerInputSize());
  ASSERT_OK_AND_ASSIGN(compress::JpegSize declared, compress::ReadJpegSize(jpeg));
  EXPECT_EQ(declared.width, size.first);
  EXPECT_EQ(declared.height, size.second);
  ASSERT_OK_AND_ASSIGN(model::VisualTokenReply tokens, cloud->TowerTokensOfJpeg(jpeg, "frame"));
  ASSERT_EQ(tokens.tokens, a[0].visual.tokens);
  ASSERT_EQ(tokens.dim, a[0].visual.dim);
  double num = 0, den = 0;
  for (size_t i = 0; i < tokens.features.size(); ++i) {
    const double d = tokens.features[i] - a[0].visual.values[i];
    num += d * d;
    den += static_cast<double>(a[0].visual.values[i]) * a[0].visual.values[i];
  }
  EXPECT_LT(std::sqrt(num / den), 0.1);
  // Another size, or bytes that are not a JPEG, are refused before decoding.
  ASSERT_OK_AND_ASSIGN(datasets::Image decoded, datasets::DecodeImageRgb(jpeg, "frame"));
  EXPECT_EQ(decoded.width, size.first);
  ASSERT_OK_AND_ASSIGN(std::string wide,
                       datasets::EncodeJpeg(datasets::Image(size.first + 8, size.second), 90));
  EXPECT_THAT(cloud->TowerTokensOfJpeg(wide, "frame").status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                ::testing::HasSubstr("but the tower takes")));
  EXPECT_EQ(cloud->TowerTokensOfJpeg("not a jpeg", "frame").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The cloud's guard holds out half the samples: the device learns the share at Register and
// uplinks exactly the samples IsHeldOutSample picks with every visual token (stage 2's
// choice on the others), and a guarded job holds out exactly those, so the guard scores the
// mirror on whole frames, as the device answers them.
class AgentHoldoutTest : public AgentLoopTest {
 protected:
  AgentHoldoutTest() { service_holdout_fraction_ = 0.5; }
};

TEST_F(AgentHoldoutTest, HeldOutSamplesGoUpWholeAndTheJobHoldsOutThoseSame) {
  ASSERT_OK_AND_ASSIGN(auto agent,
                       device::DeviceAgent::Create(Options(), runtime_.get(), client_.get()));
  ASSERT_OK(agent->SyncOnce());  // Register: the cloud's share reaches the device
  ASSERT_OK_AND_ASSIGN(auto results, agent->Process(Frames(16, 3)));
  ASSERT_OK(agent->SyncOnce());
  ASSERT_EQ(agent->Stats().queue.batches, 0u);

  ASSERT_OK_AND_ASSIGN(std::vector<store::v1::SampleRecord> records,
                       cloud_->samples()->Read("dev-0", 1, 100));
  int whole = 0, selected = 0;
  for (const store::v1::SampleRecord& r : records) {
    ASSERT_OK_AND_ASSIGN(std::vector<compress::UplinkSample> batch,
                         compress::DecodeUplinkBatch(r.batch().payload()));
    for (const compress::UplinkSample& s : batch) {
      if (compress::IsHeldOutSample("dev-0", s.sample_id, 0.5)) {
        EXPECT_EQ(s.kept_indices.size(), s.grid_tokens) << "held-out sample " << s.sample_id;
        ++whole;
      } else {
        EXPECT_LT(s.kept_indices.size(), s.grid_tokens) << "training sample " << s.sample_id;
        ++selected;
      }
    }
  }
  EXPECT_EQ(whole + selected, 16);
  // 16 draws at one half: both kinds occur unless the hash is broken (odds 2 * 2^-16).
  EXPECT_GT(whole, 0);
  EXPECT_GT(selected, 0);
  EXPECT_EQ(agent->Stats().held_out_samples, static_cast<uint64_t>(whole));

  cloud::PerDeviceStrategyOptions so = StrategyOptions();
  so.state_dir = dir_.path() + "/cloud/guarded";
  so.guard.enabled = true;
  so.guard.holdout_fraction = 0.5;
  ASSERT_OK_AND_ASSIGN(auto guarded,
                       cloud::PerDeviceStrategy::Create(so, cloud_->samples(), cloud_->updates()));
  ASSERT_OK_AND_ASSIGN(cloud::JobReport report, guarded->RunJob("dev-0"));
  EXPECT_EQ(report.held_out_samples, whole);
  EXPECT_EQ(report.samples, selected);
}

// The share is picked among every answer, before stage 1: with stage 1 passing nothing, the
// held-out samples still go up (whole) and only they do, so the guard's pool is a sample of
// what the device answers rather than of the answers stage 1 finds uncertain.
TEST_F(AgentHoldoutTest, TheShareIsPickedAmongAllAnswersNotOnlyThoseStageOneKeeps) {
  device::AgentOptions o = Options();
  o.uts.entropy_alpha = 1e9f;  // no answer's entropy reaches it: stage 1 keeps nothing
  ASSERT_OK_AND_ASSIGN(auto agent, device::DeviceAgent::Create(o, runtime_.get(), client_.get()));
  ASSERT_OK(agent->SyncOnce());
  ASSERT_OK_AND_ASSIGN(auto results, agent->Process(Frames(16, 5)));
  ASSERT_OK(agent->Flush());
  ASSERT_OK(agent->SyncOnce());
  ASSERT_EQ(agent->Stats().queue.batches, 0u);

  ASSERT_OK_AND_ASSIGN(std::vector<store::v1::SampleRecord> records,
                       cloud_->samples()->Read("dev-0", 1, 100));
  int sent = 0;
  for (const store::v1::SampleRecord& r : records) {
    ASSERT_OK_AND_ASSIGN(std::vector<compress::UplinkSample> batch,
                         compress::DecodeUplinkBatch(r.batch().payload()));
    for (const compress::UplinkSample& s : batch) {
      EXPECT_TRUE(compress::IsHeldOutSample("dev-0", s.sample_id, 0.5)) << s.sample_id;
      EXPECT_EQ(s.kept_indices.size(), s.grid_tokens) << "held-out sample " << s.sample_id;
      ++sent;
    }
  }
  int uplinked = 0;
  for (const device::FrameResult& r : results) uplinked += r.uplinked ? 1 : 0;
  // 16 draws at one half: some are held out unless the hash is broken (odds 2^-16).
  EXPECT_GT(sent, 0);
  EXPECT_LT(sent, 16);
  EXPECT_EQ(uplinked, sent);
  EXPECT_EQ(agent->Stats().held_out_samples, static_cast<uint64_t>(sent));
  EXPECT_EQ(agent->Stats().kept_samples, 0u);
}

}  // namespace
}  // namespace cdcca
