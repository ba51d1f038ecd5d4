#include "datasets/domain.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "datasets/test_images.h"
#include "datasets/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::datasets {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::Contains;

const ImageSet& TrainImages() {
  static const ImageSet set = SyntheticImageSet(Split::kTrain);
  return set;
}
const ImageSet& TestImages() {
  static const ImageSet set = SyntheticImageSet(Split::kTest);
  return set;
}

TEST(DomainTest, SameSeedAndIndexGiveTheSameSample) {
  ASSERT_OK_AND_ASSIGN(SampleGenerator a,
                       SampleGenerator::Create(&TrainImages(), TeacherDomain(), 7));
  ASSERT_OK_AND_ASSIGN(SampleGenerator b,
                       SampleGenerator::Create(&TrainImages(), TeacherDomain(), 7));
  ASSERT_OK_AND_ASSIGN(SampleGenerator c,
                       SampleGenerator::Create(&TrainImages(), TeacherDomain(), 8));
  int differ = 0;
  for (uint64_t i : {0ull, 5ull, 123456789ull}) {
    const Sample x = a.Generate(i), y = b.Generate(i), z = c.Generate(i);
    EXPECT_EQ(x.image.pixels, y.image.pixels);
    ASSERT_EQ(x.questions.size(), y.questions.size());
    for (size_t q = 0; q < x.questions.size(); ++q) {
      EXPECT_EQ(x.questions[q].question, y.questions[q].question);
      EXPECT_EQ(x.questions[q].direct_answers, y.questions[q].direct_answers);
    }
    EXPECT_EQ(x.captions, y.captions);
    differ += x.image.pixels != z.image.pixels;
  }
  EXPECT_EQ(differ, 3);
  // Out-of-order generation gives the same sample (independent per index).
  EXPECT_EQ(a.Generate(5).captions, b.Generate(5).captions);
  EXPECT_EQ(a.GenerateImageOnly(5).image.pixels, a.Generate(5).image.pixels);
}

TEST(DomainTest, SplitMismatchIsRejected) {
  EXPECT_THAT(SampleGenerator::Create(&TrainImages(), StudentSourceDomain(Split::kTest), 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
  DomainSpec bad = StudentSourceDomain();
  bad.shifts = {{ImageShift::kFog, 9}};
  EXPECT_THAT(SampleGenerator::Create(&TrainImages(), bad, 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
  bad = StudentSourceDomain();
  bad.scene.classes = {11};
  EXPECT_THAT(SampleGenerator::Create(&TrainImages(), bad, 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// Ground truth is self-consistent and every answer follows from it.
TEST(DomainTest, GroundTruthAndAnswersAgree) {
  ASSERT_OK_AND_ASSIGN(SampleGenerator gen,
                       SampleGenerator::Create(&TestImages(), TextShiftDomain(), 3));
  const std::vector<std::string>& vocab = AnswerVocabulary();
  for (uint64_t i = 0; i < 300; ++i) {
    const Sample s = gen.Generate(i);
    ASSERT_GE(s.scene.items.size(), 1u);
    ASSERT_LE(s.scene.items.size(), 4u);
    std::set<int> cells;
    std::set<std::pair<int, int>> pairs;
    for (const SceneItem& it : s.scene.items) {
      EXPECT_TRUE(cells.insert(it.cell).second);
      EXPECT_TRUE(pairs.insert({it.label, it.color}).second);
      EXPECT_EQ(TestImages().labels[it.image_index], it.label);
      // The box lies inside its own grid cell.
      EXPECT_GE(it.x, (it.cell % 2) * 32);
      EXPECT_LE(it.x + it.w, (it.cell % 2) * 32 + 32);
      EXPECT_GE(it.y, (it.cell / 2) * 32);
      EXPECT_LE(it.y + it.h, (it.cell / 2) * 32 + 32);
    }
    ASSERT_EQ(s.questions.size(), 5u);
    for (const VqaItem& q : s.questions) {
      EXPECT_THAT(vocab, Contains(q.answer)) << q.question;
      ASSERT_EQ(q.choices.size(), 4u) << q.question;
      EXPECT_EQ(q.choices[q.correct_choice], q.answer);
      EXPECT_EQ(std::set<std::string>(q.choices.begin(), q.choices.end()).size(), 4u);
      ASSERT_EQ(q.direct_answers.size(), 10u);
      EXPECT_GE(std::count(q.direct_answers.begin(), q.direct_answers.end(), q.answer), 5);
      if (q.type == QuestionType::kCount && q.question == "how many items are there?") {
        EXPECT_EQ(q.answer, std::to_string(s.scene.items.size()));
      }
      if (q.type == QuestionType::kWhere) EXPECT_GE(CellFromName(q.answer), 0);
      if (q.type == QuestionType::kColor) EXPECT_GE(ColorFromName(q.answer), 0);
      if (q.type == QuestionType::kWhat) {
        const int label = ClassFromName(q.answer);
        EXPECT_TRUE(std::any_of(s.scene.items.begin(), s.scene.items.end(),
                                [&](const SceneItem& it) { return it.label == label; }));
      }
    }
    ASSERT_EQ(s.captions.size(), 5u);
    EXPECT_EQ(std::set<std::string>(s.captions.begin(), s.captions.end()).size(), 5u);
  }
}

TEST(DomainTest, BaseQuestionsAnswerTheirTemplates) {
  ASSERT_OK_AND_ASSIGN(SampleGenerator gen,
                       SampleGenerator::Create(&TrainImages(), StudentSourceDomain(), 11));
  for (uint64_t i = 0; i < 200; ++i) {
    const Sample s = gen.Generate(i);
    for (const VqaItem& q : s.questions) {
      EXPECT_EQ(q.phrasing, Phrasing::kBase);
      if (q.type == QuestionType::kWhat) {  // "what is in the <cell>?"
        for (const SceneItem& it : s.scene.items) {
          if (q.question == "what is in the " + std::string(CellName(it.cell)) + "?") {
            EXPECT_EQ(q.answer, ClassName(it.label));
          }
        }
      }
      if (q.type == QuestionType::kWhere) {  // "where is the <color> <class>?"
        for (const SceneItem& it : s.scene.items) {
          if (q.question == "where is the " + std::string(ColorName(it.color)) + " " +
                                std::string(ClassName(it.label)) + "?") {
            EXPECT_EQ(q.answer, CellName(it.cell));
          }
        }
      }
    }
    // Student source: in-domain classes only, clean.
    for (const SceneItem& it : s.scene.items) {
      EXPECT_EQ(ClassCategory(it.label), CategoryDomain::kIn);
    }
    EXPECT_EQ(s.shift.severity, 0);
    EXPECT_EQ(s.image.pixels, s.scene.image.pixels);
  }
}

TEST(DomainTest, KnowledgeQuestionsExist) {
  DomainSpec spec = TextShiftDomain(Split::kTrain);
  spec.phrasings = {Phrasing::kKnowledge};
  ASSERT_OK_AND_ASSIGN(SampleGenerator gen, SampleGenerator::Create(&TrainImages(), spec, 2));
  int knowledge = 0, feet = 0;
  for (uint64_t i = 0; i < 100; ++i) {
    for (const VqaItem& q : gen.Generate(i).questions) {
      knowledge += q.phrasing == Phrasing::kKnowledge;
      if (q.question == "which item would you wear on your feet?") {
        ++feet;
        EXPECT_THAT((std::vector<std::string>{"sandal", "sneaker", "ankle boot"}),
                    Contains(q.answer));
      }
    }
  }
  EXPECT_GT(knowledge, 400);
  EXPECT_GT(feet, 0);
}

TEST(DomainTest, TeacherNeverSeesHeldOutShifts) {
  const DomainSpec t = TeacherDomain();
  for (const ShiftSetting& s : t.shifts) {
    EXPECT_THAT(HeldOutShifts(), ::testing::Not(Contains(s.shift)));
  }
  EXPECT_GT(t.token_mask_probability, 0);
  EXPECT_EQ(t.phrasings.size(), 3u);
  ASSERT_OK_AND_ASSIGN(SampleGenerator gen, SampleGenerator::Create(&TrainImages(), t, 4));
  int shifted = 0;
  for (uint64_t i = 0; i < 200; ++i) {
    const Sample s = gen.GenerateImageOnly(i);
    if (s.shift.severity > 0) {
      ++shifted;
      EXPECT_THAT(TeacherSeenShifts(), Contains(s.shift.shift));
      EXPECT_LE(s.shift.severity, 5);
    }
  }
  EXPECT_GT(shifted, 60);
  EXPECT_LT(shifted, 140);
}

TEST(DomainTest, PresetsAndSchedule) {
  std::set<int> all;
  for (CategoryDomain d : {CategoryDomain::kIn, CategoryDomain::kNear, CategoryDomain::kOut}) {
    for (int c : ClassesIn(d)) EXPECT_TRUE(all.insert(c).second);
  }
  EXPECT_EQ(all.size(), 10u);
  const std::vector<DomainSpec> rounds = ContinualSchedule(8);
  ASSERT_EQ(rounds.size(), 8u);
  for (size_t r = 1; r < rounds.size(); ++r) {
    EXPECT_NE(rounds[r].shifts[0].shift, rounds[r - 1].shifts[0].shift);
    EXPECT_EQ(rounds[r].split, Split::kTest);
  }
  ASSERT_OK_AND_ASSIGN(
      SampleGenerator gen,
      SampleGenerator::Create(&TestImages(), CategoryShiftDomain(CategoryDomain::kOut), 1));
  for (uint64_t i = 0; i < 50; ++i) {
    for (const SceneItem& it : gen.GenerateImageOnly(i).scene.items) {
      EXPECT_EQ(ClassCategory(it.label), CategoryDomain::kOut);
    }
  }
}

TEST(DomainTest, EveryGeneratedWordIsInTheTokenizer) {
  const Tokenizer tok = Tokenizer::SceneLanguage();
  DomainSpec spec = TeacherDomain();
  ASSERT_OK_AND_ASSIGN(SampleGenerator gen, SampleGenerator::Create(&TrainImages(), spec, 9));
  for (uint64_t i = 0; i < 300; ++i) {
    const Sample s = gen.Generate(i);
    std::vector<std::string> texts = s.captions;
    texts.emplace_back(CaptionPrompt());
    for (const std::string& c : s.captions) {  // a caption and its <eos> fit the bound
      ASSERT_LE(static_cast<int>(tok.Encode(c).size()) + 1, kMaxCaptionTokens) << c;
    }
    for (const VqaItem& q : s.questions) {
      texts.push_back(q.question);
      texts.insert(texts.end(), q.choices.begin(), q.choices.end());
      texts.insert(texts.end(), q.direct_answers.begin(), q.direct_answers.end());
    }
    for (const std::string& t : texts) {
      for (int id : tok.Encode(t)) ASSERT_NE(id, Tokenizer::kUnk) << t;
    }
  }
}

// Scenes from the installed test split use only test images.
TEST(DomainTest, RealTestScenesUseTestImagesOnly) {
  if (!std::filesystem::exists(std::string(kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist not installed";
  }
  ASSERT_OK_AND_ASSIGN(ImageSet test, LoadFashionMnist(Split::kTest));
  ASSERT_OK_AND_ASSIGN(SampleGenerator gen,
                       SampleGenerator::Create(&test, TeacherDomain(Split::kTest), 1));
  for (uint64_t i = 0; i < 100; ++i) {
    const Sample s = gen.GenerateImageOnly(i);
    EXPECT_EQ(s.scene.split, Split::kTest);
    for (const SceneItem& it : s.scene.items) {
      ASSERT_LT(it.image_index, 10000);
      EXPECT_EQ(test.labels[it.image_index], it.label);
    }
  }
}

}  // namespace
}  // namespace cdcca::datasets
