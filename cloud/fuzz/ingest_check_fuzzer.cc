// libFuzzer entry for the cloud's ingest check (cloud/uplink_check.h): what a device sends
// against a model spec the input picks. A batch the check accepts must hold what the spec
// promises the trainer, field by field; anything else must be a status, never a crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "cloud/fuzz/ingest_spec.h"
#include "cloud/uplink_check.h"
#include "compress/fuzz/reseal.h"
#include "compress/uplink_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using cdcca::cloud::fuzz::kSpecBytes;
  if (size < kSpecBytes) return 0;
  const cdcca::cloud::SampleSpec spec = cdcca::cloud::fuzz::SpecFromBytes(data);
  const std::string payload = cdcca::compress::fuzz::Reseal(data + kSpecBytes, size - kSpecBytes);
  absl::StatusOr<cdcca::cloud::CheckedBatch> checked =
      cdcca::cloud::DecodeCheckedPayload(payload, spec);
  if (!checked.ok()) return 0;
  if (checked->samples.empty() || checked->samples.size() > spec.max_samples_per_batch ||
      checked->decoded_bytes > spec.max_decoded_bytes_per_batch) {
    __builtin_trap();
  }
  for (const cdcca::compress::UplinkSample& s : checked->samples) {
    if ((spec.grid_tokens != 0 && s.grid_tokens != spec.grid_tokens) ||
        (spec.feature_dim != 0 && s.feature_dim != spec.feature_dim) || s.prompt_tokens.empty() ||
        s.prompt_tokens.size() > spec.max_prompt_tokens ||
        s.answer_tokens.size() > spec.max_answer_tokens) {
      __builtin_trap();
    }
    if (spec.vocab_size != 0) {
      for (uint32_t t : s.prompt_tokens) {
        if (t >= spec.vocab_size) __builtin_trap();
      }
      for (uint32_t t : s.answer_tokens) {
        if (t >= spec.vocab_size) __builtin_trap();
      }
    }
    if (!s.frame.empty()) {
      // Only a cloud that takes frames takes one, and only of its tower's size, baseline,
      // within 3 bytes a pixel + 64 KiB: what it may hand the JPEG decoder.
      if (spec.frame_width == 0) __builtin_trap();
      absl::StatusOr<cdcca::compress::JpegSize> jpeg = cdcca::compress::ReadJpegSize(s.frame);
      if (!jpeg.ok() || jpeg->progressive ||
          static_cast<uint32_t>(jpeg->width) != spec.frame_width ||
          static_cast<uint32_t>(jpeg->height) != spec.frame_height ||
          s.frame.size() > uint64_t{spec.frame_width} * spec.frame_height * 3 + (64u << 10)) {
        __builtin_trap();
      }
    }
  }
  return 0;
}
