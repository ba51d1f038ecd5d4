// What the cloud accepts of an uplinked batch: the model's sample shape and per-batch
// bounds. The service checks every batch against it at ingest (a batch that fails is never
// stored, and the device is told why and whether it can ever pass), and the trainer checks
// stored batches again before training on them (a log written by an older version may hold
// batches that would fail today).
//
// Torch-free; thread-safe (pure functions over values).
#ifndef CDCCA_CLOUD_UPLINK_CHECK_H_
#define CDCCA_CLOUD_UPLINK_CHECK_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "compress/uplink_codec.h"
#include "proto/cdcca.pb.h"

namespace cdcca::cloud {

// The sample codec's format version this cloud reads (UplinkBatch.codec_version).
inline constexpr uint32_t kUplinkCodecVersion = 1;

struct SampleSpec {
  // The model's visual token grid and token width; every sample must have exactly these.
  // 0 = any within the codec's limits (a transport-only cloud without a model).
  uint32_t grid_tokens = 0;
  uint32_t feature_dim = 0;
  // Prompt and answer token ids must be below this. 0 = unchecked.
  uint32_t vocab_size = 0;
  // Longest prompt and answer, in tokens. Defaults: the codec's bounds (512, 128).
  uint32_t max_prompt_tokens = 512;
  uint32_t max_answer_tokens = 128;
  // Most samples one batch may hold. Default: 1024 (devices send 8).
  uint32_t max_samples_per_batch = 1024;
  // Most bytes one batch may decompress to (the codec's body, checked from its header
  // before anything is decompressed). Default: 16 MiB.
  uint64_t max_decoded_bytes_per_batch = 16ull << 20;
  // Frames (jpeg batches): the size of the vision tower's input the cloud recomputes tokens
  // from; a frame must declare exactly this size (compress::ReadJpegSize, before anything
  // decodes it). 0 = this cloud takes no frames (a cdcca family, or a processor whose
  // output size depends on the image).
  uint32_t frame_width = 0;
  uint32_t frame_height = 0;
  // Every sample must be a frame: the cloud trains the student's vision tower from frames
  // (--lora_vision), which a sample of tokens cannot train.
  bool frames_only = false;
};

// What a checked batch holds.
struct CheckedBatch {
  std::vector<compress::UplinkSample> samples;
  uint64_t decoded_bytes = 0;  // the codec body's size
};

// Decodes `payload` and checks every sample against `spec`: INVALID_ARGUMENT (or DATA_LOSS
// for a damaged payload) naming the sample and field that fail. Never decompresses more
// than spec.max_decoded_bytes_per_batch.
absl::StatusOr<CheckedBatch> DecodeCheckedPayload(absl::string_view payload,
                                                  const SampleSpec& spec);

// The ingest check of one uplink batch: codec_version, payload (as above), and
// sample_count equal to the samples the payload holds. Returns the decoded batch.
absl::StatusOr<CheckedBatch> CheckUplinkBatch(const v1::UplinkBatch& batch, const SampleSpec& spec);

// Every error the checks above return carries the reason of the refusal (v1::RefusalReason)
// as a payload of the status; RefusalReasonOf reads it (REFUSAL_REASON_UNSPECIFIED when a
// status has none) and WithRefusalReason attaches it.
v1::RefusalReason RefusalReasonOf(const absl::Status& status);
absl::Status WithRefusalReason(absl::Status status, v1::RefusalReason reason);

// What a device should do with a batch refused for `reason`: drop it (a batch that will
// never fit this cloud), send it again later (quota, storage), or renumber (sequence gap).
v1::UplinkRefusal RefusalFor(v1::RefusalReason reason);

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_UPLINK_CHECK_H_
