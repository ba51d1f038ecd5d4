// Checkpoints of the MLLM family. A family is a folder that is also the student's Hugging
// Face BLIP-2 model folder (SaveBlip2FamilyFolder: config.json, model.safetensors with the
// shared ViT, tokenizer.json, preprocessor_config.json, ...), with the teacher's folder in
// teacher/; the student's config.json holds the family (sizes, vocabulary, pretraining
// record, fingerprints) in its "cdcca" object. Pretraining's stage files (a tower or the
// encoder in one safetensors file whose __metadata__ holds its config) use SaveTower /
// SaveVisionEncoder.
//
// The fingerprint of a tower is a 64-bit FNV-1a hash over the names, shapes and fp32 bytes
// of its frozen base (every parameter and buffer outside the trainable set, with quantized
// weights replaced by their dequantized fp32 values). An int8 student and the fp32 cloud
// mirror built from it therefore have the same fingerprint.
//
// Loading is strict: a missing, misshaped or extra tensor fails with InvalidArgument naming
// the tensor. All functions are thread-compatible (no shared state).
#ifndef CDCCA_MODEL_FAMILY_CHECKPOINT_H_
#define CDCCA_MODEL_FAMILY_CHECKPOINT_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/family/blip2_tower.h"
#include "model/family/config.h"
#include "model/family/trainable.h"
#include "model/family/vision_encoder.h"

namespace cdcca::model {

// Every parameter and buffer of `module`, by name (parameters first, then buffers).
NamedTensors ModuleState(const torch::nn::Module& module);

// Copies `state` into `module` in place (converting device and dtype as needed).
// InvalidArgument naming the tensor if one is missing, misshaped or not in the module.
absl::Status LoadModuleState(torch::nn::Module& module, const NamedTensors& state);

// The fp32 state an equivalent fp32 model would have: quantized layers contribute
// "<layer>.weight" = their dequantized weight instead of the placeholder they register. This
// is what the cloud mirror computes with, so it computes with exactly the device's weights.
NamedTensors DequantizedState(const Blip2Tower& model);

// A copy of `model` whose frozen base is stored at `precision` (quantizing, or
// dequantizing for fp32). The trainable set is copied unchanged. Converting an int8/int4
// model to fp32 yields the cloud mirror; converting that mirror back to the same precision
// reproduces the device's stored base exactly.
absl::StatusOr<Blip2Tower> ConvertPrecision(const Blip2Tower& model, Precision precision);

// An exact copy of `model` (same precision, device and training mode) whose parameters and
// buffers are its own; the packed weights of quantized layers, which nothing trains or
// writes, are shared rather than copied (a quantized layer holds no float weight to copy).
absl::StatusOr<Blip2Tower> CopyTower(const Blip2Tower& model);

uint64_t BaseFingerprint(const Blip2Tower& model);
// FNV-1a over every parameter and buffer of `module` (names sorted, shapes, fp32 values): the
// vision tower's identity that Register compares between a device and its cloud's teacher.
uint64_t ModuleFingerprint(const torch::nn::Module& module);
std::string FingerprintHex(uint64_t fingerprint);  // 16 lowercase hex digits

// Storage of the frozen linear bases (bytes), as stored (quantized or fp32).
int64_t LinearBaseBytes(const Blip2Tower& model);

// One tower in one file (its DequantizedState); `role` ("teacher", "student", ...) and the
// tower config go into the metadata.
absl::Status SaveTower(const std::string& path, const Blip2Tower& model, const std::string& role);
// Loads a tower file at its stored precision, or at `precision` when given.
absl::StatusOr<Blip2Tower> LoadTower(const std::string& path);
absl::StatusOr<Blip2Tower> LoadTower(const std::string& path, Precision precision);

absl::Status SaveVisionEncoder(const std::string& path, const VisionEncoder& encoder);
absl::StatusOr<VisionEncoder> LoadVisionEncoder(const std::string& path);

// A whole family in directory `dir` (see the top of this file). `vocabulary` lists the words
// by id (datasets::Tokenizer's tokens; it becomes tokenizer.json). `extra_json` (JSON object
// text, or "") is stored under "training" in the family (pretraining puts its record there).
// fp32 towers whose adapter gates are zero (SaveBlip2FamilyFolder's conditions); their LoRA
// is folded into the weights, and loading starts LoRA and adapter prompts afresh, the same
// way on every machine (a fixed seed), so a device and its cloud mirror start equal.
struct FamilyCheckpoint {
  FamilyConfig config;
  VisionEncoder encoder{nullptr};
  Blip2Tower teacher{nullptr};
  Blip2Tower student{nullptr};
};
absl::Status SaveFamily(const std::string& dir, const FamilyConfig& config,
                        const VisionEncoder& encoder, const Blip2Tower& teacher,
                        const Blip2Tower& student, const std::string& extra_json,
                        const std::vector<std::string>& vocabulary);
// Loads and checks each tower's fingerprint against the family (DataLoss on mismatch). The
// student is converted to `student_precision`. The encoder is put in eval() mode.
absl::StatusOr<FamilyCheckpoint> LoadFamily(const std::string& dir, Precision student_precision);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_CHECKPOINT_H_
