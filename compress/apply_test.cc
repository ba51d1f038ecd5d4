#include "compress/apply.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "compress/delta_encoder.h"
#include "compress/hash64.h"
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
using ::testing::HasSubstr;
using testing::MakeSet;
using testing::Perturb;

void PutLe(uint64_t v, int bytes, std::string* s, size_t at) {
  for (int i = 0; i < bytes; ++i) (*s)[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// Recomputes the trailing checksum, so a test reaches the checks behind it.
std::string Reseal(std::string s) {
  const size_t covered = s.size() - kChecksumBytes;
  PutLe(Hash64(s.data(), covered), 8, &s, covered);
  return s;
}

UpdatePayload Encode(const NamedTensors& mirror, uint64_t base, int zstd_level = 3) {
  DeltaEncoderOptions options;
  options.zstd_level = zstd_level;
  DeltaEncoder encoder(options);
  auto p = encoder.Encode(Perturb(mirror, base + 10, 1e-3), mirror, base, base + 1);
  EXPECT_TRUE(p.ok()) << p.status();
  return *std::move(p);
}

std::vector<const void*> Pointers(const NamedTensors& set) {
  std::vector<const void*> out;
  for (const auto& [name, t] : set) out.push_back(t.data_ptr());
  return out;
}

TEST(ApplyTest, AppliesInPlaceAndAddsTheDecodedDelta) {
  NamedTensors live = MakeSet(1);
  const NamedTensors before = Clone(live);
  const std::vector<const void*> pointers = Pointers(live);
  const UpdatePayload p = Encode(live, 4);
  ASSERT_OK_AND_ASSIGN(uint64_t version, ApplyUpdate(p.bytes, 4, live));
  EXPECT_EQ(version, 5u);
  EXPECT_EQ(Pointers(live), pointers);
  EXPECT_NE(StateDigest(live), StateDigest(before));
  // The change equals the payload decoded on its own.
  ASSERT_OK_AND_ASSIGN(ParsedPayload parsed, ParsePayload(p.bytes));
  for (size_t i = 0; i < live.size(); ++i) {
    std::vector<float> decoded(live[i].second.numel());
    ASSERT_OK(DecodeRecord(parsed.tensors[i], absl::MakeSpan(decoded)));
    torch::Tensor expected =
        before[i].second + torch::from_blob(decoded.data(), live[i].second.sizes()).clone();
    EXPECT_TRUE(torch::equal(live[i].second, expected)) << live[i].first;
  }
}

TEST(ApplyTest, MirrorAndDeviceDigestsStayEqualOverManyRounds) {
  NamedTensors device = MakeSet(1);
  NamedTensors mirror = Clone(device);
  // The device lists its tensors in another order; matching is by name.
  std::reverse(device.begin(), device.end());
  DeltaEncoder encoder;
  for (uint64_t round = 0; round < 50; ++round) {
    const NamedTensors fresh = Perturb(mirror, 100 + round, 1e-3);
    ASSERT_OK_AND_ASSIGN(UpdatePayload p, encoder.Encode(fresh, mirror, round, round + 1));
    ASSERT_OK(ApplyUpdate(p.bytes, round, mirror));
    ASSERT_OK(ApplyUpdate(p.bytes, round, device));
    ASSERT_EQ(StateDigest(device), StateDigest(mirror)) << round;
  }
  for (const auto& [name, t] : device) {
    for (const auto& [mname, mt] : mirror) {
      if (name == mname) EXPECT_TRUE(torch::equal(t, mt)) << name;
    }
  }
}

TEST(ApplyTest, DigestSeesNamesShapesAndSingleBits) {
  const NamedTensors a = MakeSet(1);
  NamedTensors b = Clone(a);
  EXPECT_EQ(StateDigest(a), StateDigest(b));
  float* p = b[3].second.data_ptr<float>();
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  bits ^= 1;
  std::memcpy(p, &bits, 4);
  EXPECT_NE(StateDigest(a), StateDigest(b));
  NamedTensors renamed = Clone(a);
  renamed[0].first = "x";
  EXPECT_NE(StateDigest(a), StateDigest(renamed));
  NamedTensors reshaped = Clone(a);
  reshaped[1].second = reshaped[1].second.reshape({256, 8}).contiguous();
  EXPECT_NE(StateDigest(a), StateDigest(reshaped));
}

// One malformed payload (or live set) class per case; every one is rejected with its code
// and leaves the live weights bit-identical and in the same storage.
struct MalformedCase {
  std::string name;
  absl::StatusCode code;
  std::function<std::string(const std::string& good)> payload;
  std::function<void(NamedTensors& live)> live = nullptr;
  uint64_t base = 7;
};

TEST(ApplyTest, EveryMalformedClassIsRejectedWithWeightsUntouched) {
  const NamedTensors reference = MakeSet(1);
  const std::string good = Encode(reference, 7).bytes;
  const std::string raw = Encode(reference, 7, /*zstd_level=*/0).bytes;
  ASSERT_OK_AND_ASSIGN(ParsedPayload parsed_raw, ParsePayload(raw));
  // Offset of the first record's bits byte in the raw body.
  const TensorRecord& first = parsed_raw.tensors[0];
  const size_t bits_at = kFixedHeaderBytes + 2 + first.name.size() + 1 + 8 * first.shape.size();
  ASSERT_GT(first.bits, 0);

  std::vector<MalformedCase> cases;
  for (size_t cut : {size_t{0}, size_t{10}, size_t{47}, size_t{48}, size_t{60}, good.size() / 2,
                     good.size() - 9, good.size() - 1}) {
    cases.push_back({"truncated at " + std::to_string(cut), absl::StatusCode::kDataLoss,
                     [cut](const std::string& g) { return g.substr(0, cut); }});
  }
  for (size_t at :
       {size_t{3}, size_t{9}, size_t{30}, size_t{50}, good.size() / 2, good.size() - 1}) {
    cases.push_back({"flipped byte " + std::to_string(at), absl::StatusCode::kDataLoss,
                     [at](const std::string& g) {
                       std::string s = g;
                       s[at] = static_cast<char>(s[at] ^ 0x20);
                       return s;
                     }});
  }
  cases.push_back(
      {"extended", absl::StatusCode::kDataLoss, [](const std::string& g) { return g + "more"; }});
  cases.push_back({"wrong base version", absl::StatusCode::kFailedPrecondition,
                   [](const std::string& g) { return g; }, nullptr, 6});
  cases.push_back({"bad magic", absl::StatusCode::kDataLoss, [](const std::string& g) {
                     std::string s = g;
                     s[0] = 'X';
                     return Reseal(s);
                   }});
  cases.push_back(
      {"future format version", absl::StatusCode::kInvalidArgument, [](const std::string& g) {
         std::string s = g;
         PutLe(2, 2, &s, 4);
         return Reseal(s);
       }});
  cases.push_back({"unknown flags", absl::StatusCode::kInvalidArgument, [](const std::string& g) {
                     std::string s = g;
                     PutLe(0x81, 2, &s, 6);
                     return Reseal(s);
                   }});
  cases.push_back(
      {"reserved field set", absl::StatusCode::kInvalidArgument, [](const std::string& g) {
         std::string s = g;
         PutLe(1, 4, &s, 28);
         return Reseal(s);
       }});
  cases.push_back({"stored size lies", absl::StatusCode::kDataLoss, [](const std::string& g) {
                     std::string s = g;
                     PutLe(s.size(), 8, &s, 40);
                     return Reseal(s);
                   }});
  cases.push_back({"body size lies", absl::StatusCode::kDataLoss, [](const std::string& g) {
                     std::string s = g;
                     PutLe(12345, 8, &s, 32);
                     return Reseal(s);
                   }});
  cases.push_back({"tensor count lies", absl::StatusCode::kDataLoss, [](const std::string& g) {
                     std::string s = g;
                     PutLe(99, 4, &s, 24);
                     return Reseal(s);
                   }});
  cases.push_back({"zstd garbage", absl::StatusCode::kDataLoss, [](const std::string& g) {
                     std::string s = g;
                     for (size_t i = kFixedHeaderBytes; i < s.size() - kChecksumBytes; ++i) {
                       s[i] = static_cast<char>(i * 131 + 7);
                     }
                     return Reseal(s);
                   }});
  cases.push_back(
      {"zstd frame damaged inside", absl::StatusCode::kDataLoss, [](const std::string& g) {
         std::string s = g;
         s[s.size() / 2] = static_cast<char>(s[s.size() / 2] ^ 0x55);
         return Reseal(s);
       }});
  cases.push_back(
      {"unsupported bit width", absl::StatusCode::kDataLoss, [&raw, bits_at](const std::string&) {
         std::string s = raw;
         s[bits_at] = 5;
         return Reseal(s);
       }});
  cases.push_back({"NaN scale", absl::StatusCode::kDataLoss, [&raw, &first](const std::string&) {
                     std::string s = raw;
                     const size_t at = raw.find(first.block);
                     s[at] = '\xc0';
                     s[at + 1] = '\x7f';
                     return Reseal(s);
                   }});
  cases.push_back(
      {"renamed tensor", absl::StatusCode::kInvalidArgument, [&raw](const std::string&) {
         std::string s = raw;
         s[kFixedHeaderBytes + 2] = 'X';
         return Reseal(s);
       }});
  cases.push_back({"live shape differs", absl::StatusCode::kInvalidArgument,
                   [](const std::string& g) { return g; },
                   [](NamedTensors& live) {
                     live[1].second = torch::zeros({8, 257});
                   }});
  cases.push_back({"live has an extra tensor", absl::StatusCode::kInvalidArgument,
                   [](const std::string& g) { return g; },
                   [](NamedTensors& live) { live.emplace_back("extra", torch::zeros({3})); }});
  cases.push_back({"live lacks a tensor", absl::StatusCode::kInvalidArgument,
                   [](const std::string& g) { return g; },
                   [](NamedTensors& live) { live.pop_back(); }});
  cases.push_back({"live tensor renamed", absl::StatusCode::kInvalidArgument,
                   [](const std::string& g) { return g; },
                   [](NamedTensors& live) { live[2].first = "lm.other"; }});
  cases.push_back(
      {"live tensor not float32", absl::StatusCode::kInvalidArgument,
       [](const std::string& g) { return g; },
       [](NamedTensors& live) { live[0].second = live[0].second.to(torch::kFloat64); }});

  for (const MalformedCase& c : cases) {
    SCOPED_TRACE(c.name);
    NamedTensors live = Clone(reference);
    if (c.live) c.live(live);
    const uint64_t digest = StateDigest(live);
    const std::vector<const void*> pointers = Pointers(live);
    EXPECT_THAT(ApplyUpdate(c.payload(good), c.base, live), StatusIs(c.code));
    EXPECT_EQ(StateDigest(live), digest);
    EXPECT_EQ(Pointers(live), pointers);
  }
  // And the untouched payload still applies.
  NamedTensors live = Clone(reference);
  EXPECT_OK(ApplyUpdate(good, 7, live));
  NamedTensors live_raw = Clone(reference);
  EXPECT_OK(ApplyUpdate(raw, 7, live_raw));
}

TEST(CopyIntoTest, CopiesByNameIntoAnyDtypeAndRefusesAMismatchBeforeCopying) {
  NamedTensors state = {{"b", torch::full({2, 2}, 1.5f)}, {"a", torch::full({3}, -2.0f)}};
  // A model's parameters in another order and dtype (a CUDA student holds bf16).
  NamedTensors params = {{"a", torch::zeros({3}, torch::kBFloat16)},
                         {"b", torch::zeros({2, 2}, torch::kBFloat16)}};
  ASSERT_TRUE(CopyInto(state, params).ok());
  EXPECT_TRUE(torch::equal(params[0].second.to(torch::kFloat), state[1].second));
  EXPECT_TRUE(torch::equal(params[1].second.to(torch::kFloat), state[0].second));

  // A shape mismatch on the second tensor: the first is not touched either.
  NamedTensors wrong = {{"a", torch::full({3}, 7.0f)}, {"b", torch::full({4}, 7.0f)}};
  EXPECT_THAT(CopyInto(wrong, params),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor b")));
  EXPECT_TRUE(torch::equal(params[0].second.to(torch::kFloat), state[1].second));
  NamedTensors missing = {{"a", torch::full({3}, 7.0f)}};
  EXPECT_THAT(CopyInto(missing, params),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lacks tensor b")));
  EXPECT_TRUE(torch::equal(params[0].second.to(torch::kFloat), state[1].second));
}

TEST(ApplyTest, ErrorMessagesNameTheProblem) {
  NamedTensors live = MakeSet(1);
  const std::string good = Encode(live, 3).bytes;
  EXPECT_THAT(ApplyUpdate(good, 2, live),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("version 3")));
  EXPECT_THAT(ApplyUpdate(good.substr(0, 100), 3, live),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("checksum")));
  live[1].second = torch::zeros({8, 257});
  EXPECT_THAT(ApplyUpdate(good, 3, live),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("shape")));
}

}  // namespace
}  // namespace cdcca::compress
