#include "cloud/uplink_check.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace cdcca::cloud {
namespace {

// The codec's header (compress/uplink_codec.h): u32 sample count at byte 8, u64 body size at
// byte 12.
constexpr size_t kSampleCountOffset = 8;
constexpr size_t kBodySizeOffset = 12;
constexpr size_t kHeaderBytes = 20;
// Type URL of the refusal reason a status carries (its number, in decimal).
constexpr char kRefusalReasonUrl[] = "type.cdcca/cdcca.v1.RefusalReason";

absl::Status Refused(v1::RefusalReason reason, absl::string_view message) {
  return WithRefusalReason(absl::InvalidArgumentError(message), reason);
}

absl::Status CheckSample(const compress::UplinkSample& s, size_t i, const SampleSpec& spec) {
  const auto bad = [&](v1::RefusalReason reason, absl::string_view why) {
    return Refused(reason, absl::StrCat("uplink sample ", i, " (id ", s.sample_id, "): ", why));
  };
  if ((spec.grid_tokens != 0 && s.grid_tokens != spec.grid_tokens) ||
      (spec.feature_dim != 0 && s.feature_dim != spec.feature_dim)) {
    return bad(v1::REFUSAL_REASON_SHAPE, absl::StrCat("grid ", s.grid_tokens, "x", s.feature_dim,
                                                      " but the cloud's model expects ",
                                                      spec.grid_tokens, "x", spec.feature_dim));
  }
  if (s.prompt_tokens.empty()) return bad(v1::REFUSAL_REASON_MALFORMED, "empty prompt");
  if (s.prompt_tokens.size() > spec.max_prompt_tokens) {
    return bad(v1::REFUSAL_REASON_PROMPT_TOO_LONG,
               absl::StrCat("a prompt of ", s.prompt_tokens.size(), " tokens; this cloud takes ",
                            spec.max_prompt_tokens, " at most"));
  }
  if (s.answer_tokens.size() > spec.max_answer_tokens) {
    return bad(v1::REFUSAL_REASON_ANSWER_TOO_LONG,
               absl::StrCat("an answer of ", s.answer_tokens.size(), " tokens; this cloud takes ",
                            spec.max_answer_tokens, " at most"));
  }
  if (s.frame.empty() && spec.frames_only) {
    return bad(v1::REFUSAL_REASON_FRAME,
               "visual tokens, but this cloud trains the student's vision tower (--lora_vision), "
               "which learns from frames: uplink frames (--uplink_precision=jpeg)");
  }
  if (!s.frame.empty()) {
    const auto bad_frame = [&](absl::string_view why) {
      return bad(v1::REFUSAL_REASON_FRAME, why);
    };
    if (spec.frame_width == 0) {
      return bad_frame(
          "a frame, but this cloud takes visual tokens only (the jpeg uplink needs a Hugging "
          "Face pair whose image processor has a fixed output size)");
    }
    absl::StatusOr<compress::JpegSize> size = compress::ReadJpegSize(s.frame);
    if (!size.ok()) return bad_frame(size.status().message());
    // Devices send baseline JPEG: a progressive one can hold many scans that cost the decoder
    // far more than its bytes suggest.
    if (size->progressive) return bad_frame("a progressive or lossless JPEG frame (baseline only)");
    const uint64_t most = uint64_t{spec.frame_width} * spec.frame_height * 3 + (64u << 10);
    if (s.frame.size() > most) {
      return bad_frame(
          absl::StrCat("a frame of ", s.frame.size(), " bytes, more than ", most, " for its size"));
    }
    if (static_cast<uint32_t>(size->width) != spec.frame_width ||
        static_cast<uint32_t>(size->height) != spec.frame_height) {
      return bad_frame(absl::StrCat("a ", size->width, "x", size->height,
                                    " frame, but the tower takes ", spec.frame_width, "x",
                                    spec.frame_height));
    }
  }
  if (spec.vocab_size != 0) {
    for (const std::vector<uint32_t>* ids : {&s.prompt_tokens, &s.answer_tokens}) {
      for (uint32_t t : *ids) {
        if (t >= spec.vocab_size) {
          return bad(
              v1::REFUSAL_REASON_VOCABULARY,
              absl::StrCat("token id ", t, " is outside the vocabulary of ", spec.vocab_size));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WithRefusalReason(absl::Status status, v1::RefusalReason reason) {
  if (!status.ok())
    status.SetPayload(kRefusalReasonUrl, absl::Cord(absl::StrCat(static_cast<int>(reason))));
  return status;
}

v1::RefusalReason RefusalReasonOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kRefusalReasonUrl);
  int reason = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &reason) ||
      !v1::RefusalReason_IsValid(reason)) {
    return v1::REFUSAL_REASON_UNSPECIFIED;
  }
  return static_cast<v1::RefusalReason>(reason);
}

v1::UplinkRefusal RefusalFor(v1::RefusalReason reason) {
  switch (reason) {
    case v1::REFUSAL_REASON_MALFORMED:
    case v1::REFUSAL_REASON_CODEC:
    case v1::REFUSAL_REASON_DAMAGED:
    case v1::REFUSAL_REASON_TOO_LARGE:
    case v1::REFUSAL_REASON_SHAPE:
    case v1::REFUSAL_REASON_PROMPT_TOO_LONG:
    case v1::REFUSAL_REASON_ANSWER_TOO_LONG:
    case v1::REFUSAL_REASON_VOCABULARY:
    case v1::REFUSAL_REASON_FRAME:
    case v1::REFUSAL_REASON_SAMPLE_COUNT:
      return v1::UPLINK_REFUSAL_PERMANENT;
    case v1::REFUSAL_REASON_SEQUENCE_GAP:
      return v1::UPLINK_REFUSAL_RESEQUENCE;
    default:
      return v1::UPLINK_REFUSAL_TRANSIENT;
  }
}

absl::StatusOr<CheckedBatch> DecodeCheckedPayload(absl::string_view payload,
                                                  const SampleSpec& spec) {
  // The batch's size as its header declares it, before anything is decompressed: a batch
  // over the bounds is too large whatever it holds.
  if (payload.size() >= kHeaderBytes) {
    uint32_t count = 0;
    uint64_t body = 0;
    std::memcpy(&count, payload.data() + kSampleCountOffset, sizeof(count));
    std::memcpy(&body, payload.data() + kBodySizeOffset, sizeof(body));
    if (count > spec.max_samples_per_batch) {
      return Refused(v1::REFUSAL_REASON_TOO_LARGE,
                     absl::StrCat("uplink payload sample count ", count, " is outside 1-",
                                  spec.max_samples_per_batch));
    }
    if (body > spec.max_decoded_bytes_per_batch) {
      return Refused(
          v1::REFUSAL_REASON_TOO_LARGE,
          absl::StrCat("uplink payload body of ", body, " bytes exceeds max_body_bytes (",
                       spec.max_decoded_bytes_per_batch, ")"));
    }
  }
  // The codec's own bounds on the token grid and the text: the spec's, which are tighter,
  // are checked per sample below with their own reasons. The body bound above caps what the
  // decoder allocates.
  compress::UplinkLimits limits;
  limits.max_samples = std::min(limits.max_samples, spec.max_samples_per_batch);
  limits.max_body_bytes = std::min(limits.max_body_bytes, spec.max_decoded_bytes_per_batch);
  absl::StatusOr<std::vector<compress::UplinkSample>> samples =
      compress::DecodeUplinkBatch(payload, limits);
  if (!samples.ok()) {
    return WithRefusalReason(samples.status(), absl::IsDataLoss(samples.status())
                                                   ? v1::REFUSAL_REASON_DAMAGED
                                                   : v1::REFUSAL_REASON_MALFORMED);
  }
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
  const auto bad = [&](v1::RefusalReason reason, absl::string_view why) {
    return Refused(reason, absl::StrCat("batch ", batch.sequence(), ": ", why));
  };
  if (batch.codec_version() != kUplinkCodecVersion) {
    return bad(
        v1::REFUSAL_REASON_CODEC,
        absl::StrCat("codec_version ", batch.codec_version(),
                     " is not supported (this cloud reads version ", kUplinkCodecVersion, ")"));
  }
  absl::StatusOr<CheckedBatch> checked = DecodeCheckedPayload(batch.payload(), spec);
  if (!checked.ok()) {
    // Whatever the codec says (DATA_LOSS for a damaged payload), the device sent bad input.
    return bad(RefusalReasonOf(checked.status()),
               absl::StrCat("payload: ", checked.status().message()));
  }
  if (batch.sample_count() != checked->samples.size()) {
    return bad(v1::REFUSAL_REASON_SAMPLE_COUNT,
               absl::StrCat("sample_count ", batch.sample_count(), " but the payload holds ",
                            checked->samples.size(), " samples"));
  }
  return checked;
}

}  // namespace cdcca::cloud
