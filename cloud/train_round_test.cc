// The round's cloud step (cloud/train_round.h) on small tensors: what TrainRound makes of each
// learner outcome, and that the new version is what a device gets by applying the update.
#include "cloud/train_round.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>

#include "compress/delta_encoder.h"
#include "compress/named_tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cdcca::cloud {
namespace {

compress::NamedTensors Mirror() {
  torch::manual_seed(7);
  return {{"a.weight", torch::randn({64, 32})}, {"b.bias", torch::randn({48})}};
}

compress::NamedTensors Moved(const compress::NamedTensors& mirror, float by) {
  compress::NamedTensors out;
  for (const auto& [name, t] : mirror) out.emplace_back(name, t + by * torch::randn_like(t));
  return out;
}

TEST(EncodeVersionTest, TheNewStateIsTheMirrorWithTheUpdateApplied) {
  const compress::NamedTensors mirror = Mirror();
  const compress::NamedTensors trained = Moved(mirror, 0.1f);
  const compress::DeltaEncoder encoder;
  absl::StatusOr<NewVersion> next = EncodeVersion(trained, mirror, 3, encoder);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->base_version, 3u);
  EXPECT_EQ(next->version, 4u);
  // A device at version 3 applies the bytes to its own copy and lands on the same state.
  compress::NamedTensors device = compress::Fp32Clones(mirror);
  absl::StatusOr<uint64_t> applied = compress::ApplyUpdate(next->update.bytes, 3, device);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(compress::StateDigest(device), next->digest);
  EXPECT_EQ(compress::StateDigest(next->state), next->digest);
  EXPECT_FALSE(next->snapshot.empty());
  // The mirror itself is not touched, and the update moved the state towards the trained set.
  EXPECT_TRUE(torch::equal(mirror[0].second, Mirror()[0].second));
  EXPECT_LT((next->state[0].second - trained[0].second).norm().item<float>(),
            (mirror[0].second - trained[0].second).norm().item<float>());
  EXPECT_EQ(next->budget_raised_to, 0u);
  // What the update left out is carried in the residual (error feedback).
  EXPECT_NE(next->residual, encoder.SerializeState());
}

TEST(EncodeVersionTest, ABudgetBelowTheSmallestPayloadIsRaisedAndSaid) {
  const compress::NamedTensors mirror = Mirror();
  compress::DeltaEncoderOptions tiny;
  tiny.bits_per_param = 0;
  tiny.byte_budget = 16;  // below the header and one record per tensor
  absl::StatusOr<NewVersion> next =
      EncodeVersion(Moved(mirror, 0.1f), mirror, 0, compress::DeltaEncoder(tiny));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_GT(next->budget_raised_to, 16u);
  EXPECT_LE(next->update.bytes.size(), next->budget_raised_to);
}

TEST(EncodeVersionTest, SetsThatDoNotMatchAreRefused) {
  const compress::NamedTensors mirror = Mirror();
  compress::NamedTensors other = {{"a.weight", torch::randn({64, 32})}};
  EXPECT_FALSE(EncodeVersion(other, mirror, 0, compress::DeltaEncoder()).ok());
}

TEST(RestoreVersionTest, TheNewStateIsTheTargetExactlyWithAnEmptyResidual) {
  const compress::NamedTensors mirror = Mirror();
  const compress::NamedTensors target = Moved(mirror, 1.0f);
  const uint64_t want = compress::StateDigest(target);
  compress::DeltaEncoderOptions options;
  absl::StatusOr<NewVersion> next =
      RestoreVersion(compress::Fp32Clones(target), mirror, 5, options);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->version, 6u);
  EXPECT_EQ(next->digest, want);
  EXPECT_EQ(next->residual, compress::DeltaEncoder(options).SerializeState());
  // The update is uncapped: it brings a device close to the target, though not exactly.
  compress::NamedTensors device = compress::Fp32Clones(mirror);
  ASSERT_TRUE(compress::ApplyUpdate(next->update.bytes, 5, device).ok());
  EXPECT_LT((device[0].second - target[0].second).norm().item<float>(),
            0.2f * (mirror[0].second - target[0].second).norm().item<float>());
}

TEST(TrainRoundTest, ATrainedSetBecomesTheNextVersion) {
  const compress::NamedTensors mirror = Mirror();
  absl::StatusOr<TrainedRound> round = TrainRound(
      [&]() -> absl::StatusOr<TrainedSet> {
        TrainedSet set;
        set.trainable = Moved(mirror, 0.1f);
        set.stats.steps = 3;
        return set;
      },
      mirror, 0, compress::DeltaEncoder());
  ASSERT_TRUE(round.ok()) << round.status();
  EXPECT_EQ(round->outcome, RoundOutcome::kTrained);
  EXPECT_EQ(round->job.stats.steps, 3);
  EXPECT_EQ(round->next.version, 1u);
  EXPECT_EQ(compress::StateDigest(round->next.state), round->next.digest);
}

TEST(TrainRoundTest, TheLearnersFailuresAreOutcomes) {
  const compress::NamedTensors mirror = Mirror();
  absl::StatusOr<TrainedRound> failed = TrainRound(
      []() -> absl::StatusOr<TrainedSet> { return absl::UnavailableError("no teacher"); }, mirror,
      0, compress::DeltaEncoder());
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->outcome, RoundOutcome::kFailed);
  EXPECT_TRUE(absl::IsUnavailable(failed->why));

  absl::StatusOr<TrainedRound> thrown = TrainRound(
      []() -> absl::StatusOr<TrainedSet> {
        TORCH_CHECK(false, "shapes do not match");
        return TrainedSet();
      },
      mirror, 0, compress::DeltaEncoder());
  ASSERT_TRUE(thrown.ok());
  EXPECT_EQ(thrown->outcome, RoundOutcome::kFailed);
  EXPECT_THAT(std::string(thrown->why.message()), testing::HasSubstr("shapes do not match"));

  absl::StatusOr<TrainedRound> nothing = TrainRound(
      []() -> absl::StatusOr<TrainedSet> {
        TrainedSet set;
        set.rejected.emplace_back(0, absl::InvalidArgumentError("frame does not decode"));
        return set;
      },
      mirror, 0, compress::DeltaEncoder());
  ASSERT_TRUE(nothing.ok());
  EXPECT_EQ(nothing->outcome, RoundOutcome::kNothingUsable);
  EXPECT_EQ(nothing->job.rejected.size(), 1u);
}

TEST(TrainRoundTest, ANonFiniteResultNeverBecomesAnUpdate) {
  const compress::NamedTensors mirror = Mirror();
  absl::StatusOr<TrainedRound> round = TrainRound(
      [&]() -> absl::StatusOr<TrainedSet> {
        TrainedSet set;
        set.trainable = Moved(mirror, 0.1f);
        set.trainable[1].second[5] = std::numeric_limits<float>::infinity();
        return set;
      },
      mirror, 0, compress::DeltaEncoder());
  ASSERT_TRUE(round.ok());
  EXPECT_EQ(round->outcome, RoundOutcome::kNonFinite);
  EXPECT_THAT(std::string(round->why.message()), testing::HasSubstr("b.bias"));
  EXPECT_TRUE(round->next.update.bytes.empty());
}

}  // namespace
}  // namespace cdcca::cloud
