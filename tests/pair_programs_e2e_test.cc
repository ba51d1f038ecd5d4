// The collaborative loop on Hugging Face pairs, end to end: a real `cdcca-cloud
// --teacher DIR --student_base DIR` and a real `cdcca-device --checkpoint_dir DIR --cloud`
// on loopback, with the tiny random checkpoints of tests/fixtures/hf/models/.
//   1. Per family (LLaVA CLIP+Llama, LLaVA SigLIP+Qwen2, BLIP-2, InstructBLIP): frames are
//      answered, uplinked, a job trains, the device applies the update in place, and its
//      state digest equals the cloud's mirror.
//   2. A device whose vision tower is not the teacher's is refused at Register, naming both.
//   3. A pair whose tower differs is refused when the cloud starts.
//   4. A pair with different tokenizers trains without the logit KL and the job log says so.
//   5. `cdcca adapt` (the same round offline) gates frames by UTS stage 1 and trains on the
//      kept ones only; it and `cdcca adapt-eval` take the programs' names for the settings
//      they share with them and refuse any flag not their own.
//   6. Questions longer than the pair takes (256 tokens) or than the device can encode (512):
//      the device answers them, drops the batches the cloud refuses for good, does not send
//      what it cannot encode, and goes on in sync.
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cloud/sample_store.h"
#include "cloud/update_store.h"
#include "compress/uplink_codec.h"
#include "device/internal/state_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hub/safetensors_view.h"
#include "nlohmann/json.hpp"
#include "tests/testing/child_process.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/wait.h"

namespace cdcca {
namespace {

using ::cdcca::testing::Child;
using ::cdcca::testing::ReadJson;
using ::cdcca::testing::ReadText;
using ::cdcca::testing::TempDir;
using ::cdcca::testing::WaitUntil;
using ::testing::HasSubstr;

std::string Fixture(const std::string& name) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + name;
}

class PairProgramsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_.path() + "/tokens") << "dev-a token-aaaaaaaaaaaaaaaa\n";
    cloud_data_ = dir_.path() + "/cloud";
  }

  std::unique_ptr<Child> StartCloud(const std::string& teacher, const std::string& student,
                                    std::vector<std::string> extra = {}) {
    const std::string port_file = dir_.path() + "/port";
    std::vector<std::string> args = {
        CDCCA_CLOUD_BINARY,    "--data_dir=" + cloud_data_, "--tokens=" + dir_.path() + "/tokens",
        "--insecure",          "--listen=127.0.0.1:0",      "--port_file=" + port_file,
        "--trigger_samples=2", "--trigger_interval_s=2",    "--max_steps=4",
        "--batch_size=2",      "--torch_threads=1",         "--uts_keep_fraction=0.6",
        "--uts_mc_passes=2"};
    // A family's folder alone (teacher empty) is passed as --checkpoint_dir.
    if (teacher.empty()) {
      args.push_back("--checkpoint_dir=" + student);
    } else {
      args.push_back("--teacher=" + teacher);
      args.push_back("--student_base=" + student);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    auto child = std::make_unique<Child>(args, dir_.path() + "/cloud.log");
    if (port_ == 0) port_ = testing::WaitForPortFile(port_file, absl::Minutes(1), child.get());
    return child;
  }

  std::string DeviceDir() const { return dir_.path() + "/dev-a"; }

  std::unique_ptr<Child> StartDevice(const std::string& folder,
                                     const std::vector<std::string>& extra = {}) {
    std::filesystem::create_directories(DeviceDir());
    std::vector<std::string> args = {
        CDCCA_DEVICE_BINARY,
        absl::StrCat("--cloud=127.0.0.1:", port_),
        "--insecure",
        "--device_id=dev-a",
        "--token=token-aaaaaaaaaaaaaaaa",
        "--checkpoint_dir=" + folder,
        "--torch_threads=1",
        "--state_dir=" + DeviceDir() + "/state",
        "--input=" + std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/images",
        "--loop",
        "--fps=6",
        "--max_answer_tokens=6",
        "--output=" + DeviceDir() + "/answers.jsonl",
        "--uplink_batch_samples=2",
        "--uplink_max_age_s=1",
        "--poll_ms=300",
        "--max_attempts=2",
        "--status_file=" + DeviceDir() + "/status.json"};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<Child>(args, DeviceDir() + "/device.log");
  }

  nlohmann::json DeviceStatus() { return ReadJson(DeviceDir() + "/status.json"); }

  // The device's log once it contains `needle`, or as it is after two minutes.
  std::string WaitForDeviceLog(const std::string& needle) {
    return testing::WaitForText(DeviceDir() + "/device.log", needle, absl::Minutes(2));
  }

  bool WaitInSync(uint64_t version, absl::Duration timeout) {
    return testing::WaitStatusInSync(DeviceDir() + "/status.json", version, timeout);
  }

  std::string CloudDigest(uint64_t version) {
    auto store = cloud::UpdateStore::Open({cloud_data_ + "/updates", 16});
    if (!store.ok()) return "no store";
    auto digest = (*store)->DigestOf("dev-a", version);
    if (!digest.ok()) return digest.status().ToString();
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(*digest));
    return hex;
  }

  // cdcca-cloud on the pair (folder, folder) and cdcca-device on `folder` with `device_flags`,
  // until the device runs an update in sync with the mirror; then the device is stopped and
  // its status (version, digest equal to the cloud's, batches acked) checked into `status`.
  // The cloud keeps running (cloud_) until StopCloud().
  // The cloud serves `teacher` and `folder` as its pair (teacher empty: `folder` is a family,
  // served by its folder alone).
  void RunDeviceToFirstUpdate(const std::string& folder,
                              const std::vector<std::string>& device_flags, nlohmann::json* status,
                              std::optional<std::string> teacher = std::nullopt,
                              const std::vector<std::string>& cloud_flags = {}) {
    cloud_ = StartCloud(teacher.value_or(folder), folder, cloud_flags);
    ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
    std::unique_ptr<Child> device = StartDevice(folder, device_flags);
    ASSERT_TRUE(WaitInSync(1, absl::Minutes(3)))
        << ReadText(DeviceDir() + "/device.log") << ReadText(dir_.path() + "/cloud.log");
    // It answers with the update before it stops.
    ASSERT_TRUE(WaitUntil(
        [&] {
          const std::set<uint64_t> versions = AnswerVersions();
          return !versions.empty() && *versions.rbegin() >= 1;
        },
        absl::Minutes(1)))
        << ReadText(DeviceDir() + "/device.log");
    device->Signal(SIGTERM);
    ASSERT_EQ(device->Wait(absl::Seconds(60)), 0) << ReadText(DeviceDir() + "/device.log");
    *status = DeviceStatus();
    const uint64_t version = status->value("version", 0ull);
    EXPECT_GE(version, 1u);
    EXPECT_EQ(status->value("digest", std::string()), CloudDigest(version)) << status->dump();
    EXPECT_GT(status->value("acked", 0ull), 0u);
  }

  // The model versions that answered, from the device's answers.
  std::set<uint64_t> AnswerVersions() {
    std::ifstream in(DeviceDir() + "/answers.jsonl");
    std::set<uint64_t> versions;
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded()) versions.insert(j.value("model_version", 0ull));
    }
    return versions;
  }

  void StopCloud() {
    cloud_->Signal(SIGTERM);
    EXPECT_EQ(cloud_->Wait(absl::Seconds(60)), 0);
  }

  // The cloud's job lines.
  std::vector<nlohmann::json> Jobs() {
    return testing::LogEvents(dir_.path() + "/cloud.log", "job");
  }

  // Those of jobs that produced an update. Not simply the first job: a job
  // whose samples the update guard all held out trains nothing and ships nothing, and which
  // samples it holds out hashes the device's sample ids, which carry the clock, so a small
  // first batch is now and then held out whole.
  std::vector<nlohmann::json> UpdateJobs() {
    std::vector<nlohmann::json> out;
    for (nlohmann::json& j : Jobs()) {
      if (j.value("new_version", 0) > j.value("base_version", 0)) out.push_back(std::move(j));
    }
    return out;
  }

  TempDir dir_;
  std::string cloud_data_;
  int port_ = 0;
  std::unique_ptr<Child> cloud_;
};

class InProcessRoundTest : public PairProgramsTest,
                           public ::testing::WithParamInterface<std::string> {};

TEST_P(InProcessRoundTest, DeviceAppliesTheUpdateAndMatchesTheCloud) {
  nlohmann::json s;
  RunDeviceToFirstUpdate(Fixture(GetParam()), {}, &s);
  if (HasFatalFailure()) return;
  EXPECT_GE(s.value("updates_applied", 0ull) + s.value("resyncs", 0ull), 1u);
  // Answers came from the base and from the update, without a restart.
  const std::set<uint64_t> versions = AnswerVersions();
  EXPECT_TRUE(versions.count(0)) << "no answer before the update";
  EXPECT_GE(*versions.rbegin(), 1u) << "no answer after the update";
  // A job trained on the uplinked tokens: same tokenizer on both sides, so no KL note.
  std::vector<nlohmann::json> jobs = UpdateJobs();
  ASSERT_FALSE(jobs.empty());
  EXPECT_GT(jobs[0].value("samples", 0), 0);
  EXPECT_GT(jobs[0].value("steps", 0), 0);
  EXPECT_TRUE(jobs[0]["notes"].empty()) << jobs[0].dump();
  // The cloud's guard share reached the device at Register: every sample the cloud's jobs held
  // out the device counted as sent whole (it may have sent more the jobs have not read yet).
  ASSERT_TRUE(s.contains("held_out_samples")) << s.dump();
  int64_t cloud_held_out = 0;
  for (const nlohmann::json& j : Jobs()) cloud_held_out += j.value("held_out_samples", 0);
  EXPECT_LE(cloud_held_out, s.value("held_out_samples", -1)) << s.dump();
  StopCloud();
}

INSTANTIATE_TEST_SUITE_P(Families, InProcessRoundTest,
                         ::testing::Values("llava_clip_llama", "llava_siglip_qwen2", "blip2_llama",
                                           "instructblip_llama"));

class VisionSideRoundTest : public PairProgramsTest,
                            public ::testing::WithParamInterface<std::string> {};

// The vision side trained in the cloud (--lora_vision on both programs, frames uplinked): the
// cloud's mirror runs its own tower on each frame, the update carries the tower's LoRA and
// LayerNorms, and the device applies it in place to the state the mirror holds, bit for bit
// (its digest is the cloud's). The budget of 8 bits per parameter ships every tensor, so the
// tower's LoRA is seen to arrive.
TEST_P(VisionSideRoundTest, TheDeviceAppliesTheTowersUpdateAndMatchesTheCloud) {
  nlohmann::json s;
  RunDeviceToFirstUpdate(Fixture(GetParam()), {"--lora_vision", "--uplink_precision=jpeg"}, &s,
                         std::nullopt, {"--lora_vision", "--bits_per_param=8"});
  if (HasFatalFailure()) return;
  std::vector<nlohmann::json> jobs = UpdateJobs();
  ASSERT_FALSE(jobs.empty());
  EXPECT_GT(jobs[0].value("samples", 0), 0);
  EXPECT_THAT(ReadText(dir_.path() + "/cloud.log"),
              ::testing::Not(HasSubstr("sample_quarantined")));
  StopCloud();
  // The device's state file (its version, digest and trainable set as safetensors).
  const std::string bytes = ReadText(DeviceDir() + "/state/trainable.state");
  absl::StatusOr<device::internal::TrainableStateFile> file =
      device::internal::DecodeTrainableStateFile(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<model::SafetensorsView> state = model::ParseSafetensors(file->safetensors);
  ASSERT_TRUE(state.ok()) << state.status();
  int tower_norms = 0, tower_moved = 0;
  for (const model::SafetensorsEntry& t : state->tensors) {
    if (!absl::StrContains(t.name, "vision_model.")) continue;
    tower_norms += absl::StrContains(t.name, "norm");
    // B starts at zero: any other byte is the update's.
    if (absl::EndsWith(t.name, ".lora_b")) {
      tower_moved += t.bytes.find_first_not_of('\0') != absl::string_view::npos;
    }
  }
  EXPECT_GT(tower_norms, 0);
  EXPECT_GT(tower_moved, 0) << "no LoRA factor of the tower arrived";
}

INSTANTIATE_TEST_SUITE_P(Families, VisionSideRoundTest,
                         ::testing::Values("llava_clip_llama", "blip2_llama",
                                           "instructblip_llama"));

// A cloud that trains the vision side refuses batches of tokens at the uplink (they cannot
// train the tower) with a reason the device logs, and stores none of them.
TEST_F(PairProgramsTest, TokensAreRefusedWhereTheCloudTrainsTheTower) {
  const std::string folder = Fixture("llava_clip_llama");
  std::unique_ptr<Child> cloud = StartCloud(folder, folder, {"--lora_vision"});
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  std::unique_ptr<Child> device = StartDevice(folder, {"--lora_vision", "--uplink_precision=fp16"});
  const std::string log = WaitForDeviceLog("--uplink_precision=jpeg");
  EXPECT_THAT(log, HasSubstr("which learns from frames"));
  device->Signal(SIGTERM);
  EXPECT_EQ(device->Wait(absl::Seconds(60)), 0);
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

// The jpeg uplink between the real programs: the device sends frames, cdcca-cloud checks their
// size at ingest, recomputes the tokens with the pair's tower and trains; the device ends on
// the mirror's digest.
TEST_F(PairProgramsTest, FramesTravelAsJpegAndTheCloudRecomputesTheTokens) {
  nlohmann::json s;
  RunDeviceToFirstUpdate(Fixture("llava_clip_llama"), {"--uplink_precision=jpeg"}, &s);
  if (HasFatalFailure()) return;
  std::vector<nlohmann::json> jobs = UpdateJobs();
  ASSERT_FALSE(jobs.empty());
  EXPECT_GT(jobs[0].value("samples", 0), 0);
  EXPECT_THAT(ReadText(dir_.path() + "/cloud.log"),
              ::testing::Not(HasSubstr("sample_quarantined")));
  StopCloud();
  // What the cloud stored are frames with kept indices, not tokens.
  cloud::SampleStoreOptions so;
  so.dir = cloud_data_ + "/samples";
  auto store = cloud::SampleStore::Open(so);
  ASSERT_TRUE(store.ok()) << store.status();
  auto records = (*store)->Read("dev-a", 1, 4);
  ASSERT_TRUE(records.ok()) << records.status();
  ASSERT_FALSE(records->empty());
  for (const auto& r : *records) {
    auto samples = compress::DecodeUplinkBatch(r.batch().payload());
    ASSERT_TRUE(samples.ok()) << samples.status();
    for (const compress::UplinkSample& s : *samples) {
      EXPECT_TRUE(compress::ReadJpegSize(s.frame).ok());
      EXPECT_TRUE(s.features.empty());
      EXPECT_FALSE(s.kept_indices.empty());
    }
  }
}

// A cdcca family served by its folder alone (cdcca-cloud --checkpoint_dir) is the pair
// DIR/teacher, DIR: the device reads the same folder as any downloaded BLIP-2 checkpoint and
// uplinks frames, the cloud's teacher and mirror read every token of them, and the device
// ends on the mirror's digest.
TEST_F(PairProgramsTest, AFamilyRunsAsThePairItIsWithFramesUplinked) {
  nlohmann::json s;
  RunDeviceToFirstUpdate(std::string(CDCCA_SOURCE_DIR) + "/models/small",
                         {"--uplink_precision=jpeg"}, &s, /*teacher=*/"");
  if (HasFatalFailure()) return;
  std::vector<nlohmann::json> jobs = UpdateJobs();
  ASSERT_FALSE(jobs.empty());
  EXPECT_GT(jobs[0].value("samples", 0), 0);
  StopCloud();
}

TEST_F(PairProgramsTest, DeviceWithAnotherVisionTowerIsRefusedAtRegister) {
  const std::string folder = Fixture("llava_clip_llama");
  std::unique_ptr<Child> cloud = StartCloud(folder, folder);
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  std::unique_ptr<Child> device = StartDevice(Fixture("llava_siglip_qwen2"));
  const std::string log = WaitForDeviceLog("but the teacher reads tokens");
  EXPECT_THAT(log, HasSubstr("runs vision tower"));
  EXPECT_THAT(log, HasSubstr("a teacher-student pair must share one vision tower"));
  device->Signal(SIGTERM);
  EXPECT_EQ(device->Wait(absl::Seconds(60)), 0);
  const nlohmann::json status = DeviceStatus();
  ASSERT_TRUE(status.contains("acked")) << "the device wrote no status file";
  EXPECT_EQ(status["acked"].get<uint64_t>(), 0u);
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

// A device that adds LoRA on its projector (--lora_projector, the measured profile's on LLaVA)
// while the cloud's mirror does not (--profile=paper) would start from another state than the
// mirror: Register refuses it, naming the flag.
TEST_F(PairProgramsTest, DeviceWithLoraTheCloudLacksIsRefusedAtRegister) {
  const std::string folder = Fixture("llava_clip_llama");
  std::unique_ptr<Child> cloud = StartCloud(folder, folder, {"--profile=paper"});
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  std::unique_ptr<Child> device = StartDevice(folder, {"--lora_projector"});
  const std::string log = WaitForDeviceLog("--lora_projector");
  EXPECT_THAT(log, HasSubstr("does not match the cloud's student base"));
  EXPECT_THAT(log, HasSubstr("--lora_projector"));
  device->Signal(SIGTERM);
  EXPECT_EQ(device->Wait(absl::Seconds(60)), 0);
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

TEST_F(PairProgramsTest, PairWithDifferentTowersIsRefusedAtStart) {
  std::unique_ptr<Child> cloud =
      StartCloud(Fixture("llava_clip_llama"), Fixture("llava_siglip_qwen2"));
  EXPECT_EQ(cloud->Wait(absl::Minutes(2)), 1);
  EXPECT_THAT(ReadText(dir_.path() + "/cloud.log"), HasSubstr("different vision towers"));
}

TEST_F(PairProgramsTest, DifferentTokenizersTrainWithoutKlAndSaySo) {
  // The student: the teacher's folder with tokenizer.json written out again (same vocabulary,
  // other bytes), which counts as another tokenizer.
  const std::string teacher = Fixture("llava_clip_llama");
  const std::string student = dir_.path() + "/student";
  std::filesystem::copy(teacher, student, std::filesystem::copy_options::recursive);
  nlohmann::json tok = ReadJson(teacher + "/tokenizer.json");
  ASSERT_FALSE(tok.empty());
  std::ofstream(student + "/tokenizer.json", std::ios::trunc) << tok.dump(1);
  std::unique_ptr<Child> cloud = StartCloud(
      teacher, student,
      {"--distill_config=" + std::string(CDCCA_SOURCE_DIR) + "/configs/distill/akd.json"});
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  std::unique_ptr<Child> device = StartDevice(student);
  ASSERT_TRUE(WaitInSync(1, absl::Minutes(3)))
      << ReadText(DeviceDir() + "/device.log") << ReadText(dir_.path() + "/cloud.log");
  device->Signal(SIGTERM);
  EXPECT_EQ(device->Wait(absl::Seconds(60)), 0);
  std::vector<nlohmann::json> jobs = UpdateJobs();
  ASSERT_FALSE(jobs.empty());
  ASSERT_EQ(jobs[0]["notes"].size(), 1u) << jobs[0].dump();
  EXPECT_THAT(jobs[0]["notes"][0].get<std::string>(), HasSubstr("kl_off"));
  EXPECT_THAT(jobs[0]["notes"][0].get<std::string>(), HasSubstr("weight 0.5"));
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

// A question of `words` 4-token phrases ("is the car red" is 4 tokens of the fixtures'
// tokenizer), so about 4 x words tokens.
std::string LongQuestion(int words) {
  std::vector<std::string> parts(words, "is the car red");
  return absl::StrJoin(parts, " ");
}

// The honest mismatch: the pair's cloud takes questions of at most 256 tokens; the device's
// codec carries 512. A batch holding a 300-token question is refused for good and dropped
// (the batches behind it go through); a 600-token question is answered but never queued.
// Nothing is resent, and the device never exits.
TEST_F(PairProgramsTest, LongQuestionsAreAnsweredAndTheirRefusedBatchesDropped) {
  const std::string folder = Fixture("llava_clip_llama");
  const std::string prompts = dir_.path() + "/prompts";
  std::ofstream(prompts) << "what is shown?\nwhat color is it?\n"
                         << LongQuestion(75) << "\n"
                         << LongQuestion(150) << "\n";
  const std::string cloud_status = dir_.path() + "/cloud-status.json";
  cloud_ = StartCloud(
      folder, folder,
      {"--uts_keep_fraction=0.99", "--status_file=" + cloud_status, "--status_interval_s=0.5"});
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  std::unique_ptr<Child> device = StartDevice(folder, {"--prompts_file=" + prompts});
  ASSERT_TRUE(WaitUntil([&] { return DeviceStatus().value("dropped_batches", 0ull) >= 1; },
                        absl::Minutes(3)))
      << ReadText(DeviceDir() + "/device.log") << ReadText(dir_.path() + "/cloud.log");
  const uint64_t acked_at_drop = DeviceStatus().value("acked", 0ull);
  // Later batches go through, an update arrives, and the device stays in sync.
  ASSERT_TRUE(WaitUntil(
      [&] {
        nlohmann::json s = DeviceStatus();
        return s.value("acked", 0ull) >= acked_at_drop + 2 && s.value("version", 0ull) >= 1 &&
               s.value("in_sync", false) && s.value("unsent_samples", 0ull) >= 1;
      },
      absl::Minutes(3)))
      << DeviceStatus().dump() << ReadText(DeviceDir() + "/device.log");
  EXPECT_EQ(device->Wait(absl::ZeroDuration()), -1) << "the device exited";
  device->Signal(SIGTERM);
  ASSERT_EQ(device->Wait(absl::Seconds(60)), 0) << ReadText(DeviceDir() + "/device.log");
  const nlohmann::json s = DeviceStatus();
  const uint64_t dropped = s.value("dropped_batches", 0ull);
  EXPECT_EQ(
      s.value("dropped_batches_by_reason", nlohmann::json::object()).value("prompt_too_long", 0ull),
      dropped)
      << s.dump();
  EXPECT_EQ(s.value("failed_frames", -1), 0);
  const std::string log = ReadText(DeviceDir() + "/device.log");
  EXPECT_THAT(log, HasSubstr("uplink_batch_dropped"));
  EXPECT_THAT(log, HasSubstr("sample_not_uplinked"));
  // Each refused batch was refused once (dropped, never resent), the device's drops reached
  // the cloud, and both ends number the batches alike.
  const uint64_t acked = s.value("acked", 0ull);
  nlohmann::json cs;
  EXPECT_TRUE(WaitUntil(
      [&] {
        cs = ReadJson(cloud_status);
        return cs["devices"]["dev-a"].value("durable_sequence", 0ull) == acked &&
               cs["uplink_refused"].value("prompt_too_long", 0ull) == dropped;
      },
      absl::Seconds(30)))
      << "device: " << s.dump() << "\ncloud: " << cs.dump();
  EXPECT_EQ(cs["uplink_refused"].size(), 1u) << cs.dump();
  EXPECT_GE(cs["uplink_refusals"]["dev-a"]["dropped_by_device"].value("prompt_too_long", 0ull), 1u)
      << cs.dump();
  StopCloud();
}

// A --checkpoint_dir that is no model folder (a typo, or a family's parent folder) is refused
// before anything loads, saying what the folder must hold.
TEST(DeviceProgramTest, AFolderThatIsNoModelIsRefused) {
  TempDir dir;
  const std::string log = dir.path() + "/device.log";
  Child device({CDCCA_DEVICE_BINARY, "--checkpoint_dir=" + dir.path() + "/no-such-model",
                "--input=scenes:fog:4", "--frames=1"},
               log);
  EXPECT_EQ(device.Wait(absl::Minutes(1)), 1) << ReadText(log);
  EXPECT_THAT(ReadText(log), HasSubstr("is not a model folder"));
}

// `cdcca adapt-eval --checkpoint_dir DIR` reads a family as the pair it is (DIR/teacher, DIR): a
// family folder made of the BLIP-2 fixture (as student and as teacher) runs; the same folder
// without its teacher/ is refused naming the teacher's folder, and half a pair is refused.
TEST(AdaptEvalProgramTest, AFamilyIsReadAsThePairItIs) {
  TempDir dir;
  const std::string family = dir.path() + "/family";
  const std::string fixture =
      std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/blip2_llama";
  std::filesystem::copy(fixture, family, std::filesystem::copy_options::recursive);
  auto run = [&](const std::vector<std::string>& extra, const std::string& log) {
    std::vector<std::string> args = {
        CDCCA_TOOL_BINARY,
        "adapt-eval",
        "--shift=fog",
        "--severity=4",
        "--stream_scenes=2",
        "--test_scenes=1",
        "--max_steps=2",
        "--learners=pl",
        "--student_precision=fp32",
        "--distill_config=" + std::string(CDCCA_SOURCE_DIR) + "/configs/distill/akd.json"};
    args.insert(args.end(), extra.begin(), extra.end());
    Child child(args, log);
    return child.Wait(absl::Minutes(3));
  };
  const std::string log = dir.path() + "/no_teacher.log";
  EXPECT_EQ(run({"--checkpoint_dir=" + family}, log), 1) << ReadText(log);
  EXPECT_THAT(ReadText(log), HasSubstr(family + "/teacher"));
  std::filesystem::copy(fixture, family + "/teacher", std::filesystem::copy_options::recursive);
  const std::string ok_log = dir.path() + "/family.log";
  ASSERT_EQ(run({"--checkpoint_dir=" + family, "--out=" + dir.path() + "/report"}, ok_log), 0)
      << ReadText(ok_log);
  const nlohmann::json report = nlohmann::json::parse(ReadText(dir.path() + "/report.json"));
  ASSERT_TRUE(report.contains("rows")) << report.dump();
  EXPECT_FALSE(report["rows"].empty());
  const std::string half_log = dir.path() + "/half.log";
  EXPECT_EQ(run({"--teacher=" + family}, half_log), 2) << ReadText(half_log);
}

TEST(AdaptProgramTest, StageOneKeepsTheEntropyQuantileAndTheJobTrainsOnThoseFrames) {
  TempDir dir;
  const std::string fixtures = std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf";
  const std::string model = fixtures + "/models/llava_clip_llama";
  auto run = [&](const std::vector<std::string>& extra, const std::string& log) {
    std::vector<std::string> args = {CDCCA_TOOL_BINARY,
                                     "adapt",
                                     "--teacher=" + model,
                                     "--student_base=" + model,
                                     "--student_precision=fp32",
                                     "--images=" + fixtures + "/images",
                                     "--prompt=What is shown?",
                                     "--student_template=llava",
                                     "--max_steps=4",
                                     "--batch_size=2",
                                     "--max_answer_tokens=4",
                                     "--out=" + dir.path() + "/state"};
    args.insert(args.end(), extra.begin(), extra.end());
    Child child(args, log);
    return child.Wait(absl::Minutes(3));
  };
  const std::string log = dir.path() + "/adapt.log";
  ASSERT_EQ(run({"--uts_keep_fraction=0.5"}, log), 0) << ReadText(log);
  int kept = 0, passed = 0;
  nlohmann::json job;
  for (absl::string_view line : absl::StrSplit(ReadText(log), '\n', absl::SkipEmpty())) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) continue;
    if (j.value("event", "") == "frame") {
      (j.value("stage1", "") == "kept" ? kept : passed) += 1;
      // Stage 2 runs on kept frames only.
      EXPECT_EQ(j.contains("kept"), j.value("stage1", "") == "kept") << j.dump();
    }
    if (j.value("event", "") == "job") job = j;
  }
  // Six fixture images; the first frame of an empty window passes, then about half.
  EXPECT_EQ(kept + passed, 6);
  EXPECT_GE(kept, 2);
  EXPECT_GE(passed, 1);
  ASSERT_TRUE(job.is_object()) << ReadText(log);
  EXPECT_EQ(job.value("samples", -1), kept);

  // Two stage-1 rules at once, and a threshold no frame reaches, are refused.
  const std::string both = dir.path() + "/both.log";
  EXPECT_EQ(run({"--uts_keep_fraction=0.5", "--entropy_alpha=1"}, both), 2);
  EXPECT_THAT(ReadText(both), HasSubstr("two stage-1 rules"));
  const std::string none = dir.path() + "/none.log";
  EXPECT_EQ(run({"--entropy_alpha=1000"}, none), 1);
  EXPECT_THAT(ReadText(none), HasSubstr("kept none of the 6 frames"));
}

// adapt and adapt-eval take cdcca-cloud's and cdcca-device's names for the settings they
// share with them, list only their own flags, and refuse a flag that is not theirs (another
// sub-command's, or a near miss) naming it and the nearest of their own.
TEST(AdaptProgramTest, TakesTheProgramsNamesAndOnlyItsOwnFlags) {
  TempDir dir;
  for (const std::string command : {"adapt", "adapt-eval"}) {
    SCOPED_TRACE(command);
    const std::string help = dir.path() + "/" + command + "_help.txt";
    Child child({CDCCA_TOOL_BINARY, command, "--help"}, help + ".err", "", help);
    ASSERT_EQ(child.Wait(absl::Minutes(1)), 0) << ReadText(help + ".err");
    const std::string text = ReadText(help);
    for (const char* flag :
         {"--uts_mc_passes", "--uts_token_ratio", "--uts_keep_fraction", "--uts_dropout",
          "--max_steps", "--batch_size", "--lr", "--student_template", "--student_precision",
          "--distill_config", "--teacher_template", "--lora_rank"}) {
      EXPECT_THAT(text, HasSubstr(std::string("\n  ") + flag + "  ")) << flag;
    }
    for (const char* other : {"--keep_ratio", "--mc_passes", "--job_steps", "--learner_config",
                              "--precision", "--template", "--render_seed", "--torch_threads"}) {
      EXPECT_THAT(text, ::testing::Not(HasSubstr(std::string("\n  ") + other + "  "))) << other;
    }
    const std::string near_miss = dir.path() + "/" + command + "_near_miss.log";
    Child near({CDCCA_TOOL_BINARY, command, "--uts_passes=4"}, near_miss);
    EXPECT_EQ(near.Wait(absl::Minutes(1)), 1) << ReadText(near_miss);
    EXPECT_THAT(ReadText(near_miss), HasSubstr("'--uts_passes'"));
    EXPECT_THAT(ReadText(near_miss), HasSubstr("'--uts_mc_passes'"));  // the nearest of its own
    const std::string pretrains = dir.path() + "/" + command + "_pretrain_flag.log";
    Child other({CDCCA_TOOL_BINARY, command, "--torch_threads=1"}, pretrains);
    EXPECT_EQ(other.Wait(absl::Minutes(1)), 1) << ReadText(pretrains);
    EXPECT_THAT(ReadText(pretrains), HasSubstr("'--torch_threads'"));
  }
}

}  // namespace
}  // namespace cdcca
