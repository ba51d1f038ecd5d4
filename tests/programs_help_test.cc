// The programs' command-line conventions that users' scripts rely on: `--help` prints the
// help and exits 0 (absl alone exits 1), and an unknown flag exits non-zero naming the
// flag. Runs the built binaries; a program this configuration does not build is skipped.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/child_process.h"
#include "tests/testing/temp_dir.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Outcome {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

Outcome RunProgram(const std::string& command) {
  Outcome r;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Each program with a flag its help must list.
const std::pair<const char*, const char*> kPrograms[] = {
#ifdef CDCCA_BINARY
    {CDCCA_BINARY, "usage: cdcca"},
#endif
#ifdef CDCCA_CLOUD_BINARY
    {CDCCA_CLOUD_BINARY, "--data_dir"},
#endif
#ifdef CDCCA_DEVICE_BINARY
    {CDCCA_DEVICE_BINARY, "--device_id"},
#endif
#ifdef CDCCA_SIM_BINARY
    {CDCCA_SIM_BINARY, "--experiment"},
#endif
};

TEST(ProgramsHelpTest, HelpExitsZeroAndPrintsHelp) {
  for (const auto& [binary, expected] : kPrograms) {
    for (const char* flag : {"--help", "-help", "--helpfull"}) {
      SCOPED_TRACE(std::string(binary) + " " + flag);
      const Outcome r = RunProgram(std::string(binary) + " " + flag);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      EXPECT_THAT(r.output, HasSubstr(expected));
    }
  }
}

TEST(ProgramsHelpTest, UnknownFlagExitsNonZeroNamingIt) {
  for (const auto& [binary, expected] : kPrograms) {
    SCOPED_TRACE(binary);
    const Outcome r = RunProgram(std::string(binary) + " --no_such_flag_xyz=1");
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("no_such_flag_xyz"));
  }
}

// A misspelt flag, or a flag of another program, is refused naming the one meant.
TEST(ProgramsHelpTest, AMisspeltFlagIsRefusedNamingTheNearestKnownOne) {
#ifdef CDCCA_DEVICE_BINARY
  const Outcome device = RunProgram(std::string(CDCCA_DEVICE_BINARY) + " --uts_mc_pases=4");
  EXPECT_NE(device.exit_code, 0);
  EXPECT_THAT(device.output, HasSubstr("did you mean '--uts_mc_passes'?"));
  // --data_dir is cdcca-cloud's: the device does not take it silently.
  const Outcome foreign = RunProgram(std::string(CDCCA_DEVICE_BINARY) + " --data_dir=/tmp");
  EXPECT_NE(foreign.exit_code, 0);
  EXPECT_THAT(foreign.output, HasSubstr("unknown flag '--data_dir'"));
#endif
#ifdef CDCCA_CLOUD_BINARY
  const std::filesystem::path config =
      std::filesystem::path(::testing::TempDir()) / "misspelt_cloud_config.json";
  std::ofstream(config) << R"({"trigger_sample": 8})";
  const Outcome cloud = RunProgram(std::string(CDCCA_CLOUD_BINARY) +
                                   " --config=" + config.string() + " --print_config");
  EXPECT_NE(cloud.exit_code, 0);
  EXPECT_THAT(cloud.output, HasSubstr("did you mean 'trigger_samples'?"));
  // A UTS setting every device would refuse at Register is refused at the start.
  const Outcome share = RunProgram(
      std::string(CDCCA_CLOUD_BINARY) + " --uts_random_share=1.5 --insecure --data_dir=" +
      (std::filesystem::path(::testing::TempDir()) / "share").string());
  EXPECT_NE(share.exit_code, 0);
  EXPECT_THAT(share.output, HasSubstr("--uts_random_share must be in [0, 1)"));
  // A name of no mode of the base's products is refused at the start, not at the first job.
  const Outcome fp8 =
      RunProgram(std::string(CDCCA_CLOUD_BINARY) + " --fp8_base=fp8 --insecure --data_dir=" +
                 (std::filesystem::path(::testing::TempDir()) / "fp8").string());
  EXPECT_NE(fp8.exit_code, 0);
  EXPECT_THAT(fp8.output, HasSubstr("--fp8_base must be native, on or off"));
#endif
}

#ifdef CDCCA_BINARY
TEST(ProgramsHelpTest, CdccaSubcommandHelp) {
  const Outcome r = RunProgram(std::string(CDCCA_BINARY) + " eval --help");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("usage: cdcca eval"));
  EXPECT_THAT(r.output, HasSubstr("--annotations"));    // a flag `cdcca eval` reads
  EXPECT_THAT(r.output, Not(HasSubstr("--flagfile")));  // absl's own flags are left out
  const Outcome help = RunProgram(std::string(CDCCA_BINARY) + " help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.output, HasSubstr("eval"));
  const Outcome bad = RunProgram(std::string(CDCCA_BINARY) + " eval vqa --no_such_flag_xyz");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr("no_such_flag_xyz"));
  EXPECT_NE(RunProgram(CDCCA_BINARY).exit_code, 0);  // no command: usage error
}
#endif

#ifdef CDCCA_DEVICE_BINARY
// cdcca-device pointed at a Hugging Face LLaVA folder answers each frame offline with the
// greedy answer transformers gives for the same image and prompt (the fixture's reference),
// offline and in the agent loop of --cloud.
TEST(DeviceHubFolderTest, AnswersAsTransformersOfflineAndInTheLoop) {
  const std::string fixture =
      std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/llava_clip_llama";
  std::ifstream expected_file(fixture + "/expected.json");
  ASSERT_TRUE(expected_file) << fixture;
  const nlohmann::json expected = nlohmann::json::parse(expected_file)["cases"][0];
  ASSERT_EQ(expected["prompt"], "USER: <image>\nWhat is shown? ASSISTANT:");
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "device_hub_folder";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "frames");
  std::filesystem::copy_file(std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/images/" +
                                 expected["image"].get<std::string>(),
                             dir / "frames" / "0.png");
  const std::string base =
      std::string(CDCCA_DEVICE_BINARY) + " --checkpoint_dir=" + fixture +
      " --input=" + (dir / "frames").string() +
      " --prompt='What is shown?' --student_precision=fp32 --max_answer_tokens=" +
      std::to_string(expected["max_new_tokens"].get<int>());
  const Outcome r = RunProgram(base + " --output=" + (dir / "answers.jsonl").string());
  if (r.output.find("has no Hugging Face tokenizers") != std::string::npos) {
    GTEST_SKIP() << r.output;
  }
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream answers(dir / "answers.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(answers, line)) << r.output;
  const nlohmann::json a = nlohmann::json::parse(line);
  EXPECT_EQ(a["answer"], expected["text"]);
  EXPECT_EQ(a["question"], "What is shown?");
  EXPECT_EQ(a["uplinked"], false);
  EXPECT_GT(a["entropy"].get<double>(), 0.0);
  EXPECT_FALSE(std::getline(answers, line));  // one frame, one answer
  // UTS: the first frame of an empty running-quantile window passes stage 1;
  // stage 2 keeps half of the 5 x 5 image tokens, encoded at fp16 by default.
  EXPECT_EQ(a["uts_kept"], true) << line;
  EXPECT_EQ(a["tokens_total"], 25);
  EXPECT_GE(a["tokens_kept"].get<int>(), 12);
  EXPECT_LE(a["tokens_kept"].get<int>(), 13);
  const int64_t fp16_bytes = a["uplink_bytes"].get<int64_t>();
  EXPECT_GT(fp16_bytes, 12 * 32);  // at least the kept tokens' 32 channels, zstd or not
  const Outcome int4 =
      RunProgram(base + " --uplink_precision=int4 --output=" + (dir / "int4.jsonl").string());
  ASSERT_EQ(int4.exit_code, 0) << int4.output;
  std::ifstream int4_answers(dir / "int4.jsonl");
  ASSERT_TRUE(std::getline(int4_answers, line));
  EXPECT_LT(nlohmann::json::parse(line)["uplink_bytes"].get<int64_t>(), fp16_bytes);
  for (const std::string flag : {"--uts_dropout=1.5", "--uts_mc_passes=0", "--uts_token_ratio=0",
                                 "--uts_random_share=1", "--uplink_precision=int2"}) {
    const Outcome refused = RunProgram(base + " " + flag + " --output=/dev/null");
    EXPECT_NE(refused.exit_code, 0) << flag;
    EXPECT_THAT(refused.output, HasSubstr(flag.substr(2, flag.find('=') - 2))) << flag;
  }

  // With --cloud the folder runs the agent loop: it needs a state directory, and
  // while the cloud is away it keeps answering, through the tower's tokens (what the cloud's
  // mirror computes), with transformers' answer.
  const Outcome no_state = RunProgram(base + " --cloud=127.0.0.1:1 --output=/dev/null");
  EXPECT_NE(no_state.exit_code, 0);
  EXPECT_THAT(no_state.output, HasSubstr("--state_dir"));
  const Outcome linked = RunProgram(
      base + " --cloud=127.0.0.1:1 --insecure --device_id=dev-a --token=t --max_attempts=1 " +
      "--state_dir=" + (dir / "state").string() + " --output=" + (dir / "linked.jsonl").string());
  ASSERT_EQ(linked.exit_code, 0) << linked.output;
  std::ifstream linked_answers(dir / "linked.jsonl");
  ASSERT_TRUE(std::getline(linked_answers, line)) << linked.output;
  EXPECT_EQ(nlohmann::json::parse(line)["answer"], expected["text"]) << line;
  const Outcome bad = RunProgram(base + " --student_template=nope --output=/dev/null");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr("nope"));
}
#endif

#ifdef CDCCA_CLOUD_BINARY
// A guard measure cdcca-cloud does not know is refused at start, naming the flag and the
// measures it knows.
TEST(CloudFlagsTest, AnUnknownGuardMeasureIsRefusedNamingTheKnownOnes) {
  cdcca::testing::TempDir dir;
  {
    std::ofstream tokens(dir.path() + "/tokens.txt");
    tokens << "dev-a token-aaaaaaaaaaaaaaaa\n";
  }
  const std::string pair = std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/blip2_llama";
  // Under `timeout`: a cloud that took the flag would serve until stopped.
  const Outcome r = RunProgram("timeout 60 " + std::string(CDCCA_CLOUD_BINARY) +
                               " --listen=127.0.0.1:0 --insecure --tokens=" + dir.path() +
                               "/tokens.txt --data_dir=" + dir.path() + "/data --teacher=" + pair +
                               " --student_base=" + pair + " --guard_measure=votes");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--guard_measure"));
  EXPECT_THAT(r.output, HasSubstr("'votes'"));
  EXPECT_THAT(r.output, HasSubstr("teacher_probability"));
}

// One cdcca-cloud per --data_dir: a second process on the directory of a serving one exits
// non-zero naming the holder, and a holder killed with -9 leaves nothing that blocks a restart.
TEST(CloudDataDirTest, SecondProcessOnOneDataDirRefusesToStart) {
  cdcca::testing::TempDir dir;
  {
    std::ofstream tokens(dir.path() + "/tokens.txt");
    tokens << "dev-a token-aaaaaaaaaaaaaaaa\n";
  }
  auto cloud_args = [&](const std::string& name) {
    return std::vector<std::string>{CDCCA_CLOUD_BINARY,
                                    "--listen=127.0.0.1:0",
                                    "--insecure",
                                    "--tokens=" + dir.path() + "/tokens.txt",
                                    "--data_dir=" + dir.path() + "/data",
                                    "--port_file=" + dir.path() + "/" + name + ".port"};
  };
  // The port file is written once the server listens, after the lock and the stores.
  auto wait_for_port = [&](const std::string& name, cdcca::testing::Child& child) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline && child.running()) {
      std::ifstream in(dir.path() + "/" + name + ".port");
      int port = 0;
      if (in >> port && port > 0) return true;
      if (child.Wait(absl::Milliseconds(50)) != -1) return false;  // it exited
    }
    return false;
  };
  auto first =
      std::make_unique<cdcca::testing::Child>(cloud_args("first"), dir.path() + "/first.log");
  ASSERT_TRUE(first->running());
  ASSERT_TRUE(wait_for_port("first", *first))
      << cdcca::testing::ReadText(dir.path() + "/first.log");

  cdcca::testing::Child second(cloud_args("second"), dir.path() + "/second.log");
  const int code = second.Wait(absl::Seconds(60));
  const std::string second_log = cdcca::testing::ReadText(dir.path() + "/second.log");
  EXPECT_NE(code, -1) << "the second process is still running: " << second_log;
  EXPECT_NE(code, 0) << second_log;
  EXPECT_THAT(second_log, HasSubstr("in use by another cdcca-cloud process"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/second.port"));

  first->Signal(SIGKILL);
  EXPECT_NE(first->Wait(absl::Seconds(30)), -1);
  cdcca::testing::Child third(cloud_args("third"), dir.path() + "/third.log");
  EXPECT_TRUE(wait_for_port("third", third)) << cdcca::testing::ReadText(dir.path() + "/third.log");
}
#endif

}  // namespace
