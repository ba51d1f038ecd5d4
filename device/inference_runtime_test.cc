// InferenceRuntime on the `tiny` family (random weights) read as its BLIP-2 folder: answers,
// UTS stage-2 scores,
// in-place updates that readers never see half-applied, and state round trips.
#include "device/inference_runtime.h"

#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "absl/strings/match.h"
#include "compress/delta_encoder.h"
#include "compress/named_tensors.h"
#include "datasets/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/hub/safetensors.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_family.h"

namespace cdcca::device {
namespace {

using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;

class InferenceRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(5);
    ASSERT_OK(testing::WriteTinyFamily(dir_.path()));
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
  std::unique_ptr<InferenceRuntime> runtime_;
};

// A family's folder is read as the BLIP-2 folder it is, as any downloaded checkpoint: frames
// can be sent, and the trainable set is the checkpoint's adapters under transformers' names.
// A folder that is no model folder is refused with a clear error.
TEST_F(InferenceRuntimeTest, AFamilyIsReadAsTheBlip2FolderItIs) {
  EXPECT_TRUE(runtime_->CanSendFrames());
  ASSERT_OK_AND_ASSIGN(std::string state, runtime_->SaveTrainableState());
  ASSERT_OK_AND_ASSIGN(model::SafetensorsContents decoded, model::DecodeSafetensors(state));
  bool lora = false, query_tokens = false;
  for (const auto& [name, t] : decoded.tensors) {
    lora = lora || absl::StrContains(name, "q_proj.lora_a");
    query_tokens = query_tokens || name == "query_tokens";
  }
  EXPECT_TRUE(lora);
  EXPECT_TRUE(query_tokens);
  RuntimeOptions options;
  options.checkpoint_dir = dir_.path() + "/no-such-folder";
  EXPECT_THAT(InferenceRuntime::Load(options), StatusIs(absl::StatusCode::kInvalidArgument));
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
    EXPECT_EQ(batch[i].visual.tokens, testing::kTinyFamilyTokens);
    EXPECT_EQ(batch[i].visual.values.size(),
              static_cast<size_t>(batch[i].visual.tokens * batch[i].visual.dim));
    EXPECT_GT(batch[i].latency_ms, 0.0);
  }
  EXPECT_THAT(runtime_->Answer({Frame{}}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST_F(InferenceRuntimeTest, TokenScoresVaryWithDropoutAndDependOnTheSeedAlone) {
  ASSERT_OK_AND_ASSIGN(auto answers, runtime_->Answer({MakeFrame(4, "what is the item ?")}));
  const VisualTokens& v = answers[0].visual;
  // VIS with dropout: every token's representation varies.
  ASSERT_OK_AND_ASSIGN(std::vector<float> vis,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kVis, 11));
  ASSERT_EQ(vis.size(), static_cast<size_t>(v.tokens));
  EXPECT_GT(*std::min_element(vis.begin(), vis.end()), 0.0f);
  ASSERT_OK_AND_ASSIGN(std::vector<float> again,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kVis, 11));
  EXPECT_EQ(again, vis);
  ASSERT_OK_AND_ASSIGN(std::vector<float> other,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kVis, 12));
  EXPECT_NE(other, vis);
  ASSERT_OK_AND_ASSIGN(std::vector<float> mass,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kAttentionVariance, 11));
  EXPECT_GT(*std::max_element(mass.begin(), mass.end()), 0.0f);
  EXPECT_THAT(runtime_->TokenScores(v, 8, 0.0f, TokenScore::kVis),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(runtime_->TokenScores(v, 8, 0.3f, TokenScore::kAttentionCv),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  VisualTokens broken = v;
  broken.values.pop_back();
  EXPECT_THAT(runtime_->TokenScores(broken, 8, 0.1f, TokenScore::kVis),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The token probe is the project's own, trained on the benchmark's labels; no model folder
// has one: probe_entropy is refused with a clear error, and variance_probe falls back to the
// attention variance (the same scores under the same seed).
TEST_F(InferenceRuntimeTest, ProbeScoresAreRefusedOrFallBack) {
  ASSERT_OK_AND_ASSIGN(auto answers, runtime_->Answer({MakeFrame(4, "what is the item ?")}));
  const VisualTokens& v = answers[0].visual;
  EXPECT_THAT(runtime_->TokenScores(v, 8, 0.1f, TokenScore::kProbeEntropy),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(UtsOptions().score, TokenScore::kVis);
  EXPECT_EQ(runtime_->EffectiveScore(TokenScore::kVis), TokenScore::kVis);
  EXPECT_EQ(runtime_->EffectiveScore(TokenScore::kVarianceProbe), TokenScore::kAttentionVariance);
  ASSERT_OK_AND_ASSIGN(std::vector<float> fallback,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kVarianceProbe, 5));
  ASSERT_OK_AND_ASSIGN(std::vector<float> variance,
                       runtime_->TokenScores(v, 8, 0.3f, TokenScore::kAttentionVariance, 5));
  EXPECT_EQ(fallback, variance);
  EXPECT_GT(*std::max_element(variance.begin(), variance.end()), 0.0f);
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
