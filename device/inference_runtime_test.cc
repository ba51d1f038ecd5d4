// InferenceRuntime on the `tiny` family with random weights: batching, UTS stage-2 scores,
// in-place updates that readers never see half-applied, and state round trips.
#include "device/inference_runtime.h"

#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "compress/delta_encoder.h"
#include "compress/named_tensors.h"
#include "datasets/domain.h"
#include "datasets/fashion_mnist.h"
#include "datasets/shifts.h"
#include "datasets/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/family/checkpoint.h"
#include "model/family/trainable.h"
#include "model/hub/safetensors.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::device {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;
namespace ds = ::cdcca::datasets;

class InferenceRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(5);
    auto family =
        model::LoadFamilyConfig(std::string(CDCCA_SOURCE_DIR) + "/configs/models/tiny.json");
    ASSERT_OK(family);
    family_ = *family;
    model::VisionEncoder encoder(family_.vision);
    model::Blip2Tower teacher(family_.teacher), student(family_.student);
    ASSERT_OK(model::SaveFamily(dir_.path(), family_, encoder, teacher, student, "",
                                datasets::Tokenizer::SceneLanguage().tokens()));
    RuntimeOptions options;
    options.checkpoint_dir = dir_.path();
    options.precision = "fp32";
    options.threads = 1;
    ASSERT_OK_AND_ASSIGN(runtime_, InferenceRuntime::Load(options));
  }

  static Frame MakeFrame(int seed, const std::string& question) {
    Frame f;
    f.image = datasets::Image(64, 64);
    for (size_t i = 0; i < f.image.pixels.size(); ++i) {
      f.image.pixels[i] = static_cast<uint8_t>((i * 131 + seed * 977) % 251);
    }
    f.question = question;
    return f;
  }

  // The runtime's trainable set, perturbed, as a DWC payload from its current version.
  std::string MakeUpdate(uint64_t base, float scale, compress::NamedTensors* target) {
    compress::NamedTensors mirror;
    RuntimeOptions o;
    auto state = runtime_->SaveTrainableState();
    EXPECT_OK(state);
    auto decoded = model::DecodeSafetensors(*state);
    EXPECT_OK(decoded);
    for (auto& [name, t] : decoded->tensors) mirror.emplace_back(name, t.clone());
    target->clear();
    for (auto& [name, t] : mirror) target->emplace_back(name, t + scale * torch::randn_like(t));
    compress::DeltaEncoderOptions eo;
    eo.bits_per_param = 0;  // no cap: the test wants an exact-ish update
    eo.allowed_bits = {0, 8};
    compress::DeltaEncoder encoder(eo);
    auto payload = encoder.Encode(*target, mirror, base, base + 1);
    EXPECT_OK(payload);
    // The target the device reaches is the mirror plus the decoded payload.
    EXPECT_OK(compress::ApplyUpdate(payload->bytes, base, mirror));
    *target = mirror;
    return payload->bytes;
  }

  TempDir dir_;
  model::FamilyConfig family_;
  std::unique_ptr<InferenceRuntime> runtime_;
};

// family_as_hub reads the family's student folder as any downloaded BLIP-2 checkpoint: the
// Hugging Face path (frames can be sent, the trainable set is the Hub adapters' under the
// checkpoint's names, not the family's), and it answers.
TEST_F(InferenceRuntimeTest, AFamilyReadAsAHubFolderTakesTheHubPath) {
  EXPECT_FALSE(runtime_->CanSendFrames());
  RuntimeOptions options;
  options.checkpoint_dir = dir_.path();
  options.precision = "fp32";
  options.threads = 1;
  options.family_as_hub = true;
  absl::StatusOr<std::unique_ptr<InferenceRuntime>> hub = InferenceRuntime::Load(options);
  if (absl::IsUnimplemented(hub.status())) GTEST_SKIP() << "built without Hugging Face support";
  ASSERT_OK(hub);
  EXPECT_TRUE((*hub)->CanSendFrames());
  auto names = [](const InferenceRuntime& r) {
    std::vector<std::string> out;
    absl::StatusOr<std::string> state = r.SaveTrainableState();
    EXPECT_OK(state);
    absl::StatusOr<model::SafetensorsContents> decoded = model::DecodeSafetensors(*state);
    EXPECT_OK(decoded);
    for (const auto& [name, t] : decoded->tensors) out.push_back(name);
    return out;
  };
  const std::vector<std::string> family_names = names(*runtime_), hub_names = names(**hub);
  ASSERT_FALSE(hub_names.empty());
  EXPECT_NE(hub_names, family_names);
  ASSERT_OK_AND_ASSIGN(std::vector<AnswerResult> answers,
                       (*hub)->Answer({MakeFrame(1, "what is the item ?")}));
  ASSERT_EQ(answers.size(), 1u);
}

TEST_F(InferenceRuntimeTest, BatchedAnswersEqualOneByOne) {
  std::vector<Frame> frames = {MakeFrame(1, "what is the item ?"),
                               MakeFrame(2, "how many items are there ?"),
                               MakeFrame(3, "what color is the bag ?")};
  ASSERT_OK_AND_ASSIGN(std::vector<AnswerResult> batch, runtime_->Answer(frames));
  ASSERT_EQ(batch.size(), 3u);
  for (size_t i = 0; i < frames.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(std::vector<AnswerResult> one, runtime_->Answer({frames[i]}));
    EXPECT_EQ(one[0].answer_ids, batch[i].answer_ids) << i;
    EXPECT_NEAR(one[0].entropy, batch[i].entropy, 1e-4) << i;
    EXPECT_GE(batch[i].entropy, 0.0f);
    EXPECT_EQ(batch[i].visual.tokens, family_.vision.NumTokens());
    EXPECT_EQ(batch[i].visual.values.size(),
              static_cast<size_t>(batch[i].visual.tokens * batch[i].visual.dim));
    EXPECT_GT(batch[i].latency_ms, 0.0);
  }
  EXPECT_THAT(runtime_->Answer({Frame{}}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(InferenceRuntimeTest, TokenScoresAreZeroWithoutDropoutAndVaryWithIt) {
  ASSERT_OK_AND_ASSIGN(auto answers, runtime_->Answer({MakeFrame(4, "what is the item ?")}));
  const VisualTokens& v = answers[0].visual;
  for (TokenScore kind : {TokenScore::kVis, TokenScore::kAttentionVariance}) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> still, runtime_->TokenScores(v, 8, 0.0f, kind));
    ASSERT_EQ(still.size(), static_cast<size_t>(v.tokens));
    for (float s : still) EXPECT_EQ(s, 0.0f) << TokenScoreName(kind);
  }
  // VIS with dropout: every token's representation varies.
  ASSERT_OK_AND_ASSIGN(std::vector<float> vis, runtime_->TokenScores(v, 8, 0.3f, TokenScore::kVis));
  ASSERT_EQ(vis.size(), static_cast<size_t>(v.tokens));
  EXPECT_GT(*std::min_element(vis.begin(), vis.end()), 0.0f);
  ASSERT_OK_AND_ASSIGN(std::vector<float> noisy,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kAttentionCv));
  float max_score = 0;
  for (float s : noisy) {
    EXPECT_GE(s, 0.0f);
    max_score = std::max(max_score, s);
  }
  EXPECT_GT(max_score, 0.0f);
  VisualTokens broken = v;
  broken.values.pop_back();
  EXPECT_THAT(runtime_->TokenScores(broken, 8, 0.1f, TokenScore::kAttentionCv),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The tiny test family has no token probe: probe_entropy is refused with a clear error, and
// variance_probe falls back to the attention variance (the same scores under the
// same seed).
TEST_F(InferenceRuntimeTest, ProbeScoresWithoutTheProbeFile) {
  ASSERT_OK_AND_ASSIGN(auto answers, runtime_->Answer({MakeFrame(4, "what is the item ?")}));
  const VisualTokens& v = answers[0].visual;
  EXPECT_FALSE(runtime_->has_probe());
  EXPECT_THAT(runtime_->TokenScores(v, 8, 0.1f, TokenScore::kProbeEntropy),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(UtsOptions().score, TokenScore::kVis);
  EXPECT_EQ(runtime_->EffectiveScore(TokenScore::kVis), TokenScore::kVis);
  EXPECT_EQ(runtime_->EffectiveScore(TokenScore::kVarianceProbe), TokenScore::kAttentionVariance);
  EXPECT_EQ(runtime_->EffectiveScore(TokenScore::kAttentionCv), TokenScore::kAttentionCv);
  torch::manual_seed(5);
  ASSERT_OK_AND_ASSIGN(std::vector<float> fallback,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kVarianceProbe));
  torch::manual_seed(5);
  ASSERT_OK_AND_ASSIGN(std::vector<float> variance,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kAttentionVariance));
  EXPECT_EQ(fallback, variance);
  EXPECT_GT(*std::max_element(variance.begin(), variance.end()), 0.0f);
}

ds::Image SpliceHalf(const ds::Image& clean, const ds::Image& corrupted, bool left) {
  ds::Image out = clean;
  for (int y = 0; y < clean.height; ++y) {
    for (int x = 0; x < clean.width; ++x) {
      if ((x < clean.width / 2) == left) std::copy_n(corrupted.at(x, y), 3, out.at(x, y));
    }
  }
  return out;
}

std::unique_ptr<InferenceRuntime> LoadSmallFamily() {
  RuntimeOptions options;
  options.checkpoint_dir = std::string(CDCCA_SOURCE_DIR) + "/models/small";
  options.precision = "int8";
  options.threads = 1;
  absl::StatusOr<std::unique_ptr<InferenceRuntime>> runtime = InferenceRuntime::Load(options);
  EXPECT_OK(runtime.status());
  return runtime.ok() ? std::move(*runtime) : nullptr;
}

// variance_probe on a family with a probe is the attention variance (the same dropout draws
// under the same seed: the probe part draws nothing) times the cube of the probe's entropy
// without dropout.
TEST(VisOnTheSmallFamilyTest, VarianceProbeIsTheProductOfItsTwoScores) {
  std::unique_ptr<InferenceRuntime> runtime = LoadSmallFamily();
  ASSERT_NE(runtime, nullptr);
  ASSERT_TRUE(runtime->has_probe());
  EXPECT_EQ(runtime->EffectiveScore(TokenScore::kVarianceProbe), TokenScore::kVarianceProbe);
  Frame frame;
  frame.image = ds::Image(64, 64);
  for (size_t i = 0; i < frame.image.pixels.size(); ++i)
    frame.image.pixels[i] = static_cast<uint8_t>(i * 37 % 251);
  frame.question = "what is the item ?";
  ASSERT_OK_AND_ASSIGN(auto answers, runtime->Answer({frame}));
  const VisualTokens& v = answers[0].visual;
  torch::manual_seed(9);
  ASSERT_OK_AND_ASSIGN(std::vector<float> product,
                       runtime->TokenScores(v, 8, 0.1f, TokenScore::kVarianceProbe));
  torch::manual_seed(9);
  ASSERT_OK_AND_ASSIGN(std::vector<float> variance,
                       runtime->TokenScores(v, 8, 0.1f, TokenScore::kAttentionVariance));
  ASSERT_OK_AND_ASSIGN(std::vector<float> entropy,
                       runtime->TokenScores(v, 8, 0.0f, TokenScore::kProbeEntropy));
  ASSERT_EQ(product.size(), variance.size());
  int differ_from_variance = 0;
  for (size_t i = 0; i < product.size(); ++i) {
    const float expected = variance[i] * entropy[i] * entropy[i] * entropy[i];
    EXPECT_NEAR(product[i], expected, 1e-5f * std::abs(expected) + 1e-12f) << i;
    differ_from_variance += std::abs(product[i] - variance[i]) > 1e-6f * variance[i] ? 1 : 0;
  }
  EXPECT_GT(differ_from_variance, 0);
}

// Where kept tokens fall on the committed `small` family: frames whose one half is corrupted
// (each image shift at severity 4, the other half clean) keep most of their top-50 % tokens
// in the corrupted half under `variance_probe` (an ablation: its token probe was trained on
// the benchmark's labels). With the BLIP-2 family's ViT (every patch token attends to the
// whole frame) this holds over the eight shifts together (1,319 of 2,265 kept patch tokens,
// 58 %) but not for each: contrast, motion blur and jpeg sit at 48-51 %. VIS, the default,
// keeps 52 % there (docs/BENCHMARKS.md, "Device runtime and UTS"), so this is not asserted
// of it.
TEST(VisOnTheSmallFamilyTest, KeptTokensFallMostlyInTheCorruptedHalf) {
  absl::StatusOr<ds::ImageSet> images = ds::LoadFashionMnist(ds::Split::kTest);
  if (!images.ok()) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  std::unique_ptr<InferenceRuntime> runtime = LoadSmallFamily();
  ASSERT_NE(runtime, nullptr);
  ASSERT_OK_AND_ASSIGN(
      ds::SampleGenerator source,
      ds::SampleGenerator::Create(&*images, ds::StudentSourceDomain(ds::Split::kTest), 17));
  torch::manual_seed(1);
  const UtsOptions defaults;
  int all_in_corrupted = 0, all_kept = 0, kept_per_frame = 0;
  for (ds::ImageShift shift : ds::AllImageShifts()) {
    SCOPED_TRACE(std::string(ds::ImageShiftName(shift)));
    int in_corrupted = 0, kept = 0;
    for (int i = 0; i < 32; ++i) {
      ds::Sample sample = source.Generate(static_cast<uint64_t>(i));
      ds::Image corrupted = sample.image;
      ASSERT_OK(ds::ApplyShift(shift, 4, 100 + i, corrupted));
      const bool left = i % 2 == 0;
      ASSERT_OK_AND_ASSIGN(auto answers,
                           runtime->Answer({{SpliceHalf(sample.image, corrupted, left),
                                             sample.questions.front().question}}));
      const VisualTokens& v = answers[0].visual;
      ASSERT_OK_AND_ASSIGN(std::vector<float> scores,
                           runtime->TokenScores(v, defaults.mc_passes, defaults.dropout_p,
                                                TokenScore::kVarianceProbe));
      // The class token, then the grid x grid patches row by row.
      const int grid = static_cast<int>(std::lround(std::sqrt(v.tokens - 1)));
      ASSERT_EQ(v.tokens, 1 + grid * grid);
      ASSERT_EQ(grid % 2, 0);
      const std::vector<uint16_t> selected = SelectTokens(scores, {}, 0.5f, 0);
      ASSERT_EQ(selected.size(), static_cast<size_t>((v.tokens + 1) / 2));  // rounded up
      kept_per_frame = static_cast<int>(selected.size()) - 1;
      for (uint16_t t : selected) {
        if (t == 0) continue;  // the class token sees both halves
        const int patch = t - 1;
        in_corrupted += ((patch % grid) < grid / 2) == left ? 1 : 0;
        ++kept;
      }
    }
    ASSERT_GE(kept, 32 * kept_per_frame);
    std::printf("%s: %d of %d kept patch tokens in the corrupted half\n",
                std::string(ds::ImageShiftName(shift)).c_str(), in_corrupted, kept);
    all_in_corrupted += in_corrupted;
    all_kept += kept;
  }
  EXPECT_GT(all_in_corrupted, all_kept * 0.53) << all_in_corrupted << " of " << all_kept;
}

TEST_F(InferenceRuntimeTest, UpdatesApplyInPlaceAndBadOnesChangeNothing) {
  compress::NamedTensors target;
  const std::string payload = MakeUpdate(0, 0.01f, &target);
  const uint64_t before = runtime_->StateDigest();
  std::string corrupt = payload;
  corrupt[corrupt.size() / 2] ^= 0x40;
  EXPECT_FALSE(runtime_->ApplyUpdate(corrupt).ok());
  EXPECT_EQ(runtime_->StateDigest(), before);
  EXPECT_EQ(runtime_->version(), 0u);
  ASSERT_OK(runtime_->ApplyUpdate(payload));
  EXPECT_EQ(runtime_->version(), 1u);
  EXPECT_EQ(runtime_->StateDigest(), compress::StateDigest(target));
  // The same payload again no longer applies: its base is version 0.
  EXPECT_THAT(runtime_->ApplyUpdate(payload), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(InferenceRuntimeTest, ReadersNeverSeeAHalfAppliedUpdate) {
  std::vector<std::string> payloads;
  std::vector<uint64_t> digests = {runtime_->StateDigest()};
  {
    // Build a chain of updates on a scratch runtime, recording the digest after each.
    RuntimeOptions options;
    options.checkpoint_dir = dir_.path();
    options.precision = "fp32";
    options.threads = 1;
    ASSERT_OK_AND_ASSIGN(auto scratch, InferenceRuntime::Load(options));
    std::swap(scratch, runtime_);
    for (uint64_t v = 0; v < 6; ++v) {
      compress::NamedTensors target;
      payloads.push_back(MakeUpdate(v, 0.02f, &target));
      ASSERT_OK(runtime_->ApplyUpdate(payloads.back()));
      digests.push_back(runtime_->StateDigest());
    }
    std::swap(scratch, runtime_);
  }
  std::atomic<bool> done{false};
  std::atomic<int> torn{0}, reads{0};
  std::thread reader([&] {
    while (!done.load()) {
      const uint64_t d = runtime_->StateDigest();
      if (std::find(digests.begin(), digests.end(), d) == digests.end()) ++torn;
      ++reads;
      auto answers = runtime_->Answer({MakeFrame(9, "what is the item ?")});
      if (!answers.ok()) ++torn;
    }
  });
  // Interleave: each update lands only after the reader has read again, so reads and
  // writes overlap however the threads are scheduled.
  for (size_t i = 0; i < payloads.size(); ++i) {
    while (reads.load() <= static_cast<int>(i)) std::this_thread::yield();
    EXPECT_OK(runtime_->ApplyUpdate(payloads[i]));  // no ASSERT: the reader must be joined
  }
  done = true;
  reader.join();
  EXPECT_EQ(torn.load(), 0);
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(runtime_->StateDigest(), digests.back());
}

TEST_F(InferenceRuntimeTest, TrainableStateRoundTripsAndIsValidated) {
  compress::NamedTensors target;
  ASSERT_OK(runtime_->ApplyUpdate(MakeUpdate(0, 0.05f, &target)));
  ASSERT_OK_AND_ASSIGN(std::string saved, runtime_->SaveTrainableState());
  const uint64_t digest = runtime_->StateDigest();
  RuntimeOptions options;
  options.checkpoint_dir = dir_.path();
  options.precision = "fp32";
  ASSERT_OK_AND_ASSIGN(auto fresh, InferenceRuntime::Load(options));
  EXPECT_NE(fresh->StateDigest(), digest);
  ASSERT_OK(fresh->LoadTrainableState(saved, 1));
  EXPECT_EQ(fresh->StateDigest(), digest);
  EXPECT_EQ(fresh->version(), 1u);
  EXPECT_FALSE(fresh->LoadTrainableState(saved.substr(0, saved.size() / 2), 2).ok());
  EXPECT_EQ(fresh->StateDigest(), digest);
}

}  // namespace
}  // namespace cdcca::device
