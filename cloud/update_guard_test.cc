// The update guard's arithmetic: which samples are held out and what the paired rule decides
// (table-driven). The guard on real models is in cloud/trainer_test.cc.
#include "cloud/update_guard.h"

#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cdcca::cloud {
namespace {

struct Case {
  std::string name;
  int both = 0, gained = 0, lost = 0, neither = 0;  // pairs (before, after)
  bool ship = false;
  std::string decision;
};

std::vector<double> Before(const Case& c) {
  std::vector<double> v;
  v.insert(v.end(), c.both, 1.0);
  v.insert(v.end(), c.gained, 0.0);
  v.insert(v.end(), c.lost, 1.0);
  v.insert(v.end(), c.neither, 0.0);
  return v;
}

std::vector<double> After(const Case& c) {
  std::vector<double> v;
  v.insert(v.end(), c.both, 1.0);
  v.insert(v.end(), c.gained, 1.0);
  v.insert(v.end(), c.lost, 0.0);
  v.insert(v.end(), c.neither, 0.0);
  return v;
}

// Exact match for one-word answers; the F1 of the words for longer ones.
TEST(AnswerAgreementTest, IsTheF1OfTheWords) {
  EXPECT_DOUBLE_EQ(AnswerAgreement("red", "red"), 1.0);
  EXPECT_DOUBLE_EQ(AnswerAgreement("red", "blue"), 0.0);
  EXPECT_DOUBLE_EQ(AnswerAgreement("", ""), 1.0);
  EXPECT_DOUBLE_EQ(AnswerAgreement("", "red"), 0.0);
  EXPECT_DOUBLE_EQ(AnswerAgreement("red", ""), 0.0);
  // 2 shared of 3 and of 4 words: precision 2/3, recall 1/2, F1 4/7.
  EXPECT_NEAR(AnswerAgreement("a red shirt", "a shirt in blue"), 4.0 / 7.0, 1e-12);
  // Symmetric, counted with multiplicity, blind to spacing.
  EXPECT_DOUBLE_EQ(AnswerAgreement("a shirt in blue", "a red shirt"),
                   AnswerAgreement("a red shirt", "a shirt in blue"));
  EXPECT_NEAR(AnswerAgreement("a a bag", "a bag"), 0.8, 1e-12);  // p 2/3, r 1
  EXPECT_DOUBLE_EQ(AnswerAgreement("top  left", "top left"), 1.0);
}

// A graded gain: captions that move closer to the teacher's, none of them matching it.
TEST(JudgeUpdateTest, PartialAgreementCountsTowardsTheGain) {
  std::vector<double> before(32, 0.25), after(32, 0.25);
  for (int i = 0; i < 16; ++i) after[i] = 0.5;
  const GuardVerdict v = JudgeUpdate(before, after, UpdateGuardOptions{});
  EXPECT_TRUE(v.ship);
  EXPECT_EQ(v.decision, "helps");
  EXPECT_DOUBLE_EQ(v.gain, 0.125);
  EXPECT_DOUBLE_EQ(v.after, 0.375);
}

TEST(JudgeUpdateTest, PairedRuleWithMarginAndSmallPools) {
  UpdateGuardOptions o;  // min_pool 16, z 1
  const std::vector<Case> cases = {
      {"empty pool ships", 0, 0, 0, 0, true, "empty"},
      {"clear gain", 10, 8, 0, 14, true, "helps"},
      // gain 2/32 = 0.0625, se = 0.0434: ships at z = 1.
      {"small gain beyond one se", 10, 2, 0, 20, true, "helps"},
      // gain 1/32 = 0.031, se = 0.055: not beyond the margin.
      {"a net gain of one is noise", 10, 2, 1, 19, false, "not_beyond_noise"},
      {"no change does not ship", 16, 0, 0, 16, false, "not_beyond_noise"},
      {"gains and losses cancel", 10, 5, 5, 12, false, "not_beyond_noise"},
      {"worse", 10, 0, 6, 16, false, "not_beyond_noise"},
      // Below min_pool: ships unless worse by more than z / sqrt(n).
      {"small pool ships", 2, 1, 0, 1, true, "small_pool"},
      {"small pool slightly worse ships", 2, 0, 1, 1, true, "small_pool"},
      // n = 4, gain -3/4 < -1/2.
      {"small pool clearly worse is withheld", 1, 0, 3, 0, false, "small_pool_worse"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const GuardVerdict v = JudgeUpdate(Before(c), After(c), o);
    EXPECT_EQ(v.ship, c.ship);
    EXPECT_EQ(v.decision, c.decision);
    const int n = c.both + c.gained + c.lost + c.neither;
    EXPECT_EQ(v.pool, n);
    if (n > 0) {
      EXPECT_DOUBLE_EQ(v.before, static_cast<double>(c.both + c.lost) / n);
      EXPECT_DOUBLE_EQ(v.after, static_cast<double>(c.both + c.gained) / n);
      EXPECT_DOUBLE_EQ(v.gain, static_cast<double>(c.gained - c.lost) / n);
    }
  }
}

TEST(JudgeUpdateTest, StandardErrorIsThePairedOne) {
  // d = +1 x 3, -1 x 1, 0 x 4: mean 0.25, sample variance (4 - 8 * 0.0625) / 7 = 0.5.
  const Case c{"", 0, 3, 1, 4};
  const GuardVerdict v = JudgeUpdate(Before(c), After(c), UpdateGuardOptions{});
  EXPECT_NEAR(v.se, std::sqrt(0.5 / 8), 1e-12);
  UpdateGuardOptions loose;
  loose.min_pool = 8;
  loose.z = 0.99;  // 0.25 > 0.99 * 0.25
  EXPECT_TRUE(JudgeUpdate(Before(c), After(c), loose).ship);
  loose.z = 1.01;
  EXPECT_FALSE(JudgeUpdate(Before(c), After(c), loose).ship);
}

}  // namespace
// The comparison counts the teacher's surest share: the lowest entropies, ties to the lower
// index, returned in pool order; a fraction of 1 counts everything.
TEST(ConfidentSamplesTest, KeepsTheLowestEntropiesInPoolOrder) {
  const std::vector<double> e = {0.9, 0.1, 0.5, 0.1, 2.0};
  EXPECT_EQ(ConfidentSamples(e, 1.0), (std::vector<size_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(ConfidentSamples(e, 0.5), (std::vector<size_t>{1, 2, 3}));  // ceil(2.5) = 3
  EXPECT_EQ(ConfidentSamples(e, 0.2), (std::vector<size_t>{1}));
  EXPECT_EQ(ConfidentSamples(e, 0.4), (std::vector<size_t>{1, 3}));
  EXPECT_TRUE(ConfidentSamples({}, 0.5).empty());
}

}  // namespace cdcca::cloud
