#include "sim/experiment.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::sim {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kGood[] = R"({
  "name": "t", "paper_table": "Table 6", "devices": 2, "rounds": 3, "stagger": true,
  "schedule": [{"shift": "fog", "severity": 4}, {"shift": "none", "text": true},
               {"continual": true}],
  "methods": ["source-only", "cd-cca"],
  "uts_token_ratio": 0.25, "uplink_precision": "int8",
  "max_steps": 10,
  "link": {"up_mbit_s": 5, "loss": 0.01}
})";

TEST(ExperimentTest, ParsesEveryField) {
  ASSERT_OK_AND_ASSIGN(Experiment e, ParseExperiment(kGood, "good.json"));
  EXPECT_EQ(e.name, "t");
  EXPECT_EQ(e.devices, 2);
  EXPECT_EQ(e.rounds, 3);
  ASSERT_EQ(e.schedule.size(), 3u);
  EXPECT_EQ(e.schedule[0].shift, "fog");
  EXPECT_EQ(e.schedule[0].severity, 4);
  EXPECT_TRUE(e.schedule[1].text);
  EXPECT_TRUE(e.schedule[2].continual);
  EXPECT_FLOAT_EQ(e.uts.token_ratio, 0.25f);
  EXPECT_EQ(e.uts.precision, "int8");
  EXPECT_EQ(e.uts.score, "vis");  // default kept: the device's
  EXPECT_EQ(e.job.max_steps, 10);
  EXPECT_DOUBLE_EQ(e.link.up_mbit_s, 5);
  EXPECT_DOUBLE_EQ(e.link.loss, 0.01);
  EXPECT_DOUBLE_EQ(e.link.down_mbit_s, 100);  // default kept
}

TEST(ExperimentTest, StaggeredDevicesStartAtLaterEntriesAndTheLastRepeats) {
  ASSERT_OK_AND_ASSIGN(Experiment e, ParseExperiment(kGood, "good.json"));
  EXPECT_EQ(e.DomainFor(0, 0).shift, "fog");
  EXPECT_TRUE(e.DomainFor(1, 0).text);       // device 1 is one step ahead
  EXPECT_TRUE(e.DomainFor(1, 2).continual);  // past the end: the last entry
  EXPECT_TRUE(e.DomainFor(0, 7).continual);
  e.stagger = false;
  EXPECT_EQ(e.DomainFor(1, 0).shift, "fog");
}

TEST(ExperimentTest, RejectsBadFilesNamingTheField) {
  EXPECT_THAT(ParseExperiment("{", "a.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a.json")));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["magic"]})", "b.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("magic")));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{"shift": "smoke", "severity": 2}],
                          "methods": ["pl"]})",
                              "c.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("schedule[0]")));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{"shift": "fog"}], "methods": ["pl"]})",
                              "d.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("severity")));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "rounds": "three", "schedule": [{}],
                                  "methods": ["pl"]})",
                              "e.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rounds")));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["pl"],
                                  "link": {"loss": 1.5}})",
                              "f.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loss")));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["pl"],
                                  "uts_score": "magnitude"})",
                              "g.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("vis, attention_variance")));
  EXPECT_THAT(LoadExperiment("/nonexistent/x.json").status(),
              StatusIs(absl::StatusCode::kNotFound));
}

// A misspelt key is refused with its place and the keys that place knows, at every level,
// instead of being ignored (the run would quietly use the default).
TEST(ExperimentTest, RefusesUnknownKeysNamingThePlace) {
  const std::string base = R"("name": "x", "schedule": [{}], "methods": ["pl"])";
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "round": 3})", "a.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("a.json: unknown key \"round\""), HasSubstr("rounds"))));
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "guard_poool": 64})", "b.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("b.json: unknown key \"guard_poool\"; did you mean "
                                 "\"guard_pool\"?")));
  // A key under its old name is refused naming the new one; so are the old groups.
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "precision": "int4"})", "p.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("did you mean \"student_precision\"?")));
  EXPECT_THAT(
      ParseExperiment("{" + base + R"(, "uts": {"keep_fraction": 0.5}})", "u.json").status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("uts_keep_fraction")));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{"shift": "fog", "severty": 3}],
                                  "methods": ["pl"]})",
                              "c.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("schedule[0]: unknown key")));
  for (const char* part :
       {R"("uts_keep": 0.5)", R"("cloud": {"front": 2})", R"("link": {"up_mbits": 5})"}) {
    EXPECT_THAT(ParseExperiment("{" + base + ", " + part + "}", "d.json").status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown key")))
        << part;
  }
  ASSERT_OK_AND_ASSIGN(Experiment e,
                       ParseExperiment("{" + base + R"(, "guard_pool": 64})", "e.json"));
  EXPECT_EQ(e.job.guard_pool, 64);
}

// The guard's measure: the teacher's probability by default, agreement when asked, and
// nothing else.
TEST(ExperimentTest, ReadsTheGuardsMeasure) {
  const std::string base = R"("name": "x", "schedule": [{}], "methods": ["pl"])";
  ASSERT_OK_AND_ASSIGN(Experiment by_default, ParseExperiment("{" + base + "}", "a.json"));
  EXPECT_EQ(by_default.job.guard_measure, "teacher_probability");
  ASSERT_OK_AND_ASSIGN(
      Experiment agreement,
      ParseExperiment("{" + base + R"(, "guard_measure": "agreement"})", "b.json"));
  EXPECT_EQ(agreement.job.guard_measure, "agreement");
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "guard_measure": "votes"})", "c.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("c.json"), HasSubstr("guard_measure"))));
}

// How the jobs' frozen base multiplies: native by default, one of the three modes or true /
// false for on / off, and nothing else.
TEST(ExperimentTest, ReadsTheBasesProducts) {
  const std::string base = R"("name": "x", "schedule": [{}], "methods": ["pl"])";
  ASSERT_OK_AND_ASSIGN(Experiment by_default, ParseExperiment("{" + base + "}", "a.json"));
  EXPECT_EQ(by_default.job.fp8_base, "native");
  for (const auto& [text, mode] : std::vector<std::pair<std::string, std::string>>{
           {R"("on")", "on"}, {R"("off")", "off"}, {"true", "on"}, {"false", "off"}}) {
    ASSERT_OK_AND_ASSIGN(Experiment e,
                         ParseExperiment("{" + base + R"(, "fp8_base": )" + text + "}", "b.json"));
    EXPECT_EQ(e.job.fp8_base, mode) << text;
  }
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "fp8_base": "fp8"})", "c.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("c.json"), HasSubstr("fp8_base"))));
}

// A Hugging Face pair: both folders, the adapters and the jobs' device are read; one folder
// alone, a device-side method, a family's token score or an unknown device are refused.
TEST(ExperimentTest, ReadsAHubPairAndRefusesWhatItCannotRun) {
  ASSERT_OK_AND_ASSIGN(
      Experiment e,
      ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["source-only", "cd-cca"],
                          "teacher": "/m/t", "student_base": "/m/s", "lora_rank": 16,
                          "lora_alpha": 32, "lora_mlp": true, "device": "cuda"})",
                      "h.json"));
  EXPECT_TRUE(e.hub());
  EXPECT_EQ(e.teacher, "/m/t");
  EXPECT_EQ(e.student_base, "/m/s");
  EXPECT_EQ(e.lora_rank, 16);
  EXPECT_DOUBLE_EQ(e.lora_alpha, 32);
  EXPECT_TRUE(e.lora_mlp);
  EXPECT_EQ(e.job.device, "cuda");
  EXPECT_FALSE(
      ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["pl"]})", "i.json")->hub());
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["pl"],
                                  "teacher": "/m/t"})",
                              "j.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"student_base\"")));
  // The device learners run on a pair as on a family.
  EXPECT_OK(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["cotta", "tent"],
                                "teacher": "/m/t", "student_base": "/m/s"})",
                            "k.json")
                .status());
  // A score the device does not compute, on a family as on a pair.
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["pl"],
                                  "uts_score": "attention_cv"})",
                              "l.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("attention_cv")));
  // Every score the device computes is taken, the scale-free VIS ablation too.
  for (const char* score : {"vis", "vis_relative", "attention_variance", "attention_mass"}) {
    ASSERT_OK_AND_ASSIGN(
        Experiment scored,
        ParseExperiment(absl::StrCat(R"({"name": "x", "schedule": [{}], "methods": ["pl"],
                                          "uts_score": ")",
                                     score, R"("})"),
                        "s.json"));
    EXPECT_EQ(scored.uts.score, score);
  }
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["pl"],
                                  "device": "tpu"})",
                              "m.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tpu")));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["pl"],
                                  "lora_rank": 0})",
                              "n.json")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lora_rank")));
}

TEST(ExperimentTest, MethodNamesMayCarryATokenRatio) {
  EXPECT_EQ(ParseMethodName("cd-cca").base, "cd-cca");
  EXPECT_EQ(ParseMethodName("cd-cca").token_ratio, 0);
  EXPECT_EQ(ParseMethodName("akd-random@0.25").base, "akd-random");
  EXPECT_FLOAT_EQ(ParseMethodName("akd-random@0.25").token_ratio, 0.25f);
  EXPECT_EQ(ParseMethodName("cd-cca@x").token_ratio, -1);
  EXPECT_OK(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["cd-cca@0.75"]})", "a"));
  EXPECT_THAT(ParseExperiment(R"({"name": "x", "schedule": [{}], "methods": ["cd-cca@1.5"]})", "b")
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cd-cca@1.5")));
}

TEST(ExperimentTest, CaptionExperimentsStreamTheCategoriesWithoutASchedule) {
  ASSERT_OK_AND_ASSIGN(
      Experiment e,
      ParseExperiment(R"({"name": "c", "task": "caption", "methods": ["cd-cca"]})", "c.json"));
  EXPECT_TRUE(e.captioning());
  ASSERT_EQ(e.schedule.size(), 1u);  // one implicit entry: every round is the same mix
  EXPECT_EQ(e.AnswerTokens(), 48);   // the longest caption, <eos> included
  ASSERT_OK_AND_ASSIGN(Experiment vqa, ParseExperiment(kGood, "g.json"));
  EXPECT_FALSE(vqa.captioning());
  EXPECT_EQ(vqa.AnswerTokens(), 6);
  EXPECT_THAT(ParseExperiment(R"({"name": "c", "task": "caption", "methods": ["cd-cca"],
                                  "schedule": [{"shift": "fog", "severity": 4}]})",
                              "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("schedule")));
  EXPECT_THAT(ParseExperiment(R"({"name": "c", "task": "ocr", "methods": ["cd-cca"]})", "c.json"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"ocr\"")));
}

TEST(ExperimentTest, EveryCheckedInExperimentParses) {
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(CDCCA_SOURCE_DIR) +
                                                               "/configs/experiments")) {
    if (entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().string());
    ASSERT_OK_AND_ASSIGN(Experiment e, LoadExperiment(entry.path().string()));
    EXPECT_EQ(e.name, entry.path().stem().string());  // the run directory is named after it
    ++files;
  }
  EXPECT_GE(files, 10);
}

// "profile" picks the uplink and the projector's LoRA where the file leaves them out, by the
// student's family; what the file says wins; a changed model is resolved again.
TEST(ExperimentTest, TheProfilePicksWhatTheFileLeavesOutByFamily) {
  const std::string small = std::string(CDCCA_SOURCE_DIR) + "/models/small";
  const std::string llava = std::string(CDCCA_SOURCE_DIR) + "/models/llava-small";
  const std::string base = R"("name": "x", "schedule": [{}], "methods": ["cd-cca"])";
  ASSERT_OK_AND_ASSIGN(
      Experiment e,
      ParseExperiment("{" + base + R"(, "checkpoint_dir": ")" + small + "\"}", "m.json"));
  EXPECT_EQ(e.profile, "measured");
  EXPECT_EQ(e.uts.precision, "jpeg");
  EXPECT_FALSE(e.lora_projector);
  e.checkpoint = llava;  // as cdcca-sim --checkpoint_dir does
  ASSERT_OK(ApplyProfile(&e));
  EXPECT_EQ(e.uts.precision, "jpeg");
  EXPECT_TRUE(e.lora_projector);
  ASSERT_OK_AND_ASSIGN(
      e,
      ParseExperiment("{" + base + R"(, "profile": "paper", "checkpoint_dir": ")" + llava + "\"}",
                      "p.json"));
  EXPECT_EQ(e.uts.precision, "fp16");
  EXPECT_FALSE(e.lora_projector);
  ASSERT_OK_AND_ASSIGN(e, ParseExperiment("{" + base + R"(, "uplink_precision": "int8",
                                              "lora_projector": false, "checkpoint_dir": ")" +
                                              llava + "\"}",
                                          "s.json"));
  EXPECT_EQ(e.uts.precision, "int8");
  EXPECT_FALSE(e.lora_projector);
  // The vision side trains from frames: a file that uplinks tokens with it is refused.
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "lora_vision": true, "profile": "paper",
                                 "checkpoint_dir": ")" +
                                  small + "\"}",
                              "v.json"),
              ::cdcca::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                         ::testing::HasSubstr("lora_vision")));
  ASSERT_OK_AND_ASSIGN(
      e,
      ParseExperiment("{" + base + R"(, "lora_vision": true, "checkpoint_dir": ")" + small + "\"}",
                      "v.json"));
  EXPECT_TRUE(e.lora_vision);
  EXPECT_EQ(e.uts.precision, "jpeg");
  // More of the stream: the pool and the random share, read under the programs' names and
  // refused out of range.
  ASSERT_OK_AND_ASSIGN(e, ParseExperiment("{" + base + R"(, "pool_samples": 1024,
                                              "uts_random_share": 0.2})",
                                          "m.json"));
  EXPECT_EQ(e.job.pool_samples, 1024);
  EXPECT_FLOAT_EQ(e.uts.random_share, 0.2f);
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "pool_samples": -1})", "m.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pool_samples")));
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "uts_random_share": 1})", "m.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("uts_random_share")));
  EXPECT_THAT(ParseExperiment("{" + base + R"(, "profile": "papr"})", "b.json").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("profile")));
}

TEST(ExperimentTest, ShrinkKeepsTheShapeAndCutsTheWork) {
  ASSERT_OK_AND_ASSIGN(Experiment e, ParseExperiment(kGood, "good.json"));
  e.stream_frames = 1000;
  e.job.max_steps = 500;
  Experiment s = Shrink(e);
  EXPECT_EQ(s.rounds, e.rounds);
  EXPECT_EQ(s.methods, e.methods);
  EXPECT_LE(s.stream_frames, 64);
  EXPECT_LE(s.job.max_steps, 20);
}

}  // namespace
}  // namespace cdcca::sim
