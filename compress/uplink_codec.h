// The uplink sample codec: what a device sends the cloud for each sample that UTS kept.
// Torch-free (plain vectors in and out), so it builds anywhere and can be fuzzed.
//
// Batch layout (the `payload` of one v1::UplinkBatch), integers little-endian:
//   u32 magic 'C','D','U','P' | u16 version | u16 precision | u32 sample count |
//   u64 body size (uncompressed) | zstd frame of the body | u64 Hash64 of all bytes before it
// Body: per sample
//   u64 sample id | u64 model version | f32 entropy (nats) |
//   u16 grid tokens | u16 feature dim | u16 kept count | kept count x u16 token index
//     (strictly increasing, < grid tokens) |
//   u16 prompt length | prompt x u32 token id | u16 answer length | answer x u32 token id |
//   features of the kept tokens, row by row:
//     fp16: kept x dim x u16 (IEEE half);
//     int8: kept x (f32 scale + dim x i8), value = scale * q, scale = max|x| / 127;
//     int4: kept x (f32 scale + ceil(dim / 2) bytes), two 4-bit codes a byte (low nibble
//       first; the last high nibble of an odd dim is 0), value = scale * (code - 8),
//       scale = max|x| / 7.
//     jpeg: no features; instead u32 frame length | the frame's JPEG bytes (after the answer),
//       and the kept indices as a bitmask of ceil(grid / 8) bytes (token t = bit t % 8 of
//       byte t / 8) in place of the u16 list.
// Pixels appear only in a jpeg batch: a pair shares its frozen vision tower (Register checks
// its fingerprint), so a device may send the frame it answered (resized to the tower's input,
// as JPEG) and the kept indices instead of the tokens; the cloud decodes it, runs the tower
// and keeps the rows of the kept indices. The teacher then reads tokens of the decoded frame,
// not the device's exact ones. Otherwise visual tokens are the cloud's input.
#ifndef CDCCA_COMPRESS_UPLINK_CODEC_H_
#define CDCCA_COMPRESS_UPLINK_CODEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::compress {

enum class FeaturePrecision : uint16_t { kFp16 = 1, kInt8 = 2, kInt4 = 3, kJpeg = 4 };

// "fp16", "int8", "int4", "jpeg".
const char* FeaturePrecisionName(FeaturePrecision precision);
// The precision a name stands for; INVALID_ARGUMENT listing the names for any other.
absl::StatusOr<FeaturePrecision> ParseFeaturePrecision(absl::string_view name);

// One kept sample. `features` holds kept_indices.size() x feature_dim floats, row-major; in
// a jpeg batch it is empty and `frame` holds the JPEG the tokens are to be recomputed from.
struct UplinkSample {
  uint64_t sample_id = 0;
  uint64_t model_version = 0;
  float entropy = 0;         // mean answer-token entropy (nats), UTS stage 1
  uint32_t grid_tokens = 0;  // visual tokens the encoder produced (e.g. 64)
  uint32_t feature_dim = 0;
  std::vector<uint16_t> kept_indices;  // UTS stage 2; strictly increasing
  std::vector<uint32_t> prompt_tokens;
  std::vector<uint32_t> answer_tokens;  // the device's own answer
  std::vector<float> features;
  std::string frame;  // jpeg batches only
};

// Bounds checked by both encode and decode. Defaults fit every cdcca model config.
struct UplinkLimits {
  uint32_t max_samples = 4096;
  uint32_t max_grid_tokens = 4096;
  uint32_t max_feature_dim = 4096;
  uint32_t max_prompt_tokens = 512;
  uint32_t max_answer_tokens = 128;
  uint64_t max_body_bytes = 64ull << 20;  // uncompressed. Default: 64 MiB
  uint32_t max_frame_bytes = 4u << 20;    // one jpeg sample's frame. Default: 4 MiB
};

// The checks EncodeUplinkBatch makes of each sample: OK when `sample` encodes at
// `precision` within `limits`; INVALID_ARGUMENT naming the field that breaks a bound.
absl::Status CheckUplinkSample(const UplinkSample& sample, FeaturePrecision precision,
                               const UplinkLimits& limits = {});

// Encodes `samples` (at least one) into one batch payload. INVALID_ARGUMENT names the
// sample and field that break a bound. zstd_level: 1-19 (default 3).
absl::StatusOr<std::string> EncodeUplinkBatch(const std::vector<UplinkSample>& samples,
                                              FeaturePrecision precision,
                                              const UplinkLimits& limits = {}, int zstd_level = 3);

// Decodes and validates a payload. DATA_LOSS for a bad checksum, a truncated or overlong
// payload, or a body that does not match its sizes; INVALID_ARGUMENT for values outside the
// limits. Never reads outside `payload`. Allocation: a body declared over max_body_bytes is
// rejected before any allocation; the zstd body is decoded by DecompressBoundedFrame
// (compress/zstd_frame.h: only as much as the frame really produces, <= 2 x max_body_bytes
// + 16 MiB window), and the decoded features take at most 2 x the body's bytes (fp16 ->
// float) or 4 x (int8 -> float): with the default limits, at most 64 + 256 MiB.
absl::StatusOr<std::vector<UplinkSample>> DecodeUplinkBatch(absl::string_view payload,
                                                            const UplinkLimits& limits = {});

// The width and height a JPEG declares in its start-of-frame segment, read without decoding
// (so a receiver can refuse a frame of the wrong size before any decoder allocates for it).
// INVALID_ARGUMENT for bytes that are not a baseline or progressive JPEG with a frame header
// before its first scan, that hold before it a marker other than APPn, COM, DQT, DHT, DRI or
// DAC (so a decoder finds the same frame header), or that declare a zero size or other than 1
// or 3 components. Never reads outside `jpeg`.
struct JpegSize {
  int width = 0;
  int height = 0;
  int components = 0;
  bool progressive = false;  // a progressive or lossless frame (not SOF0/SOF1 baseline)
};
absl::StatusOr<JpegSize> ReadJpegSize(absl::string_view jpeg);

// Bytes one sample's features take in the body at `precision` (before zstd).
uint64_t FeatureBytes(uint32_t kept, uint32_t dim, FeaturePrecision precision);

// IEEE 754 half conversions (round to nearest even; inf/nan kept), used for fp16 features.
// Whether the cloud's update guard holds out sample `sample_id` of device `device_id`
// (cloud/update_guard.h): a hash of the two against `fraction` (in [0, 1); <= 0: never). The
// device and the cloud decide it alike, the device when it selects tokens (it uplinks a
// held-out sample whole, every visual token, so the guard scores the mirror on what the
// device really answers from) and the cloud when it splits a job's samples. The choice is the
// same in every job and after a restart; a device steers it only by choosing its sample ids,
// which only takes samples from its own training. A device assigns each sample a distinct id.
bool IsHeldOutSample(absl::string_view device_id, uint64_t sample_id, double fraction);

uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_UPLINK_CODEC_H_
