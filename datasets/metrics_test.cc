#include "datasets/metrics.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cdcca::datasets {
namespace {

using ::testing::DoubleNear;
using ::testing::ElementsAre;

std::vector<std::string> Repeat(const std::string& s, int n) {
  return std::vector<std::string>(n, s);
}

std::vector<std::string> Concat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(VqaMetricTest, Normalization) {
  EXPECT_EQ(VqaNormalizeAnswer("Two"), "2");
  EXPECT_EQ(VqaNormalizeAnswer("  The Red coat.\n"), "red coat");
  EXPECT_EQ(VqaNormalizeAnswer("none"), "0");
  EXPECT_EQ(VqaNormalizeAnswer("Ten"), "10");
  EXPECT_EQ(VqaNormalizeAnswer("an apple"), "apple");
  EXPECT_EQ(VqaNormalizeAnswer("dont"), "don't");  // the 2021 table's straight apostrophe
  EXPECT_EQ(VqaNormalizeAnswer("Youre"), "you're");
  EXPECT_EQ(VqaNormalizeAnswer("couldn'tve"), "couldn't've");  // a key with an apostrophe
  EXPECT_EQ(VqaNormalizeAnswer("Im"), "im");  // capitalised keys never match after lower()
  EXPECT_EQ(VqaProcessPunctuation("3.5"), "3.5");  // a period before a digit stays
  EXPECT_EQ(VqaProcessPunctuation("yes."), "yes");
  // The official look-behind is spelt as a look-ahead: a period after a digit goes too.
  EXPECT_EQ(VqaProcessPunctuation("2."), "2");
  EXPECT_EQ(VqaProcessPunctuation("hello,world"), "hello world");  // no space: -> space
  EXPECT_EQ(VqaProcessPunctuation("a , b"), "a  b");               // touches a space: deleted
  EXPECT_EQ(VqaProcessPunctuation("1,000 sheep"), "1000 sheep");   // digit,digit: deleted
  EXPECT_EQ(VqaProcessPunctuation("t-shirt"), "t shirt");          // '-' is in the 2021 list
  EXPECT_EQ(VqaProcessPunctuation("3:30 it's"), "3:30 it's");      // ':' and '\'' are not
  EXPECT_EQ(VqaNormalizeAnswer("top-left?"), "top left");
  // Python's strip() and split() know more whitespace than ASCII's.
  EXPECT_EQ(VqaStripAnswer("\xc2\xa0 yes\t\n\x1f"), "yes");
  EXPECT_EQ(VqaNormalizeAnswer("red\xe3\x80\x80" "car"), "red car");
  EXPECT_EQ(VqaNormalizeAnswer("\xc3\x89T\xc3\x89"), "\xc3\xa9t\xc3\xa9");  // ÉTÉ -> été
}

// Every mark of the official list, both ways: glued between letters it becomes a space;
// when it touches a space anywhere in the answer, or the answer holds a digit,digit comma,
// it is deleted everywhere.
TEST(VqaMetricTest, EveryPunctuationMark) {
  for (char p : std::string(";/[]\"{}()=+\\_-><@`,?!")) {
    const std::string m(1, p);
    SCOPED_TRACE(m);
    EXPECT_EQ(VqaProcessPunctuation("ab" + m + "cd"), "ab cd");
    EXPECT_EQ(VqaProcessPunctuation("ab" + m + "cd " + m), "abcd ");
    EXPECT_EQ(VqaProcessPunctuation(m + " ab" + m + "cd"), " abcd");
    EXPECT_EQ(VqaProcessPunctuation("ab" + m + "cd 1,5"), "abcd 15");
  }
  // Not in the list: kept whatever surrounds them.
  for (char p : std::string(":'#*%&$~|^")) {
    const std::string m(1, p);
    SCOPED_TRACE(m);
    EXPECT_EQ(VqaProcessPunctuation("ab" + m + "cd " + m), "ab" + m + "cd " + m);
  }
  // periodStrip deletes at most 32 periods (re.UNICODE passed as the count).
  EXPECT_EQ(VqaProcessPunctuation(std::string(40, '.')), std::string(8, '.'));
}

TEST(VqaMetricTest, AllIdenticalAnswers) {
  EXPECT_DOUBLE_EQ(VqaAccuracy("yes", Repeat("yes", 10)), 1.0);
  EXPECT_DOUBLE_EQ(VqaAccuracy(" yes\n", Repeat("yes", 10)), 1.0);  // stripped
  // Unanimous annotators: neither side is processed beyond the strip, so case,
  // punctuation and number words count (the 2021 official code).
  EXPECT_DOUBLE_EQ(VqaAccuracy("Yes.", Repeat("yes", 10)), 0.0);
  EXPECT_DOUBLE_EQ(VqaAccuracy("Yes", Repeat("yes", 10)), 0.0);
  EXPECT_DOUBLE_EQ(VqaAccuracy("Yes", Repeat("Yes", 10)), 1.0);
  EXPECT_DOUBLE_EQ(VqaAccuracy("two", Repeat("2", 10)), 0.0);
  EXPECT_DOUBLE_EQ(VqaAccuracy("no", Repeat("yes", 10)), 0.0);
  // Unanimity is judged after stripping.
  EXPECT_DOUBLE_EQ(VqaAccuracy("Yes", Concat(Repeat("yes", 9), {" yes\n"})), 0.0);
}

TEST(VqaMetricTest, NumberWordsAndArticles) {
  // Annotators disagree: both sides are normalized, the ground truth included.
  EXPECT_DOUBLE_EQ(VqaAccuracy("two", Concat(Repeat("2", 4), Repeat("3", 6))), 1.0);
  EXPECT_NEAR(VqaAccuracy("2", Concat(Repeat("Two", 3), Repeat("3", 7))), 0.9, 1e-12);
  EXPECT_DOUBLE_EQ(VqaAccuracy("the red coat", Concat(Repeat("red coat", 4), Repeat("coat", 6))),
                   1.0);
  EXPECT_NEAR(VqaAccuracy("dont", Concat(Repeat("Don't", 3), Repeat("no", 7))), 0.9, 1e-12);
}

TEST(VqaMetricTest, LeaveOneOutMean) {
  // 2 of 10 say "2": those two subsets see 1 match (1/3), the other eight see 2 (2/3).
  EXPECT_NEAR(VqaAccuracy("2", Concat(Repeat("2", 2), Repeat("3", 8))), 0.6, 1e-12);
  // 3 of 10: three subsets see 2 matches (2/3), seven see 3 (1): (2 + 7) / 10.
  EXPECT_NEAR(VqaAccuracy("3", Concat(Repeat("3", 3), Repeat("4", 7))), 0.9, 1e-12);
  // 1 of 10: nine subsets see 1 match: 9 * (1/3) / 10.
  EXPECT_NEAR(VqaAccuracy("4", Concat(Repeat("4", 1), Repeat("5", 9))), 0.3, 1e-12);
  // Ground truth punctuation is processed when annotators disagree.
  EXPECT_NEAR(VqaAccuracy("yes", Concat(Repeat("yes.", 3), Repeat("no", 7))), 0.9, 1e-12);
  EXPECT_DOUBLE_EQ(VqaAccuracy("yes", {}), 0.0);
}

TEST(VqaMetricTest, AccumulatorRoundsPercentages) {
  VqaAccumulator acc;
  acc.Add(1.0, "yes/no", "is the");
  acc.Add(0.0, "yes/no", "is this");
  acc.Add(0.6, "number", "is the");
  EXPECT_DOUBLE_EQ(acc.Overall(), 53.33);
  EXPECT_DOUBLE_EQ(acc.PerAnswerType().at("yes/no"), 50.0);
  EXPECT_DOUBLE_EQ(acc.PerAnswerType().at("number"), 60.0);
  EXPECT_DOUBLE_EQ(acc.PerQuestionType().at("is the"), 80.0);
  EXPECT_DOUBLE_EQ(acc.PerQuestionType().at("is this"), 0.0);
  EXPECT_DOUBLE_EQ(VqaAccumulator().Overall(), 0.0);
  EXPECT_DOUBLE_EQ(RoundTo2(66.666666), 66.67);
}

TEST(AokvqaMetricTest, MultipleChoiceAndDirectAnswer) {
  const std::vector<std::string> choices = {"bag", "coat", "sandal", "dress"};
  EXPECT_EQ(AokvqaMcAccuracy("sandal", choices, 2), 1.0);
  EXPECT_EQ(AokvqaMcAccuracy("coat", choices, 2), 0.0);
  EXPECT_EQ(AokvqaMcAccuracy("sandal", choices, 7), 0.0);
  const std::vector<std::string> da = Concat(Repeat("sandal", 2), Repeat("sandals", 8));
  EXPECT_NEAR(AokvqaDaAccuracy("sandal", da), 2.0 / 3, 1e-12);  // no leave-one-out
  EXPECT_EQ(AokvqaDaAccuracy("sandals", da), 1.0);
  EXPECT_EQ(AokvqaDaAccuracy("Sandals", da), 0.0);  // exact match, no normalization
}

TEST(CaptionMetricTest, PtbTokenization) {
  EXPECT_THAT(PtbTokenize("A man's dog, running."),
              ElementsAre("a", "man", "'s", "dog", "running"));
  EXPECT_THAT(PtbTokenize("I don't know!"), ElementsAre("i", "do", "n't", "know"));
  EXPECT_THAT(PtbTokenize("a t-shirt (red) - \"nice\""),
              ElementsAre("a", "t-shirt", "red", "nice"));
  EXPECT_THAT(PtbTokenize(""), ElementsAre());
  EXPECT_THAT(PtbTokenize("..."), ElementsAre());
}

std::vector<std::string> Words(const std::string& s) { return PtbTokenize(s); }

TEST(CaptionMetricTest, BleuHandComputed) {
  // Clipped precisions 5/6, 3/5, 1/4, 0/3; closest reference length 6 = candidate length.
  const auto bleu =
      CorpusBleu({Words("the cat sat on the mat")},
                 {{Words("the cat is on the mat"), Words("there is a cat on the mat")}});
  EXPECT_NEAR(bleu[0], 5.0 / 6, 1e-6);
  EXPECT_NEAR(bleu[1], std::sqrt(0.5), 1e-6);
  EXPECT_NEAR(bleu[2], 0.5, 1e-6);
  // No 4-gram matches: the official tiny/small smoothing gives ~(0.125 * 1e-15 / 3)^(1/4).
  EXPECT_NEAR(bleu[3], std::pow(0.125 * 1e-15 / 3, 0.25), 1e-9);
}

TEST(CaptionMetricTest, BleuBrevityPenaltyAndClosestLength) {
  auto b = CorpusBleu({Words("the cat")}, {{Words("the cat is on the mat")}});
  EXPECT_NEAR(b[0], std::exp(1 - 3.0), 1e-6);  // ratio 2/6
  // Corpus level: lengths and counts are summed before the ratio.
  b = CorpusBleu({Words("the cat"), Words("a dog")}, {{Words("the cat sat")}, {Words("a dog")}});
  EXPECT_NEAR(b[0], std::exp(1 - 5.0 / 4), 1e-6);
  // Candidate of 5 words, references of 4 and 6: the tie goes to the shorter (4), no penalty.
  b = CorpusBleu({Words("a b c d e")}, {{Words("a b c d"), Words("a b c d e f")}});
  EXPECT_NEAR(b[0], 1.0, 1e-6);
  // Empty candidate: everything ~0, no crash.
  b = CorpusBleu({Words("")}, {{Words("a b")}});
  EXPECT_LT(b[0], 1e-5);
}

TEST(CaptionMetricTest, CiderDHandComputed) {
  // Two images; every n-gram occurs in one image's references, so idf = log(2) throughout.
  auto c = CiderD({Words("a b"), Words("c d")}, {{Words("a b")}, {Words("c d")}});
  // Unigram and bigram cosines are 1, there are no 3- and 4-grams: (1 + 1 + 0 + 0) / 4 x 10.
  EXPECT_THAT(c, ElementsAre(DoubleNear(5.0, 1e-9), DoubleNear(5.0, 1e-9)));

  // Clipping: "a" twice in the candidate counts min(2, 1) * 1 against the reference.
  c = CiderD({Words("a a"), Words("c d")}, {{Words("a b")}, {Words("c d")}});
  EXPECT_NEAR(c[0], 10.0 * (1 / (2 * std::sqrt(2.0))) / 4, 1e-9);

  // Length penalty: bigram lengths 2 vs 1, exp(-1/72).
  c = CiderD({Words("a b c"), Words("x y")}, {{Words("a b")}, {Words("x y")}});
  const double uni = 2 / std::sqrt(6.0), bi = 1 / std::sqrt(2.0);
  EXPECT_NEAR(c[0], 10.0 * (uni + bi) * std::exp(-1.0 / 72) / 4, 1e-9);

  // A single image: idf is log(1) - log(1) = 0 for everything, so CIDEr-D is 0.
  c = CiderD({Words("a b")}, {{Words("a b")}});
  EXPECT_THAT(c, ElementsAre(0.0));
}

TEST(CaptionMetricTest, ScoreCaptionsAveragesAndHandlesEmpty) {
  const CaptionScores s = ScoreCaptions({"A b.", "c d", ""}, {{"a b"}, {"c d"}, {"e f", "e g"}});
  ASSERT_EQ(s.cider_per_item.size(), 3u);
  EXPECT_DOUBLE_EQ(s.cider_per_item[2], 0.0);
  EXPECT_NEAR(s.cider, (s.cider_per_item[0] + s.cider_per_item[1]) / 3, 1e-12);
  EXPECT_GT(s.bleu[0], 0.0);
  const CaptionScores none = ScoreCaptions({}, {});
  EXPECT_EQ(none.cider, 0.0);
}

}  // namespace
}  // namespace cdcca::datasets
