// What a user runs is what the docs measured: the real cdcca-cloud and cdcca-device, started
// with nothing but the settings they require (paths, id, token), report (--print_config) the
// same round settings as cdcca-sim reports for the quickstart (README.md's headline table),
// on either family; with `--profile=paper` they report what cdcca-sim reports for the paper's
// image, multimodal and text shift tables (docs/RESULTS.md). Every one of those settings
// comes from settings/defaults.h.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/child_process.h"

namespace {

namespace fs = std::filesystem;
using cdcca::testing::Child;
using cdcca::testing::ReadJson;
using cdcca::testing::ReadText;

class SettingsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }

  // Runs `args` to completion and returns what it printed on stdout as JSON (null when the
  // program failed; its stderr is then in the test's output).
  nlohmann::json PrintedConfig(const std::vector<std::string>& args, const std::string& name) {
    const std::string out = (dir_ / (name + ".json")).string();
    const std::string log = (dir_ / (name + ".log")).string();
    Child child(args, log, "", out);
    const int code = child.Wait(absl::Minutes(2));
    EXPECT_EQ(code, 0) << name << ": " << ReadText(log);
    if (code != 0) return nullptr;
    return ReadJson(out);
  }

  // The programs' configuration on model folder `models` (relative to the checkout), with
  // `extra` flags.
  nlohmann::json CloudConfig(const std::string& models = "models/small",
                             const std::vector<std::string>& extra = {}) {
    std::ofstream(dir_ / "tokens") << "cam-1 0123456789abcdef0123456789abcdef\n";
    std::vector<std::string> args = {CDCCA_CLOUD_BINARY,
                                     "--print_config",
                                     "--insecure",
                                     "--data_dir=" + (dir_ / "cloud").string(),
                                     "--tokens=" + (dir_ / "tokens").string(),
                                     "--checkpoint_dir=" + Source(models)};
    args.insert(args.end(), extra.begin(), extra.end());
    return PrintedConfig(args, "cloud");
  }

  nlohmann::json DeviceConfig(const std::string& models = "models/small",
                              const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {CDCCA_DEVICE_BINARY,
                                     "--print_config",
                                     "--insecure",
                                     "--cloud=127.0.0.1:50051",
                                     "--device_id=cam-1",
                                     "--token=0123456789abcdef0123456789abcdef",
                                     "--checkpoint_dir=" + Source(models),
                                     "--state_dir=" + (dir_ / "device").string(),
                                     "--input=scenes:fog:4"};
    args.insert(args.end(), extra.begin(), extra.end());
    return PrintedConfig(args, "device");
  }

  // cdcca-sim's round settings for experiment `name`, with its distill settings file named
  // by absolute path (the experiment files name it relative to the checkout).
  nlohmann::json SimConfig(const std::string& name, const std::string& models = "models/small") {
    std::ifstream in(Source("configs/experiments/" + name + ".json"));
    nlohmann::json experiment = nlohmann::json::parse(in);
    experiment["distill_config"] = Source("configs/distill/akd.json");
    const std::string path = (dir_ / (name + "_experiment.json")).string();
    std::ofstream(path) << experiment.dump();
    return PrintedConfig({CDCCA_SIM_BINARY, "--print_config", "--experiment=" + path,
                          "--checkpoint_dir=" + Source(models)},
                         "sim_" + name);
  }

  // Every round setting `sim` reports, reported alike by the cloud or the device (or both).
  static void ExpectSameSettings(const nlohmann::json& sim, const nlohmann::json& cloud,
                                 const nlohmann::json& device);

  static std::string Source(const std::string& relative) {
    return std::string(CDCCA_SOURCE_DIR) + "/" + relative;
  }

  fs::path dir_;
};

// Equal as settings: numbers to within rounding of a decimal, everything else exactly.
bool SameSetting(const nlohmann::json& a, const nlohmann::json& b) {
  if (a.is_number() && b.is_number()) {
    const double x = a.get<double>();
    const double y = b.get<double>();
    return std::abs(x - y) <= 1e-9 * std::max(1.0, std::abs(y));
  }
  return a == b;
}

void SettingsTest::ExpectSameSettings(const nlohmann::json& sim, const nlohmann::json& cloud,
                                      const nlohmann::json& device) {
  ASSERT_TRUE(sim.is_object());
  ASSERT_TRUE(cloud.is_object());
  ASSERT_TRUE(device.is_object());
  // The round's settings, every one: a key the harness reports that neither program
  // takes is a setting a user cannot reproduce.
  EXPECT_GE(sim.size(), 30u) << sim.dump();
  for (const auto& [key, value] : sim.items()) {
    SCOPED_TRACE(key);
    EXPECT_TRUE(cloud.contains(key) || device.contains(key)) << "neither program reports " << key;
    if (cloud.contains(key)) {
      EXPECT_TRUE(SameSetting(cloud[key], value))
          << "cdcca-cloud runs " << cloud[key] << ", the experiment " << value;
    }
    if (device.contains(key)) {
      EXPECT_TRUE(SameSetting(device[key], value))
          << "cdcca-device runs " << device[key] << ", the experiment " << value;
    }
  }
  // The settings a device and its cloud must agree on are reported by both.
  for (const char* key :
       {"profile", "uts_keep_fraction", "uts_token_ratio", "uts_mc_passes", "uts_random_share",
        "student_precision", "lora_rank", "lora_alpha", "lora_mlp", "lora_qformer",
        "lora_projector", "lora_vision", "max_answer_tokens"}) {
    EXPECT_TRUE(cloud.contains(key) && device.contains(key)) << key;
  }
}

TEST_F(SettingsTest, TheProgramsWithoutFlagsRunTheQuickstartsSettings) {
  const nlohmann::json sim = SimConfig("quickstart");
  ExpectSameSettings(sim, CloudConfig(), DeviceConfig());
  // The measured profile: the frames uplinked, LoRA on the LM alone on a BLIP-2 student.
  EXPECT_EQ(sim["profile"], "measured");
  EXPECT_EQ(sim["uplink_precision"], "jpeg");
  EXPECT_EQ(sim["lora_projector"], false);
}

TEST_F(SettingsTest, OnLlavaTheMeasuredProfileTrainsTheProjectorToo) {
  const nlohmann::json sim = SimConfig("quickstart", "models/llava-small");
  ExpectSameSettings(sim, CloudConfig("models/llava-small"), DeviceConfig("models/llava-small"));
  EXPECT_EQ(sim["uplink_precision"], "jpeg");
  EXPECT_EQ(sim["lora_projector"], true);
  // A setting given on the command line wins over the profile's.
  const nlohmann::json device =
      DeviceConfig("models/llava-small", {"--lora_projector=false", "--uplink_precision=int8"});
  ASSERT_TRUE(device.is_object());
  EXPECT_EQ(device["lora_projector"], false);
  EXPECT_EQ(device["uplink_precision"], "int8");
}

TEST_F(SettingsTest, ThePaperProfileRunsThePaperTablesSettings) {
  for (const std::string models : {"models/small", "models/llava-small"}) {
    const nlohmann::json cloud = CloudConfig(models, {"--profile=paper"});
    const nlohmann::json device = DeviceConfig(models, {"--profile=paper"});
    for (const std::string experiment : {"image_shift", "multimodal_shift", "text_shift"}) {
      SCOPED_TRACE(experiment + " on " + models);
      const nlohmann::json sim = SimConfig(experiment, models);
      ExpectSameSettings(sim, cloud, device);
      EXPECT_EQ(sim["uplink_precision"], "fp16");
      EXPECT_EQ(sim["lora_projector"], false);
    }
  }
}

TEST_F(SettingsTest, AnUnknownProfileIsRefusedNamingTheChoices) {
  const std::string log = (dir_ / "bad.log").string();
  Child child({CDCCA_DEVICE_BINARY, "--print_config", "--profile=papr",
               "--checkpoint_dir=" + Source("models/small")},
              log, "", (dir_ / "bad.json").string());
  EXPECT_NE(child.Wait(absl::Minutes(2)), 0);
  EXPECT_THAT(ReadText(log), ::testing::HasSubstr("--profile must be measured or paper"));
}

TEST_F(SettingsTest, PrintConfigShowsWhatTheCommandLineSetsAndHidesTheToken) {
  const nlohmann::json device = DeviceConfig();
  ASSERT_TRUE(device.is_object());
  EXPECT_EQ(device["token"], "(set)");
  EXPECT_THAT(device.dump(), ::testing::Not(::testing::HasSubstr("0123456789abcdef")));
  std::ofstream(dir_ / "tokens") << "cam-1 0123456789abcdef0123456789abcdef\n";
  const nlohmann::json cloud = PrintedConfig(
      {CDCCA_CLOUD_BINARY, "--print_config", "--insecure",
       "--data_dir=" + (dir_ / "cloud").string(), "--tokens=" + (dir_ / "tokens").string(),
       "--uts_keep_fraction=0.3", "--distill_config=" + Source("configs/distill/akd.json"),
       "--learner=pl", "--max_steps=7"},
      "cloud_flags");
  ASSERT_TRUE(cloud.is_object());
  EXPECT_DOUBLE_EQ(cloud["uts_keep_fraction"].get<double>(), 0.3);
  EXPECT_EQ(cloud["learner"], "pl");
  EXPECT_EQ(cloud["l_query"], 0.0);  // pl: no feature term
  EXPECT_EQ(cloud["max_steps"], 7);
  EXPECT_EQ(cloud["batch_size"], 16);  // from the distill settings file
}

// The teacher's preparation chunk comes from the distill settings file the user gives
// cdcca-cloud, shows in what it would run, and a negative one stops it naming the key.
TEST_F(SettingsTest, TheCloudTakesThePreparationChunkFromTheDistillSettings) {
  nlohmann::json file = ReadJson(Source("configs/distill/akd.json"));
  ASSERT_TRUE(file.is_object());
  EXPECT_EQ(CloudConfig()["prepare_batch"], 0);  // the committed file: twice the batch
  file["job"]["prepare_batch"] = 24;
  const std::string config = (dir_ / "distill.json").string();
  std::ofstream(config) << file.dump();
  const nlohmann::json cloud = CloudConfig("models/small", {"--distill_config=" + config});
  ASSERT_TRUE(cloud.is_object());
  EXPECT_EQ(cloud["prepare_batch"], 24);
  file["job"]["prepare_batch"] = -2;
  std::ofstream(config, std::ios::trunc) << file.dump();
  std::ofstream(dir_ / "tokens") << "cam-1 0123456789abcdef0123456789abcdef\n";
  const std::string log = (dir_ / "negative.log").string();
  Child child({CDCCA_CLOUD_BINARY, "--print_config", "--insecure",
               "--data_dir=" + (dir_ / "cloud").string(), "--tokens=" + (dir_ / "tokens").string(),
               "--checkpoint_dir=" + Source("models/small"), "--distill_config=" + config},
              log, "", (dir_ / "negative.json").string());
  EXPECT_NE(child.Wait(absl::Minutes(2)), 0);
  EXPECT_THAT(ReadText(log), ::testing::HasSubstr("'prepare_batch' must be >= 0"));
}

// cdcca-device reads a --config file of its flags' names as cdcca-cloud does; the command
// line wins over the file, and a misspelt key stops the program naming the one meant.
TEST_F(SettingsTest, TheDeviceReadsAConfigFileOfItsFlagsNames) {
  const std::string config = (dir_ / "device.json").string();
  std::ofstream(config) << R"({"uts_token_ratio": 0.25, "uts_mc_passes": 4,
                              "uplink_precision": "int8"})";
  const nlohmann::json device = PrintedConfig(
      {CDCCA_DEVICE_BINARY, "--config=" + config, "--uts_mc_passes=6", "--print_config"},
      "device_config");
  ASSERT_TRUE(device.is_object());
  EXPECT_DOUBLE_EQ(device["uts_token_ratio"].get<double>(), 0.25);
  EXPECT_EQ(device["uplink_precision"], "int8");
  EXPECT_EQ(device["uts_mc_passes"], 6);  // the command line wins
  std::ofstream(config) << R"({"uts_token_ratios": 0.25})";
  const std::string log = (dir_ / "device_bad_config.log").string();
  Child bad({CDCCA_DEVICE_BINARY, "--config=" + config, "--print_config"}, log);
  EXPECT_EQ(bad.Wait(absl::Minutes(1)), 1);
  EXPECT_THAT(ReadText(log), ::testing::HasSubstr("did you mean 'uts_token_ratio'?"));
}

}  // namespace
