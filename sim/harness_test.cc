// The harness end to end on `tiny` models (random weights): every method runs through the
// real services, the bookkeeping adds up, devices stay in sync with their cloud mirrors, the
// report is written, and the same seed gives the same accuracies.
#include "sim/harness.h"

#include <sys/wait.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "datasets/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sim/report.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_family.h"

namespace cdcca::sim {
namespace {

using ::testing::HasSubstr;

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class HarnessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(11);
    ASSERT_OK(::cdcca::testing::WriteTinyFamily(dir_.path() + "/model", /*teacher_scale=*/1.0));
  }

  Experiment TinyExperiment(std::vector<std::string> methods) const {
    Experiment e;
    e.name = "harness-test";
    e.checkpoint = dir_.path() + "/model";
    e.precision = "int8";
    e.devices = 2;
    e.rounds = 2;
    e.stream_frames = 24;
    e.eval_scenes = 6;
    e.schedule = {RoundDomain{"fog", 4, false, false}, RoundDomain{"none", 0, true, false}};
    e.methods = std::move(methods);
    e.uts.keep_fraction = 0.5f;
    e.uts.token_ratio = 0.25f;
    e.uts.mc_passes = 4;
    e.job.max_steps = 3;
    e.job.batch_size = 4;
    e.link.latency_ms = 2;
    e.threads = 1;
    e.distill_config = "";
    // One update per round (the books below count them); GuardIsReportedPerRound has it on.
    e.job.guard = false;
    return e;
  }

  ::cdcca::testing::TempDir dir_;
};

TEST_F(HarnessTest, EveryMethodRunsAndTheBooksBalance) {
  const Experiment e = TinyExperiment({"source-only", "tent", "cd-cca", "akd-random"});
  HarnessOptions options;
  options.work_dir = dir_.path() + "/work";
  options.seed = 5;
  double last_fraction = -1;
  options.progress = [&](const std::string&, double f) {
    EXPECT_GE(f, last_fraction);  // progress never goes back
    last_fraction = f;
  };
  ASSERT_OK_AND_ASSIGN(RunResult run, RunExperiment(e, options));
  EXPECT_DOUBLE_EQ(last_fraction, 1.0);
  ASSERT_EQ(run.methods.size(), 4u);
  for (const MethodResult& m : run.methods) {
    SCOPED_TRACE(m.method);
    ASSERT_EQ(m.rounds.size(), static_cast<size_t>(e.devices * (e.rounds + 1)));
    for (const DeviceRound& r : m.rounds) {
      EXPECT_GT(r.questions, 0);
      EXPECT_GE(r.da, 0);
      EXPECT_LE(r.da, 100);
      if (r.round > 0) EXPECT_EQ(r.frames, e.stream_frames);
      EXPECT_EQ(r.domain, r.round <= 1 ? "fog-4" : "clean+text");
      // The per-question scores are what the accuracy averages.
      ASSERT_EQ(r.question_da.size(), static_cast<size_t>(r.questions));
      double sum = 0;
      for (float v : r.question_da) sum += v;
      EXPECT_NEAR(100 * sum / r.questions, r.da, 1e-3);
    }
  }
  const MethodResult& source = run.methods[0];
  const MethodResult& tent = run.methods[1];
  const MethodResult& cdcca = run.methods[2];
  const MethodResult& random = run.methods[3];
  for (const DeviceRound& r : source.rounds) {
    EXPECT_EQ(r.version, 0u);
    EXPECT_EQ(r.uplink_wire_bytes, 0u);
  }
  for (const DeviceRound& r : tent.rounds) {
    EXPECT_EQ(r.version, static_cast<uint64_t>(r.round));  // adapted locally every round
    EXPECT_EQ(r.uplink_wire_bytes, 0u);                    // without the cloud
  }
  for (const MethodResult* m : {&cdcca, &random}) {
    for (const DeviceRound& r : m->rounds) {
      if (r.round == 0) continue;
      SCOPED_TRACE(m->method + " device " + std::to_string(r.device) + " round " +
                   std::to_string(r.round));
      EXPECT_GT(r.kept_samples, 0);
      EXPECT_LT(r.kept_samples, r.frames);  // stage 1 drops some
      // Stage 2 keeps a quarter of the 17 visual tokens of every kept sample (4, rounded).
      EXPECT_EQ(r.kept_tokens, r.kept_samples * 4);
      EXPECT_GT(r.uplink_payload_bytes, 0u);
      EXPECT_GE(r.uplink_wire_bytes, r.uplink_payload_bytes);  // framing on top
      EXPECT_GT(r.downlink_payload_bytes, 0u);
      EXPECT_GE(r.downlink_wire_bytes, r.downlink_payload_bytes);
      EXPECT_EQ(r.version, static_cast<uint64_t>(r.round));  // one update applied per round
      EXPECT_TRUE(r.in_sync);
    }
  }

  ASSERT_OK(WriteReport(run, dir_.path() + "/report"));
  for (const char* f : {"report.md", "results.json", "results.csv", "report.html"}) {
    EXPECT_TRUE(std::filesystem::exists(dir_.path() + "/report/" + f)) << f;
  }
  const std::string text = ReadText(dir_.path() + "/report/report.md");
  EXPECT_THAT(text, HasSubstr("| cd-cca |"));
  EXPECT_THAT(text, HasSubstr("Transmission"));
  EXPECT_THAT(text, HasSubstr("paired on the same questions"));
  // Two devices, two rounds: four updates per cloud method, each about 1/4 of the bytes.
  for (const MethodResult* m : {&cdcca, &random}) {
    uint64_t down = 0;
    for (const DeviceRound& r : m->rounds) down += r.downlink_payload_bytes;
    EXPECT_THAT(text, HasSubstr(absl::StrFormat("| %.1f | %.1f |", down / 1000.0, down / 4000.0)))
        << m->method;
  }
  EXPECT_THAT(SummaryTable(run), HasSubstr("akd-random"));
}

// A caption experiment: every round streams the caption prompt over the three categories;
// each evaluation scores them apart and together, and the report has the Table 2 layout.
TEST_F(HarnessTest, CaptionRunsScoreEveryCategory) {
  Experiment e = TinyExperiment({"source-only", "cd-cca"});
  e.task = "caption";
  e.schedule = {RoundDomain{}};
  e.devices = 1;
  e.rounds = 1;
  e.eval_scenes = 4;
  HarnessOptions options;
  options.work_dir = dir_.path() + "/work";
  options.seed = 3;
  ASSERT_OK_AND_ASSIGN(RunResult run, RunExperiment(e, options));
  ASSERT_EQ(run.methods.size(), 2u);
  for (const MethodResult& m : run.methods) {
    SCOPED_TRACE(m.method);
    ASSERT_EQ(m.rounds.size(), 2u);
    for (const DeviceRound& r : m.rounds) {
      EXPECT_EQ(r.domain, "in+near+out");
      ASSERT_EQ(r.captions.size(), 4u);
      const char* names[] = {"in-domain", "near-domain", "out-domain", "all"};
      for (size_t c = 0; c < 4; ++c) {
        EXPECT_EQ(r.captions[c].category, names[c]);
        EXPECT_EQ(r.captions[c].images, c < 3 ? 4 : 12);
        EXPECT_GE(r.captions[c].bleu4, 0);
        EXPECT_LE(r.captions[c].bleu4, 100);
        EXPECT_GE(r.captions[c].cider, 0);
      }
      // The VQA fields carry "all": CIDEr-D, BLEU-4, and per-image CIDEr-D averaging to it.
      EXPECT_DOUBLE_EQ(r.da, r.captions[3].cider);
      EXPECT_DOUBLE_EQ(r.mc, r.captions[3].bleu4);
      ASSERT_EQ(r.question_da.size(), 12u);
      double sum = 0;
      for (float v : r.question_da) sum += v;
      EXPECT_NEAR(100 * sum / 12, r.da, 1e-3);
    }
  }
  const DeviceRound& adapted = run.methods[1].rounds[1];
  EXPECT_GT(adapted.kept_samples, 0);
  EXPECT_GT(adapted.downlink_payload_bytes, 0u);
  EXPECT_TRUE(adapted.in_sync);
  const std::string md = MarkdownReport(run);
  EXPECT_THAT(md, HasSubstr("the paper's Table 2 layout"));
  EXPECT_THAT(md, HasSubstr("| method | in-domain | near-domain | out-domain | all |"));
  EXPECT_THAT(md, HasSubstr("CIDEr-D points"));
  EXPECT_THAT(SummaryTable(run), HasSubstr("captions CIDEr-D / BLEU-4"));
}

// The cloud's update guard in the deployed round: with a margin no update can pass, every
// round's update is withheld, the devices stay at version 0 in sync with their mirrors, and
// report.md and results.json count the withheld updates per round.
TEST_F(HarnessTest, GuardIsReportedPerRound) {
  Experiment e = TinyExperiment({"cd-cca"});
  e.job.guard = true;
  e.job.guard_holdout_fraction = 0.5;
  e.job.guard_min_pool = 1;
  e.job.guard_z = 1e6;
  HarnessOptions options;
  options.work_dir = dir_.path() + "/work";
  options.seed = 5;
  ASSERT_OK_AND_ASSIGN(RunResult run, RunExperiment(e, options));
  int withheld = 0;
  for (const DeviceRound& r : run.methods[0].rounds) {
    if (r.round == 0) continue;
    SCOPED_TRACE(absl::StrCat("device ", r.device, " round ", r.round));
    EXPECT_GT(r.guard_pool, 0);
    EXPECT_TRUE(r.update_withheld);
    EXPECT_EQ(r.downlink_payload_bytes, 0u);
    EXPECT_EQ(r.version, 0u);
    // The device was put back after being scored with the update it did not get: it is in
    // sync with its mirror again at the next round.
    EXPECT_TRUE(r.in_sync);
    withheld += r.update_withheld ? 1 : 0;
    // What the withheld update would have done is measured on the same questions.
    EXPECT_TRUE(r.withheld_measured);
    EXPECT_GE(r.withheld_da, 0.0);
    EXPECT_LE(r.withheld_da, 100.0);
    EXPECT_NEAR(r.withheld_gain, r.withheld_da - r.da, 1e-9);
    EXPECT_GE(r.withheld_gain_se, 0.0);
    // It was the update's state the device was scored with, not its own.
    EXPECT_NE(r.withheld_state_digest, r.state_digest);
    EXPECT_NE(r.withheld_state_digest, 0u);
  }
  EXPECT_EQ(withheld, e.devices * e.rounds);
  ASSERT_OK(WriteReport(run, dir_.path() + "/report"));
  EXPECT_THAT(ReadText(dir_.path() + "/report/report.md"), HasSubstr("| cd-cca | 2 | 2 | 4 |"));
  const nlohmann::json results =
      nlohmann::json::parse(ReadText(dir_.path() + "/report/results.json"));
  EXPECT_EQ(results["methods"][0]["updates_withheld_per_round"], nlohmann::json({2.0, 2.0}));
  EXPECT_EQ(results["methods"][0]["rounds"][2]["withheld_measured"], true);
}

// "teacher": the devices answer with the family's teacher/ folder, never adapted, no cloud;
// without a teacher folder the method fails and names the folder.
TEST_F(HarnessTest, TheTeacherMethodAnswersWithTheTeacherFolder) {
  ASSERT_OK(::cdcca::testing::WriteTinyFamily(dir_.path() + "/twice", /*teacher_scale=*/2.0));
  Experiment e = TinyExperiment({"source-only", "teacher"});
  e.checkpoint = dir_.path() + "/twice";
  HarnessOptions options;
  options.work_dir = dir_.path() + "/work";
  options.seed = 5;
  ASSERT_OK_AND_ASSIGN(RunResult run, RunExperiment(e, options));
  ASSERT_EQ(run.methods.size(), 2u);
  const MethodResult& teacher = run.methods[1];
  EXPECT_EQ(teacher.method, "teacher");
  ASSERT_EQ(teacher.rounds.size(), run.methods[0].rounds.size());
  for (size_t i = 0; i < teacher.rounds.size(); ++i) {
    const DeviceRound& t = teacher.rounds[i];
    EXPECT_EQ(t.version, 0u);
    EXPECT_EQ(t.uplink_wire_bytes, 0u);
    EXPECT_EQ(t.downlink_payload_bytes, 0u);
    EXPECT_EQ(t.questions, run.methods[0].rounds[i].questions);
  }

  std::filesystem::remove_all(dir_.path() + "/twice/teacher");
  options.work_dir = dir_.path() + "/work2";
  absl::StatusOr<RunResult> missing = RunExperiment(e, options);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("twice/teacher"));
}

#ifdef CDCCA_SIM_CLUSTER
// "cloud": {"store": "postgresql"}: the same rounds on a PostgreSQL server, two fronts behind
// nginx and two trainers. Every round ends with each device on its new version in sync with
// the store, and the first round (a fresh mirror on either cloud, the same samples) trains
// exactly what the embedded cloud trains.
TEST_F(HarnessTest, TheScaledCloudRunsTheRoundsInSync) {
  Experiment e = TinyExperiment({"cd-cca"});
  HarnessOptions options;
  options.seed = 3;
  options.work_dir = dir_.path() + "/embedded";
  ASSERT_OK_AND_ASSIGN(RunResult embedded, RunExperiment(e, options));
  e.cloud.store = "postgresql";
  e.cloud.fronts = 2;
  e.cloud.trainers = 2;
  options.work_dir = dir_.path() + "/scaled";
  ASSERT_OK_AND_ASSIGN(RunResult scaled, RunExperiment(e, options));
  ASSERT_EQ(scaled.methods[0].rounds.size(), embedded.methods[0].rounds.size());
  for (size_t k = 0; k < scaled.methods[0].rounds.size(); ++k) {
    const DeviceRound& r = scaled.methods[0].rounds[k];
    const DeviceRound& base = embedded.methods[0].rounds[k];
    SCOPED_TRACE(absl::StrCat("device ", r.device, " round ", r.round));
    if (r.round == 0) continue;
    EXPECT_TRUE(r.in_sync);
    EXPECT_EQ(r.version, static_cast<uint64_t>(r.round));
    EXPECT_GT(r.downlink_payload_bytes, 0u);
    if (r.round == 1) {
      EXPECT_EQ(r.state_digest, base.state_digest);
      EXPECT_EQ(r.uplink_payload_bytes, base.uplink_payload_bytes);
    }
  }
}
#endif

// A fleet runs the deployed round: the devices stream and uplink at once, the programs'
// scheduler holds every device's job in flight together (one worker: the later jobs
// queue), and a rerun with the same seed gives the same accuracies, uplink, updates and
// digests.
TEST_F(HarnessTest, TheSameSeedGivesTheSameRunWithTheFleetAtOnce) {
  Experiment e = TinyExperiment({"cd-cca"});
  e.devices = 3;
  e.stagger = true;
  std::vector<double> first;
  std::vector<uint64_t> first_digests;
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE(pass);
    HarnessOptions options;
    options.work_dir = dir_.path() + "/work" + std::to_string(pass);
    options.seed = 9;
    ASSERT_OK_AND_ASSIGN(RunResult run, RunExperiment(e, options));
    const MethodResult& m = run.methods[0];
    EXPECT_GE(m.peak_devices_streaming, 2);       // streams overlap (all three, unless one is late)
    EXPECT_EQ(m.peak_jobs_in_flight, e.devices);  // every device's job triggered at once
    EXPECT_EQ(m.peak_jobs_running, 1);            // on the one worker
    std::vector<double> figures;
    std::vector<uint64_t> digests;
    double most_queued = 0;
    for (const DeviceRound& r : m.rounds) {
      figures.insert(figures.end(), r.question_da.begin(), r.question_da.end());
      for (double v :
           {r.da, r.mc, static_cast<double>(r.kept_samples), static_cast<double>(r.kept_tokens),
            static_cast<double>(r.uplink_payload_bytes),
            static_cast<double>(r.downlink_payload_bytes), static_cast<double>(r.version)}) {
        figures.push_back(v);
      }
      digests.push_back(r.state_digest);
      if (r.round > 0) {
        EXPECT_EQ(r.version, static_cast<uint64_t>(r.round));
        EXPECT_TRUE(r.in_sync);
        EXPECT_GE(r.queue_seconds, 0);
        most_queued = std::max(most_queued, r.queue_seconds);
      }
    }
    EXPECT_GT(most_queued, 0);  // a job waited for the one before it
    // Staggered devices adapt to different domains, so their digests differ.
    EXPECT_NE(digests[static_cast<size_t>(e.devices)], digests[static_cast<size_t>(e.devices) + 1]);
    if (pass == 0) {
      first = figures;
      first_digests = digests;
    } else {
      EXPECT_EQ(figures, first);
      EXPECT_EQ(digests, first_digests);
    }
  }
}

// The program end to end with --seeds: one run directory per seed, the summary files, and
// the summary printed; a repeated seed is refused before anything runs.
TEST_F(HarnessTest, SimProgramRunsSeveralSeeds) {
  const std::string experiment = dir_.path() + "/seeds.json";
  {
    std::ofstream f(experiment);
    f << R"({"name": "seeds-test", "checkpoint_dir": ")" << dir_.path() << R"(/model",
      "devices": 1, "rounds": 1, "stream_frames": 16, "eval_scenes": 4, "torch_threads": 1,
      "distill_config": "", "schedule": [{"shift": "fog", "severity": 4}],
      "methods": ["source-only", "cd-cca"], "uts_keep_fraction": 0.5, "uts_mc_passes": 2,
      "max_steps": 2, "batch_size": 4, "link": {"latency_ms": 1}})";
  }
  const std::string out = dir_.path() + "/runs";
  auto run = [&](const std::string& seeds, std::string* stdout_text) {
    const std::string cmd = absl::StrCat(CDCCA_SIM_BINARY, " --experiment ", experiment, " --out ",
                                         out, " --seeds ", seeds, " 2>/dev/null");
    FILE* p = popen(cmd.c_str(), "r");
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) stdout_text->append(buf, n);
    const int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  std::string printed;
  ASSERT_EQ(run("3,4", &printed), 0) << printed;
  EXPECT_THAT(printed, HasSubstr("seed 3 (1/2)"));
  EXPECT_THAT(printed, HasSubstr("| cd-cca minus source-only |"));
  EXPECT_THAT(printed, HasSubstr("summary: " + out + "/seeds.md"));
  for (const char* f : {"/seed-3/report.md", "/seed-4/results.json", "/seeds.json"}) {
    EXPECT_TRUE(std::filesystem::exists(out + f)) << f;
  }
  const std::string text = ReadText(out + "/seeds.md");
  EXPECT_THAT(text, HasSubstr("| comparison | seed 3 | seed 4 | mean |"));
  std::string refused;
  EXPECT_EQ(run("5,5", &refused), 2);
  EXPECT_FALSE(std::filesystem::exists(out + "/seed-5"));
}

// A Hugging Face pair runs the experiment's rounds through the same services: the
// devices load the student folder, the cloud mirrors it and trains from the teacher folder,
// and every cloud method's devices end each round in sync with their mirrors. One LLaVA and
// one BLIP-2 fixture, each as its own teacher (the towers must match).
TEST_F(HarnessTest, PairRunsEveryCloudMethodInSync) {
  for (const std::string folder : {"llava_clip_llama", "blip2_llama"}) {
    SCOPED_TRACE(folder);
    Experiment e = TinyExperiment({"source-only", "pl", "cd-cca"});
    // The jpeg uplink on LLaVA: the devices send frames, the cloud recomputes the tokens.
    if (folder == "llava_clip_llama") e.uts.precision = "jpeg";
    e.teacher = std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + folder;
    e.student_base = e.teacher;
    e.lora_rank = 4;
    e.lora_alpha = 8;
    e.devices = 1;
    e.rounds = 1;
    e.stream_frames = 8;
    e.eval_scenes = 2;
    e.uts.mc_passes = 2;
    e.job.max_steps = 2;
    e.job.batch_size = 2;
    HarnessOptions options;
    options.work_dir = dir_.path() + "/hub-" + folder;
    options.seed = 3;
    ASSERT_OK_AND_ASSIGN(RunResult run, RunExperiment(e, options));
    ASSERT_EQ(run.methods.size(), 3u);
    for (const MethodResult& m : run.methods) {
      ASSERT_EQ(m.rounds.size(), 2u) << m.method;
      EXPECT_GT(m.trainable_parameters, 0) << m.method;
      const DeviceRound& r = m.rounds[1];
      EXPECT_GT(r.questions, 0);
      EXPECT_EQ(r.frames, e.stream_frames);
      if (m.method == "source-only") {
        EXPECT_EQ(r.version, 0u);
        EXPECT_EQ(r.uplink_wire_bytes, 0u);
        continue;
      }
      EXPECT_GT(r.kept_samples, 0) << m.method;
      EXPECT_GT(r.kept_tokens, 0) << m.method;
      EXPECT_GT(r.uplink_payload_bytes, 0u) << m.method;
      EXPECT_GT(r.downlink_payload_bytes, 0u) << m.method;
      EXPECT_EQ(r.version, 1u) << m.method;
      EXPECT_TRUE(r.in_sync) << m.method;
      EXPECT_NE(r.state_digest, m.rounds[0].state_digest) << m.method;
    }
    ASSERT_OK(WriteReport(run, options.work_dir + "/report"));
    if (e.uts.precision == "jpeg") {
      EXPECT_THAT(ReadText(options.work_dir + "/report/report.md"),
                  HasSubstr("the cloud recomputes the tokens"));
    }
    EXPECT_THAT(ReadText(options.work_dir + "/report/report.md"),
                HasSubstr("Teacher `" + e.teacher + "`, student `" + e.student_base));
  }
}

// A pair that names one folder, or a score the device does not compute, is refused before
// anything runs, by the harness and by the program.
TEST_F(HarnessTest, PairRefusesWhatItCannotRun) {
  Experiment e = TinyExperiment({"source-only", "cd-cca"});
  e.teacher = std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/llava_clip_llama";
  e.student_base = e.teacher;
  HarnessOptions options;
  options.work_dir = dir_.path() + "/refused";
  e.uts.score = "probe_entropy";
  EXPECT_THAT(RunExperiment(e, options).status(),
              ::cdcca::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("scores its visual tokens by")));
  e.uts.score = "vis";
  e.student_base.clear();
  EXPECT_THAT(CheckExperiment(e, "x").message(), HasSubstr("\"student_base\" is required"));
  EXPECT_FALSE(std::filesystem::exists(options.work_dir));

  const std::string cmd = absl::StrCat(CDCCA_SIM_BINARY, " --experiment ", CDCCA_SOURCE_DIR,
                                       "/configs/experiments/quickstart.json --teacher ", e.teacher,
                                       " --out ", dir_.path(), "/refused-run 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  std::string printed;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) printed.append(buf, n);
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 2) << printed;
  EXPECT_THAT(printed, HasSubstr("\"student_base\" is required"));
}

// The paired comparison on a hand-made run: per-question differences {1, 0, 0, 0} give a
// mean of 25 points and a standard error of sqrt(0.25 / 4) = 25 points; a method scored on
// another domain is left out rather than compared; a ratio-suffixed CD-CCA is paired with
// source-only and the methods at its own ratio.
TEST(ReportTest, PairsCdCcaWithEachMethodOnTheSameQuestions) {
  RunResult run;
  run.experiment.name = "paired";
  run.experiment.devices = 1;
  run.experiment.rounds = 1;
  auto method = [](const std::string& name, std::vector<float> scores, const std::string& domain) {
    MethodResult m;
    m.method = name;
    for (int round = 0; round <= 1; ++round) {
      DeviceRound r;
      r.round = round;
      r.domain = domain;
      r.question_da = scores;
      r.questions = static_cast<int>(scores.size());
      m.rounds.push_back(r);
    }
    return m;
  };
  run.methods.push_back(method("source-only", {0, 1, 0, 1}, "fog-4"));
  run.methods.push_back(method("other-domain", {0, 0, 0, 0}, "snow-3"));
  run.methods.push_back(method("cd-cca", {1, 1, 0, 1}, "fog-4"));
  // Table 4 pairs: a ratio-suffixed CD-CCA meets source-only and its own ratio only.
  run.methods.push_back(method("cd-cca@0.25", {0, 1, 1, 1}, "fog-4"));
  run.methods.push_back(method("akd-random@0.25", {0, 0, 0, 1}, "fog-4"));
  run.methods.push_back(method("akd-random@0.75", {0, 0, 0, 0}, "fog-4"));
  const std::string md = MarkdownReport(run);
  EXPECT_THAT(md, HasSubstr("| cd-cca | source-only | +25.00 | 25.00 | +1.0 | 4 |"));
  EXPECT_THAT(md, ::testing::Not(HasSubstr("| other-domain | +")));
  EXPECT_THAT(md, HasSubstr("| cd-cca | akd-random@0.25 | +50.00 |"));
  EXPECT_THAT(md, HasSubstr("| cd-cca@0.25 | source-only | +25.00 |"));
  EXPECT_THAT(md, HasSubstr("| cd-cca@0.25 | akd-random@0.25 | +50.00 |"));
  EXPECT_THAT(md, ::testing::Not(HasSubstr("| cd-cca@0.25 | akd-random@0.75 |")));
  EXPECT_THAT(md, ::testing::Not(HasSubstr("| cd-cca@0.25 | cd-cca |")));
  // The report names the uplink's settings, the stage-2 score included.
  EXPECT_THAT(md, HasSubstr("stage 2 50% of each kept frame's visual tokens by `vis`"));
}

// One seed's run of one round: method i answers its questions with scores[i] (before and
// after the round alike).
RunResult SeedRun(uint64_t seed, const std::vector<std::string>& names,
                  const std::vector<std::vector<float>>& scores) {
  RunResult r;
  r.seed = seed;
  r.experiment.name = "seeds";
  r.experiment.devices = 1;
  r.experiment.rounds = 1;
  for (size_t i = 0; i < names.size(); ++i) {
    MethodResult m;
    m.method = names[i];
    for (int round = 0; round <= 1; ++round) {
      DeviceRound d;
      d.round = round;
      d.domain = "fog-4";
      d.question_da = scores[i];
      m.rounds.push_back(d);
    }
    r.methods.push_back(m);
  }
  return r;
}

// Several seeds: per-seed paired differences, their mean, the standard error across seeds
// and the question-level one, by hand. cd-cca minus pkd: seed 1 {1,0,0,1} -> +50 (question
// SE sqrt(1/3 / 4) = 28.87), seed 2 {0,0,1,0} -> +25 (SE 25); mean 37.5, across-seed SE
// sd(50, 25) / sqrt(2) = 12.5, question SE sqrt(28.87^2 + 25^2) / 2 = 19.09.
TEST(ReportTest, SummarizesSeveralSeeds) {
  auto run = [](uint64_t seed, std::vector<std::vector<float>> scores) {
    return SeedRun(seed, {"source-only", "pkd", "cd-cca"}, scores);
  };
  std::vector<RunResult> runs = {run(1, {{0, 1, 0, 1}, {0, 1, 0, 0}, {1, 1, 0, 1}}),
                                 run(2, {{0, 0, 0, 1}, {1, 0, 0, 1}, {1, 0, 1, 1}})};
  const std::string md = SeedSummaryMarkdown(runs);
  EXPECT_THAT(md, HasSubstr("| comparison | seed 1 | seed 2 | mean |"));
  EXPECT_THAT(md, HasSubstr("| pkd minus source-only | -25.00 | +25.00 | **+0.00** | 25.00 |"));
  EXPECT_THAT(md, HasSubstr("| cd-cca minus source-only | +25.00 | +50.00 | **+37.50** | 12.50 |"));
  EXPECT_THAT(md, HasSubstr("| cd-cca minus pkd | +50.00 | +25.00 | **+37.50** | 12.50 | 19.09 |"));

  // A seed without the method: that seed shows "-" and the mean uses the others.
  runs.push_back(run(3, {{0, 0, 0, 0}, {0, 0, 0, 0}, {1, 1, 1, 1}}));
  runs.back().methods.erase(runs.back().methods.begin() + 1);
  EXPECT_THAT(SeedSummaryMarkdown(runs),
              HasSubstr("| cd-cca minus pkd | +50.00 | +25.00 | - | **+37.50** | 12.50 |"));

  const std::string dir = ::testing::TempDir() + "/seed_summary";
  ASSERT_TRUE(WriteSeedSummary(runs, dir).ok());
  std::ifstream in(dir + "/seeds.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["seeds"].size(), 3u);
  bool found = false;
  for (const auto& c : j["comparisons"]) {
    if (c["reference"] != "cd-cca" || c["method"] != "pkd") continue;
    found = true;
    EXPECT_NEAR(c["mean"].get<double>(), 37.5, 1e-9);
    EXPECT_EQ(c["seeds_paired"].get<int>(), 2);
    EXPECT_TRUE(c["per_seed"][2].is_null());
  }
  EXPECT_TRUE(found);
  EXPECT_FALSE(WriteSeedSummary({}, dir).ok());
}

// With a "teacher" method: each method's gain over source-only as a share of the teacher's,
// per seed, by hand. Seed 1: teacher +75, cd-cca +25 -> 33 %, pkd -25 -> -33 %; seed 2:
// teacher +50, cd-cca +50 -> 100 %, pkd +25 -> 50 %; seed 3: the teacher is not ahead -> "-".
TEST(ReportTest, SharesOfTheTeachersLeadRecovered) {
  auto run = [](uint64_t seed, std::vector<std::vector<float>> scores) {
    return SeedRun(seed, {"source-only", "teacher", "pkd", "cd-cca"}, scores);
  };
  const std::vector<RunResult> runs = {
      run(1, {{0, 0, 0, 1}, {1, 1, 1, 1}, {0, 0, 0, 0}, {1, 0, 0, 1}}),
      run(2, {{0, 0, 0, 1}, {1, 1, 0, 1}, {1, 0, 0, 1}, {1, 1, 0, 1}}),
      run(3, {{1, 1, 1, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}})};
  const std::string md = SeedSummaryMarkdown(runs);
  EXPECT_THAT(md, HasSubstr("| teacher minus source-only | +75.00 | +50.00 | +0.00 |"));
  EXPECT_THAT(md, HasSubstr("Share of the teacher's lead recovered"));
  // cd-cca: mean(33.3, 100) = 66.7, SE sd / sqrt(2) = 33.3.
  EXPECT_THAT(md, HasSubstr("| cd-cca | 33 | 100 | - | **67** | 33 |"));
  EXPECT_THAT(md, HasSubstr("| pkd | -33 | 50 | - | **8** | 42 |"));
  const std::string dir = ::testing::TempDir() + "/gap_summary";
  ASSERT_TRUE(WriteSeedSummary(runs, dir).ok());
  std::ifstream in(dir + "/seeds.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_EQ(j["teacher_lead_recovered"].size(), 2u);
  EXPECT_EQ(j["teacher_lead_recovered"][1]["method"], "cd-cca");
  EXPECT_NEAR(j["teacher_lead_recovered"][1]["mean"].get<double>(), 2.0 / 3.0, 1e-9);
  EXPECT_TRUE(j["teacher_lead_recovered"][1]["per_seed"][2].is_null());

  // Without a teacher there is no such table.
  std::vector<RunResult> no_teacher = runs;
  for (RunResult& r : no_teacher) r.methods.erase(r.methods.begin() + 1);
  EXPECT_THAT(SeedSummaryMarkdown(no_teacher),
              ::testing::Not(HasSubstr("Share of the teacher's lead recovered")));
}

// Runs without source-only (the transmission experiment runs CD-CCA alone): no "minus
// source-only" row with a made-up +0.00, and a sentence instead of an empty table.
TEST(ReportTest, ASummaryWithoutSourceOnlyHasNoRowsAgainstIt) {
  const std::vector<RunResult> alone = {SeedRun(1, {"cd-cca"}, {{1, 0, 1, 1}}),
                                        SeedRun(2, {"cd-cca"}, {{1, 1, 1, 1}})};
  const std::string md = SeedSummaryMarkdown(alone);
  EXPECT_THAT(md, ::testing::Not(HasSubstr("minus source-only")));
  EXPECT_THAT(md, HasSubstr("No paired comparison"));
  const std::vector<RunResult> two = {SeedRun(1, {"pkd", "cd-cca"}, {{0, 0, 1, 1}, {1, 0, 1, 1}}),
                                      SeedRun(2, {"pkd", "cd-cca"}, {{1, 1, 1, 1}, {1, 1, 1, 1}})};
  const std::string both = SeedSummaryMarkdown(two);
  EXPECT_THAT(both, ::testing::Not(HasSubstr("minus source-only")));
  EXPECT_THAT(both, HasSubstr("| cd-cca minus pkd | +25.00 | +0.00 | **+12.50** |"));
}

// Each adapted round against source-only, by hand (4 questions, source-only right on all).
// Seed 1: pl wrong on all 4 in round 1 (-100, SE 0: below beyond noise) and on 1 in round 2
// (-25, SE sqrt(0.25 / 4) = 25, z -1: within noise); cd-cca level. Seed 2: pl -25 in round
// 1 only.
TEST(ReportTest, SaysWhichRoundsFallBelowSourceOnlyBeyondNoise) {
  auto run = [](uint64_t seed, std::vector<float> pl_round1, std::vector<float> pl_round2) {
    RunResult r;
    r.seed = seed;
    r.experiment.name = "rounds";
    r.experiment.devices = 1;
    r.experiment.rounds = 2;
    for (const std::string name : {"source-only", "pl", "cd-cca"}) {
      MethodResult m;
      m.method = name;
      for (int round = 0; round <= 2; ++round) {
        DeviceRound d;
        d.round = round;
        d.domain = "snow-4";
        d.question_da = {1, 1, 1, 1};
        if (name == "pl" && round == 1) d.question_da = pl_round1;
        if (name == "pl" && round == 2) d.question_da = pl_round2;
        d.questions = 4;
        m.rounds.push_back(d);
      }
      r.methods.push_back(m);
    }
    return r;
  };
  const std::vector<RunResult> runs = {run(1, {0, 0, 0, 0}, {1, 1, 1, 0}),
                                       run(2, {1, 1, 1, 0}, {1, 1, 1, 1})};
  const std::string md = MarkdownReport(runs[0]);
  EXPECT_THAT(md, HasSubstr("## Each round against source-only"));
  EXPECT_THAT(md, HasSubstr("| pl | -100.00 | -25.00 (z -1.0) | 1 of 2 |"));
  EXPECT_THAT(md, HasSubstr("| cd-cca | +0.00 | +0.00 | 0 of 2 |"));
  EXPECT_THAT(MarkdownReport(runs[1]), HasSubstr("| pl | -25.00 (z -1.0) | +0.00 | 0 of 2 |"));

  const std::string summary = SeedSummaryMarkdown(runs);
  EXPECT_THAT(summary, HasSubstr("Each method's lowest adapted round against source-only"));
  EXPECT_THAT(summary, HasSubstr("| pl | -100.00, round 1 | -25.00 (z -1.0), round 1 | 1 of 4 |"));
  EXPECT_THAT(summary, HasSubstr("| cd-cca | +0.00, round 1 | +0.00, round 1 | 0 of 4 |"));

  const std::string dir = ::testing::TempDir() + "/rounds_summary";
  ASSERT_TRUE(WriteSeedSummary(runs, dir).ok());
  std::ifstream in(dir + "/seeds.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_EQ(j["lowest_round_vs_source_only"].size(), 2u);
  const nlohmann::json& pl = j["lowest_round_vs_source_only"][0];
  EXPECT_EQ(pl["method"], "pl");
  EXPECT_EQ(pl["rounds_below_beyond_noise"].get<int>(), 1);
  EXPECT_NEAR(pl["per_seed"][1]["difference"].get<double>(), -25.0, 1e-9);
  EXPECT_NEAR(pl["per_seed"][1]["standard_error"].get<double>(), 25.0, 1e-9);

  ASSERT_TRUE(WriteReport(runs[0], dir + "/seed-1").ok());
  std::ifstream rin(dir + "/seed-1/results.json");
  const nlohmann::json r = nlohmann::json::parse(rin);
  const nlohmann::json& rounds = r["methods"][1]["rounds_vs_source_only"];
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_TRUE(rounds[0]["below_beyond_noise"].get<bool>());
  EXPECT_FALSE(rounds[1]["below_beyond_noise"].get<bool>());
  EXPECT_FALSE(r["methods"][0].contains("rounds_vs_source_only"));
}

}  // namespace
}  // namespace cdcca::sim
