// The two programs end to end: a real `cdcca-cloud` and real `cdcca-device` processes on
// loopback with a tiny family and a folder of shifted scenes.
//   1. Samples uplink, jobs run, both devices apply their updates, their digests equal the
//      cloud's, and answers continue throughout.
//   2. Faults (a planned crash, _exit(86) as kill -9 leaves a process, just before the
//      programs' Env writes a chosen file: storage/exit_at_env.h): the cloud dies during a
//      job (before and after its commit); a device dies after downloading and applying an
//      update in memory, before saving it; an update file is damaged on the cloud's disk.
//      Each ends consistent, with nothing acked lost.
//   3. The cloud's sample log loses its tail while the device has batches queued: the device
//      renumbers them and both ends agree on the sequence again.
//   4. --linger_s: the device drains its queue after its input (dropping what the cloud
//      refuses for good), or exits at the deadline saying what it left and why.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cloud/internal/record_log.h"
#include "cloud/sample_store.h"
#include "cloud/update_store.h"
#include "datasets/scene.h"
#include "datasets/shifts.h"
#include "datasets/test_images.h"
#include "datasets/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/arch/multimodal_model.h"
#include "model/runtime/threads.h"
#include "nlohmann/json.hpp"
#include "opencv2/imgcodecs.hpp"
#include "opencv2/imgproc.hpp"
#include "tests/testing/child_process.h"
#include "tests/testing/program_fixtures.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/wait.h"

namespace cdcca {
namespace {

using ::cdcca::testing::Child;
using ::cdcca::testing::LogEvents;
using ::cdcca::testing::ReadJson;
using ::cdcca::testing::ReadText;
using ::cdcca::testing::TempDir;
using ::cdcca::testing::WaitUntil;
using ::testing::HasSubstr;

class ProgramsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(11);
    checkpoint_ = dir_.path() + "/family";
    ASSERT_OK(testing::SaveRandomTinyFamily(checkpoint_));
    images_ = dir_.path() + "/images";
    ASSERT_OK(testing::WriteShiftedScenes(images_));
    std::ofstream(dir_.path() + "/tokens") << "dev-a token-aaaaaaaaaaaaaaaa\n"
                                           << "dev-b token-bbbbbbbbbbbbbbbb\n";
    cloud_data_ = dir_.path() + "/cloud";
  }

  // `exit_at`: where the process is to crash (storage/exit_at_env.h), "" = nowhere.
  std::unique_ptr<Child> StartCloud(const std::string& exit_at = "") {
    const std::string port_file = dir_.path() + "/port";
    ::unlink(port_file.c_str());
    // The guard by its small-pool rule only: on the random fixture the paired rule is a coin
    // flip (cluster_e2e_test.cc says why); it is tested in update_guard_test.
    std::vector<std::string> args = {CDCCA_CLOUD_BINARY,
                                     "--data_dir=" + cloud_data_,
                                     "--tokens=" + dir_.path() + "/tokens",
                                     "--insecure",
                                     absl::StrCat("--listen=127.0.0.1:", port_),
                                     "--port_file=" + port_file,
                                     "--checkpoint_dir=" + checkpoint_,
                                     "--student_precision=int8",
                                     "--trigger_samples=4",
                                     "--trigger_interval_s=3",
                                     "--max_steps=3",
                                     "--batch_size=4",
                                     "--torch_threads=1",
                                     "--blas_threads=1",
                                     "--bits_per_param=4",
                                     "--uts_keep_fraction=0.6",
                                     "--uts_mc_passes=2",
                                     "--status_file=" + dir_.path() + "/cloud-status.json",
                                     "--status_interval_s=0.5",
                                     "--guard_min_pool=1000000"};
    auto child = std::make_unique<Child>(args, dir_.path() + "/cloud.log", exit_at);
    if (port_ == 0) port_ = testing::WaitForPortFile(port_file, absl::Minutes(1));
    return child;
  }

  std::string DeviceDir(const std::string& id) const { return dir_.path() + "/" + id; }

  std::unique_ptr<Child> StartDevice(const std::string& id, const std::string& exit_at = "",
                                     const std::vector<std::string>& extra = {}) {
    std::filesystem::create_directories(DeviceDir(id));
    std::filesystem::remove(DeviceDir(id) + "/status.json");  // only this run's status counts
    std::vector<std::string> args = {CDCCA_DEVICE_BINARY,
                                     absl::StrCat("--cloud=127.0.0.1:", port_),
                                     "--insecure",
                                     "--device_id=" + id,
                                     "--token=token-" + std::string(16, id.back()),
                                     "--checkpoint_dir=" + checkpoint_,
                                     "--student_precision=int8",
                                     "--torch_threads=1",
                                     "--blas_threads=1",
                                     "--state_dir=" + DeviceDir(id) + "/state",
                                     "--input=" + images_,
                                     "--loop",
                                     "--fps=8",
                                     "--prompts_file=" + dir_.path() + "/prompts",
                                     "--output=" + DeviceDir(id) + "/answers.jsonl",
                                     "--uplink_batch_samples=2",
                                     "--uplink_max_age_s=1",
                                     "--poll_ms=300",
                                     "--max_attempts=2",
                                     "--status_file=" + DeviceDir(id) + "/status.json"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::ofstream(dir_.path() + "/prompts")
        << "what is in the picture?\nhow many items are there?\n";
    return std::make_unique<Child>(args, DeviceDir(id) + "/device.log", exit_at);
  }

  nlohmann::json DeviceStatus(const std::string& id) {
    return ReadJson(DeviceDir(id) + "/status.json");
  }

  // Waits until the device runs at least `version` and its last report matched the cloud.
  bool WaitInSync(const std::string& id, uint64_t version, absl::Duration timeout) {
    return testing::WaitStatusInSync(DeviceDir(id) + "/status.json", version, timeout);
  }

  // The digest the cloud recorded for `version` of `id` (hex), from its update store.
  std::string CloudDigest(const std::string& id, uint64_t version) {
    auto store = cloud::UpdateStore::Open({cloud_data_ + "/updates", 16});
    if (!store.ok()) return "no store";
    auto digest = (*store)->DigestOf(id, version);
    if (!digest.ok()) return digest.status().ToString();
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(*digest));
    return hex;
  }

  // Stops a device cleanly and checks its final state against the cloud's.
  void StopAndCheck(const std::string& id, Child& device) {
    device.Signal(SIGTERM);
    ASSERT_EQ(device.Wait(absl::Seconds(60)), 0) << ReadText(DeviceDir(id) + "/device.log");
    nlohmann::json s = DeviceStatus(id);
    const uint64_t version = s.value("version", 0ull);
    EXPECT_GE(version, 1u);
    EXPECT_EQ(s.value("digest", std::string()), CloudDigest(id, version)) << s.dump();
  }

  // Every batch the device saw acked is in the cloud's sample log.
  void CheckNothingAckedLost(const std::string& id) {
    cloud::SampleStoreOptions so;
    so.dir = cloud_data_ + "/samples";
    auto store = cloud::SampleStore::Open(so);
    ASSERT_OK(store.status());
    EXPECT_GE((*store)->HighestDurable(id), DeviceStatus(id).value("acked", 0ull));
  }

  // Answers in the device's JSONL, by model version.
  std::map<uint64_t, int> AnswersByVersion(const std::string& id, int64_t* frames) {
    std::map<uint64_t, int> out;
    std::ifstream in(DeviceDir(id) + "/answers.jsonl");
    *frames = 0;
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded()) continue;
      ++out[j.value("model_version", 0ull)];
      ++*frames;
    }
    return out;
  }

  TempDir dir_;
  std::string checkpoint_, images_, cloud_data_;
  int port_ = 0;
};

TEST_F(ProgramsTest, TwoDevicesUplinkApplyAndMatchTheCloud) {
  std::unique_ptr<Child> cloud = StartCloud();
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  std::unique_ptr<Child> a = StartDevice("dev-a");
  std::unique_ptr<Child> b = StartDevice("dev-b");
  ASSERT_TRUE(WaitInSync("dev-a", 1, absl::Minutes(3))) << ReadText(dir_.path() + "/cloud.log");
  ASSERT_TRUE(WaitInSync("dev-b", 1, absl::Minutes(3)))
      << ReadText(DeviceDir("dev-b") + "/device.log");
  // Both keep answering after the update.
  for (const std::string id : {"dev-a", "dev-b"}) {
    ASSERT_TRUE(WaitUntil(
        [&] {
          int64_t frames = 0;
          std::map<uint64_t, int> by_version = AnswersByVersion(id, &frames);
          return !by_version.empty() && by_version.rbegin()->first >= 1;
        },
        absl::Minutes(1)))
        << id << " answered nothing with its update";
  }
  StopAndCheck("dev-a", *a);
  StopAndCheck("dev-b", *b);
  for (const std::string id : {"dev-a", "dev-b"}) {
    int64_t frames = 0;
    std::map<uint64_t, int> by_version = AnswersByVersion(id, &frames);
    EXPECT_GT(by_version[0], 0) << id;          // answered before the first update
    EXPECT_GT(by_version.rbegin()->first, 0u);  // and after it, without a restart
    EXPECT_GT(by_version.rbegin()->second, 0);
    nlohmann::json s = DeviceStatus(id);
    EXPECT_EQ(s.value("answered", 0ll), frames);
    EXPECT_GT(s.value("acked", 0ull), 0u);
    EXPECT_GE(s.value("updates_applied", 0ull) + s.value("resyncs", 0ull), 1u);
    CheckNothingAckedLost(id);
  }
  nlohmann::json cs = ReadJson(dir_.path() + "/cloud-status.json");
  EXPECT_GE(cs.value("jobs_done", 0ull), 2u) << cs.dump();
  // Both programs run their BLAS on the one thread --blas_threads gave them, and say so (-1
  // where the BLAS is not OpenBLAS and cannot say).
  const int blas = model::BlasThreads() < 0 ? -1 : 1;
  const std::vector<nlohmann::json> serving = LogEvents(dir_.path() + "/cloud.log", "serving");
  const std::vector<nlohmann::json> start = LogEvents(DeviceDir("dev-a") + "/device.log", "start");
  ASSERT_FALSE(serving.empty());
  ASSERT_FALSE(start.empty());
  EXPECT_EQ(serving[0].value("blas_threads", 0), blas);
  EXPECT_EQ(start[0].value("blas_threads", 0), blas);
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

// `cdcca-device --rollback`: the device returns, together with the cloud, to its state
// before its newest update, as a new version whose digest on both ends is the older one's.
TEST_F(ProgramsTest, DeviceRollsBackToItsStateBeforeTheNewestUpdate) {
  std::unique_ptr<Child> cloud = StartCloud();
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  {
    std::unique_ptr<Child> a = StartDevice("dev-a");
    ASSERT_TRUE(WaitInSync("dev-a", 2, absl::Minutes(3))) << ReadText(dir_.path() + "/cloud.log");
    a->Signal(SIGTERM);
    ASSERT_EQ(a->Wait(absl::Seconds(60)), 0) << ReadText(DeviceDir("dev-a") + "/device.log");
  }
  // The cloud trains what the device left; then its mirror stays where it is. The status file
  // is rewritten every few seconds, so it counts only once it holds the device's last batch.
  const uint64_t acked = DeviceStatus("dev-a").value("acked", 0ull);
  ASSERT_GT(acked, 0u);
  uint64_t newest = 0;
  ASSERT_TRUE(WaitUntil(
      [&] {
        nlohmann::json d = ReadJson(dir_.path() + "/cloud-status.json")["devices"]["dev-a"];
        newest = d.value("mirror_version", 0ull);
        return d.value("durable_sequence", 0ull) >= acked &&
               d.value("consumed_sequence", 0ull) == d.value("durable_sequence", 1ull);
      },
      absl::Minutes(2)))
      << ReadText(dir_.path() + "/cloud.log");
  ASSERT_GE(newest, 2u);

  std::unique_ptr<Child> rolled = StartDevice("dev-a", "", {"--rollback", "--frames=2"});
  ASSERT_EQ(rolled->Wait(absl::Minutes(2)), 0) << ReadText(DeviceDir("dev-a") + "/device.log");
  const std::string log = ReadText(DeviceDir("dev-a") + "/device.log");
  EXPECT_THAT(log, HasSubstr(absl::StrCat("from version ", newest, " to the state of version ",
                                          newest - 1, " as version ", newest + 1)));
  EXPECT_EQ(CloudDigest("dev-a", newest + 1), CloudDigest("dev-a", newest - 1));
  nlohmann::json s = DeviceStatus("dev-a");
  EXPECT_EQ(s.value("rollbacks", 0ull), 1u) << s.dump();
  if (s.value("version", 0ull) == newest + 1) {  // no job on its two frames ran before it exited
    EXPECT_EQ(s.value("digest", std::string()), CloudDigest("dev-a", newest - 1)) << s.dump();
  }
  ASSERT_TRUE(WaitUntil(
      [&] {
        return ReadJson(dir_.path() + "/cloud-status.json")["devices"]["dev-a"].value("rollbacks",
                                                                                      0ull) == 1u;
      },
      absl::Seconds(30)));

  // On the pretrained base there is nothing to roll back: the program says so and fails.
  std::unique_ptr<Child> fresh = StartDevice("dev-b", "", {"--rollback", "--frames=1"});
  EXPECT_NE(fresh->Wait(absl::Minutes(2)), 0);
  EXPECT_THAT(ReadText(DeviceDir("dev-b") + "/device.log"), HasSubstr("nothing to roll back"));
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

// The teacher reads the tokens a device uplinks, so a device whose vision tower is
// not the teacher's is refused at Register, with both towers named, and sends nothing.
TEST_F(ProgramsTest, DeviceWithAnotherVisionTowerIsRefusedAtRegister) {
  // The same family, its vision tower's weights moved.
  const std::string other_dir = dir_.path() + "/family-other-tower";
  ASSERT_OK(testing::WriteTinyFamily(other_dir));
  ASSERT_OK(testing::PerturbWeights(other_dir, "vision_model.", 1.0, 0.5, 12));
  std::unique_ptr<Child> cloud = StartCloud();
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  const std::string cloud_dir = checkpoint_;
  checkpoint_ = other_dir;
  std::unique_ptr<Child> device = StartDevice("dev-a");
  checkpoint_ = cloud_dir;
  const std::string log = testing::WaitForText(DeviceDir("dev-a") + "/device.log",
                                               "but the teacher reads tokens", absl::Minutes(2));
  // The towers as the device and the cloud's teacher read them from their folders.
  ASSERT_OK_AND_ASSIGN(uint64_t device_tower, model::TowerFingerprint(other_dir));
  ASSERT_OK_AND_ASSIGN(uint64_t teacher_tower, model::TowerFingerprint(cloud_dir + "/teacher"));
  EXPECT_NE(device_tower, teacher_tower);
  EXPECT_THAT(log, HasSubstr(absl::StrFormat("runs vision tower %016x", device_tower)));
  EXPECT_THAT(log, HasSubstr(absl::StrFormat("tokens of tower %016x", teacher_tower)));
  device->Signal(SIGTERM);
  EXPECT_EQ(device->Wait(absl::Seconds(60)), 0);
  const nlohmann::json status = DeviceStatus("dev-a");
  ASSERT_TRUE(status.contains("acked")) << "the device wrote no status file";
  EXPECT_EQ(status["acked"].get<uint64_t>(), 0u);
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

// A cloud whose log lost its tail (here: the last record, torn) expects an earlier sequence
// than the device saw acked. The device, which queued batches while the cloud was away,
// renumbers them to continue where the cloud expects, and the two agree again.
TEST_F(ProgramsTest, ADeviceRenumbersItsQueueAfterTheCloudLostTheTailOfItsLog) {
  std::unique_ptr<Child> cloud = StartCloud();
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");
  std::unique_ptr<Child> a = StartDevice("dev-a");
  ASSERT_TRUE(
      WaitUntil([&] { return DeviceStatus("dev-a").value("acked", 0ull) >= 2; }, absl::Minutes(3)))
      << ReadText(DeviceDir("dev-a") + "/device.log");
  a->Signal(SIGTERM);
  ASSERT_EQ(a->Wait(absl::Seconds(60)), 0) << ReadText(DeviceDir("dev-a") + "/device.log");
  cloud->Signal(SIGTERM);
  ASSERT_EQ(cloud->Wait(absl::Seconds(60)), 0);
  const uint64_t acked = DeviceStatus("dev-a").value("acked", 0ull);
  {
    cloud::SampleStoreOptions so;
    so.dir = cloud_data_ + "/samples";
    ASSERT_OK_AND_ASSIGN(auto store, cloud::SampleStore::Open(so));
    ASSERT_EQ(store->HighestDurable("dev-a"), acked);
  }
  // The newest record (the device's last acked batch) loses its last byte: the segment ends
  // with that record's group commit's SYNC fragment, which goes with it.
  std::string newest;
  for (const auto& e : std::filesystem::directory_iterator(cloud_data_ + "/samples")) {
    const std::string name = e.path().string();
    if (absl::EndsWith(name, ".log") && name > newest) newest = name;
  }
  ASSERT_FALSE(newest.empty());
  std::filesystem::resize_file(
      newest, std::filesystem::file_size(newest) - cloud::internal::kSyncFragmentBytes - 1);

  // The device comes back first and queues while the cloud is away.
  a = StartDevice("dev-a");
  ASSERT_TRUE(WaitUntil([&] { return DeviceStatus("dev-a").value("waiting_batches", 0ull) >= 2; },
                        absl::Minutes(2)))
      << ReadText(DeviceDir("dev-a") + "/device.log");
  cloud = StartCloud();
  // Renumbered, and batches after the lost one acked under the cloud's numbering.
  ASSERT_TRUE(WaitUntil(
      [&] {
        nlohmann::json s = DeviceStatus("dev-a");
        return s.value("renumbered", 0ull) >= 1 && s.value("acked", 0ull) > acked;
      },
      absl::Minutes(2)))
      << ReadText(DeviceDir("dev-a") + "/device.log") << ReadText(dir_.path() + "/cloud.log");
  a->Signal(SIGTERM);
  ASSERT_EQ(a->Wait(absl::Seconds(60)), 0) << ReadText(DeviceDir("dev-a") + "/device.log");
  const uint64_t final_acked = DeviceStatus("dev-a").value("acked", 0ull);
  EXPECT_TRUE(WaitUntil(
      [&] {
        nlohmann::json cs = ReadJson(dir_.path() + "/cloud-status.json");
        return cs["devices"]["dev-a"].value("durable_sequence", 0ull) == final_acked;
      },
      absl::Seconds(30)))
      << "device acked " << final_acked
      << "; cloud: " << ReadText(dir_.path() + "/cloud-status.json");
  EXPECT_THAT(ReadText(dir_.path() + "/cloud.log"), HasSubstr("sample_log_torn_tail"));
  const std::string log = ReadText(DeviceDir("dev-a") + "/device.log");
  EXPECT_THAT(log, HasSubstr("uplink_renumbered"));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("uplink_refused")));
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

// The device's last "exit" line in its log (null when there is none).
nlohmann::json LastExitLine(const std::string& log_path) {
  nlohmann::json last;
  std::ifstream in(log_path);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.value("event", "") == "exit") last = std::move(j);
  }
  return last;
}

// Uplink batches waiting on the device's disk (UplinkQueue's batch files).
int QueuedBatchFiles(const std::string& queue_dir) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(queue_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, "batch-") && absl::EndsWith(name, ".pb")) ++n;
  }
  return n;
}

// --linger_s after the input ends: the device keeps uplinking until its durable queue is
// empty, dropping the batches the cloud refuses for good (questions past the model's 256
// tokens) rather than waiting on them, and exits on its own long before the deadline, saying
// so. With the cloud away it exits at the deadline saying how many batches it left on disk
// and why, and its next start sends them.
TEST_F(ProgramsTest, LingerDrainsTheQueueOrSaysWhatItLeftAndWhy) {
  const std::string long_prompts = dir_.path() + "/long-prompts";
  {
    std::ofstream out(long_prompts);
    out << "what is in the picture?\nhow many items are there?\n";
    for (int i = 0; i < 75; ++i) out << "is the car red ";
    out << "\n";
  }
  const std::string log = DeviceDir("dev-a") + "/device.log";
  const std::string queue = DeviceDir("dev-a") + "/state/queue";
  std::unique_ptr<Child> cloud = StartCloud();
  ASSERT_GT(port_, 0) << ReadText(dir_.path() + "/cloud.log");

  // 1. Cloud up: 16 frames, a third of them with a question the cloud refuses, then the
  // linger drains the queue.
  std::unique_ptr<Child> device =
      StartDevice("dev-a", "", {"--prompts_file=" + long_prompts, "--frames=16", "--linger_s=120"});
  ASSERT_EQ(device->Wait(absl::Minutes(3)), 0) << ReadText(log);
  nlohmann::json status = LastExitLine(log)["status"];
  ASSERT_TRUE(status.is_object()) << ReadText(log);
  EXPECT_EQ(status["linger"].value("ended", ""), "drained") << status.dump();
  EXPECT_EQ(status["linger"].value("waiting_batches", -1), 0) << status.dump();
  EXPECT_EQ(status.value("waiting_batches", -1), 0) << status.dump();
  EXPECT_EQ(QueuedBatchFiles(queue), 0);
  EXPECT_GE(status.value("dropped_batches", 0), 1) << status.dump();
  EXPECT_GE(status["dropped_batches_by_reason"].value("prompt_too_long", 0), 1) << status.dump();
  // Every batch queued went somewhere: stored by the cloud (which numbers only those) or
  // dropped as refused for good.
  EXPECT_EQ(status.value("queued_batches_total", 0),
            status.value("acked", 0) + status.value("dropped_batches", 0))
      << status.dump();
  const uint64_t acked = status.value("acked", 0ull);
  EXPECT_TRUE(WaitUntil(
      [&] {
        return ReadJson(dir_.path() + "/cloud-status.json")["devices"]["dev-a"].value(
                   "durable_sequence", 0ull) == acked;
      },
      absl::Seconds(30)))
      << "device acked " << acked << "; cloud: " << ReadText(dir_.path() + "/cloud-status.json");

  // 2. Cloud away: the device answers and queues, and the linger ends at its deadline with
  // the batches on disk, saying the link is down.
  cloud->Signal(SIGTERM);
  ASSERT_EQ(cloud->Wait(absl::Seconds(60)), 0);
  device = StartDevice("dev-a", "", {"--frames=8", "--linger_s=2", "--uts_keep_fraction=0.9"});
  ASSERT_EQ(device->Wait(absl::Minutes(3)), 0) << ReadText(log);
  status = LastExitLine(log)["status"];
  ASSERT_TRUE(status.is_object()) << ReadText(log);
  const int left = QueuedBatchFiles(queue);
  EXPECT_GT(left, 0) << status.dump();
  EXPECT_EQ(status["linger"].value("ended", ""), "deadline") << status.dump();
  EXPECT_EQ(status["linger"].value("waiting_batches", -1), left) << status.dump();
  EXPECT_EQ(status.value("waiting_batches", -1), left) << status.dump();
  EXPECT_THAT(status["linger"].value("why", ""), HasSubstr("link down")) << status.dump();

  // 3. The cloud back: the next start sends what the last one left.
  cloud = StartCloud();
  device = StartDevice("dev-a", "", {"--frames=1", "--linger_s=120"});
  ASSERT_EQ(device->Wait(absl::Minutes(3)), 0) << ReadText(log);
  status = LastExitLine(log)["status"];
  EXPECT_EQ(status["linger"].value("ended", ""), "drained") << status.dump();
  EXPECT_EQ(QueuedBatchFiles(queue), 0);
  EXPECT_GE(status.value("acked", 0ull), acked + left) << status.dump();
  cloud->Signal(SIGTERM);
  EXPECT_EQ(cloud->Wait(absl::Seconds(60)), 0);
}

TEST_F(ProgramsTest, CloudKilledDuringJobsRestartsConsistent) {
  // First start: dies in its first job, after training and before the commit (the first
  // write of the device's mirror state).
  std::unique_ptr<Child> cloud = StartCloud("dev-a.mirror");
  ASSERT_GT(port_, 0);
  std::unique_ptr<Child> a = StartDevice("dev-a");
  EXPECT_EQ(cloud->Wait(absl::Minutes(3)), 86) << ReadText(dir_.path() + "/cloud.log");
  // Second start: dies after committing a job's state, before publishing the update.
  cloud = StartCloud("/update-0");
  EXPECT_EQ(cloud->Wait(absl::Minutes(3)), 86) << ReadText(dir_.path() + "/cloud.log");
  // Third start: recovers (republishes the committed update) and carries on.
  cloud = StartCloud();
  ASSERT_TRUE(WaitInSync("dev-a", 1, absl::Minutes(3)))
      << ReadText(dir_.path() + "/cloud.log") << ReadText(DeviceDir("dev-a") + "/device.log");
  StopAndCheck("dev-a", *a);
  CheckNothingAckedLost("dev-a");
  int64_t frames = 0;
  AnswersByVersion("dev-a", &frames);
  EXPECT_EQ(DeviceStatus("dev-a").value("answered", 0ll),
            frames);  // served while the cloud was away
}

TEST_F(ProgramsTest, DeviceKilledDuringDownloadAndApplyRestartsConsistent) {
  std::unique_ptr<Child> cloud = StartCloud();
  ASSERT_GT(port_, 0);
  // Dies once an update is downloaded and applied in memory, before the state file is
  // written (opening its temp file) ...
  std::unique_ptr<Child> a = StartDevice("dev-a", "trainable.state");
  ASSERT_EQ(a->Wait(absl::Minutes(3)), 86) << ReadText(DeviceDir("dev-a") + "/device.log");
  // ... and, on the next start, with the temp file written, before it is renamed into place.
  a = StartDevice("dev-a", "trainable.state@2");
  ASSERT_EQ(a->Wait(absl::Minutes(3)), 86) << ReadText(DeviceDir("dev-a") + "/device.log");
  // Restarts on the last good state (the pretrained one), fetches the update again.
  a = StartDevice("dev-a");
  ASSERT_TRUE(WaitInSync("dev-a", 1, absl::Minutes(3)))
      << ReadText(DeviceDir("dev-a") + "/device.log");
  const std::string log = ReadText(DeviceDir("dev-a") + "/device.log");
  // Three starts, all on version 0: neither crash left a half-applied state behind.
  size_t starts = 0;
  for (size_t at = log.find("\"event\":\"start\""); at != std::string::npos;
       at = log.find("\"event\":\"start\"", at + 1)) {
    ++starts;
    EXPECT_NE(log.find("\"version\":0", at), std::string::npos);
  }
  EXPECT_EQ(starts, 3u);
  StopAndCheck("dev-a", *a);
  CheckNothingAckedLost("dev-a");
}

TEST_F(ProgramsTest, CorruptUpdateOnCloudDiskIsRepublished) {
  std::unique_ptr<Child> cloud = StartCloud();
  ASSERT_GT(port_, 0);
  std::unique_ptr<Child> a = StartDevice("dev-a", "trainable.state");
  ASSERT_EQ(a->Wait(absl::Minutes(3)), 86) << ReadText(DeviceDir("dev-a") + "/device.log");
  cloud->Kill();
  // Damage the newest update's payload bytes.
  const std::string dir = cloud_data_ + "/updates/dev-a";
  std::string newest;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("update-", 0) == 0 && name > newest) newest = name;
  }
  ASSERT_FALSE(newest.empty());
  {
    std::fstream f(dir + "/" + newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const std::streamoff size = f.tellg();
    f.seekp(size - 20);
    f.put('\x42');
    f.put('\x24');
  }
  cloud = StartCloud();
  a = StartDevice("dev-a");
  ASSERT_TRUE(WaitInSync("dev-a", 1, absl::Minutes(3)))
      << ReadText(dir_.path() + "/cloud.log") << ReadText(DeviceDir("dev-a") + "/device.log");
  StopAndCheck("dev-a", *a);
  CheckNothingAckedLost("dev-a");
}

}  // namespace
}  // namespace cdcca
