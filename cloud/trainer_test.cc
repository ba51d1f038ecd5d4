// PerDeviceStrategy and JobScheduler on the `tiny` family with random weights: a job turns
// stored samples into an update that takes the device exactly to the mirror, state survives
// a restart, a commit that was never published is republished, the scheduler triggers, and
// the update guard withholds an update that makes the held-out agreement worse.
#include "cloud/trainer.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "compress/named_tensors.h"
#include "compress/uplink_codec.h"
#include "datasets/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/family/checkpoint.h"
#include "model/hub/safetensors.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    ASSERT_OK_AND_ASSIGN(family_, model::LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) +
                                                          "/configs/models/tiny.json"));
    model::VisionEncoder encoder(family_.vision);
    model::Blip2Tower teacher(family_.teacher), student(family_.student);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : teacher->parameters()) p.mul_(2.0);
    }
    checkpoint_ = dir_.path() + "/family";
    ASSERT_OK(model::SaveFamily(checkpoint_, family_, encoder, teacher, student, "",
                                datasets::Tokenizer::SceneLanguage().tokens()));
    OpenStores();
  }

  void OpenStores() {
    strategy_.reset();
    updates_.reset();
    samples_.reset();
    SampleStoreOptions so;
    so.dir = dir_.path() + "/samples";
    ASSERT_OK_AND_ASSIGN(samples_, SampleStore::Open(so));
    ASSERT_OK_AND_ASSIGN(updates_, UpdateStore::Open({dir_.path() + "/updates", 16}));
  }

  PerDeviceStrategyOptions Options() const {
    PerDeviceStrategyOptions o;
    o.checkpoint_dir = checkpoint_;
    o.student_precision = "int8";
    o.state_dir = dir_.path() + "/trainer";
    o.max_steps = 3;
    o.batch_size = 4;
    o.torch_threads = 1;
    o.bits_per_param = 4.0;
    // These tests are about what a job commits and publishes: every sample trains and every
    // update ships. The guard's own tests (GuardTest) turn it on.
    o.guard.enabled = false;
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
              compress::FeaturePrecision precision = compress::FeaturePrecision::kFp16) {
    std::mt19937_64 rng(sequence * 7 + device.size());
    std::normal_distribution<float> normal;
    const int tokens = grid != 0 ? grid : family_.vision.NumTokens(), dim = family_.vision.d_vis;
    std::vector<compress::UplinkSample> batch(n);
    for (int i = 0; i < n; ++i) {
      compress::UplinkSample& s = batch[i];
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

  // The pretrained student's trainable set, as the device holds it at version 0.
  compress::NamedTensors DeviceState() {
    auto family = model::LoadFamily(checkpoint_, model::Precision::kInt8);
    EXPECT_OK(family);
    compress::NamedTensors out;
    for (auto& [name, t] : model::TrainableParameters(*family->student)) {
      out.emplace_back(name, t.detach().clone());
    }
    return out;
  }

  TempDir dir_;
  model::FamilyConfig family_;
  std::string checkpoint_;
  std::unique_ptr<SampleStore> samples_;
  std::unique_ptr<UpdateStore> updates_;
  std::unique_ptr<PerDeviceStrategy> strategy_;
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

// Regression (issue 20, attack finding 1): after the sample log lost its tail, the durable
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

// Regression (issue 20, attack finding 3): a stored batch that decodes but does not fit the
// model (from a log written before ingest checked batches) failed every job of its device,
// every few seconds, forever; its later valid batches were never trained.
TEST_F(TrainerTest, StoredBatchThatDoesNotFitTheModelIsSkippedNotFatal) {
  MakeStrategy();
  Uplink("dev-a", 1, 2, /*grid=*/family_.vision.NumTokens() * 4);
  Uplink("dev-a", 2, 3);
  ASSERT_OK_AND_ASSIGN(JobReport report, strategy_->RunJob("dev-a"));
  EXPECT_EQ(report.skipped_batches, 1);
  EXPECT_EQ(report.first_sequence, 1u);
  EXPECT_EQ(report.last_sequence, 2u);
  EXPECT_EQ(report.samples, 3);
  EXPECT_EQ(strategy_->ConsumedSequence("dev-a"), 2u);
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
  for (uint64_t seq = 1; seq <= 3; ++seq) Uplink("dev-a", seq, 3);
  EXPECT_EQ(samples_->SampleCount("dev-a", 1, 3), 9u);
  ASSERT_OK_AND_ASSIGN(JobReport first, strategy_->RunJob("dev-a"));
  EXPECT_EQ(first.last_sequence, 1u);
  EXPECT_EQ(first.samples, 3);
  ASSERT_OK_AND_ASSIGN(JobReport second, strategy_->RunJob("dev-a"));
  EXPECT_EQ(second.first_sequence, 2u);
  EXPECT_EQ(second.last_sequence, 2u);
  // The model's shape reaches the service's ingest check.
  EXPECT_EQ(strategy_->Spec().grid_tokens, static_cast<uint32_t>(family_.vision.NumTokens()));
  EXPECT_EQ(strategy_->Spec().feature_dim, static_cast<uint32_t>(family_.vision.d_vis));
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
  // `offset` moves the student's LoRA weights off the teacher's (0 = identical).
  void SaveTwinFamily(float offset) {
    model::FamilyConfig twin = family_;
    twin.teacher = twin.student;
    model::VisionEncoder encoder(twin.vision);
    model::Blip2Tower teacher(twin.teacher), student(twin.student);
    {
      torch::NoGradGuard no_grad;
      auto from = teacher->named_parameters();
      for (auto& p : student->named_parameters()) p.value().copy_(from[p.key()]);
      // LoRA only: a family's adapter prompts must start at zero gates.
      for (auto& [name, t] : model::TrainableParameters(*student)) {
        if (name.find("lora") != std::string::npos) t.add_(offset * torch::randn_like(t));
      }
    }
    checkpoint_ = dir_.path() + "/twin";
    ASSERT_OK(model::SaveFamily(checkpoint_, twin, encoder, teacher, student, "",
                                datasets::Tokenizer::SceneLanguage().tokens()));
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
  Uplink("dev-a", 1, 24);
  Uplink("dev-a", 2, 24);
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

INSTANTIATE_TEST_SUITE_P(EveryLearner, GuardTest, ::testing::Values("pl", "akd", "pkd", "cwd"));

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

// Regression (issue 20, attack finding 4): the scheduler read every pending record to count
// its samples (1.2 GB RSS for a 1 GiB backlog at startup). It counts from the store's index
// now: with every payload on disk made unreadable, the trigger still fires (the job itself is
// what reads, and fails).
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
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (scheduler.jobs_failed() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(scheduler.jobs_failed(), 1u);
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
