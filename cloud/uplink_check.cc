#include "cloud/uplink_check.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace cdcca::cloud {
namespace {

// The codec body's declared size: u64 at byte 12 of the header (compress/uplink_codec.h).
constexpr size_t kBodySizeOffset = 12;

absl::Status CheckSample(const compress::UplinkSample& s, size_t i, const SampleSpec& spec) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("uplink sample ", i, " (id ", s.sample_id, "): ", why));
  };
  if ((spec.grid_tokens != 0 && s.grid_tokens != spec.grid_tokens) ||
      (spec.feature_dim != 0 && s.feature_dim != spec.feature_dim)) {
    return bad(absl::StrCat("grid ", s.grid_tokens, "x", s.feature_dim,
                            " but the cloud's model expects ", spec.grid_tokens, "x",
                            spec.feature_dim));
  }
  if (s.prompt_tokens.empty()) return bad("empty prompt");
  if (!s.frame.empty()) {
    if (spec.frame_width == 0) {
      return bad(
          "a frame, but this cloud takes visual tokens only (the jpeg uplink needs a Hugging "
          "Face pair whose image processor has a fixed output size)");
    }
    absl::StatusOr<compress::JpegSize> size = compress::ReadJpegSize(s.frame);
    if (!size.ok()) return bad(size.status().message());
    // Devices send baseline JPEG: a progressive one can hold many scans that cost the decoder
    // far more than its bytes suggest.
    if (size->progressive) return bad("a progressive or lossless JPEG frame (baseline only)");
    const uint64_t most = uint64_t{spec.frame_width} * spec.frame_height * 3 + (64u << 10);
    if (s.frame.size() > most) {
      return bad(
          absl::StrCat("a frame of ", s.frame.size(), " bytes, more than ", most, " for its size"));
    }
    if (static_cast<uint32_t>(size->width) != spec.frame_width ||
        static_cast<uint32_t>(size->height) != spec.frame_height) {
      return bad(absl::StrCat("a ", size->width, "x", size->height, " frame, but the tower takes ",
                              spec.frame_width, "x", spec.frame_height));
    }
  }
  if (spec.vocab_size != 0) {
    for (const std::vector<uint32_t>* ids : {&s.prompt_tokens, &s.answer_tokens}) {
      for (uint32_t t : *ids) {
        if (t >= spec.vocab_size) {
          return bad(
              absl::StrCat("token id ", t, " is outside the vocabulary of ", spec.vocab_size));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckedBatch> DecodeCheckedPayload(absl::string_view payload,
                                                  const SampleSpec& spec) {
  compress::UplinkLimits limits;
  limits.max_samples = std::min(limits.max_samples, spec.max_samples_per_batch);
  if (spec.grid_tokens != 0) limits.max_grid_tokens = spec.grid_tokens;
  if (spec.feature_dim != 0) limits.max_feature_dim = spec.feature_dim;
  limits.max_prompt_tokens = std::min(limits.max_prompt_tokens, spec.max_prompt_tokens);
  limits.max_answer_tokens = std::min(limits.max_answer_tokens, spec.max_answer_tokens);
  limits.max_body_bytes = std::min(limits.max_body_bytes, spec.max_decoded_bytes_per_batch);
  absl::StatusOr<std::vector<compress::UplinkSample>> samples =
      compress::DecodeUplinkBatch(payload, limits);
  if (!samples.ok()) return samples.status();
  CheckedBatch out;
  uint64_t body = 0;
  std::memcpy(&body, payload.data() + kBodySizeOffset, sizeof(body));  // decoded: long enough
  out.decoded_bytes = body;
  for (size_t i = 0; i < samples->size(); ++i) {
    if (absl::Status s = CheckSample((*samples)[i], i, spec); !s.ok()) return s;
  }
  out.samples = *std::move(samples);
  return out;
}

absl::StatusOr<CheckedBatch> CheckUplinkBatch(const v1::UplinkBatch& batch,
                                              const SampleSpec& spec) {
  const auto bad = [&](const absl::Status& why) {
    return absl::Status(why.code(), absl::StrCat("batch ", batch.sequence(), ": ", why.message()));
  };
  if (batch.codec_version() != kUplinkCodecVersion) {
    return bad(absl::InvalidArgumentError(
        absl::StrCat("codec_version ", batch.codec_version(),
                     " is not supported (this cloud reads version ", kUplinkCodecVersion, ")")));
  }
  absl::StatusOr<CheckedBatch> checked = DecodeCheckedPayload(batch.payload(), spec);
  if (!checked.ok()) {
    // Whatever the codec says (DATA_LOSS for a damaged payload), the device sent bad input.
    return bad(absl::InvalidArgumentError(absl::StrCat("payload: ", checked.status().message())));
  }
  if (batch.sample_count() != checked->samples.size()) {
    return bad(absl::InvalidArgumentError(absl::StrCat("sample_count ", batch.sample_count(),
                                                       " but the payload holds ",
                                                       checked->samples.size(), " samples")));
  }
  return checked;
}

}  // namespace cdcca::cloud
