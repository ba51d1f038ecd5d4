// PerDeviceStrategy and JobScheduler on the `tiny` family with random weights: a job turns
// stored samples into an update that takes the device exactly to the mirror, state survives
// a restart, a commit that was never published is republished, the scheduler triggers, and
// the update guard withholds an update that makes the held-out agreement worse.
#include "cloud/trainer.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "cloud/internal/record_log.h"
#include "cloud/update_guard.h"
#include "compress/named_tensors.h"
#include "compress/uplink_codec.h"
#include "datasets/formats.h"
#include "datasets/image.h"
#include "datasets/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/arch/answerer.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/safetensors.h"
#include "storage/fault_injection_env.h"
#include "tests/testing/fault_walk.h"
#include "tests/testing/jpeg_header.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_family.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;
using ::testing::HasSubstr;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    checkpoint_ = dir_.path() + "/family";
    ASSERT_OK(testing::WriteTinyFamily(checkpoint_));
    OpenStores();
  }

  void OpenStores() {
    strategy_.reset();
    updates_.reset();
    samples_.reset();
    SampleStoreOptions so;
    so.dir = dir_.path() + "/samples";
    so.env = env_;
    ASSERT_OK_AND_ASSIGN(samples_, SampleStore::Open(so));
    ASSERT_OK_AND_ASSIGN(updates_, UpdateStore::Open({dir_.path() + "/updates", 16, env_}));
  }

  PerDeviceStrategyOptions Options() const {
    PerDeviceStrategyOptions o;
    o.checkpoint_dir = checkpoint_;
    o.student_precision = "int8";
    o.state_dir = dir_.path() + "/trainer";
    o.env = env_;
    o.max_steps = 3;
    o.batch_size = 4;
    o.torch_threads = 1;
    o.bits_per_param = 4.0;
    // These tests are about what a job commits and publishes: every sample trains and every
    // update ships. The guard's own tests (GuardTest) turn it on.
    o.guard.enabled = false;
    o.pool_samples = pool_samples_;
    return o;
  }

  void MakeStrategy() {
    ASSERT_OK_AND_ASSIGN(strategy_,
                         PerDeviceStrategy::Create(Options(), samples_.get(), updates_.get()));
    ASSERT_OK(strategy_->Recover());
  }

  // Appends one batch of `n` random samples as uplink sequence `sequence`; `grid` 0 = the
  // model's token grid.
  void Uplink(const std::string& device, uint64_t sequence, int n, int grid = 0, float scale = 1.0f,
              compress::FeaturePrecision precision = compress::FeaturePrecision::kFp16,
              int distinct = 0) {
    std::mt19937_64 rng(sequence * 7 + device.size());
    std::normal_distribution<float> normal;
    const int tokens = grid != 0 ? grid : GridTokens(), dim = testing::kTinyFamilyDim;
    std::vector<compress::UplinkSample> batch(n);
    for (int i = 0; i < n; ++i) {
      compress::UplinkSample& s = batch[i];
      // With `distinct` > 0, sample i repeats the content (features, prompt) of sample
      // i % distinct of any batch: what a job learns on some carries over to the others.
      if (distinct > 0) rng.seed(static_cast<uint64_t>(i % distinct) + 1000);
      s.sample_id = sequence * 100 + i;
      s.grid_tokens = tokens;
      s.feature_dim = dim;
      for (int k = 0; k < tokens; k += 2) s.kept_indices.push_back(k);
      for (size_t k = 0; k < s.kept_indices.size() * dim; ++k) {
        s.features.push_back(scale * normal(rng));
      }
      s.prompt_tokens = {1, static_cast<uint32_t>(4 + rng() % 60), 7};
      s.answer_tokens = {5, 2};
    }
    ASSERT_OK_AND_ASSIGN(std::string payload, compress::EncodeUplinkBatch(batch, precision));
    v1::UplinkBatch b;
    b.set_sequence(sequence);
    b.set_sample_count(n);
    b.set_codec_version(1);
    b.set_payload(payload);
    ASSERT_OK(samples_->AppendAndWait(device, b).status());
  }

  // Uplinks three batches of 3 samples of dev-a at `precision`; the strategy's job bounds
  // must let its first job take batch 1 alone, and the next one batch 2 alone.
  void ExpectOneBatchPerJob(compress::FeaturePrecision precision) {
    for (uint64_t seq = 1; seq <= 3; ++seq) Uplink("dev-a", seq, 3, 0, 1.0f, precision);
    EXPECT_EQ(samples_->SampleCount("dev-a", 1, 3), 9u);
    ASSERT_OK_AND_ASSIGN(JobReport first, strategy_->RunJob("dev-a"));
    EXPECT_EQ(first.last_sequence, 1u);
    EXPECT_EQ(first.samples, 3);
    ASSERT_OK_AND_ASSIGN(JobReport second, strategy_->RunJob("dev-a"));
    EXPECT_EQ(second.first_sequence, 2u);
    EXPECT_EQ(second.last_sequence, 2u);
  }

  // The pretrained student's trainable set, as the device holds it at version 0.
  // (The device reads the family's student folder at int8 with the default adapters, as the
  // mirror does.)
  compress::NamedTensors DeviceState() {
    absl::StatusOr<std::unique_ptr<model::Answerer>> student =
        model::Answerer::Load(checkpoint_, "int8", "cpu");
    EXPECT_OK(student);
    EXPECT_OK((*student)->model().AddAdapters(model::AdapterOptions{}));
    return compress::Fp32Clones((*student)->model().TrainableParameters());
  }

  // The visual tokens a device uplinks per frame (the ViT's class token, then the patches).
  static int GridTokens() { return testing::kTinyFamilyTokens; }

  TempDir dir_;
  storage::Env* env_ = storage::Env::Default();  // of the stores and the state files
  std::string checkpoint_;
  std::unique_ptr<SampleStore> samples_;
  std::unique_ptr<UpdateStore> updates_;
  std::unique_ptr<PerDeviceStrategy> strategy_;
  size_t pool_samples_ = 0;  // PerDeviceStrategyOptions::pool_samples
};

TEST_F(TrainerTest, JobPublishesAnUpdateThatTakesTheDeviceToTheMirror) {
  MakeStrategy();
  EXPECT_THAT(strategy_->RunJob("dev-a"), StatusIs(absl::StatusCode::kNotFound));
  Uplink("dev-a", 1, 5);
  Uplink("dev-a", 2, 3);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_EQ(report.base_version, 0u);
  EXPECT_EQ(report.new_version, 1u);
  EXPECT_EQ(report.first_sequence, 1u);
  EXPECT_EQ(report.last_sequence, 2u);
  EXPECT_EQ(report.samples, 8);
  EXPECT_EQ(report.steps, 3);
  EXPECT_GT(report.payload_bytes, 0u);
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 2u);

  // The device applies exactly what was published and lands on the mirror, bit for bit.
  compress::NamedTensors device = DeviceState();
  EXPECT_EQ(compress::StateDigest(device), strategy_->BaseDigest());
  ASSERT_OK_AND_ASSIGN(StoredUpdate update, updates_->UpdateAfter("dev-a", 0));
  EXPECT_EQ(update.new_version, 1u);
  ASSERT_OK(compress::ApplyUpdate(*update.payload, 0, device).status());
  EXPECT_EQ(compress::StateDigest(device), report.state_digest);
  EXPECT_NE(report.state_digest, strategy_->BaseDigest());
  ASSERT_OK_AND_ASSIGN(uint64_t stored, updates_->DigestOf("dev-a", 1));
  EXPECT_EQ(stored, report.state_digest);

  // The snapshot is the same state, loadable as safetensors.
  ASSERT_OK_AND_ASSIGN(StoredUpdate snapshot, updates_->Snapshot("dev-a", 1));
  ASSERT_OK_AND_ASSIGN(model::SafetensorsContents contents,
                       model::DecodeSafetensors(*snapshot.payload));
  EXPECT_EQ(compress::StateDigest(contents.tensors), report.state_digest);

  // Another device is untouched; no new samples means no job.
  EXPECT_EQ(strategy_->State("dev-b").version, 0u);
  EXPECT_THAT(strategy_->RunJob("dev-a"), StatusIs(absl::StatusCode::kNotFound));
  Uplink("dev-a", 3, 4);
  ASSERT_OK_AND_ASSIGN(JobReport second, strategy_->RunJob("dev-a"));
  EXPECT_EQ(second.base_version, 1u);
  EXPECT_EQ(second.first_sequence, 3u);
  ASSERT_OK_AND_ASSIGN(StoredUpdate update2, updates_->UpdateAfter("dev-a", 1));
  ASSERT_OK(compress::ApplyUpdate(*update2.payload, 1, device).status());
  EXPECT_EQ(compress::StateDigest(device), second.state_digest);
}

// What a job consumed is released from the sample log: the device's quota counts only what
// its jobs have not trained on (and its newest batch, which carries its sequence).
TEST_F(TrainerTest, JobReleasesWhatItConsumedFromTheSampleLog) {
  MakeStrategy();
  Uplink("dev-a", 1, 4);
  Uplink("dev-a", 2, 4);
  Uplink("dev-a", 3, 4);
  const uint64_t before = samples_->DeviceBytes("dev-a");
  ASSERT_OK(strategy_->RunJob("dev-a").status());
  EXPECT_LT(samples_->DeviceBytes("dev-a"), before / 2);
  EXPECT_EQ(samples_->Stats().released_records, 2u);
  EXPECT_EQ(samples_->HighestDurable("dev-a"), 3u);
  Uplink("dev-a", 4, 2);
  ASSERT_OK_AND_ASSIGN(JobReport next, strategy_->RunJob("dev-a"));
  EXPECT_EQ(next.first_sequence, 4u);
}

// The durable pool: the newest trained samples stay in the sample log, every next job trains
// on them again beside its new ones, a restart reads them back from the log, and the batches
// that leave the pool are released.
TEST_F(TrainerTest, PoolTrainsEarlierSamplesAgainAndSurvivesARestart) {
  pool_samples_ = 6;
  MakeStrategy();
  Uplink("dev-a", 1, 4);
  ASSERT_OK_AND_ASSIGN(JobReport first, strategy_->RunJob("dev-a"));
  EXPECT_EQ(first.samples, 4);
  EXPECT_EQ(first.pool_samples, 0);
  Uplink("dev-a", 2, 4);
  ASSERT_OK_AND_ASSIGN(JobReport second, strategy_->RunJob("dev-a"));
  EXPECT_EQ(second.samples, 4);
  EXPECT_EQ(second.pool_samples, 4);  // batch 1's
  // The pool is now 2 samples of batch 1 and the 4 of batch 2: nothing is released.
  EXPECT_EQ(samples_->Stats().released_records, 0u);

  OpenStores();
  MakeStrategy();
  Uplink("dev-a", 3, 4);
  ASSERT_OK_AND_ASSIGN(JobReport third, strategy_->RunJob("dev-a"));
  EXPECT_EQ(third.samples, 4);
  EXPECT_EQ(third.pool_samples, 6);  // read back from batches 1 and 2
  // Now 2 of batch 2 and the 4 of batch 3: batch 1 leaves the log.
  EXPECT_EQ(samples_->Stats().released_records, 1u);
  Uplink("dev-a", 4, 4);
  ASSERT_OK_AND_ASSIGN(JobReport fourth, strategy_->RunJob("dev-a"));
  EXPECT_EQ(fourth.pool_samples, 6);
  EXPECT_EQ(samples_->Stats().released_records, 2u);
}

TEST_F(TrainerTest, RestartKeepsMirrorCursorAndResidual) {
  MakeStrategy();
  Uplink("dev-a", 1, 6);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  ASSERT_OK_AND_ASSIGN(std::string before, strategy_->MirrorState("dev-a"));
  OpenStores();
  MakeStrategy();
  DeviceTrainingState state = strategy_->State("dev-a");
  EXPECT_EQ(state.version, 1u);
  EXPECT_EQ(state.consumed_sequence, 1u);
  EXPECT_EQ(state.state_digest, report.state_digest);
  ASSERT_OK_AND_ASSIGN(std::string after, strategy_->MirrorState("dev-a"));
  EXPECT_EQ(before, after);
  // The next job continues from version 1 on the samples after the cursor only.
  Uplink("dev-a", 2, 2);
  ASSERT_OK_AND_ASSIGN(JobReport next, strategy_->RunJob("dev-a"));
  EXPECT_EQ(next.base_version, 1u);
  EXPECT_EQ(next.samples, 2);
}

// The replay buffer is in the commit: a trainer that loads the device's state (after a
// restart, an eviction, or on the shared store another trainer) replays what this one would
// have. dev-a's trainer restarts between its jobs, dev-b's (the same uplinks) does not.
TEST_F(TrainerTest, ReplayGoesOnAfterARestartAsWithout) {
  MakeStrategy();
  for (const std::string device : {"dev-a", "dev-b"}) {
    Uplink(device, 1, 8);
    ASSERT_OK_AND_ASSIGN(JobReport first, strategy_->RunJob(device));
    EXPECT_EQ(first.replay_samples, 0);  // nothing trained before
  }
  Uplink("dev-b", 2, 4);
  ASSERT_OK_AND_ASSIGN(JobReport without_restart, strategy_->RunJob("dev-b"));
  ASSERT_GT(without_restart.replay_samples, 0);
  OpenStores();
  MakeStrategy();
  Uplink("dev-a", 2, 4);
  ASSERT_OK_AND_ASSIGN(JobReport after_restart, strategy_->RunJob("dev-a"));
  EXPECT_EQ(after_restart.samples, 4);
  EXPECT_EQ(after_restart.replay_samples, without_restart.replay_samples);
}

// With more devices than max_resident_mirrors, the least recently used idle ones leave
// memory and come back from their state files: same mirror, same version, and the next
// update still takes the device exactly to the mirror (the encoder's residual came back too).
TEST_F(TrainerTest, MirrorsBeyondTheBoundAreEvictedAndReloadFromTheirStateFiles) {
  PerDeviceStrategyOptions options = Options();
  options.max_resident_mirrors = 2;
  ASSERT_OK_AND_ASSIGN(strategy_,
                       PerDeviceStrategy::Create(options, samples_.get(), updates_.get()));
  ASSERT_OK(strategy_->Recover());
  std::map<std::string, std::string> states;
  for (const std::string device : {"dev-0", "dev-1", "dev-2", "dev-3"}) {
    Uplink(device, 1, 4);
    ASSERT_OK(strategy_->RunJob(device).status());
    ASSERT_OK_AND_ASSIGN(states[device], strategy_->MirrorState(device));
    EXPECT_LE(strategy_->ResidentMirrors(), 2u);
  }
  EXPECT_EQ(strategy_->MirrorEvictions(), 2u);
  // A device that never trained is answered without a mirror in memory.
  EXPECT_EQ(strategy_->State("dev-new").state_digest, strategy_->BaseDigest());
  EXPECT_EQ(strategy_->State("dev-0").version, 1u);  // evicted: answered from what it published
  EXPECT_EQ(strategy_->ResidentMirrors(), 2u);
  EXPECT_EQ(strategy_->MirrorEvictions(), 2u);

  // dev-0 comes back as it left, and its next update lands the device on the mirror.
  ASSERT_OK_AND_ASSIGN(std::string reloaded, strategy_->MirrorState("dev-0"));
  EXPECT_EQ(reloaded, states["dev-0"]);
  EXPECT_EQ(strategy_->MirrorEvictions(), 3u);
  Uplink("dev-0", 2, 3);
  ASSERT_OK_AND_ASSIGN(JobReport next, strategy_->RunJob("dev-0"));
  EXPECT_EQ(next.base_version, 1u);
  EXPECT_EQ(next.new_version, 2u);
  compress::NamedTensors device = DeviceState();
  for (uint64_t v = 0; v < 2; ++v) {
    ASSERT_OK_AND_ASSIGN(StoredUpdate update, updates_->UpdateAfter("dev-0", v));
    ASSERT_OK(compress::ApplyUpdate(*update.payload, v, device).status());
  }
  EXPECT_EQ(compress::StateDigest(device), next.state_digest);
  EXPECT_LE(strategy_->ResidentMirrors(), 2u);

  // A restart brings every device's state back but keeps only the bound in memory.
  OpenStores();
  ASSERT_OK_AND_ASSIGN(strategy_,
                       PerDeviceStrategy::Create(options, samples_.get(), updates_.get()));
  ASSERT_OK(strategy_->Recover());
  EXPECT_EQ(strategy_->ResidentMirrors(), 2u);
  for (const std::string device : {"dev-1", "dev-2", "dev-3"}) {
    EXPECT_EQ(strategy_->State(device).version, 1u) << device;
    ASSERT_OK_AND_ASSIGN(std::string after, strategy_->MirrorState(device));
    EXPECT_EQ(after, states[device]) << device;
  }
  EXPECT_EQ(strategy_->State("dev-0").version, 2u);
  EXPECT_LE(strategy_->ResidentMirrors(), 2u);
}

TEST_F(TrainerTest, RecoverRepublishesACommittedUpdateTheStoreLacks) {
  MakeStrategy();
  Uplink("dev-a", 1, 4);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  // As if the process died between the state file and the update store: lose the store.
  strategy_.reset();
  updates_.reset();
  std::filesystem::remove_all(dir_.path() + "/updates");
  ASSERT_OK_AND_ASSIGN(updates_, UpdateStore::Open({dir_.path() + "/updates", 16}));
  MakeStrategy();
  ASSERT_OK_AND_ASSIGN(StoredUpdate update, updates_->UpdateAfter("dev-a", 0));
  EXPECT_EQ(update.new_version, 1u);
  EXPECT_EQ(update.state_digest, report.state_digest);
  compress::NamedTensors device = DeviceState();
  ASSERT_OK(compress::ApplyUpdate(*update.payload, 0, device).status());
  EXPECT_EQ(compress::StateDigest(device), report.state_digest);
  EXPECT_OK(updates_->Snapshot("dev-a", 1).status());
}

// A job's commit (the mirror state file, then the update and the snapshot published) under
// every injected file fault at every step, the stores and the strategy restarted after
// each: the device's version is the old one or the new one; a job that said OK is never
// lost; whatever version the mirror holds is what the update store serves (an update never
// outlives its mirror state, and the published update takes the device to the mirror's
// digest); and the next job runs.
TEST_F(TrainerTest, JobCommitIsAllOrNothingUnderEveryFileFault) {
  const compress::NamedTensors base = DeviceState();
  const auto close = [&] {
    strategy_.reset();
    updates_.reset();
    samples_.reset();
  };
  for (storage::Fault fault : cdcca::testing::kAllFaults) {
    bool job_ok = false;
    const uint64_t steps = cdcca::testing::WalkFault(
        fault,
        [&](storage::FaultInjectionEnv& env) {
          env_ = &env;
          job_ok = false;
          OpenStores();
          Uplink("dev-a", 1, 4);
          close();
        },
        [&](storage::FaultInjectionEnv& env) {
          SampleStoreOptions so;
          so.dir = dir_.path() + "/samples";
          so.env = &env;
          absl::StatusOr<std::unique_ptr<SampleStore>> samples = SampleStore::Open(so);
          if (!samples.ok()) return;
          samples_ = *std::move(samples);
          absl::StatusOr<std::unique_ptr<UpdateStore>> updates =
              UpdateStore::Open({dir_.path() + "/updates", 16, &env});
          if (!updates.ok()) return close();
          updates_ = *std::move(updates);
          absl::StatusOr<std::unique_ptr<PerDeviceStrategy>> strategy =
              PerDeviceStrategy::Create(Options(), samples_.get(), updates_.get());
          if (!strategy.ok()) return close();
          strategy_ = *std::move(strategy);
          if (strategy_->Recover().ok()) job_ok = strategy_->RunJob("dev-a").ok();
          close();
        },
        [&](storage::FaultInjectionEnv& env) {
          OpenStores();
          if (HasFatalFailure()) return;
          MakeStrategy();
          if (HasFatalFailure()) return;
          DeviceTrainingState state = strategy_->State("dev-a");
          if (job_ok) {
            EXPECT_EQ(state.version, 1u) << "a job that said OK was lost";
          }
          if (state.version == 0) {
            EXPECT_EQ(state.consumed_sequence, 0u);
            EXPECT_EQ(updates_->LatestVersion("dev-a"), 0u)
                << "an update was published whose mirror state is lost";
            ASSERT_OK(strategy_->RunJob("dev-a").status());
            state = strategy_->State("dev-a");
          }
          EXPECT_EQ(state.version, 1u);
          EXPECT_EQ(state.consumed_sequence, 1u);
          ASSERT_OK_AND_ASSIGN(StoredUpdate update, updates_->UpdateAfter("dev-a", 0));
          EXPECT_EQ(update.new_version, 1u);
          EXPECT_EQ(update.state_digest, state.state_digest);
          compress::NamedTensors device;
          for (const auto& [name, t] : base) device.emplace_back(name, t.clone());
          ASSERT_OK(compress::ApplyUpdate(*update.payload, 0, device).status());
          EXPECT_EQ(compress::StateDigest(device), state.state_digest);
          ASSERT_OK_AND_ASSIGN(StoredUpdate snapshot, updates_->Snapshot("dev-a", 1));
          EXPECT_EQ(snapshot.state_digest, state.state_digest);
          close();
        });
    EXPECT_GE(steps, fault == storage::Fault::kShortWrite ? 3u : 15u) << storage::FaultName(fault);
  }
  env_ = storage::Env::Default();
}

// Regression: after the sample log lost its tail, the durable
// sequence went back, the device renumbered its batches from there, and the trainer's cursor
// (still at the old end) skipped every one of them.
TEST_F(TrainerTest, CursorIsClampedToTheDurableLogAndRenumberedBatchesAreTrained) {
  MakeStrategy();
  Uplink("dev-a", 1, 2);
  Uplink("dev-a", 2, 2);
  Uplink("dev-a", 3, 2);
  ASSERT_OK(strategy_->RunJob("dev-a").status());
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 3u);
  // The log now ends at sequence 1.
  strategy_.reset();
  samples_.reset();
  std::filesystem::remove_all(dir_.path() + "/samples");
  OpenStores();
  Uplink("dev-a", 1, 2);
  MakeStrategy();
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 1u);
  Uplink("dev-a", 2, 3);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_EQ(report.first_sequence, 2u);
  EXPECT_EQ(report.samples, 3);
  // The clamp was committed: a restart keeps it.
  OpenStores();
  MakeStrategy();
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 2u);
}

// A stored batch that decodes but does not fit the model (from a log written before ingest
// checked batches) is quarantined with its reason; the device's later batches train.
TEST_F(TrainerTest, StoredBatchThatDoesNotFitTheModelIsQuarantinedNotFatal) {
  MakeStrategy();
  Uplink("dev-a", 1, 2, /*grid=*/GridTokens() * 4);
  Uplink("dev-a", 2, 3);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_EQ(report.quarantined_samples, 2u);
  EXPECT_EQ(report.first_sequence, 1u);
  EXPECT_EQ(report.last_sequence, 2u);
  EXPECT_EQ(report.samples, 3);
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 2u);
  EXPECT_EQ(strategy_->State("dev-a").quarantined_samples, 2u);
  EXPECT_THAT(strategy_->State("dev-a").last_quarantine_reason,
              HasSubstr("but the cloud's model expects"));
}

// Flips a byte in the body of `device`'s stored batch `sequence` (the store stays open: the
// record rots after start-up).
void DamageStoredBatch(const std::string& segment, const std::string& device, uint64_t sequence) {
  std::string data;
  {
    std::ifstream in(segment, std::ios::binary);
    data.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  std::vector<bool> match;
  ASSERT_OK_AND_ASSIGN(
      internal::SegmentScan scan, internal::ScanSegment(data, [&](absl::string_view body) {
        store::v1::SampleRecord r;
        r.ParseFromArray(body.data(), static_cast<int>(body.size()));
        match.push_back(r.device_id() == device && r.batch().sequence() == sequence);
        return true;
      }));
  for (size_t i = 0; i < scan.records.size(); ++i) {
    if (!match[i]) continue;
    const uint64_t at = (scan.records[i].span.offset + scan.records[i].span.end) / 2;
    std::fstream f(segment, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at));
    f.put(static_cast<char>(data[at] ^ 0x5a));
    return;
  }
  FAIL() << "no stored batch " << sequence << " of " << device;
}

// A record that rots after it was acked reads back DATA_LOSS on every try: the job
// quarantines it (persisted: a restart does not try it again), trains on the good batches
// around it and publishes its update.
TEST_F(TrainerTest, RottenRecordAmongGoodOnesIsQuarantinedAndTheJobGoesOn) {
  MakeStrategy();
  Uplink("dev-a", 1, 3);
  Uplink("dev-a", 2, 4);
  Uplink("dev-a", 3, 2);
  DamageStoredBatch(dir_.path() + "/samples/seg-00000001.log", "dev-a", 2);
  ASSERT_THAT(samples_->Read("dev-a", 1, 10), StatusIs(absl::StatusCode::kDataLoss));
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_EQ(report.new_version, 1u);
  EXPECT_EQ(report.first_sequence, 1u);
  EXPECT_EQ(report.last_sequence, 3u);
  EXPECT_EQ(report.samples, 5);
  EXPECT_EQ(report.quarantined_samples, 4u);
  EXPECT_OK(updates_->UpdateAfter("dev-a", 0).status());
  DeviceTrainingState state = strategy_->State("dev-a");
  EXPECT_EQ(state.consumed_sequence, 3u);
  EXPECT_EQ(state.quarantined_samples, 4u);
  EXPECT_THAT(state.last_quarantine_reason, HasSubstr("DATA_LOSS"));
  EXPECT_THAT(strategy_->RunJob("dev-a"), StatusIs(absl::StatusCode::kNotFound));

  // After a restart the quarantine is still counted, and nothing is retried.
  OpenStores();
  MakeStrategy();
  state = strategy_->State("dev-a");
  EXPECT_EQ(state.quarantined_samples, 4u);
  EXPECT_EQ(state.consumed_sequence, 3u);
  EXPECT_THAT(strategy_->RunJob("dev-a"), StatusIs(absl::StatusCode::kNotFound));
}

// On a Hugging Face pair the job recomputes tokens from uplinked JPEG frames: a frame that
// passes ingest (its header declares the tower's size) but does not decode is quarantined
// with its reason, and the job trains on the other samples and publishes its update.
// A Hugging Face pair's strategy on the tiny LLaVA fixture (teacher and student), guard as
// `guard` says; false if the build has no Hugging Face tokenizers.
bool MakeHubStrategy(const std::string& state_dir, SampleStore* samples, UpdateStore* updates,
                     const UpdateGuardOptions& guard,
                     std::unique_ptr<PerDeviceStrategy>* strategy) {
  PerDeviceStrategyOptions o;
  o.teacher_dir = std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/llava_clip_llama";
  o.student_base_dir = o.teacher_dir;
  o.state_dir = state_dir;
  o.max_steps = 2;
  o.batch_size = 2;
  o.torch_threads = 1;
  o.bits_per_param = 4.0;
  o.guard = guard;
  absl::StatusOr<std::unique_ptr<PerDeviceStrategy>> created =
      PerDeviceStrategy::Create(o, samples, updates);
  if (absl::IsUnimplemented(created.status())) return false;
  EXPECT_OK(created);
  if (!created.ok()) return false;
  *strategy = *std::move(created);
  EXPECT_OK((*strategy)->Recover());
  return true;
}

// Uplinks batch 1 of `device`: three frames (samples 100-102) of which sample 101 passes the
// ingest check (a well-formed header of the right size) but does not decode.
void UplinkFramesOneUndecodable(const SampleSpec& spec, const std::string& device,
                                SampleStore* samples) {
  ASSERT_GT(spec.frame_width, 0u);
  datasets::Image image(static_cast<int>(spec.frame_width), static_cast<int>(spec.frame_height));
  std::mt19937 rng(5);
  for (uint8_t& p : image.pixels) p = static_cast<uint8_t>(rng());
  ASSERT_OK_AND_ASSIGN(std::string good, datasets::EncodeJpeg(image, 90));
  const std::string bad = cdcca::testing::JpegHeader(static_cast<int>(spec.frame_width),
                                                     static_cast<int>(spec.frame_height)) +
                          std::string(64, '\x5a');
  std::vector<compress::UplinkSample> batch(3);
  for (size_t i = 0; i < batch.size(); ++i) {
    compress::UplinkSample& s = batch[i];
    s.sample_id = 100 + i;
    s.grid_tokens = spec.grid_tokens;
    s.feature_dim = spec.feature_dim;
    s.kept_indices = {0, 1, 2, 3};
    s.prompt_tokens = {5, 6, 7};
    s.answer_tokens = {8, 9};
    s.frame = i == 1 ? bad : good;
  }
  ASSERT_OK_AND_ASSIGN(std::string payload,
                       compress::EncodeUplinkBatch(batch, compress::FeaturePrecision::kJpeg));
  v1::UplinkBatch b;
  b.set_sequence(1);
  b.set_sample_count(3);
  b.set_codec_version(1);
  b.set_payload(payload);
  ASSERT_OK(CheckUplinkBatch(b, spec).status()) << "the bad frame passes ingest";
  ASSERT_OK(samples->AppendAndWait(device, b).status());
}

TEST_F(TrainerTest, UndecodableFrameIsQuarantinedAndTheJobTrainsTheOthers) {
  UpdateGuardOptions guard;
  guard.enabled = false;
  if (!MakeHubStrategy(dir_.path() + "/trainer", samples_.get(), updates_.get(), guard,
                       &strategy_)) {
    GTEST_SKIP() << "built without Hugging Face tokenizers";
  }
  UplinkFramesOneUndecodable(strategy_->Spec(), "dev-a", samples_.get());

  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_EQ(report.new_version, 1u);
  EXPECT_EQ(report.samples, 2);
  EXPECT_EQ(report.quarantined_samples, 1u);
  EXPECT_OK(updates_->UpdateAfter("dev-a", 0).status());
  const DeviceTrainingState state = strategy_->State("dev-a");
  EXPECT_EQ(state.consumed_sequence, 1u);
  EXPECT_EQ(state.quarantined_samples, 1u);
  EXPECT_THAT(state.last_quarantine_reason, HasSubstr("sample 101"));
  std::ifstream in(dir_.path() + "/trainer/dev-a.quarantine");
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(file, HasSubstr("\"sample_id\": 101"));
}

// The same frame among the guard's held-out samples: quarantined when the job first sees it,
// never in the pool, so the guard can answer the pool and the job goes on (else every guarded
// job of the device would fail on it).
TEST_F(TrainerTest, UndecodableHeldOutFrameIsQuarantinedNotScored) {
  UpdateGuardOptions guard;
  guard.holdout_fraction = 0.5;
  guard.min_pool = 1;
  // A device whose sample 101 is held out and sample 100 trains.
  std::string device;
  for (int i = 0; device.empty(); ++i) {
    const std::string id = absl::StrCat("dev-", i);
    if (compress::IsHeldOutSample(id, 101, 0.5) && !compress::IsHeldOutSample(id, 100, 0.5)) {
      device = id;
    }
  }
  if (!MakeHubStrategy(dir_.path() + "/trainer", samples_.get(), updates_.get(), guard,
                       &strategy_)) {
    GTEST_SKIP() << "built without Hugging Face tokenizers";
  }
  UplinkFramesOneUndecodable(strategy_->Spec(), device, samples_.get());

  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob(device));
  EXPECT_EQ(report.quarantined_samples, 1u);
  EXPECT_GE(report.samples, 1);
  EXPECT_EQ(report.samples + report.held_out_samples, 2);
  const DeviceTrainingState state = strategy_->State(device);
  EXPECT_EQ(state.consumed_sequence, 1u);
  EXPECT_EQ(state.quarantined_samples, 1u);
  EXPECT_EQ(state.holdout_pool, static_cast<uint64_t>(report.held_out_samples));
  EXPECT_THAT(state.last_quarantine_reason, HasSubstr("sample 101"));
}

// Training that fails at the same cursor ends: after kMaxJobAttempts failures the job's
// batches are quarantined and the cursor moves on; the device's next batches are trained.
TEST_F(TrainerTest, JobThatKeepsFailingAtOneCursorQuarantinesItsBatches) {
  PerDeviceStrategyOptions failing = Options();
  failing.before_training = [](const std::string&) {
    return absl::InternalError("training fails");
  };
  ASSERT_OK_AND_ASSIGN(strategy_,
                       PerDeviceStrategy::Create(failing, samples_.get(), updates_.get()));
  ASSERT_OK(strategy_->Recover());
  Uplink("dev-a", 1, 3);
  Uplink("dev-a", 2, 2);
  for (int attempt = 1; attempt < kMaxJobAttempts; ++attempt) {
    EXPECT_THAT(strategy_->RunJob("dev-a"), StatusIs(absl::StatusCode::kInternal));
    EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 0u);
  }
  EXPECT_THAT(strategy_->RunJob("dev-a"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("quarantined")));
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 2u);
  EXPECT_EQ(strategy_->State("dev-a").quarantined_samples, 5u);
  EXPECT_EQ(strategy_->State("dev-a").version, 0u);
  // The same device, training again: its next batch becomes an update.
  MakeStrategy();
  Uplink("dev-a", 3, 2);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_EQ(report.first_sequence, 3u);
  EXPECT_EQ(report.new_version, 1u);
  EXPECT_EQ(strategy_->State("dev-a").quarantined_samples, 5u);
}

// The job's bound counts what the decoded samples hold (floats), not the codec's body: int8
// features are 4x smaller on the wire than in memory.
TEST_F(TrainerTest, JobBoundCountsDecodedFloatsNotTheCodecBody) {
  PerDeviceStrategyOptions o = Options();
  const int tokens = GridTokens() / 2, dim = testing::kTinyFamilyDim;
  const uint64_t floats_per_batch = uint64_t{3} * tokens * dim * sizeof(float);
  // Room for two batches' int8 bodies (about a quarter of their floats), not for two
  // batches' floats.
  o.max_decoded_bytes_per_job = floats_per_batch * 3 / 2;
  ASSERT_OK_AND_ASSIGN(strategy_, PerDeviceStrategy::Create(o, samples_.get(), updates_.get()));
  ASSERT_OK(strategy_->Recover());
  ExpectOneBatchPerJob(compress::FeaturePrecision::kInt8);
}

// Features are finite on the wire, but an int8 payload's scale lets them be huge: a job they
// overflow never becomes an update, and the device's next batches still train.
TEST_F(TrainerTest, HugeFeaturesNeverBecomeANonFiniteUpdate) {
  MakeStrategy();
  Uplink("dev-a", 1, 3, 0, 1e37f, compress::FeaturePrecision::kInt8);
  const uint64_t base = strategy_->BaseDigest();
  // They overflow this model's training: the job is refused and the mirror stays.
  absl::StatusOr<JobReport> first = strategy_->RunJob("dev-a");
  EXPECT_EQ(first.status().code(), absl::StatusCode::kDataLoss) << first.status();
  EXPECT_EQ(strategy_->State("dev-a").state_digest, base);
  EXPECT_EQ(strategy_->State("dev-a").version, 0u);
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 1u);
  EXPECT_EQ(strategy_->State("dev-a").quarantined_samples, 3u);
  EXPECT_THAT(strategy_->State("dev-a").last_quarantine_reason, HasSubstr("non-finite"));
  Uplink("dev-a", 2, 3);
  ASSERT_OK_AND_ASSIGN(JobReport second, strategy_->RunJob("dev-a"));
  // The next batch trains normally (the learner's fitted projections were dropped too).
  EXPECT_EQ(second.first_sequence, 2u);
  EXPECT_EQ(second.new_version, 1u);
}

TEST_F(TrainerTest, JobTakesAtMostItsSampleBoundAndLeavesTheRestForTheNext) {
  PerDeviceStrategyOptions o = Options();
  o.max_samples_per_job = 5;
  ASSERT_OK_AND_ASSIGN(strategy_, PerDeviceStrategy::Create(o, samples_.get(), updates_.get()));
  ASSERT_OK(strategy_->Recover());
  ExpectOneBatchPerJob(compress::FeaturePrecision::kFp16);
  // The model's shape reaches the service's ingest check.
  EXPECT_EQ(strategy_->Spec().grid_tokens, static_cast<uint32_t>(GridTokens()));
  EXPECT_EQ(strategy_->Spec().feature_dim, static_cast<uint32_t>(testing::kTinyFamilyDim));
}

TEST_F(TrainerTest, DamagedStateFileIsDataLoss) {
  MakeStrategy();
  Uplink("dev-a", 1, 2);
  ASSERT_OK(strategy_->RunJob("dev-a").status());
  strategy_.reset();
  {
    std::fstream f(dir_.path() + "/trainer/dev-a.mirror",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(50);
    f.put('\x5a');
  }
  ASSERT_OK_AND_ASSIGN(strategy_,
                       PerDeviceStrategy::Create(Options(), samples_.get(), updates_.get()));
  EXPECT_THAT(strategy_->Recover(), StatusIs(absl::StatusCode::kDataLoss));
}

// The update guard on a family whose teacher is the student's own weights (fp32, so the
// mirror and the teacher compute alike): a job trained away from the teacher's labels (a
// negative CE weight) lowers the held-out agreement and must not ship; a job trained toward
// them from a student moved off the teacher raises it and ships.
class GuardTest : public TrainerTest, public ::testing::WithParamInterface<std::string> {
 protected:
  // `offset` moves the student's final LM norm, a member of its trainable set, off the
  // teacher's (noise of `offset` times its RMS; 0 = identical).
  void SaveTwinFamily(float offset) {
    checkpoint_ = dir_.path() + "/twin";
    ASSERT_OK(testing::WriteTinyFamily(checkpoint_, /*teacher_scale=*/1.0));
    if (offset > 0) {
      ASSERT_OK(testing::PerturbWeights(checkpoint_, "language_model.model.norm.", 1.0, offset, 7));
    }
  }

  // The guard on, half the samples held out, the paired rule from 8 held-out samples; the
  // learner's CE weight `l_ce` (feature terms as the learner's preset).
  PerDeviceStrategyOptions GuardOptions(double l_ce, int steps = 30) {
    PerDeviceStrategyOptions o = Options();
    o.student_precision = "fp32";
    o.learner = GetParam();
    o.guard.enabled = true;
    o.guard.holdout_fraction = 0.5;
    o.guard.min_pool = 8;
    o.guard.z = 1.0;
    // Agreement: a student that is the teacher scores exactly 1 (the teacher's probability
    // tests set their measure themselves).
    o.guard.measure = GuardMeasure::kAgreement;
    o.max_steps = steps;
    o.batch_size = 8;
    const std::string config = dir_.path() + "/distill.json";
    std::ofstream(config) << "{\"learner\": {\"l_ce\": " << l_ce
                          << "}, \"job\": {\"lr\": 0.03, \"replay_fraction\": 0}}";
    o.distill_config = config;
    return o;
  }

  void Start(const PerDeviceStrategyOptions& o) {
    ASSERT_OK_AND_ASSIGN(strategy_, PerDeviceStrategy::Create(o, samples_.get(), updates_.get()));
    ASSERT_OK(strategy_->Recover());
  }
};

TEST_P(GuardTest, AnUpdateThatMakesHeldOutAgreementWorseIsWithheld) {
  SaveTwinFamily(0.0f);
  Start(GuardOptions(-1.0));
  Uplink("dev-a", 1, 24);
  Uplink("dev-a", 2, 24);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_GE(report.guard.pool, 8);
  EXPECT_EQ(report.guard.pool, report.held_out_samples);
  EXPECT_EQ(report.samples + report.held_out_samples, 48);
  EXPECT_DOUBLE_EQ(report.guard.before, 1.0);  // the student is the teacher
  EXPECT_LT(report.guard.after, report.guard.before);
  EXPECT_TRUE(report.update_withheld);
  EXPECT_FALSE(report.guard.ship);
  EXPECT_EQ(report.guard.decision, "not_beyond_noise");
  // No update: the mirror, its version and the store stay; the batches are consumed.
  EXPECT_EQ(report.new_version, 0u);
  EXPECT_EQ(report.state_digest, strategy_->BaseDigest());
  EXPECT_EQ(report.payload_bytes, 0u);
  EXPECT_THAT(updates_->UpdateAfter("dev-a", 0).status(), StatusIs(absl::StatusCode::kNotFound));
  DeviceTrainingState state = strategy_->State("dev-a");
  EXPECT_EQ(state.version, 0u);
  EXPECT_EQ(state.state_digest, strategy_->BaseDigest());
  EXPECT_EQ(state.consumed_sequence, 2u);
  EXPECT_EQ(state.updates_withheld, 1u);
  EXPECT_EQ(state.holdout_pool, static_cast<uint64_t>(report.held_out_samples));
  EXPECT_THAT(strategy_->RunJob("dev-a"), StatusIs(absl::StatusCode::kNotFound));

  // The cursor move was committed, and a restart rebuilds the same pool from the log.
  OpenStores();
  Start(GuardOptions(-1.0));
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 2u);
  Uplink("dev-a", 3, 24);
  ASSERT_OK_AND_ASSIGN(JobReport next, strategy_->RunJob("dev-a"));
  EXPECT_EQ(next.first_sequence, 3u);
  EXPECT_EQ(next.guard.pool, report.guard.pool + next.held_out_samples);
  EXPECT_TRUE(next.update_withheld);
  EXPECT_EQ(strategy_->State("dev-a").version, 0u);
  EXPECT_EQ(strategy_->State("dev-a").updates_withheld, 1u);  // since this start
}

TEST_P(GuardTest, AnUpdateThatHelpsShips) {
  SaveTwinFamily(0.2f);
  Start(GuardOptions(1.0, /*steps=*/80));
  // Four inputs repeated: the held-out samples are inputs the job trains on, under other ids.
  Uplink("dev-a", 1, 24, 0, 1.0f, compress::FeaturePrecision::kFp16, /*distinct=*/4);
  Uplink("dev-a", 2, 24, 0, 1.0f, compress::FeaturePrecision::kFp16, /*distinct=*/4);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_GE(report.guard.pool, 8);
  EXPECT_GT(report.guard.after, report.guard.before);
  EXPECT_FALSE(report.update_withheld);
  EXPECT_EQ(report.guard.decision, "helps");
  EXPECT_EQ(report.new_version, 1u);
  ASSERT_OK_AND_ASSIGN(StoredUpdate update, updates_->UpdateAfter("dev-a", 0));
  EXPECT_EQ(update.state_digest, report.state_digest);
  EXPECT_EQ(strategy_->State("dev-a").updates_withheld, 0u);
}

// restore_base: a device whose version agrees with the teacher worse than the pretrained base
// (an update trained away from the teacher, shipped with the guard off) stays there while
// restore_base is off, and goes back to the base, as a new version whose state is the base's,
// at the next withheld update once it is on.
TEST_P(GuardTest, ADeviceWorseThanTheBaseReturnsToIt) {
  SaveTwinFamily(0.0f);
  PerDeviceStrategyOptions off = GuardOptions(-1.0);
  off.guard.enabled = false;
  Start(off);
  Uplink("dev-a", 1, 24);
  Uplink("dev-a", 2, 24);
  ASSERT_OK_AND_ASSIGN(JobReport harmful, strategy_->RunJob("dev-a"));
  ASSERT_EQ(harmful.new_version, 1u);
  ASSERT_NE(harmful.state_digest, strategy_->BaseDigest());

  PerDeviceStrategyOptions kept = GuardOptions(-1.0);
  kept.guard.restore_base = false;
  OpenStores();
  Start(kept);
  Uplink("dev-a", 3, 24);
  ASSERT_OK_AND_ASSIGN(JobReport stays, strategy_->RunJob("dev-a"));
  EXPECT_TRUE(stays.update_withheld);
  EXPECT_FALSE(stays.restored_base);
  EXPECT_EQ(stays.base_guard.pool, 0);  // not scored
  EXPECT_EQ(stays.new_version, 1u);
  EXPECT_EQ(stays.state_digest, harmful.state_digest);

  OpenStores();
  Start(GuardOptions(-1.0));
  Uplink("dev-a", 4, 24);
  ASSERT_OK_AND_ASSIGN(JobReport back, strategy_->RunJob("dev-a"));
  EXPECT_TRUE(back.update_withheld);
  EXPECT_GE(back.base_guard.pool, 8);
  // The base is judged on what the device answers now: this job's held-out samples (at
  // least min_pool of the newest), not the whole pool.
  EXPECT_EQ(back.base_guard.pool,
            std::min<int64_t>(back.guard.pool, std::max<int64_t>(back.held_out_samples, 8)));
  EXPECT_LT(back.base_guard.pool, back.guard.pool);
  EXPECT_DOUBLE_EQ(back.base_guard.after, 1.0);  // the base is the teacher
  EXPECT_LT(back.base_guard.before, 1.0);
  EXPECT_EQ(back.base_guard.decision, "helps");
  EXPECT_TRUE(back.restored_base);
  EXPECT_EQ(back.new_version, 2u);
  EXPECT_EQ(back.state_digest, strategy_->BaseDigest());
  ASSERT_OK_AND_ASSIGN(StoredUpdate update, updates_->UpdateAfter("dev-a", 1));
  EXPECT_EQ(update.new_version, 2u);
  EXPECT_EQ(update.state_digest, strategy_->BaseDigest());
  const DeviceTrainingState state = strategy_->State("dev-a");
  EXPECT_EQ(state.version, 2u);
  EXPECT_EQ(state.state_digest, strategy_->BaseDigest());
  EXPECT_EQ(state.consumed_sequence, 4u);

  // At the base, a withheld update has nothing to return to.
  Uplink("dev-a", 5, 24);
  ASSERT_OK_AND_ASSIGN(JobReport again, strategy_->RunJob("dev-a"));
  EXPECT_TRUE(again.update_withheld);
  EXPECT_FALSE(again.restored_base);
  EXPECT_EQ(again.new_version, 2u);
  // Every held-out sample, those the base was not scored on too, is scored with the base's
  // own answers: they are the teacher's.
  EXPECT_GT(again.guard.pool, back.base_guard.pool);
  EXPECT_DOUBLE_EQ(again.guard.before, 1.0);
}

// With confident_fraction the guard compares only the held-out samples the teacher answers
// most surely: half the pool here, rounded up.
TEST_P(GuardTest, ComparesTheTeachersSurestShareOfThePool) {
  SaveTwinFamily(0.0f);
  PerDeviceStrategyOptions o = GuardOptions(-1.0);
  o.guard.confident_fraction = 0.5;
  Start(o);
  Uplink("dev-a", 1, 24);
  Uplink("dev-a", 2, 24);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  ASSERT_GE(report.held_out_samples, 8);
  EXPECT_EQ(report.guard.pool, (report.held_out_samples + 1) / 2);
  EXPECT_DOUBLE_EQ(report.guard.before, 1.0);  // the student is the teacher
}

// Scored by the teacher's probability of the student's answer, the guard withholds a job
// trained away from the teacher's labels (on the twin family a student that is the teacher
// scores the teacher's own certainty, below 1) and ships one trained toward them.
TEST_P(GuardTest, TheTeachersProbabilityWithholdsWhatHurts) {
  SaveTwinFamily(0.0f);
  PerDeviceStrategyOptions worse = GuardOptions(-1.0);
  worse.guard.measure = GuardMeasure::kTeacherProbability;
  Start(worse);
  Uplink("dev-a", 1, 24);
  Uplink("dev-a", 2, 24);
  ASSERT_OK_AND_ASSIGN(JobReport withheld, strategy_->RunJob("dev-a"));
  EXPECT_GE(withheld.guard.pool, 8);
  EXPECT_GT(withheld.guard.before, 0.0);
  EXPECT_LT(withheld.guard.before, 1.0);
  EXPECT_LT(withheld.guard.after, withheld.guard.before);
  EXPECT_TRUE(withheld.update_withheld);
  EXPECT_EQ(withheld.guard.decision, "not_beyond_noise");
  EXPECT_EQ(strategy_->State("dev-a").version, 0u);
}

TEST_P(GuardTest, TheTeachersProbabilityShipsWhatHelps) {
  SaveTwinFamily(0.2f);
  PerDeviceStrategyOptions better = GuardOptions(1.0, /*steps=*/80);
  better.guard.measure = GuardMeasure::kTeacherProbability;
  Start(better);
  Uplink("dev-a", 1, 24, 0, 1.0f, compress::FeaturePrecision::kFp16, /*distinct=*/4);
  Uplink("dev-a", 2, 24, 0, 1.0f, compress::FeaturePrecision::kFp16, /*distinct=*/4);
  ASSERT_OK_AND_ASSIGN(JobReport shipped, strategy_->RunJob("dev-a"));
  EXPECT_GE(shipped.guard.pool, 8);
  EXPECT_GT(shipped.guard.after, shipped.guard.before);
  EXPECT_FALSE(shipped.update_withheld);
  EXPECT_EQ(shipped.guard.decision, "helps");
  EXPECT_EQ(shipped.new_version, 1u);
}

INSTANTIATE_TEST_SUITE_P(EveryLearner, GuardTest, ::testing::Values("pl", "akd", "pkd", "cwd"));

// The teacher_and_base measure, which does not depend on the learner: one learner's job.
class GuardJudgesTest : public GuardTest {
 protected:
  // The job of TheTeachersProbabilityShipsWhatHelps (trained toward the teacher's labels) on
  // fresh stores and the same seed, its update judged by `measure`: the same job and update
  // whatever judges it, so two measures' verdicts compare on one update.
  void JudgedBy(GuardMeasure measure, GuardVerdict* verdict) {
    strategy_.reset();
    for (const char* d : {"/samples", "/updates", "/trainer"}) {
      std::filesystem::remove_all(dir_.path() + d);
    }
    OpenStores();
    torch::manual_seed(3);
    PerDeviceStrategyOptions o = GuardOptions(1.0, /*steps=*/80);
    o.guard.measure = measure;
    Start(o);
    Uplink("dev-a", 1, 24, 0, 1.0f, compress::FeaturePrecision::kFp16, /*distinct=*/4);
    Uplink("dev-a", 2, 24, 0, 1.0f, compress::FeaturePrecision::kFp16, /*distinct=*/4);
    ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
    ASSERT_GE(report.guard.pool, 8);
    *verdict = report.guard;
  }
};

// A student that is its teacher: the base judges every answer as the teacher does, and the
// mean of the two is the teacher's probability. (The tiny family's probabilities of a whole
// answer are products of near-uniform softmaxes, far below 1: compared relatively.)
TEST_P(GuardJudgesTest, TheBaseThatIsTheTeacherJudgesAsTheTeacher) {
  SaveTwinFamily(0.0f);
  GuardVerdict teacher, both;
  JudgedBy(GuardMeasure::kTeacherProbability, &teacher);
  JudgedBy(GuardMeasure::kTeacherAndBase, &both);
  EXPECT_EQ(both.pool, teacher.pool);
  ASSERT_GT(teacher.before, 0.0);
  ASSERT_GT(teacher.after, 0.0);
  EXPECT_NEAR(both.before / teacher.before, 1.0, 1e-4);
  EXPECT_NEAR(both.after / teacher.after, 1.0, 1e-4);
}

// A student off its teacher, trained toward the teacher's labels: the teacher's probability
// rises, and the base, whose own greedy answers the update moves away from, judges the move
// worse; the mean gains less than the teacher's probability alone (on the same update).
TEST_P(GuardJudgesTest, TheBaseJudgesAMoveOffItsOwnAnswersWorse) {
  SaveTwinFamily(0.2f);
  GuardVerdict teacher, both;
  JudgedBy(GuardMeasure::kTeacherProbability, &teacher);
  JudgedBy(GuardMeasure::kTeacherAndBase, &both);
  ASSERT_GT(teacher.gain, 0.0);
  EXPECT_EQ(both.pool, teacher.pool);
  EXPECT_LT(both.gain, teacher.gain);
  // Before the job the device is the base: the base's probability of its own greedy answers
  // is above the teacher's probability of them.
  EXPECT_GT(both.before, teacher.before);
}

INSTANTIATE_TEST_SUITE_P(OneLearner, GuardJudgesTest, ::testing::Values("akd"));

TEST_F(TrainerTest, SchedulerTriggersOnSampleCount) {
  MakeStrategy();
  JobSchedulerOptions so;
  so.trigger_samples = 6;
  so.trigger_interval = absl::InfiniteDuration();
  JobScheduler scheduler(so, strategy_.get(), samples_.get());
  Uplink("dev-a", 1, 4);
  scheduler.OnSamplesStored("dev-a", 1);
  ASSERT_TRUE(scheduler.WaitIdle(absl::Seconds(60)));
  EXPECT_EQ(scheduler.jobs_done(), 0u);  // 4 < 6
  Uplink("dev-a", 2, 3);
  scheduler.OnSamplesStored("dev-a", 2);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(scheduler.WaitIdle(absl::Seconds(120)));
  EXPECT_EQ(scheduler.jobs_done(), 1u);
  EXPECT_EQ(strategy_->State("dev-a").version, 1u);
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 2u);
}

// The scheduler counts pending samples from the store's index, never from payloads: with
// every payload on disk made unreadable, the trigger still fires (the job itself is what
// reads them, and quarantines them).
TEST_F(TrainerTest, SchedulerCountsSamplesFromTheIndexWithoutReadingPayloads) {
  MakeStrategy();
  Uplink("dev-a", 1, 4);
  Uplink("dev-a", 2, 4);
  {
    // Damage every record body on disk; the open store's index is untouched.
    const std::string seg = dir_.path() + "/samples/seg-00000001.log";
    std::fstream f(seg, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const std::streamoff size = f.tellg();
    for (std::streamoff at = 40; at < size; at += 64) {
      f.seekp(at);
      f.put('\x5a');
    }
  }
  ASSERT_THAT(samples_->Read("dev-a", 1, 10), StatusIs(absl::StatusCode::kDataLoss));
  JobSchedulerOptions so;
  so.trigger_samples = 8;
  so.trigger_interval = absl::InfiniteDuration();
  so.retry_after = absl::Hours(1);
  JobScheduler scheduler(so, strategy_.get(), samples_.get());
  // The job runs, reads both batches back damaged and quarantines them.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (strategy_->State("dev-a").quarantined_samples < 8 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(strategy_->State("dev-a").quarantined_samples, 8u);
  ASSERT_TRUE(scheduler.WaitIdle(absl::Seconds(60)));
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 2u);
}

TEST_F(TrainerTest, SchedulerTriggersOnTime) {
  MakeStrategy();
  JobSchedulerOptions so;
  so.trigger_samples = 1000;
  so.trigger_interval = absl::Milliseconds(300);
  JobScheduler scheduler(so, strategy_.get(), samples_.get());
  Uplink("dev-a", 1, 2);
  scheduler.OnSamplesStored("dev-a", 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (scheduler.jobs_done() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(scheduler.jobs_done(), 1u);
  EXPECT_EQ(strategy_->State("dev-a").version, 1u);
}

// On an injected clock the interval trigger follows that clock, not real time; jobs
// triggered together queue for the one worker, and each report says how long it waited.
TEST_F(TrainerTest, SchedulerTriggersOnItsClockAndReportsQueueing) {
  MakeStrategy();
  VirtualClock clock;
  JobSchedulerOptions so;
  so.trigger_samples = 1000;
  so.trigger_interval = absl::Seconds(60);
  so.clock = &clock;
  JobScheduler scheduler(so, strategy_.get(), samples_.get());
  absl::Mutex mu;
  std::vector<JobReport> reports;
  scheduler.SetJobCallback([&](const absl::StatusOr<JobReport>& r) {
    ASSERT_TRUE(r.ok()) << r.status();
    absl::MutexLock lock(&mu);
    reports.push_back(*r);
  });
  Uplink("dev-a", 1, 2);
  scheduler.OnSamplesStored("dev-a", 1);
  Uplink("dev-b", 1, 2);
  scheduler.OnSamplesStored("dev-b", 1);
  absl::SleepFor(absl::Milliseconds(400));  // real time passes; the scheduler's does not
  EXPECT_EQ(scheduler.jobs_done(), 0u);
  clock.Advance(absl::Seconds(59));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(scheduler.jobs_done(), 0u);
  clock.Advance(absl::Seconds(1));
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (scheduler.jobs_done() < 2 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(scheduler.jobs_done(), 2u);
  EXPECT_EQ(scheduler.peak_in_flight(), 2);
  EXPECT_EQ(scheduler.peak_running(), 1);
  absl::MutexLock lock(&mu);
  ASSERT_EQ(reports.size(), 2u);
  // The second job waited for the first one to train.
  EXPECT_GE(reports[1].queue_seconds, reports[0].train_seconds);
  EXPECT_LT(reports[0].queue_seconds, reports[1].queue_seconds);
}

}  // namespace
}  // namespace cdcca::cloud
