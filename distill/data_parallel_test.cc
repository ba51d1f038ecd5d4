#include "distill/data_parallel.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <random>
#include <thread>

#include "distill/akd.h"
#include "distill/model/config.h"
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

TEST(DataParallelTest, TwoRanksMatchOneRankOnTheSameGlobalBatch) {
  ASSERT_OK_AND_ASSIGN(
      model::FamilyConfig f,
      model::LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json"));
  torch::manual_seed(3);
  model::Mllm teacher(f.teacher);
  model::Mllm student(f.student);
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
        StoreGradientReducer reducer(path, r, 2);
        DistillLearner learner(teacher, *PresetDistillConfig("akd"));
        JobOptions ro = o;
        ro.rank = r;
        ro.world_size = 2;
        ro.reducer = &reducer;
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
    // Both ranks take bit-identical steps; one rank agrees up to summation order.
    EXPECT_TRUE(torch::equal(results[0].trainable[i].second, results[1].trainable[i].second));
    // An attention key bias adds the same score to every key, which softmax cancels: its
    // true gradient is 0 and what backward yields is rounding noise (~1e-9) that Adam's
    // normalisation turns into lr-sized steps of arbitrary sign. Not comparable.
    const std::string& name = one.trainable[i].first;
    if (name.size() > 7 && name.compare(name.size() - 7, 7, "_k.bias") == 0) continue;
    EXPECT_TRUE(torch::allclose(results[0].trainable[i].second, one.trainable[i].second,
                                /*rtol=*/1e-4, /*atol=*/1e-5))
        << one.trainable[i].first;
  }
  EXPECT_EQ(results[0].stats.samples_seen, 16);
}

}  // namespace
}  // namespace cdcca::distill
