// A Hugging Face model folder as published on the Hub or saved by transformers:
// config.json plus model.safetensors, or model-0000N-of-0000M.safetensors shards indexed by
// model.safetensors.index.json. fp32, fp16 and bf16 tensors.
//
// Tensor names taken or returned here are canonical: transformers 5's module tree (LLaVA:
// `model.language_model.*`, `lm_head.*`, `model.vision_tower.vision_model.*`). Stored names
// (4.x: `vision_tower.vision_model.*`; what 5.x saves: `vision_tower.*`; both
// `language_model.model.*`) are translated at Open() by kNameRules (model_folder.cc) alone.
//
// Open() reads only the safetensors headers; Load() reads one tensor's bytes with a seek, so
// a sharded checkpoint is never held in memory whole.
//
// Thread-safety: const methods may be called concurrently (each Load opens its own stream).
#ifndef CDCCA_MODEL_HUB_HF_FOLDER_H_
#define CDCCA_MODEL_HUB_HF_FOLDER_H_

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/hub/folder_json.h"
#include "model/runtime/quantize.h"
#include "nlohmann/json.hpp"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace cdcca::model {

// A module that takes its loaded tensors itself (e.g. a linear layer that quantizes its
// weight as it arrives, so no full-precision copy stays resident). ModelFolder::LoadInto calls
// Adopt instead of assigning the parameter when the owning module implements this.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  // `local_name` is the parameter/buffer name inside the module ("weight"); `tensor` has the
  // checked shape, on the requested device and dtype.
  virtual absl::Status Adopt(const std::string& local_name, torch::Tensor tensor) = 0;
  // The packed (quantized) form this sink keeps of `local_name` once adopted; nullptr where it
  // keeps floats. A load that writes a weight pack (weight_pack.h) records it.
  virtual const QuantizedWeight* Packed(const std::string& local_name) const { return nullptr; }
  // Takes `q`, what Packed gave on an earlier load of the same checkpoint at the same
  // precision, instead of the checkpoint's floats. InvalidArgument where the shape or the
  // precision differs.
  virtual absl::Status AdoptPacked(const std::string& local_name, const QuantizedWeight& q);
};

class WeightPack;
class WeightPackWriter;

struct LoadIntoOptions {
  // Where loaded tensors go. Default: CPU.
  torch::Device device = torch::kCPU;
  // dtype of loaded floating-point tensors; nullopt = the dtype the module's parameter has.
  std::optional<torch::ScalarType> dtype;
  // If set, receives the checkpoint names under the prefix that no parameter consumed.
  std::vector<std::string>* unused = nullptr;
};

class ModelFolder {
 public:
  enum class NameLayout { kTransformers5, kTransformers4 };

  // Reads <dir>/config.json and indexes the weights. Errors name the file: NotFound (no
  // config.json / no weights), InvalidArgument (bad JSON, a JSON file over folder_json.h's
  // bounds, a model_type that is not a string, an index naming a missing shard or a file
  // outside the folder), DataLoss (truncated or malformed safetensors: names the file and
  // tensor).
  static absl::StatusOr<ModelFolder> Open(const std::string& dir);
  // One safetensors file on its own (no config.json; names as stored), e.g. a weight pack.
  // Errors as Open's.
  static absl::StatusOr<ModelFolder> OpenFile(const std::string& path);

  const std::string& dir() const { return dir_; }
  std::string config_path() const { return dir_ + "/config.json"; }
  const nlohmann::json& config() const { return config_; }
  NameLayout layout() const { return layout_; }
  // The "__metadata__" entries of the weight files, merged.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  bool Has(const std::string& name) const { return tensors_.count(name) > 0; }
  // All tensor names (5.x layout), sorted.
  std::vector<std::string> Names() const;
  // The file a tensor lives in ("" if absent).
  std::string FileOf(const std::string& name) const;
  // Shape on disk; NotFound naming the tensor and the folder.
  absl::StatusOr<std::vector<int64_t>> ShapeOf(const std::string& name) const;

  // Reads one tensor, converted to `dtype` (a floating dtype; integer tensors keep theirs) and
  // moved to `device`. To a CUDA device the bytes go through page-locked host chunks, each
  // copied while the next is read (CDCCA_PAGEABLE_LOAD=1: through pageable host memory, for
  // measuring). Errors name the file and the tensor.
  absl::StatusOr<torch::Tensor> Load(const std::string& name, torch::ScalarType dtype,
                                     torch::Device device = torch::kCPU) const;

  // Fills every parameter and buffer of `module` (recursively) from `<prefix><name>`,
  // checking shapes. NotFound names the missing tensor and the folder; InvalidArgument names
  // the file, the tensor and both shapes. Modules implementing TensorSink adopt their
  // tensors themselves.
  absl::Status LoadInto(torch::nn::Module& module, const std::string& prefix,
                        const LoadIntoOptions& options = {}) const;

  // From now on LoadInto gives a sink the packed form of a tensor from `pack` where it has one
  // (instead of reading the floats), and records in `writer` what sinks packed from floats.
  // Either may be null; both must outlive the loads. Set by LoadModel.
  void UsePack(const WeightPack* pack, WeightPackWriter* writer) {
    pack_ = pack;
    pack_writer_ = writer;
  }
  // For a tensor a loader packs outside LoadInto (a token embedding): the pack's form of
  // `name` on `device`, or nullopt where UsePack gave no pack or it lacks `name`.
  absl::StatusOr<std::optional<QuantizedWeight>> PackedTensor(const std::string& name,
                                                              torch::Device device) const;
  // Records `q` as the packed form of `name` where UsePack gave a writer.
  void RecordPacked(const std::string& name, const QuantizedWeight& q) const;

 private:
  struct TensorEntry {
    std::string file;       // path of the safetensors file
    std::string disk_name;  // the name inside that file (4.x layout for old checkpoints)
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t offset = 0;  // absolute byte offset in the file
    uint64_t bytes = 0;
  };

  absl::Status IndexFile(const std::string& path);

  std::string dir_;
  nlohmann::json config_;
  NameLayout layout_ = NameLayout::kTransformers5;
  std::map<std::string, TensorEntry> tensors_;  // keyed by 5.x name
  std::map<std::string, std::string> metadata_;
  const WeightPack* pack_ = nullptr;
  WeightPackWriter* pack_writer_ = nullptr;
};

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_HF_FOLDER_H_
