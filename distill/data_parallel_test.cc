#include "distill/data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <random>
#include <thread>

#include "distill/akd.h"
#include "model/family/config.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::distill {
namespace {

std::vector<compress::UplinkSample> Samples(const model::FamilyConfig& f, int n) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  std::vector<compress::UplinkSample> out(n);
  for (int i = 0; i < n; ++i) {
    auto& s = out[i];
    s.sample_id = i;
    s.grid_tokens = f.vision.NumTokens();
    s.feature_dim = f.vision.d_vis;
    for (int k = 0; k < f.vision.NumTokens(); k += 2) s.kept_indices.push_back(k);
    for (size_t k = 0; k < s.kept_indices.size() * f.vision.d_vis; ++k) {
      s.features.push_back(normal(rng));
    }
    s.prompt_tokens = {1, static_cast<uint32_t>(4 + i % 50), 9};  // equal lengths
  }
  return out;
}

using MakeReducer =
    std::function<absl::StatusOr<std::unique_ptr<GradientReducer>>(const std::string&, int)>;

// Runs the same AKD job on one rank and on two ranks (threads, each a rank with its own
// reducer from `make`) splitting the same global batch, and compares the trained states.
void ExpectTwoRanksMatchOne(const MakeReducer& make, bool ranks_bit_identical) {
  ASSERT_OK_AND_ASSIGN(
      model::FamilyConfig f,
      model::LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json"));
  torch::manual_seed(3);
  model::Blip2Tower teacher(f.teacher);
  model::Blip2Tower student(f.student);
  const auto samples = Samples(f, 8);
  JobOptions o;
  o.max_steps = 4;
  o.batch_size = 8;
  o.lr = 1e-2;
  o.num_threads = 1;
  o.use_cuda = false;
  // A fixed answer length (no EOS at random weights is not guaranteed): every sample then
  // has the same number of target tokens, so the mean of the two slices' token means is
  // the global token mean.
  o.max_answer_tokens = 1;

  DistillLearner single(teacher, *PresetDistillConfig("akd"));
  ASSERT_OK_AND_ASSIGN(JobResult one, single.Run(samples, nullptr, student, o));

  const std::string path = ::testing::TempDir() + "/distill_dp_store_" + std::to_string(::getpid());
  ::unlink(path.c_str());
  JobResult results[2];
  absl::Status status[2];
  {
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<GradientReducer>> reducer = make(path, r);
        if (!reducer.ok()) {
          status[r] = reducer.status();
          return;
        }
        DistillLearner learner(teacher, *PresetDistillConfig("akd"));
        JobOptions ro = o;
        ro.rank = r;
        ro.world_size = 2;
        ro.reducer = reducer->get();
        auto result = learner.Run(samples, nullptr, student, ro);
        status[r] = result.status();
        if (result.ok()) results[r] = *std::move(result);
      });
    }
    for (auto& t : ranks) t.join();
  }
  ::unlink(path.c_str());
  ASSERT_OK(status[0]);
  ASSERT_OK(status[1]);
  ASSERT_EQ(results[0].trainable.size(), one.trainable.size());
  for (size_t i = 0; i < one.trainable.size(); ++i) {
    const std::string& name = one.trainable[i].first;
    if (ranks_bit_identical) {
      EXPECT_TRUE(torch::equal(results[0].trainable[i].second, results[1].trainable[i].second))
          << name;
    }
    // An attention key bias adds the same score to every key, which softmax cancels: its
    // true gradient is 0 and what backward yields is rounding noise (~1e-9) that Adam's
    // normalisation turns into lr-sized steps of arbitrary sign. Not comparable.
    if (name.size() > 7 && name.compare(name.size() - 7, 7, "_k.bias") == 0) continue;
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(torch::allclose(results[r].trainable[i].second, one.trainable[i].second,
                                  /*rtol=*/1e-4, /*atol=*/1e-5))
          << name << " rank " << r;
    }
  }
  EXPECT_EQ(results[0].stats.samples_seen, 16);
}

TEST(DataParallelTest, TwoRanksOverTheFileStoreMatchOneRankOnTheSameGlobalBatch) {
  // The store exchange sums in rank order, so both ranks take bit-identical steps.
  ExpectTwoRanksMatchOne(
      [](const std::string& path, int rank) -> absl::StatusOr<std::unique_ptr<GradientReducer>> {
        return std::make_unique<StoreGradientReducer>(path, rank, 2);
      },
      /*ranks_bit_identical=*/true);
}

TEST(DataParallelTest, TwoRanksOverGlooMatchOneRankOnTheSameGlobalBatch) {
  if (!GlooGradientReducer::Available()) {
    GTEST_SKIP() << "built without the gloo headers (libgloo-dev)";
  }
  ExpectTwoRanksMatchOne(
      [](const std::string& path, int rank) -> absl::StatusOr<std::unique_ptr<GradientReducer>> {
        absl::StatusOr<std::unique_ptr<GlooGradientReducer>> g =
            GlooGradientReducer::Create(path, rank, 2);
        if (!g.ok()) return g.status();
        return std::unique_ptr<GradientReducer>(std::move(*g));
      },
      /*ranks_bit_identical=*/false);
}

TEST(DataParallelTest, GlooRejectsABadRank) {
  if (!GlooGradientReducer::Available()) {
    EXPECT_EQ(GlooGradientReducer::Create("/nonexistent", 0, 2).status().code(),
              absl::StatusCode::kUnimplemented);
    return;
  }
  EXPECT_EQ(GlooGradientReducer::Create("/nonexistent", 2, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cdcca::distill
