#include "compress/delta_encoder.h"

#include <torch/torch.h>

#include <cmath>

#include "compress/named_tensors.h"
#include "compress/test_sets.h"
#include "compress/wire_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::compress {
namespace {

using ::cdcca::testing::StatusIs;
using testing::Clone;
using testing::MakeSet;
using testing::Perturb;

uint64_t Params(const NamedTensors& set) {
  uint64_t n = 0;
  for (const auto& [name, t] : set) n += t.numel();
  return n;
}

TEST(DeltaEncoderTest, DefaultPolicyStaysWithinTwoBitsPerParameter) {
  const NamedTensors mirror = MakeSet(1);
  const NamedTensors fresh = Perturb(mirror, 2, 1e-3);
  DeltaEncoder encoder;
  ASSERT_OK_AND_ASSIGN(UpdatePayload p, encoder.Encode(fresh, mirror, 0, 1));
  EXPECT_LE(p.bytes.size() * 8, 2 * Params(mirror));
  EXPECT_EQ(p.stats.payload_bytes, p.bytes.size());
  EXPECT_LE(p.stats.bits_per_param, 2.0);
  EXPECT_LT(p.stats.relative_error, 0.6);
}

TEST(DeltaEncoderTest, EveryByteBudgetIsRespectedHeaderIncluded) {
  const NamedTensors mirror = MakeSet(1);
  const NamedTensors fresh = Perturb(mirror, 2, 1e-3);
  double previous_error = 2.0;
  for (uint64_t budget : {400, 600, 1000, 2000, 4000, 8000, 20000}) {
    DeltaEncoderOptions options;
    options.byte_budget = budget;
    options.bits_per_param = 0.0;
    DeltaEncoder encoder(options);
    ASSERT_OK_AND_ASSIGN(UpdatePayload p, encoder.Encode(fresh, mirror, 0, 1));
    EXPECT_LE(p.bytes.size(), budget);
    EXPECT_LE(p.stats.relative_error, previous_error + 1e-9) << budget;
    previous_error = p.stats.relative_error;
    ASSERT_OK_AND_ASSIGN(ParsedPayload parsed, ParsePayload(p.bytes));
    EXPECT_EQ(parsed.tensors.size(), mirror.size());
  }
  EXPECT_LT(previous_error, 0.01);  // 20 kB is enough for 8 bits everywhere
  DeltaEncoderOptions tiny;
  tiny.byte_budget = 100;
  DeltaEncoder encoder(tiny);
  EXPECT_THAT(encoder.Encode(fresh, mirror, 0, 1), StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST(DeltaEncoderTest, AllowedWidthsAndTargetErrorAreHonoured) {
  const NamedTensors mirror = MakeSet(1);
  const NamedTensors fresh = Perturb(mirror, 2, 1e-3);
  DeltaEncoderOptions options;
  options.allowed_bits = {0, 4};
  options.bits_per_param = 0.0;
  options.target_relative_error = 0.2;
  DeltaEncoder encoder(options);
  ASSERT_OK_AND_ASSIGN(UpdatePayload p, encoder.Encode(fresh, mirror, 0, 1));
  EXPECT_LE(p.stats.relative_error, 0.2);
  for (const TensorEncodeStats& t : p.stats.tensors) {
    EXPECT_TRUE(t.bits == 0 || t.bits == 4) << t.name << " " << t.bits;
  }
  options.allowed_bits = {0, 5};
  EXPECT_THAT(DeltaEncoder(options).Encode(fresh, mirror, 0, 1),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(DeltaEncoderTest, DeterministicAndStateRoundTrips) {
  const NamedTensors mirror = MakeSet(1);
  const NamedTensors fresh = Perturb(mirror, 2, 1e-3);
  DeltaEncoder a, b;
  ASSERT_OK_AND_ASSIGN(UpdatePayload pa, a.Encode(fresh, mirror, 0, 1));
  ASSERT_OK_AND_ASSIGN(UpdatePayload pb, b.Encode(fresh, mirror, 0, 1));
  EXPECT_EQ(pa.bytes, pb.bytes);
  EXPECT_GT(a.ResidualSquaredNorm(), 0.0);
  const std::string state = a.SerializeState();
  DeltaEncoder restored;
  ASSERT_OK(restored.RestoreState(state));
  EXPECT_EQ(restored.SerializeState(), state);
  ASSERT_OK_AND_ASSIGN(UpdatePayload next_a, a.Encode(fresh, mirror, 1, 2));
  ASSERT_OK_AND_ASSIGN(UpdatePayload next_r, restored.Encode(fresh, mirror, 1, 2));
  EXPECT_EQ(next_a.bytes, next_r.bytes);
  std::string corrupt = state;
  corrupt[state.size() / 2] ^= 1;
  EXPECT_THAT(restored.RestoreState(corrupt), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(restored.RestoreState(state.substr(0, 20)), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(DeltaEncoderTest, RejectsMismatchedSets) {
  const NamedTensors mirror = MakeSet(1);
  NamedTensors fresh = Perturb(mirror, 2, 1e-3);
  fresh[0].second = torch::zeros({65});
  DeltaEncoder encoder;
  EXPECT_THAT(encoder.Encode(fresh, mirror, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument));
  NamedTensors renamed = Perturb(mirror, 2, 1e-3);
  renamed[1].first = "other";
  EXPECT_THAT(encoder.Encode(renamed, mirror, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument));
  NamedTensors nan = Perturb(mirror, 2, 1e-3);
  nan[2].second[0][0] = NAN;
  EXPECT_THAT(encoder.Encode(nan, mirror, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument));
  NamedTensors doubles = Clone(mirror);
  doubles[0].second = doubles[0].second.to(torch::kFloat64);
  EXPECT_THAT(encoder.Encode(doubles, mirror, 0, 1), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Over many rounds, each training a delta from the device's state, the device's total
// change tracks the sum of trained deltas: the gap is exactly the residual, which stays
// bounded, so the relative gap shrinks. Without feedback the dropped parts pile up.
double RunRounds(bool error_feedback, double topk, double* residual_gap) {
  NamedTensors device = MakeSet(1);
  NamedTensors mirror = Clone(device);
  const NamedTensors start = Clone(device);
  NamedTensors trained_total = Clone(device);
  for (auto& [name, t] : trained_total) t.zero_();
  DeltaEncoderOptions options;
  options.error_feedback = error_feedback;
  options.topk_fraction = topk;
  options.bits_per_param = 1.5;
  DeltaEncoder encoder(options);
  torch::manual_seed(5);
  const int kRounds = 40;
  for (int r = 0; r < kRounds; ++r) {
    NamedTensors fresh = Clone(mirror);
    for (size_t i = 0; i < fresh.size(); ++i) {
      // A consistent drift plus noise, like successive rounds of adaptation.
      torch::Tensor d =
          1e-3 * (torch::ones(fresh[i].second.sizes()) * (static_cast<double>(i + 1) * 0.3) +
                  torch::randn(fresh[i].second.sizes()));
      fresh[i].second += d;
      trained_total[i].second += d;
    }
    auto p = encoder.Encode(fresh, mirror, r, r + 1);
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(ApplyUpdate(p->bytes, r, mirror).ok());
    EXPECT_TRUE(ApplyUpdate(p->bytes, r, device).ok());
  }
  double gap = 0.0, total = 0.0, res_gap = 0.0;
  const std::string state = encoder.SerializeState();
  for (size_t i = 0; i < device.size(); ++i) {
    torch::Tensor applied = device[i].second - start[i].second;
    gap += (applied - trained_total[i].second).pow(2).sum().item<double>();
    total += trained_total[i].second.pow(2).sum().item<double>();
  }
  // Identity of error feedback: trained total = applied total + residual.
  res_gap = std::fabs(std::sqrt(gap) - std::sqrt(encoder.ResidualSquaredNorm()));
  if (residual_gap != nullptr) *residual_gap = res_gap / std::sqrt(total);
  EXPECT_EQ(StateDigest(device), StateDigest(mirror));
  return std::sqrt(gap / total);
}

TEST(DeltaEncoderTest, ErrorFeedbackMakesAppliedSumConvergeToTrainedSum) {
  double identity_gap = 1.0;
  const double with = RunRounds(true, 0.0, &identity_gap);
  const double without = RunRounds(false, 0.0, nullptr);
  EXPECT_LT(with, 0.05);
  EXPECT_LT(with * 4, without);
  EXPECT_LT(identity_gap, 1e-3);
}

TEST(DeltaEncoderTest, TopKWithErrorFeedbackAlsoConverges) {
  const double with = RunRounds(true, 0.1, nullptr);
  const double without = RunRounds(false, 0.1, nullptr);
  EXPECT_LT(with, 0.2);
  EXPECT_LT(with * 3, without);
}

}  // namespace
}  // namespace cdcca::compress
