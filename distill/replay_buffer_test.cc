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

}  // namespace
}  // namespace cdcca::distill
