#include "compress/uplink_codec.h"

#include <zstd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/jpeg_header.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::compress {
namespace {

using ::cdcca::testing::JpegHeader;
using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

UplinkSample MakeSample(uint64_t id, uint32_t kept, uint32_t dim = 32, uint32_t seed = 1) {
  std::mt19937 rng(seed + id);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  UplinkSample s;
  s.sample_id = id;
  s.model_version = 4;
  s.entropy = 1.25f;
  s.grid_tokens = 64;
  s.feature_dim = dim;
  for (uint32_t k = 0; k < kept; ++k)
    s.kept_indices.push_back(static_cast<uint16_t>(k * 64 / kept));
  s.prompt_tokens = {5, 17, 2, 99};
  s.answer_tokens = {42, 3};
  s.features.resize(size_t{kept} * dim);
  for (float& f : s.features) f = normal(rng);
  return s;
}

TEST(UplinkCodecTest, HalfConversionRoundTripsExactlyRepresentableValues) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 0.000061035156f, 5.96046448e-8f}) {
    EXPECT_EQ(HalfToFloat(FloatToHalf(f)), f) << f;
  }
  EXPECT_TRUE(std::isinf(HalfToFloat(FloatToHalf(1e6f))));
  EXPECT_EQ(HalfToFloat(FloatToHalf(1e-9f)), 0.0f);
  // Relative error of a normal value is at most 2^-11.
  for (float f = -100.0f; f < 100.0f; f += 0.37f) {
    EXPECT_NEAR(HalfToFloat(FloatToHalf(f)), f, std::fabs(f) * (1.0f / 2048) + 1e-7f);
  }
}

TEST(UplinkCodecTest, Fp16RoundTripKeepsEverythingButFeatureRounding) {
  std::vector<UplinkSample> in = {MakeSample(1, 32), MakeSample(2, 0), MakeSample(3, 64)};
  ASSERT_OK_AND_ASSIGN(std::string payload, EncodeUplinkBatch(in, FeaturePrecision::kFp16));
  ASSERT_OK_AND_ASSIGN(std::vector<UplinkSample> out, DecodeUplinkBatch(payload));
  ASSERT_EQ(out.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out[i].sample_id, in[i].sample_id);
    EXPECT_EQ(out[i].model_version, in[i].model_version);
    EXPECT_EQ(out[i].entropy, in[i].entropy);
    EXPECT_EQ(out[i].kept_indices, in[i].kept_indices);
    EXPECT_EQ(out[i].prompt_tokens, in[i].prompt_tokens);
    EXPECT_EQ(out[i].answer_tokens, in[i].answer_tokens);
    ASSERT_EQ(out[i].features.size(), in[i].features.size());
    for (size_t j = 0; j < in[i].features.size(); ++j) {
      EXPECT_NEAR(out[i].features[j], in[i].features[j],
                  std::fabs(in[i].features[j]) / 2048 + 1e-6);
    }
  }
}

TEST(UplinkCodecTest, Int8RoundTripErrorIsBoundedByHalfAStepPerToken) {
  std::vector<UplinkSample> in = {MakeSample(7, 40, 48)};
  ASSERT_OK_AND_ASSIGN(std::string payload, EncodeUplinkBatch(in, FeaturePrecision::kInt8));
  ASSERT_OK_AND_ASSIGN(std::vector<UplinkSample> out, DecodeUplinkBatch(payload));
  const UplinkSample& s = in[0];
  for (size_t row = 0; row < s.kept_indices.size(); ++row) {
    float max_abs = 0;
    for (size_t c = 0; c < s.feature_dim; ++c) {
      max_abs = std::max(max_abs, std::fabs(s.features[row * s.feature_dim + c]));
    }
    const float step = max_abs / 127;
    for (size_t c = 0; c < s.feature_dim; ++c) {
      const size_t j = row * s.feature_dim + c;
      EXPECT_LE(std::fabs(out[0].features[j] - s.features[j]), step / 2 + 1e-6f);
    }
  }
  // int8 with a scale per token is about half the size of fp16 before zstd.
  EXPECT_LT(FeatureBytes(40, 48, FeaturePrecision::kInt8),
            FeatureBytes(40, 48, FeaturePrecision::kFp16) * 6 / 10);
}

// int4: 4-bit codes with a per-token scale, an odd feature width (the last byte's high
// nibble unused), error within half a step of max|x| / 7, and about a quarter of fp16.
TEST(UplinkCodecTest, Int4RoundTripErrorIsBoundedByHalfAStepPerToken) {
  std::vector<UplinkSample> in = {MakeSample(3, 20, 33), MakeSample(4, 5, 33)};
  ASSERT_OK_AND_ASSIGN(std::string payload, EncodeUplinkBatch(in, FeaturePrecision::kInt4));
  ASSERT_OK_AND_ASSIGN(std::vector<UplinkSample> out, DecodeUplinkBatch(payload));
  ASSERT_EQ(out.size(), 2u);
  for (size_t i = 0; i < in.size(); ++i) {
    const UplinkSample& s = in[i];
    EXPECT_EQ(out[i].kept_indices, s.kept_indices);
    ASSERT_EQ(out[i].features.size(), s.features.size());
    for (size_t row = 0; row < s.kept_indices.size(); ++row) {
      float max_abs = 0;
      for (size_t c = 0; c < s.feature_dim; ++c) {
        max_abs = std::max(max_abs, std::fabs(s.features[row * s.feature_dim + c]));
      }
      const float step = max_abs / 7;
      float worst = 0;
      for (size_t c = 0; c < s.feature_dim; ++c) {
        const size_t j = row * s.feature_dim + c;
        worst = std::max(worst, std::fabs(out[i].features[j] - s.features[j]));
      }
      EXPECT_LE(worst, step / 2 + 1e-5f);
      EXPECT_GT(worst, 0.0f);  // 4 bits do lose something on normal values
    }
  }
  EXPECT_EQ(FeatureBytes(20, 33, FeaturePrecision::kInt4), 20u * (4 + 17));
  EXPECT_LT(FeatureBytes(40, 1024, FeaturePrecision::kInt4),
            FeatureBytes(40, 1024, FeaturePrecision::kFp16) * 26 / 100);
}

TEST(UplinkCodecTest, PrecisionNamesRoundTrip) {
  for (FeaturePrecision p : {FeaturePrecision::kFp16, FeaturePrecision::kInt8,
                             FeaturePrecision::kInt4, FeaturePrecision::kJpeg}) {
    ASSERT_OK_AND_ASSIGN(FeaturePrecision back, ParseFeaturePrecision(FeaturePrecisionName(p)));
    EXPECT_EQ(back, p);
  }
  EXPECT_THAT(ParseFeaturePrecision("int2"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp16, int8, int4, jpeg")));
}

TEST(UplinkCodecTest, ReadsTheSizeAJpegDeclaresAndRefusesWhatIsNotOne) {
  ASSERT_OK_AND_ASSIGN(JpegSize size, ReadJpegSize(JpegHeader(336, 224)));
  EXPECT_EQ(size.width, 336);
  EXPECT_EQ(size.height, 224);
  EXPECT_EQ(size.components, 3);
  EXPECT_FALSE(size.progressive);
  ASSERT_OK_AND_ASSIGN(size, ReadJpegSize(JpegHeader(65535, 1, 1, 0xC2)));  // progressive, gray
  EXPECT_EQ(size.width, 65535);
  EXPECT_EQ(size.components, 1);
  EXPECT_TRUE(size.progressive);
  // Every truncation fails cleanly (never reads past the end).
  const std::string good = JpegHeader(64, 48);
  for (size_t n = 0; n < 18; ++n) {  // the frame header ends at byte 18
    EXPECT_FALSE(ReadJpegSize(good.substr(0, n)).ok()) << n;
  }
  EXPECT_THAT(ReadJpegSize(JpegHeader(0, 48)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("zero")));
  EXPECT_THAT(ReadJpegSize(JpegHeader(64, 48, 4)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("4 components")));
  // A Huffman table (0xC4) is not a frame header; a scan before any frame header is refused.
  EXPECT_FALSE(ReadJpegSize(JpegHeader(64, 48, 3, 0xC4)).ok());
  // A decoder takes 0xFF 0x00 for a stuffed byte and looks for markers inside what a
  // length would skip: a segment hiding another frame header there is refused, as is any
  // marker a decoder does not skip by its length before the frame header.
  const std::string hidden = JpegHeader(4096, 4096).substr(2);
  std::string forged = "\xFF\xD8\xFF";
  forged += {'\0', 0, static_cast<char>(hidden.size() + 2)};
  forged += hidden + JpegHeader(64, 48).substr(2);
  EXPECT_THAT(ReadJpegSize(forged),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("marker 0x00 before")));
  for (const char code : {'\x01', '\xD0', '\xD8', '\xC8', '\xF0', '\x7F'}) {
    std::string marker = "\xFF\xD8\xFF";
    marker += {code, 0, 2};
    EXPECT_FALSE(ReadJpegSize(marker + JpegHeader(64, 48).substr(2)).ok()) << int{code};
  }
  EXPECT_THAT(ReadJpegSize(std::string("\x89PNG\r\n\x1a\n", 8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("start-of-image")));
}

// A jpeg batch carries each sample's frame and kept indices instead of features, byte for
// byte; features in a jpeg batch, a frame in a feature batch, or a frame that is not a
// JPEG (or over the receiver's bound) are refused on both sides.
TEST(UplinkCodecTest, JpegBatchesCarryTheFrameInsteadOfFeatures) {
  UplinkSample s = MakeSample(3, 16);
  s.features.clear();
  s.frame = JpegHeader(336, 336) + std::string(500, '\x5A');
  UplinkSample t = MakeSample(4, 0);
  t.features.clear();
  t.frame = JpegHeader(336, 336);
  ASSERT_OK_AND_ASSIGN(std::string payload, EncodeUplinkBatch({s, t}, FeaturePrecision::kJpeg));
  ASSERT_OK_AND_ASSIGN(std::vector<UplinkSample> out, DecodeUplinkBatch(payload));
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].frame, s.frame);
  EXPECT_EQ(out[0].kept_indices, s.kept_indices);
  EXPECT_EQ(out[0].prompt_tokens, s.prompt_tokens);
  EXPECT_TRUE(out[0].features.empty());
  EXPECT_EQ(out[1].frame, t.frame);

  UplinkSample with_features = MakeSample(5, 4);
  with_features.frame = t.frame;
  EXPECT_THAT(EncodeUplinkBatch({with_features}, FeaturePrecision::kJpeg).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not features")));
  EXPECT_THAT(EncodeUplinkBatch({with_features}, FeaturePrecision::kInt8).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only a jpeg batch")));
  UplinkSample no_frame = s;
  no_frame.frame.clear();
  EXPECT_THAT(EncodeUplinkBatch({no_frame}, FeaturePrecision::kJpeg).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs its frame")));
  UplinkSample png = s;
  png.frame = "\x89PNG\r\n\x1a\n-not-a-jpeg";
  EXPECT_THAT(EncodeUplinkBatch({png}, FeaturePrecision::kJpeg).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("start-of-image")));
  UplinkLimits small;
  small.max_frame_bytes = 100;
  EXPECT_THAT(DecodeUplinkBatch(payload, small).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_frame_bytes")));
  // Every truncation of the payload is refused.
  for (size_t n = 0; n < payload.size(); n += 7) {
    EXPECT_FALSE(DecodeUplinkBatch(payload.substr(0, n)).ok()) << n;
  }
}

// Regression: an int8 row whose largest value is a tiny
// subnormal made max|x| / 127 underflow to a zero scale; x / 0 (NaN or inf) was then cast
// to int8, which is undefined behaviour, and a zero scale was written to the payload.
TEST(UplinkCodecTest, Int8RowOfTinySubnormalsGetsAPositiveScale) {
  UplinkSample s = MakeSample(7, 2, 4);
  s.features = {1e-44f, -5e-45f, 0.0f, 3e-45f,  // max|x| / 127 == 0 in float
                0.0f,   0.0f,    0.0f, 0.0f};
  ASSERT_EQ(1e-44f / 127.0f, 0.0f) << "the test needs a max|x| whose scale underflows";
  ASSERT_OK_AND_ASSIGN(std::string payload, EncodeUplinkBatch({s}, FeaturePrecision::kInt8));
  // The body: 26 bytes of sample header, the kept indices, prompt, answer, then each row
  // as f32 scale + dim x i8.
  const size_t body_size = [&] {
    uint64_t n = 0;
    std::memcpy(&n, payload.data() + 12, 8);
    return static_cast<size_t>(n);
  }();
  std::string body(body_size, '\0');
  ASSERT_EQ(ZSTD_decompress(body.data(), body.size(), payload.data() + 20, payload.size() - 28),
            body_size);
  const size_t rows = 26 + 2 * s.kept_indices.size() + 2 + 4 * s.prompt_tokens.size() + 2 +
                      4 * s.answer_tokens.size();
  for (size_t r = 0; r < 2; ++r) {
    float scale = 0;
    std::memcpy(&scale, body.data() + rows + r * (4 + 4), 4);
    EXPECT_TRUE(std::isfinite(scale) && scale > 0) << "row " << r << " scale " << scale;
  }
  ASSERT_OK_AND_ASSIGN(auto decoded, DecodeUplinkBatch(payload));
  for (float f : decoded[0].features) EXPECT_LE(std::fabs(f), 1e-43f);
}

// Rows at the top of the float range: what the encoder accepts decodes to finite values
// within half a step (max|x| / levels rounded up, times levels, would overflow).
TEST(UplinkCodecTest, RowsNearTheFloatMaximumDecodeFinite) {
  const float big = std::numeric_limits<float>::max();
  for (FeaturePrecision p : {FeaturePrecision::kInt8, FeaturePrecision::kInt4}) {
    UplinkSample s = MakeSample(9, 2, 4);
    s.features = {big, -big, 0.5f * big, 0.0f, -big, 1.0f, big, -0.25f * big};
    ASSERT_OK_AND_ASSIGN(std::string payload, EncodeUplinkBatch({s}, p));
    ASSERT_OK_AND_ASSIGN(auto decoded, DecodeUplinkBatch(payload));
    const float levels = p == FeaturePrecision::kInt8 ? 127.0f : 7.0f;
    for (size_t i = 0; i < s.features.size(); ++i) {
      const float y = decoded[0].features[i];
      EXPECT_TRUE(std::isfinite(y)) << FeaturePrecisionName(p) << " feature " << i;
      EXPECT_LE(std::fabs(static_cast<double>(y) - s.features[i]), 0.5001 * big / levels)
          << FeaturePrecisionName(p) << " feature " << i;
    }
  }
}

TEST(UplinkCodecTest, EncoderRejectsSamplesOutsideTheBounds) {
  UplinkSample unsorted = MakeSample(1, 4);
  std::swap(unsorted.kept_indices[0], unsorted.kept_indices[1]);
  UplinkSample outside = MakeSample(2, 4);
  outside.kept_indices.back() = 64;
  UplinkSample short_features = MakeSample(3, 4);
  short_features.features.pop_back();
  UplinkSample nan = MakeSample(4, 4);
  nan.features[3] = std::nanf("");
  UplinkSample long_prompt = MakeSample(5, 4);
  long_prompt.prompt_tokens.assign(1000, 1);
  const std::pair<UplinkSample, const char*> cases[] = {
      {unsorted, "strictly increase"},        {outside, "outside the grid"},
      {short_features, "kept x feature_dim"}, {nan, "non-finite"},
      {long_prompt, "prompt too long"},
  };
  for (const auto& [sample, why] : cases) {
    EXPECT_THAT(EncodeUplinkBatch({sample}, FeaturePrecision::kFp16),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(why)))
        << why;
  }
  EXPECT_THAT(EncodeUplinkBatch({}, FeaturePrecision::kFp16),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// A finite float beyond fp16's range would travel as infinity, which every receiver refuses:
// the encoder refuses it while the device can still send the sample at int8 (found by the
// compress_uplink_encode fuzzer).
TEST(UplinkCodecTest, Fp16RefusesWhatWouldTravelAsInfinity) {
  UplinkSample large = MakeSample(1, 4);
  large.features[2] = 65520.0f;  // the first float fp16 rounds to infinity
  EXPECT_THAT(EncodeUplinkBatch({large}, FeaturePrecision::kFp16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("beyond fp16's range")));
  large.features[2] = -1e30f;
  EXPECT_THAT(EncodeUplinkBatch({large}, FeaturePrecision::kFp16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("beyond fp16's range")));
  large.features[2] = 65519.0f;  // rounds to 65504: still finite, still sent
  absl::StatusOr<std::string> fits = EncodeUplinkBatch({large}, FeaturePrecision::kFp16);
  ASSERT_TRUE(fits.ok()) << fits.status();
  absl::StatusOr<std::vector<UplinkSample>> back = DecodeUplinkBatch(*fits);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ((*back)[0].features[2], 65504.0f);
  large.features[2] = -1e30f;  // int8 scales per token: any finite value goes
  absl::StatusOr<std::string> int8 = EncodeUplinkBatch({large}, FeaturePrecision::kInt8);
  ASSERT_TRUE(int8.ok()) << int8.status();
  EXPECT_TRUE(DecodeUplinkBatch(*int8).ok());
}

TEST(UplinkCodecTest, DecoderRejectsEveryTruncationAndAnyFlippedByte) {
  ASSERT_OK_AND_ASSIGN(std::string payload, EncodeUplinkBatch({MakeSample(1, 8), MakeSample(2, 3)},
                                                              FeaturePrecision::kInt8));
  for (size_t len = 0; len < payload.size(); ++len) {
    EXPECT_THAT(DecodeUplinkBatch(payload.substr(0, len)), StatusIs(absl::StatusCode::kDataLoss))
        << "truncated to " << len;
  }
  for (size_t pos = 0; pos < payload.size(); ++pos) {
    std::string bad = payload;
    bad[pos] = static_cast<char>(bad[pos] ^ 0x20);
    EXPECT_FALSE(DecodeUplinkBatch(bad).ok()) << "flipped byte " << pos;
  }
  EXPECT_THAT(DecodeUplinkBatch(payload + "x"), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(UplinkCodecTest, DecoderEnforcesTheReceiversLimits) {
  ASSERT_OK_AND_ASSIGN(std::string payload, EncodeUplinkBatch({MakeSample(1, 8), MakeSample(2, 8)},
                                                              FeaturePrecision::kFp16));
  UplinkLimits tight;
  tight.max_samples = 1;
  EXPECT_THAT(DecodeUplinkBatch(payload, tight), StatusIs(absl::StatusCode::kInvalidArgument));
  UplinkLimits small_body;
  small_body.max_body_bytes = 100;
  EXPECT_THAT(DecodeUplinkBatch(payload, small_body), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
TEST(IsHeldOutSampleTest, IsStableAndNearTheFraction) {
  int held = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const uint64_t id = (uint64_t{1764000000000} << 16) | static_cast<uint64_t>(i);
    const bool h = IsHeldOutSample("dev-a", id, 0.2);
    EXPECT_EQ(h, IsHeldOutSample("dev-a", id, 0.2));
    held += h ? 1 : 0;
  }
  // 0.2 +- 4 standard deviations of a binomial share.
  EXPECT_NEAR(static_cast<double>(held) / n, 0.2, 4 * std::sqrt(0.2 * 0.8 / n));
  for (uint64_t id = 0; id < 100; ++id) {
    EXPECT_FALSE(IsHeldOutSample("dev-a", id, 0.0));
    EXPECT_FALSE(IsHeldOutSample("dev-a", id, -1.0));
  }
  // Another device draws independently for the same sample ids.
  int same = 0;
  for (uint64_t id = 0; id < 1000; ++id) {
    same += IsHeldOutSample("dev-a", id, 0.5) == IsHeldOutSample("dev-b", id, 0.5) ? 1 : 0;
  }
  EXPECT_GT(same, 400);
  EXPECT_LT(same, 600);
}

}  // namespace cdcca::compress
