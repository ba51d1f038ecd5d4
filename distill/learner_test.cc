#include "distill/learner.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <random>

#include "distill/akd.h"
#include "distill/baselines/cotta.h"
#include "distill/baselines/tent.h"
#include "model/family/checkpoint.h"
#include "model/family/config.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::distill {
namespace {

std::map<std::string, torch::Tensor> Snapshot(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : model::ModuleState(m)) out[name] = t.detach().clone();
  return out;
}

class LearnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(family_, model::LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) +
                                                          "/configs/models/tiny.json"));
    torch::manual_seed(1);
    teacher_ = model::Blip2Tower(family_.teacher);
    student_ = model::Blip2Tower(family_.student);
    // Random weights give near-uniform logits; sharpen the teacher so its pseudo-labels
    // differ between samples and the student has something to learn.
    torch::NoGradGuard no_grad;
    for (auto& p : teacher_->parameters()) p.mul_(2.0);
    samples_ = MakeSamples(12, 5);
  }

  std::vector<compress::UplinkSample> MakeSamples(int n, uint64_t seed) const {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal;
    const int tokens = family_.vision.NumTokens(), dim = family_.vision.d_vis;
    std::vector<compress::UplinkSample> out(n);
    for (int i = 0; i < n; ++i) {
      compress::UplinkSample& s = out[i];
      s.sample_id = seed * 1000 + i;
      s.grid_tokens = tokens;
      s.feature_dim = dim;
      for (int k = 0; k < tokens; ++k) {
        if (rng() % 2 == 0) s.kept_indices.push_back(k);
      }
      for (size_t k = 0; k < s.kept_indices.size() * dim; ++k) s.features.push_back(normal(rng));
      const int prompt = 2 + static_cast<int>(rng() % 4);
      s.prompt_tokens.push_back(1);
      for (int k = 1; k < prompt; ++k) s.prompt_tokens.push_back(4 + rng() % 60);
      s.answer_tokens = {5, 2};
    }
    return out;
  }

  JobOptions Options(int steps) const {
    JobOptions o;
    o.max_steps = steps;
    o.batch_size = 6;
    o.lr = 1e-2;
    o.num_threads = 2;
    o.use_cuda = false;
    o.max_answer_tokens = 3;
    o.seed = 9;
    return o;
  }

  model::FamilyConfig family_;
  model::Blip2Tower teacher_{nullptr};
  model::Blip2Tower student_{nullptr};
  std::vector<compress::UplinkSample> samples_;
};

TEST_F(LearnerTest, SamplePoolZeroesAndMasksAbsentTokens) {
  std::vector<const compress::UplinkSample*> ptrs{&samples_[0]};
  ASSERT_OK_AND_ASSIGN(SamplePool pool,
                       BuildSamplePool(ptrs, family_.vision.NumTokens(), family_.vision.d_vis));
  const auto& s = samples_[0];
  EXPECT_EQ(pool.visual_mask.sum().item<int64_t>(), static_cast<int64_t>(s.kept_indices.size()));
  torch::Tensor absent = pool.visual_tokens[0].index({pool.visual_mask[0].logical_not()});
  EXPECT_EQ(absent.abs().sum().item<float>(), 0.0f);
  const int64_t k = s.kept_indices[1];
  EXPECT_EQ(pool.visual_tokens[0][k][3].item<float>(), s.features[1 * family_.vision.d_vis + 3]);
  compress::UplinkSample bad = s;
  bad.kept_indices[1] = bad.kept_indices[0];
  std::vector<const compress::UplinkSample*> bad_ptrs{&bad};
  EXPECT_FALSE(BuildSamplePool(bad_ptrs, family_.vision.NumTokens(), family_.vision.d_vis).ok());
}

TEST_F(LearnerTest, CollateTextPlacesTargetsBeforeEachAnswerToken) {
  TextBatch t = CollateText({{1, 7}, {1, 8, 9}}, {{10, 2}, {11}}, 0);
  EXPECT_EQ(t.prompt_width, 3);
  // Row 0: [pad, 1, 7, 10, 2]; the logits at columns 2 and 3 predict 10 and 2.
  EXPECT_EQ(t.text_ids[0][0].item<int64_t>(), 0);
  EXPECT_FALSE(t.text_valid[0][0].item<bool>());
  EXPECT_EQ(t.targets[0][2].item<int64_t>(), 10);
  EXPECT_EQ(t.targets[0][3].item<int64_t>(), 2);
  EXPECT_EQ(t.targets[0][4].item<int64_t>(), -1);
  EXPECT_EQ(t.targets[1][2].item<int64_t>(), 11);
  EXPECT_FALSE(t.text_valid[1][4].item<bool>());
  EXPECT_TRUE(t.answer_mask[1][3].item<bool>());
}

TEST_F(LearnerTest, GradientsReachOnlyTheTrainableSetAndProjections) {
  DistillLearner akd(teacher_, *PresetDistillConfig("akd"));
  JobOptions o = Options(2);
  o.train_in_place = true;
  ASSERT_OK_AND_ASSIGN(JobResult r, akd.Run(samples_, nullptr, student_, o));
  int trainable = 0;
  for (const auto& item : student_->named_parameters()) {
    if (model::IsTrainableName(item.key())) {
      ++trainable;
      EXPECT_TRUE(item.value().grad().defined()) << item.key();
    } else {
      EXPECT_FALSE(item.value().grad().defined()) << item.key();
    }
  }
  EXPECT_GT(trainable, 0);
  for (const auto& p : teacher_->parameters()) EXPECT_FALSE(p.grad().defined());
  ASSERT_FALSE(akd.phi().is_empty());
  for (const auto& p : akd.phi()->parameters()) EXPECT_TRUE(p.grad().defined());
  for (const auto& p : akd.psi()->parameters()) EXPECT_TRUE(p.grad().defined());
  // The job restores requires_grad as it found it.
  for (const auto& p : student_->parameters()) EXPECT_TRUE(p.requires_grad());
}

TEST_F(LearnerTest, FrozenBaseBitIdenticalAfterInPlaceJob) {
  auto before = Snapshot(*student_);
  auto teacher_before = Snapshot(*teacher_);
  DistillLearner akd(teacher_, *PresetDistillConfig("akd"));
  JobOptions o = Options(3);
  o.train_in_place = true;
  ASSERT_OK_AND_ASSIGN(JobResult r, akd.Run(samples_, nullptr, student_, o));
  int changed = 0;
  for (const auto& [name, t] : model::ModuleState(*student_)) {
    if (model::IsTrainableName(name)) {
      changed += !torch::equal(t, before[name]);
    } else {
      EXPECT_TRUE(torch::equal(t, before[name])) << name;
    }
  }
  EXPECT_GT(changed, 0);
  for (const auto& [name, t] : model::ModuleState(*teacher_)) {
    EXPECT_TRUE(torch::equal(t, teacher_before[name])) << name;
  }
  // The returned state is the student's trainable set, in its order.
  model::NamedTensors live = model::TrainableParameters(*student_);
  ASSERT_EQ(r.trainable.size(), live.size());
  for (size_t i = 0; i < live.size(); ++i) {
    EXPECT_EQ(r.trainable[i].first, live[i].first);
    EXPECT_TRUE(torch::equal(r.trainable[i].second, live[i].second));
  }
}

TEST_F(LearnerTest, DefaultJobLeavesTheMirrorUntouchedAndIsDeterministic) {
  auto before = Snapshot(*student_);
  DistillLearner a(teacher_, *PresetDistillConfig("akd"));
  DistillLearner b(teacher_, *PresetDistillConfig("akd"));
  ASSERT_OK_AND_ASSIGN(JobResult ra, a.Run(samples_, nullptr, student_, Options(3)));
  ASSERT_OK_AND_ASSIGN(JobResult rb, b.Run(samples_, nullptr, student_, Options(3)));
  for (const auto& [name, t] : model::ModuleState(*student_)) {
    EXPECT_TRUE(torch::equal(t, before[name])) << name;
  }
  ASSERT_EQ(ra.trainable.size(), rb.trainable.size());
  int changed = 0;
  for (size_t i = 0; i < ra.trainable.size(); ++i) {
    EXPECT_TRUE(torch::equal(ra.trainable[i].second, rb.trainable[i].second));
    changed += !torch::equal(ra.trainable[i].second, before[ra.trainable[i].first]);
  }
  EXPECT_GT(changed, 0);
  EXPECT_EQ(ra.stats.steps, 3);
  EXPECT_EQ(ra.stats.samples_seen, 18);
  EXPECT_EQ(ra.stats.device, "cpu");
}

TEST_F(LearnerTest, AkdJobOnAFixedBatchReducesItsLoss) {
  DistillConfig c = *PresetDistillConfig("akd");
  c.l_kl = 0.5;
  DistillLearner akd(teacher_, c);
  JobOptions o = Options(40);
  o.batch_size = 12;  // the whole pool: every step sees the same batch
  ASSERT_OK_AND_ASSIGN(JobResult r, akd.Run(samples_, nullptr, student_, o));
  ASSERT_EQ(r.stats.terms.size(), 5u);  // total, ce, query, repr, kl
  EXPECT_EQ(r.stats.terms[0].name, "total");
  EXPECT_LT(r.stats.terms[0].last, r.stats.terms[0].first);
  EXPECT_LT(r.stats.terms[1].last, r.stats.terms[1].first);  // ce
  EXPECT_LT(r.stats.terms[4].last, r.stats.terms[4].first);  // kl
  EXPECT_GT(r.stats.samples_per_second, 0);

  // The alignment terms alone are minimised too (with CE in the mix they may trade off
  // against it: the ridge-initialised projections start them low).
  c.l_ce = 0;
  c.l_kl = 0;
  c.ridge_init = false;
  DistillLearner align(teacher_, c);
  ASSERT_OK_AND_ASSIGN(JobResult a, align.Run(samples_, nullptr, student_, o));
  ASSERT_EQ(a.stats.terms.size(), 4u);
  EXPECT_LT(a.stats.terms[2].last, a.stats.terms[2].first);  // query
  EXPECT_LT(a.stats.terms[3].last, a.stats.terms[3].first);  // repr
}

TEST_F(LearnerTest, EveryCloudBaselineRunsAndLearns) {
  for (const std::string name : {"pl", "pkd", "cwd"}) {
    ASSERT_OK_AND_ASSIGN(auto learner, MakeLearner(name, teacher_));
    EXPECT_EQ(learner->name(), name);
    JobOptions o = Options(30);
    o.batch_size = 12;
    ASSERT_OK_AND_ASSIGN(JobResult r, learner->Run(samples_, nullptr, student_, o));
    EXPECT_EQ(r.stats.terms.size(), name == "pl" ? 2u : 4u) << name;
    EXPECT_LT(r.stats.terms[0].last, r.stats.terms[0].first) << name;
  }
  EXPECT_FALSE(MakeLearner("akd", model::Blip2Tower(nullptr)).ok());
  EXPECT_FALSE(MakeLearner("nonsense", teacher_).ok());
}

TEST_F(LearnerTest, TentChangesOnlyNormParameters) {
  auto before = Snapshot(*student_);
  TentLearner tent;
  JobOptions o = Options(5);
  o.train_in_place = true;
  o.lr = 5e-2;
  ASSERT_OK_AND_ASSIGN(JobResult r, tent.Run(samples_, nullptr, student_, o));
  int norms_changed = 0;
  for (const auto& [name, t] : model::ModuleState(*student_)) {
    if (model::IsTrainableName(name) && IsNormParameterName(name)) {
      norms_changed += !torch::equal(t, before[name]);
    } else {
      EXPECT_TRUE(torch::equal(t, before[name])) << name;
    }
  }
  EXPECT_GT(norms_changed, 0);
  EXPECT_EQ(r.stats.terms[1].name, "entropy");
}

TEST_F(LearnerTest, CottaChangesTheTrainableSetAndKeepsAnEmaTeacher) {
  auto before = Snapshot(*student_);
  CottaConfig c;
  c.confidence_threshold = 1.1;  // always average over augmented views
  c.restore_prob = 0.5;
  CottaLearner cotta(c);
  JobOptions o = Options(3);
  o.train_in_place = true;
  ASSERT_OK_AND_ASSIGN(JobResult r, cotta.Run(samples_, nullptr, student_, o));
  int changed = 0, restored = 0, total = 0;
  for (const auto& [name, t] : model::ModuleState(*student_)) {
    if (model::IsTrainableName(name)) {
      changed += !torch::equal(t, before[name]);
      restored += (t == before[name]).sum().item<int64_t>();
      total += t.numel();
    } else {
      EXPECT_TRUE(torch::equal(t, before[name])) << name;
    }
  }
  EXPECT_GT(changed, 0);
  // With restore probability 0.5 per step a good share of elements sit at the source value.
  EXPECT_GT(restored, total / 4);
  ASSERT_FALSE(cotta.ema_teacher().is_empty());
  // The EMA teacher moved towards the student, a little.
  int ema_moved = 0;
  for (const auto& [name, t] : model::TrainableParameters(*cotta.ema_teacher())) {
    ema_moved += !torch::equal(t, before[name]);
  }
  EXPECT_GT(ema_moved, 0);
}

// The device's student is int8 or int4: its quantized layers hold packed weights and only a
// placeholder "weight". A copy (CoTTA's EMA teacher, the non-in-place jobs) must keep them.
TEST_F(LearnerTest, CopiesOfAQuantizedStudentComputeTheSameAndTrainOnTheirOwn) {
  for (model::Precision precision : {model::Precision::kInt8, model::Precision::kInt4}) {
    ASSERT_OK_AND_ASSIGN(model::Blip2Tower quantized, model::ConvertPrecision(student_, precision));
    ASSERT_OK_AND_ASSIGN(model::Blip2Tower copy, CopyMllm(quantized, torch::kCPU));
    EXPECT_EQ(model::BaseFingerprint(copy), model::BaseFingerprint(quantized));
    EXPECT_EQ(model::LinearBaseBytes(copy), model::LinearBaseBytes(quantized));
    // The trainable sets line up name by name (CoTTA's EMA pairs them by position).
    const model::NamedTensors copy_set = model::TrainableParameters(*copy);
    const model::NamedTensors source_set = model::TrainableParameters(*quantized);
    ASSERT_EQ(copy_set.size(), source_set.size());
    for (size_t k = 0; k < copy_set.size(); ++k) {
      EXPECT_EQ(copy_set[k].first, source_set[k].first);
      EXPECT_TRUE(torch::equal(copy_set[k].second, source_set[k].second)) << copy_set[k].first;
    }
    auto before = Snapshot(*quantized);
    {
      torch::NoGradGuard no_grad;
      for (auto& [name, t] : model::TrainableParameters(*copy)) t.add_(1.0);
    }
    for (const auto& [name, t] : model::TrainableParameters(*quantized)) {
      EXPECT_TRUE(torch::equal(t, before[name])) << name;
    }
    CottaConfig c;
    c.confidence_threshold = 1.1;
    CottaLearner cotta(c);
    JobOptions o = Options(2);
    o.train_in_place = true;
    ASSERT_OK(cotta.Run(samples_, nullptr, quantized, o).status());
    EXPECT_EQ(model::BaseFingerprint(cotta.ema_teacher()), model::BaseFingerprint(quantized));
  }
}

TEST_F(LearnerTest, ReplayedSamplesJoinTheJob) {
  ReplayBuffer replay(32, 3);
  replay.Add(MakeSamples(20, 77));
  DistillLearner pl(teacher_, *PresetDistillConfig("pl"));
  JobOptions o = Options(2);
  o.replay_fraction = 0.5;
  ASSERT_OK_AND_ASSIGN(JobResult r, pl.Run(samples_, &replay, student_, o));
  EXPECT_EQ(r.stats.current_samples, 12);
  EXPECT_EQ(r.stats.replay_samples, 12);
  o.replay_fraction = 1.0;
  EXPECT_FALSE(pl.Run(samples_, &replay, student_, o).ok());
}

TEST_F(LearnerTest, RejectsBadInput) {
  DistillLearner akd(teacher_, *PresetDistillConfig("akd"));
  EXPECT_FALSE(akd.Run({}, nullptr, student_, Options(1)).ok());
  JobOptions none = Options(0);
  EXPECT_FALSE(akd.Run(samples_, nullptr, student_, none).ok());
  std::vector<compress::UplinkSample> wrong = samples_;
  wrong[0].feature_dim = 7;
  EXPECT_FALSE(akd.Run(wrong, nullptr, student_, Options(1)).ok());
}

TEST(DistillSettingsTest, ParsesTheShippedConfigAndRejectsTypos) {
  ASSERT_OK_AND_ASSIGN(DistillSettings s, LoadDistillSettings(std::string(CDCCA_SOURCE_DIR) +
                                                              "/configs/distill/akd.json"));
  EXPECT_EQ(s.learner.name, "akd");
  EXPECT_EQ(s.learner.feature_loss, FeatureLoss::kMse);
  EXPECT_GT(s.job.max_steps, 0);
  ASSERT_OK_AND_ASSIGN(DistillSettings pl,
                       ParseDistillSettings(R"({"learner": {"name": "pl"}, "job": {"lr": 0.5}})"));
  EXPECT_EQ(pl.learner.feature_loss, FeatureLoss::kNone);
  EXPECT_EQ(pl.job.lr, 0.5);
  EXPECT_FALSE(ParseDistillSettings(R"({"learner": {"l_qeury": 1}})").ok());
  EXPECT_FALSE(ParseDistillSettings(R"({"job": {"steps": 1}})").ok());
}

// Baselines on equal terms: each keeps every setting of the shared config (the shipped one
// has the logit KL) and changes only its feature term.
TEST(DistillSettingsTest, BaselinesShareEverythingButTheFeatureTerm) {
  ASSERT_OK_AND_ASSIGN(DistillSettings shared, LoadDistillSettings(std::string(CDCCA_SOURCE_DIR) +
                                                                   "/configs/distill/akd.json"));
  ASSERT_GT(shared.learner.l_kl, 0.0);
  const std::map<std::string, FeatureLoss> terms = {{"akd", FeatureLoss::kMse},
                                                    {"pkd", FeatureLoss::kPearson},
                                                    {"cwd", FeatureLoss::kChannelWise},
                                                    {"pl", FeatureLoss::kNone}};
  for (const auto& [name, term] : terms) {
    SCOPED_TRACE(name);
    ASSERT_OK_AND_ASSIGN(DistillConfig c, WithFeatureTermOf(name, shared.learner));
    EXPECT_EQ(c.name, name);
    EXPECT_EQ(c.feature_loss, term);
    EXPECT_EQ(c.l_ce, shared.learner.l_ce);
    EXPECT_EQ(c.l_kl, shared.learner.l_kl);
    EXPECT_EQ(c.temperature, shared.learner.temperature);
    EXPECT_EQ(c.repr_answer_only, shared.learner.repr_answer_only);
    EXPECT_EQ(c.ridge_init, shared.learner.ridge_init);
    const bool features = term != FeatureLoss::kNone;
    EXPECT_EQ(c.l_query, features ? shared.learner.l_query : 0.0);
    EXPECT_EQ(c.l_repr, features ? shared.learner.l_repr : 0.0);
  }
  EXPECT_FALSE(WithFeatureTermOf("kd", shared.learner).ok());
}

}  // namespace
}  // namespace cdcca::distill
