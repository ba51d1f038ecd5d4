// The update guard on a Hugging Face pair (MirrorTrainer's teacher and student answers):
// with the tiny random LLaVA fixture as both teacher and student (fp32, so they answer
// alike), a job trained away from the teacher's labels (a negative CE weight) lowers the
// held-out agreement, and its update is withheld: no update, the device stays at version 0,
// the batches are consumed. An uplinked frame is answered by both sides from every token of
// it, whatever UTS kept, as the device answered it. Devices' jobs trained together over the
// one student give each device what its job alone gives.
#include "cloud/internal/mirror_trainer.h"

#include <torch/torch.h>

#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cloud/sample_store.h"
#include "cloud/trainer.h"
#include "cloud/update_store.h"
#include "compress/uplink_codec.h"
#include "datasets/formats.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/arch/answerer.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;

std::string Fixture(const std::string& name) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + name;
}

// The question of the fixture's first case in the student's ids: what follows the image.
std::vector<uint32_t> Question(const std::string& fixture) {
  nlohmann::json config = nlohmann::json::parse(std::ifstream(fixture + "/config.json"));
  nlohmann::json expected = nlohmann::json::parse(std::ifstream(fixture + "/expected.json"));
  const int64_t image = config.value("image_token_index", -1);
  std::vector<uint32_t> ids;
  for (int64_t id : expected["cases"][0]["input_ids"].get<std::vector<int64_t>>()) {
    if (id == image) {
      ids.clear();
    } else {
      ids.push_back(static_cast<uint32_t>(id));
    }
  }
  return ids;
}

// The fixture `pair` as teacher and student, both fp32 (so they answer alike), LoRA rank 4.
PerDeviceStrategyOptions PairOptions(const std::string& pair) {
  PerDeviceStrategyOptions o;
  o.teacher_dir = pair;
  o.student_base_dir = pair;
  o.teacher_precision = "fp32";
  o.student_precision = "fp32";
  o.lora_rank = 4;
  o.lora_alpha = 8;
  return o;
}

TEST(MirrorTrainerGuardTest, AnUpdateThatMakesHeldOutAgreementWorseIsWithheld) {
  torch::manual_seed(5);
  TempDir dir;
  const std::string pair = Fixture("llava_clip_llama");
  SampleStoreOptions so;
  so.dir = dir.path() + "/samples";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<SampleStore> samples, SampleStore::Open(so));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<UpdateStore> updates,
                       UpdateStore::Open({dir.path() + "/updates", 16}));
  const std::string config = dir.path() + "/distill.json";
  std::ofstream(config) << R"({"learner": {"l_ce": -1.0}, "job": {"lr": 0.05}})";
  PerDeviceStrategyOptions o = PairOptions(pair);
  o.state_dir = dir.path() + "/trainer";
  o.learner = "pl";
  o.distill_config = config;
  o.max_steps = 20;
  o.batch_size = 4;
  o.max_answer_tokens = 4;
  o.torch_threads = 1;
  o.bits_per_param = 8.0;
  o.guard.holdout_fraction = 0.5;
  o.guard.min_pool = 4;
  o.guard.measure = GuardMeasure::kAgreement;  // a student that is the teacher scores 1
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PerDeviceStrategy> strategy,
                       PerDeviceStrategy::Create(o, samples.get(), updates.get()));
  ASSERT_OK(strategy->Recover());

  // Two batches of random tower tokens (every other token kept) with the fixture's question.
  const SampleSpec spec = strategy->Spec();
  const std::vector<uint32_t> question = Question(pair);
  ASSERT_FALSE(question.empty());
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal;
  for (uint64_t sequence = 1; sequence <= 2; ++sequence) {
    std::vector<compress::UplinkSample> batch(8);
    for (size_t i = 0; i < batch.size(); ++i) {
      compress::UplinkSample& s = batch[i];
      s.sample_id = sequence * 100 + i;
      s.grid_tokens = spec.grid_tokens;
      s.feature_dim = spec.feature_dim;
      for (uint32_t k = 0; k < spec.grid_tokens; k += 2) s.kept_indices.push_back(k);
      for (size_t k = 0; k < s.kept_indices.size() * spec.feature_dim; ++k) {
        s.features.push_back(normal(rng));
      }
      s.prompt_tokens = question;
    }
    ASSERT_OK_AND_ASSIGN(std::string payload,
                         compress::EncodeUplinkBatch(batch, compress::FeaturePrecision::kFp16));
    v1::UplinkBatch b;
    b.set_sequence(sequence);
    b.set_sample_count(static_cast<uint32_t>(batch.size()));
    b.set_codec_version(1);
    b.set_payload(payload);
    ASSERT_OK(samples->AppendAndWait("dev-a", b).status());
  }

  ASSERT_OK_AND_ASSIGN(JobReport report, strategy->RunJob("dev-a"));
  EXPECT_GE(report.guard.pool, 4);
  EXPECT_EQ(report.samples + report.held_out_samples, 16);
  EXPECT_DOUBLE_EQ(report.guard.before, 1.0);  // the student is the teacher
  EXPECT_LT(report.guard.after, report.guard.before);
  EXPECT_TRUE(report.update_withheld);
  EXPECT_EQ(report.new_version, 0u);
  EXPECT_THAT(updates->UpdateAfter("dev-a", 0).status(), StatusIs(absl::StatusCode::kNotFound));
  const DeviceTrainingState state = strategy->State("dev-a");
  EXPECT_EQ(state.version, 0u);
  EXPECT_EQ(state.state_digest, strategy->BaseDigest());
  EXPECT_EQ(state.consumed_sequence, 2u);
  EXPECT_EQ(state.updates_withheld, 1u);
}

// The teacher labels an uplinked frame (and the guard scores the mirror on it) from every
// token of the frame, not from the two UTS kept: its answers equal those to the same tokens
// uplinked in full, and differ from those to the two kept tokens alone on some frame (checked
// first, so the test can tell the two apart).
TEST(MirrorTrainerGuardTest, AFrameIsAnsweredFromEveryTokenOfIt) {
  const std::string pair = Fixture("llava_clip_llama");
  PerDeviceStrategyOptions o = PairOptions(pair);
  o.max_answer_tokens = 4;
  o.torch_threads = 1;
  absl::StatusOr<std::unique_ptr<internal::MirrorTrainer>> trainer =
      internal::MirrorTrainer::Create(o);
  if (absl::IsUnimplemented(trainer.status())) GTEST_SKIP() << "no Hugging Face tokenizers";
  ASSERT_OK(trainer);
  const SampleSpec spec = (*trainer)->spec();
  ASSERT_GT(spec.frame_width, 0u);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Answerer> tower,
                       model::Answerer::Load(pair, "fp32", "cpu"));
  const std::vector<uint32_t> question = Question(pair);
  std::vector<compress::UplinkSample> frames, full, kept;
  std::mt19937 rng(7);
  for (uint64_t i = 0; i < 6; ++i) {
    datasets::Image image(static_cast<int>(spec.frame_width), static_cast<int>(spec.frame_height));
    for (uint8_t& p : image.pixels) p = static_cast<uint8_t>(rng());
    ASSERT_OK_AND_ASSIGN(std::string jpeg, datasets::EncodeJpeg(image, 90));
    ASSERT_OK_AND_ASSIGN(model::VisualTokenReply tokens, tower->TowerTokensOfJpeg(jpeg, "frame"));
    compress::UplinkSample s;
    s.sample_id = i;
    s.grid_tokens = spec.grid_tokens;
    s.feature_dim = spec.feature_dim;
    s.prompt_tokens = question;
    s.kept_indices = {static_cast<uint16_t>(i), static_cast<uint16_t>(i + 2)};
    compress::UplinkSample f = s;
    f.frame = jpeg;
    frames.push_back(f);
    for (uint16_t k : s.kept_indices) {
      const float* row = tokens.features.data() + static_cast<size_t>(k) * spec.feature_dim;
      s.features.insert(s.features.end(), row, row + spec.feature_dim);
    }
    kept.push_back(s);
    s.kept_indices.clear();
    for (uint32_t k = 0; k < spec.grid_tokens; ++k) s.kept_indices.push_back(k);
    s.features = tokens.features;
    full.push_back(s);
  }
  auto pointers = [](const std::vector<compress::UplinkSample>& v) {
    std::vector<const compress::UplinkSample*> out;
    for (const compress::UplinkSample& s : v) out.push_back(&s);
    return out;
  };
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> teacher_kept,
                       (*trainer)->TeacherAnswers(pointers(kept)));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> teacher_full,
                       (*trainer)->TeacherAnswers(pointers(full)));
  ASSERT_NE(teacher_kept, teacher_full) << "two tokens never change the teacher's answer";
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> teacher_frames,
                       (*trainer)->TeacherAnswers(pointers(frames)));
  EXPECT_EQ(teacher_frames, teacher_full);
  const compress::NamedTensors& base = (*trainer)->base_trainable();
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> student_frames,
                       (*trainer)->StudentAnswers(base, pointers(frames)));
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> student_full,
                       (*trainer)->StudentAnswers(base, pointers(full)));
  EXPECT_EQ(student_frames, student_full);
}

// Devices' jobs that train together over the one student, as TrainTogether runs them and as
// Train calls that wait for the student at once run them (however the calls happen to group),
// give each device the trained set its job alone gives. The devices start from different
// mirrors and uplinked different tokens.
TEST(MirrorTrainerTogetherTest, EachDeviceGetsWhatItsJobAloneGives) {
  const std::string pair = Fixture("llava_clip_llama");
  PerDeviceStrategyOptions o = PairOptions(pair);
  o.max_steps = 3;
  o.batch_size = 2;
  o.max_answer_tokens = 3;
  o.torch_threads = 1;
  o.max_jobs_together = 3;
  absl::StatusOr<std::unique_ptr<internal::MirrorTrainer>> trainer =
      internal::MirrorTrainer::Create(o);
  if (absl::IsUnimplemented(trainer.status())) GTEST_SKIP() << "no Hugging Face tokenizers";
  ASSERT_OK(trainer);
  const SampleSpec spec = (*trainer)->spec();
  const std::vector<uint32_t> question = Question(pair);
  constexpr int kDevices = 3;
  std::vector<compress::NamedTensors> mirrors(kDevices);
  std::vector<std::vector<compress::UplinkSample>> samples(kDevices);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  torch::manual_seed(13);
  for (int d = 0; d < kDevices; ++d) {
    for (const auto& [name, t] : (*trainer)->base_trainable()) {
      torch::Tensor m = t.clone();
      if (name.find("lora_b") != std::string::npos) m.normal_(0.0, 0.3);
      mirrors[d].emplace_back(name, m);
    }
    for (int i = 0; i < 3 + d; ++i) {
      compress::UplinkSample s;
      s.sample_id = static_cast<uint64_t>(i);
      s.grid_tokens = spec.grid_tokens;
      s.feature_dim = spec.feature_dim;
      for (uint32_t k = d % 2; k < spec.grid_tokens; k += 2) s.kept_indices.push_back(k);
      for (size_t k = 0; k < s.kept_indices.size() * spec.feature_dim; ++k) {
        s.features.push_back(normal(rng));
      }
      s.prompt_tokens = question;
      samples[d].push_back(std::move(s));
    }
  }
  std::vector<TrainedSet> alone;
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_OK_AND_ASSIGN(TrainedSet t, (*trainer)->Train(absl::StrCat("alone-", d), mirrors[d],
                                                         samples[d], nullptr, 0));
    alone.push_back(std::move(t));
  }
  std::vector<internal::MirrorTrainer::DeviceJob> jobs;
  for (int d = 0; d < kDevices; ++d) {
    jobs.push_back({absl::StrCat("together-", d), &mirrors[d], &samples[d], nullptr});
  }
  std::vector<absl::StatusOr<TrainedSet>> together = (*trainer)->TrainTogether(jobs);
  std::vector<absl::StatusOr<TrainedSet>> concurrent(kDevices, absl::UnknownError("not run"));
  {
    std::vector<std::thread> threads;
    for (int d = 0; d < kDevices; ++d) {
      threads.emplace_back([&, d] {
        concurrent[d] =
            (*trainer)->Train(absl::StrCat("concurrent-", d), mirrors[d], samples[d], nullptr, 0);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  ASSERT_EQ(together.size(), static_cast<size_t>(kDevices));
  for (int d = 0; d < kDevices; ++d) {
    SCOPED_TRACE(d);
    ASSERT_OK(together[d]);
    ASSERT_OK(concurrent[d]);
    EXPECT_EQ(together[d]->stats.current_samples, 3 + d);
    for (const TrainedSet* got : {&*together[d], &*concurrent[d]}) {
      ASSERT_EQ(got->trainable.size(), alone[d].trainable.size());
      for (size_t i = 0; i < got->trainable.size(); ++i) {
        const torch::Tensor& want = alone[d].trainable[i].second;
        const double scale = 1.0 + want.abs().max().item<double>();
        EXPECT_LE((got->trainable[i].second - want).abs().max().item<double>(), 1e-5 * scale)
            << alone[d].trainable[i].first;
      }
    }
  }
  // One device twice in a group is refused: its learner state serves one job at a time.
  std::vector<absl::StatusOr<TrainedSet>> twice = (*trainer)->TrainTogether(
      {{"twice", &mirrors[0], &samples[0], nullptr}, {"twice", &mirrors[1], &samples[1], nullptr}});
  EXPECT_THAT(twice[0].status(), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(twice[1].status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace cdcca::cloud
