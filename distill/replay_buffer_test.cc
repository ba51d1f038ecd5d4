#include "distill/replay_buffer.h"

#include <gtest/gtest.h>

#include <set>

namespace cdcca::distill {
namespace {

std::vector<compress::UplinkSample> Samples(uint64_t first, int n) {
  std::vector<compress::UplinkSample> out(n);
  for (int i = 0; i < n; ++i) out[i].sample_id = first + i;
  return out;
}

std::vector<uint64_t> Ids(const std::vector<const compress::UplinkSample*>& v) {
  std::vector<uint64_t> ids;
  for (const auto* s : v) ids.push_back(s->sample_id);
  return ids;
}

TEST(ReplayBufferTest, BoundedAndCountsEverySample) {
  ReplayBuffer buffer(10, 7);
  buffer.Add(Samples(0, 4));
  EXPECT_EQ(buffer.size(), 4u);
  buffer.Add(Samples(100, 50));
  EXPECT_EQ(buffer.size(), 10u);
  EXPECT_EQ(buffer.seen(), 54u);
}

TEST(ReplayBufferTest, SameSeedSameContentsAndDraws) {
  ReplayBuffer a(16, 42), b(16, 42), c(16, 43);
  for (int round = 0; round < 5; ++round) {
    a.Add(Samples(round * 100, 30));
    b.Add(Samples(round * 100, 30));
    c.Add(Samples(round * 100, 30));
  }
  const auto da = Ids(a.Draw(8)), db = Ids(b.Draw(8)), dc = Ids(c.Draw(8));
  EXPECT_EQ(da, db);
  EXPECT_NE(da, dc);
}

TEST(ReplayBufferTest, DrawIsWithoutReplacement) {
  ReplayBuffer buffer(20, 1);
  buffer.Add(Samples(0, 20));
  const auto ids = Ids(buffer.Draw(20));
  EXPECT_EQ(std::set<uint64_t>(ids.begin(), ids.end()).size(), 20u);
  EXPECT_EQ(buffer.Draw(50).size(), 20u);
  EXPECT_EQ(buffer.Draw(3).size(), 3u);
}

TEST(ReplayBufferTest, ReservoirKeepsOldAndNewRoundsAlike) {
  // After 10 rounds of 100 samples in a 100-slot buffer, every round should hold about 10.
  ReplayBuffer buffer(100, 3);
  for (int round = 0; round < 10; ++round) buffer.Add(Samples(round * 1000, 100));
  std::vector<int> per_round(10, 0);
  for (uint64_t id : Ids(buffer.Draw(100))) ++per_round[id / 1000];
  for (int n : per_round) {
    EXPECT_GE(n, 2);
    EXPECT_LE(n, 22);
  }
}

TEST(ReplayBufferTest, ZeroCapacityStaysEmpty) {
  ReplayBuffer buffer(0, 1);
  buffer.Add(Samples(0, 5));
  EXPECT_EQ(buffer.size(), 0u);
  EXPECT_TRUE(buffer.Draw(3).empty());
}

// Samples with every field set: features exact in fp16 for even ids, not for odd ones, and
// a frame on every third.
std::vector<compress::UplinkSample> FullSamples(uint64_t first, int n) {
  std::vector<compress::UplinkSample> out(n);
  for (int i = 0; i < n; ++i) {
    compress::UplinkSample& s = out[i];
    s.sample_id = first + i;
    s.model_version = i % 3;
    s.entropy = 0.25f * i;
    s.grid_tokens = 16;
    s.feature_dim = 3;
    s.kept_indices = {1, static_cast<uint16_t>(4 + i % 5)};
    s.prompt_tokens = {7, 8, static_cast<uint32_t>(i)};
    s.answer_tokens = {static_cast<uint32_t>(100 + i)};
    for (int k = 0; k < 6; ++k) {
      s.features.push_back(s.sample_id % 2 == 0 ? 0.5f * k - 1.0f : 0.1f * k + 1e-7f * i);
    }
    if (i % 3 == 0) s.frame = std::string("\xff\xd8jpeg", 6) + std::to_string(i);
  }
  return out;
}

void ExpectSameSample(const compress::UplinkSample& a, const compress::UplinkSample& b) {
  EXPECT_EQ(a.sample_id, b.sample_id);
  EXPECT_EQ(a.model_version, b.model_version);
  EXPECT_EQ(a.entropy, b.entropy);
  EXPECT_EQ(a.grid_tokens, b.grid_tokens);
  EXPECT_EQ(a.feature_dim, b.feature_dim);
  EXPECT_EQ(a.kept_indices, b.kept_indices);
  EXPECT_EQ(a.prompt_tokens, b.prompt_tokens);
  EXPECT_EQ(a.answer_tokens, b.answer_tokens);
  EXPECT_EQ(a.features, b.features);  // bit for bit: nothing rounded on the way
  EXPECT_EQ(a.frame, b.frame);
}

TEST(ReplayBufferTest, ARestoredBufferHoldsAndDrawsWhatTheOriginalWould) {
  ReplayBuffer original(12, 5);
  original.Add(FullSamples(0, 9));
  original.Add(FullSamples(100, 20));  // past the capacity: the generator has moved
  ReplayBuffer restored(12, 999);      // another seed: everything comes from the bytes
  ASSERT_TRUE(restored.Restore(original.Serialize(), "dev-a").ok());
  EXPECT_EQ(restored.size(), original.size());
  EXPECT_EQ(restored.seen(), original.seen());
  // The same draws and the same reservoir choices from here on.
  for (int round = 0; round < 3; ++round) {
    const auto a = original.Draw(5), b = restored.Draw(5);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) ExpectSameSample(*a[i], *b[i]);
    original.Add(FullSamples(1000 * (round + 1), 7));
    restored.Add(FullSamples(1000 * (round + 1), 7));
  }
  EXPECT_EQ(restored.Serialize(), original.Serialize());
}

TEST(ReplayBufferTest, RestoreRefusesDamagedBytesAndKeepsItsState) {
  ReplayBuffer original(8, 5);
  original.Add(FullSamples(0, 6));
  const std::string bytes = original.Serialize();
  ReplayBuffer buffer(8, 1);
  buffer.Add(FullSamples(500, 2));
  const std::string before = buffer.Serialize();
  for (size_t cut : {size_t{0}, size_t{7}, size_t{30}, bytes.size() / 2, bytes.size() - 1}) {
    absl::Status s = buffer.Restore(bytes.substr(0, cut), "dev-a");
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << cut;
  }
  EXPECT_EQ(buffer.Restore(bytes + "x", "dev-a").code(), absl::StatusCode::kDataLoss);
  ReplayBuffer smaller(3, 1);  // more samples than it holds
  EXPECT_EQ(smaller.Restore(bytes, "dev-a").code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(buffer.Serialize(), before);
}

}  // namespace
}  // namespace cdcca::distill
