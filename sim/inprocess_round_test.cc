// One in-process round on tiny random Hugging Face pairs (sim/inprocess_round.h): the device's and
// the cloud's states agree bit for bit after the update, which changes the device's answers,
// and bad pairs are refused.
#include "sim/inprocess_round.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hub/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::sim {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

std::string Fixture(const std::string& name) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + name;
}

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// A teacher for `student`: its folder with every language-model matrix drawn afresh at the
// same scale (the tower, projector or Q-Former, norms and config untouched), so the pair
// shares the tower and the two LMs answer differently.
std::string MakeTeacher(const std::string& student, const std::string& dir) {
  std::filesystem::copy(student, dir, std::filesystem::copy_options::recursive);
  absl::StatusOr<model::SafetensorsContents> st =
      model::ReadSafetensors(student + "/model.safetensors");
  EXPECT_TRUE(st.ok()) << st.status();
  torch::manual_seed(7);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& [name, t] : st->tensors) {
    torch::Tensor v = t;
    if (absl::StartsWith(name, "language_model.") && t.dim() == 2) {
      v = torch::randn(t.sizes(), torch::kFloat) * t.to(torch::kFloat).std() * 1.5;
      v = v.to(t.scalar_type());
    }
    out.emplace_back(name, v);
  }
  EXPECT_TRUE(model::WriteSafetensors(dir + "/model.safetensors", out, st->metadata).ok());
  return dir;
}

// The fixture's first prompt as the student's ids, the image placeholder left for the model
// to expand: LLaVA keeps one placeholder, BLIP-2 none (its expansion prepends the queries).
torch::Tensor PromptIds(const std::string& fixture, bool keep_one_placeholder) {
  const nlohmann::json config = ReadJson(fixture + "/config.json");
  const int64_t image = config.value("image_token_index", config.value("image_token_id", -1));
  const nlohmann::json expected = ReadJson(fixture + "/expected.json");
  std::vector<int64_t> ids;
  bool placed = false;
  for (int64_t id : expected["cases"][0]["input_ids"].get<std::vector<int64_t>>()) {
    if (id == image) {
      if (keep_one_placeholder && !placed) ids.push_back(id);
      placed = true;
      continue;
    }
    ids.push_back(id);
  }
  return torch::tensor(ids, torch::kLong).unsqueeze(0);
}

InProcessRoundOptions TinyRound(const std::string& teacher, const std::string& student,
                                const torch::Tensor& prompts) {
  InProcessRoundOptions o;
  o.teacher_dir = teacher;
  o.student_dir = student;
  o.teacher_precision = "fp32";
  o.student_precision = "int8";
  o.frames = 8;
  o.prompt_ids = prompts;
  o.max_answer_tokens = 6;
  o.uts.keep_fraction = 0.5f;
  o.uts.token_ratio = 0.5f;
  o.uts.mc_passes = 4;
  o.uts.precision = compress::FeaturePrecision::kInt8;
  o.settings.job.max_steps = 30;
  o.settings.job.batch_size = 4;
  o.settings.job.max_answer_tokens = 6;
  o.settings.job.lr = 5e-3;
  o.adapters.lora_rank = 4;
  o.adapters.lora_alpha = 8;
  // A few thousand parameters: 2 bits each would not cover the records' headers.
  o.dwc.bits_per_param = 8.0;
  return o;
}

void ExpectWholeRound(const InProcessRoundOptions& o) {
  absl::StatusOr<InProcessRoundReport> r = RunHubRound(o);
  ASSERT_TRUE(r.ok()) << r.status();
  // Stage 1 keeps about half the frames (the first one always: an empty window).
  EXPECT_GE(r->kept_samples, 2);
  EXPECT_LE(r->kept_samples, 6);
  // Stage 2 keeps half of each kept frame's tokens.
  EXPECT_EQ(r->kept_tokens, r->kept_samples * ((r->visual_tokens + 1) / 2));
  EXPECT_GT(r->uplink_bytes, 0u);
  EXPECT_EQ(r->job.steps, 30);
  EXPECT_GT(r->dwc.payload_bytes, 0u);
  EXPECT_LE(r->dwc.bits_per_param, 8.0);
  // The device applied the cloud's bytes: both states moved, and to the same bits.
  EXPECT_EQ(r->device_digest_before, r->mirror_digest_before);
  EXPECT_EQ(r->device_digest_after, r->mirror_digest_after);
  EXPECT_NE(r->device_digest_after, r->device_digest_before);
  // The job learned (its CE on the teacher's answers fell) and the device's model answers
  // differently afterwards. (Whether it now agrees more with the teacher is not asserted: a
  // tiny random student cannot tell noise frames apart and learns the commonest tokens.)
  ASSERT_FALSE(r->job.terms.empty());
  for (const distill::LossTerm& t : r->job.terms) {
    if (t.name == "ce") EXPECT_LT(t.last, t.first);
  }
  EXPECT_GT(r->answers_changed, 0);
  // Every kept frame's answers are reported, and they are the ones the count above counts.
  ASSERT_EQ(r->answers.size(), static_cast<size_t>(r->kept_samples));
  int changed = 0;
  for (const InProcessRoundReport::FrameAnswers& a : r->answers) {
    EXPECT_FALSE(a.teacher.empty()) << "frame " << a.frame;
    changed += a.before != a.after;
  }
  EXPECT_EQ(changed, r->answers_changed);
}

TEST(InProcessRoundTest, LlavaRoundEndsWithTheDeviceAndTheMirrorEqual) {
  testing::TempDir tmp;
  const std::string student = Fixture("llava_clip_llama");
  const std::string teacher = MakeTeacher(student, tmp.file("teacher"));
  ExpectWholeRound(TinyRound(teacher, student, PromptIds(student, true)));
}

TEST(InProcessRoundTest, Blip2RoundEndsWithTheDeviceAndTheMirrorEqual) {
  testing::TempDir tmp;
  const std::string student = Fixture("blip2_llama");
  const std::string teacher = MakeTeacher(student, tmp.file("teacher"));
  ExpectWholeRound(TinyRound(teacher, student, PromptIds(student, false)));
}

TEST(InProcessRoundTest, RefusesAPairWithDifferentTowers) {
  const std::string student = Fixture("llava_clip_llama");
  InProcessRoundOptions o =
      TinyRound(Fixture("llava_siglip_qwen2"), student, PromptIds(student, true));
  EXPECT_THAT(RunHubRound(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("different vision towers")));
}

TEST(InProcessRoundTest, RefusesARoundWithoutFramesOrPrompts) {
  const std::string student = Fixture("llava_clip_llama");
  InProcessRoundOptions o = TinyRound(student, student, PromptIds(student, true));
  o.frames = 0;
  EXPECT_THAT(RunHubRound(o).status(), StatusIs(absl::StatusCode::kInvalidArgument));
  o.frames = 2;
  o.prompt_ids = torch::Tensor();
  EXPECT_THAT(RunHubRound(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prompt_ids")));
}

}  // namespace
}  // namespace cdcca::sim
