// The adapted state of a Hugging Face student: its trainable set (multimodal_model.h
// AdapterOptions) after AKD, saved next to what it adapts, applied to a freshly loaded base,
// and exported as a PEFT LoRA adapter that transformers + peft load.
//
// A state folder holds
//   adapter_state.json          {"format": "cdcca-hf-adapter-state", "version": 1,
//                                "base_model": DIR, "precision": "int8", "lora_rank": 8,
//                                "lora_alpha": 16, "lora_mlp": false, "seed": 0, ...}
//   adapter_state.safetensors   the trainable set under the checkpoint's names (fp32)
// An export folder holds
//   adapter_config.json         PEFT's LoraConfig (task_type null, target_modules by name)
//   adapter_model.safetensors   "base_model.model.<module>.lora_A.weight" [r, in] and
//                               ".lora_B.weight" [out, r] per adapted linear
//   non_lora.safetensors        the rest of the trainable set (norms, biases, query tokens)
//                               under the checkpoint's names, to load into the base model
//                               (load_state_dict(strict=False)) before the adapter
//   README.md                   how to load it
//
// Pure functions over files; not thread-safe against concurrent writers of one folder.
#ifndef CDCCA_MODEL_HUB_HF_ADAPTER_STATE_H_
#define CDCCA_MODEL_HUB_HF_ADAPTER_STATE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/arch/multimodal_model.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

struct AdapterState {
  std::string base_model;   // the student's Hugging Face folder
  std::string precision;    // the base's precision when it was trained (ModelOptions)
  AdapterOptions adapters;  // rank, alpha, MLP, seed
  NamedTensors trainable;   // fp32 CPU, checkpoint names
  nlohmann::json info;      // free-form provenance (teacher, job statistics); may be null
};

// Writes `dir` (created if missing; the two files replaced atomically each).
absl::Status SaveHfAdapterState(const AdapterState& state, const std::string& dir);
// Reads a state folder. NotFound / DataLoss / InvalidArgument naming the file and field.
absl::StatusOr<AdapterState> LoadHfAdapterState(const std::string& dir);

// Adds the state's adapters to `model` (a fresh load of its base) and copies its tensors in.
// InvalidArgument naming the tensor when a name is missing on either side or a shape differs;
// the model's trainable set is then unchanged apart from the freshly added adapters.
absl::Status ApplyHfAdapterState(const AdapterState& state, MultimodalModel& model);

// Writes the PEFT export of `state` into `out_dir` (see the header comment). InvalidArgument
// for a state whose LoRA factors do not pair up.
absl::Status ExportPeftAdapter(const AdapterState& state, const std::string& out_dir);

// The identity of a folder's weights without reading them whole: FNV-1a 64 over config.json
// and, per weight file (names sorted), its name, its size and 256 evenly spaced 64 KiB
// windows of its bytes. NotFound / Internal naming the file.
absl::StatusOr<uint64_t> FolderFingerprint(const std::string& dir);

// What a device running a Hugging Face student reports as its base at Register and its cloud
// mirror expects: the folder's fingerprint, the precision its frozen base runs at,
// the adapter options and the digest of the trainable set as the adapters start
// (compress::StateDigest), so a device whose adapters differ from the cloud's is refused.
uint64_t StudentBaseFingerprint(uint64_t folder_fingerprint, const std::string& precision,
                                const AdapterOptions& adapters, uint64_t initial_trainable_digest);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_HF_ADAPTER_STATE_H_
