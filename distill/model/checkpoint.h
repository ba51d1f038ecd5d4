// Checkpoints of the MLLM family: one safetensors file per part (vision encoder, teacher,
// student) whose __metadata__ holds the part's config, plus a config.json in the
// checkpoint directory (architecture, sizes, vocabulary, precision, fingerprints).
//
// The fingerprint of a tower is a 64-bit FNV-1a hash over the names, shapes and fp32 bytes
// of its frozen base (every parameter and buffer outside the trainable set, with quantized
// weights replaced by their dequantized fp32 values). An int8 student and the fp32 cloud
// mirror built from it therefore have the same fingerprint.
//
// Loading is strict: a missing, misshaped or extra tensor fails with InvalidArgument naming
// the tensor. All functions are thread-compatible (no shared state).
#ifndef CDCCA_DISTILL_MODEL_CHECKPOINT_H_
#define CDCCA_DISTILL_MODEL_CHECKPOINT_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "distill/model/config.h"
#include "distill/model/mllm.h"
#include "distill/model/trainable.h"
#include "distill/model/vision_encoder.h"

namespace cdcca::model {

// Every parameter and buffer of `module`, by name (parameters first, then buffers).
NamedTensors ModuleState(const torch::nn::Module& module);

// Copies `state` into `module` in place (converting device and dtype as needed).
// InvalidArgument naming the tensor if one is missing, misshaped or not in the module.
absl::Status LoadModuleState(torch::nn::Module& module, const NamedTensors& state);

// The fp32 state an equivalent fp32 model would have: quantized layers contribute
// "<layer>.weight" = their dequantized weight instead of "qweight"/"qscale". This is what
// the cloud mirror loads, so it computes with exactly the device's weights.
NamedTensors DequantizedState(const Mllm& model);

// A copy of `model` whose frozen base is stored at `precision` (quantizing, or
// dequantizing for fp32). The trainable set is copied unchanged. Converting an int8/int4
// model to fp32 yields the cloud mirror; converting that mirror back to the same precision
// reproduces the device's stored base exactly.
absl::StatusOr<Mllm> ConvertPrecision(const Mllm& model, Precision precision);

uint64_t BaseFingerprint(const Mllm& model);
std::string FingerprintHex(uint64_t fingerprint);  // 16 lowercase hex digits

// Storage of the frozen linear bases (bytes), as stored (quantized or fp32).
int64_t LinearBaseBytes(const Mllm& model);
// Turns the per-layer dequantized-weight cache on or off (see AdaptedLinear).
void SetDequantCache(Mllm& model, bool on);

// One tower in one file; `role` ("teacher", "student", ...) goes into the metadata.
absl::Status SaveMllm(const std::string& path, const Mllm& model, const std::string& role);
// Loads a tower file. Its stored precision is kept unless `precision` says otherwise (then
// the loaded model is converted with ConvertPrecision).
absl::StatusOr<Mllm> LoadMllm(const std::string& path);
absl::StatusOr<Mllm> LoadMllm(const std::string& path, Precision precision);

absl::Status SaveVisionEncoder(const std::string& path, const VisionEncoder& encoder);
absl::StatusOr<VisionEncoder> LoadVisionEncoder(const std::string& path);

// A whole family in directory `dir`: encoder.safetensors, teacher.safetensors,
// student.safetensors and config.json. `extra` (JSON object text, or "") is stored under
// "training" in config.json (pretraining puts its record there).
struct FamilyCheckpoint {
  FamilyConfig config;
  VisionEncoder encoder{nullptr};
  Mllm teacher{nullptr};
  Mllm student{nullptr};
};
absl::Status SaveFamily(const std::string& dir, const FamilyConfig& config,
                        const VisionEncoder& encoder, const Mllm& teacher, const Mllm& student,
                        const std::string& extra_json);
// Loads and checks each tower's fingerprint against config.json (DataLoss on mismatch). The
// student is converted to `student_precision`. The encoder is put in eval() mode.
absl::StatusOr<FamilyCheckpoint> LoadFamily(const std::string& dir, Precision student_precision);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_CHECKPOINT_H_
