// A folder's frozen weights as cdcca quantizes them (int8, int4 in groups), stored once so
// that later loads read the packed bytes instead of reading the checkpoint's floats and
// quantizing them again:
//   <dir>/cdcca-packed/int8.safetensors, <dir>/cdcca-packed/int4-g<group>.safetensors
// A subfolder, so transformers never reads it and FolderFingerprint (which hashes the
// folder's top level only) is the same with or without it: a device or a cloud that loads
// through a pack reports the fingerprint it reports without one.
//
// Per packed tensor (its canonical name, model_folder.h) the file holds "<name>:values" and
// "<name>:scales", exactly QuantizedWeight's tensors (quantize.h), so a model loaded through
// the pack holds bit for bit what quantizing at load gives. Metadata: format
// "cdcca-weight-pack" version 1, precision, group, and the folder's fingerprint at writing:
// a pack of other weights (the folder changed since) is not used.
//
// `cdcca pack --model DIR --precision int4` writes one (LoadModel with WeightPackUse::kWrite).
//
// Thread-safety: const methods may be called concurrently; WeightPackWriter is not
// thread-safe.
#ifndef CDCCA_MODEL_HUB_WEIGHT_PACK_H_
#define CDCCA_MODEL_HUB_WEIGHT_PACK_H_

#include <torch/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/family/config.h"
#include "model/hub/model_folder.h"
#include "model/runtime/quantize.h"

namespace cdcca::model {

class WeightPack {
 public:
  // Where the pack of `dir` at this precision lives (group only matters for int4).
  static std::string PathFor(const std::string& dir, Precision precision, int64_t group);

  // The pack of `dir` at this precision, when there is one made from the weights whose
  // FolderFingerprint is `fingerprint`. nullptr when there is none; nullptr and *why set
  // when one is there but cannot be used (made from other weights, another precision or
  // group, another format, or damaged: the reason names the file).
  static std::unique_ptr<WeightPack> Find(const std::string& dir, Precision precision,
                                          int64_t group, uint64_t fingerprint, std::string* why);

  const std::string& path() const { return path_; }
  bool Has(const std::string& name) const;
  // The packed form of tensor `name` on `device`. NotFound when the pack has none; DataLoss
  // naming the file on a short read.
  absl::StatusOr<QuantizedWeight> Load(const std::string& name, torch::Device device) const;
  // How many tensors Load has returned.
  int64_t loads() const { return loads_.load(); }

 private:
  WeightPack(std::string path, ModelFolder file) : path_(std::move(path)), file_(std::move(file)) {}

  std::string path_;
  ModelFolder file_;
  mutable std::atomic<int64_t> loads_{0};
};

// Collects what a load packed, then writes it as the folder's pack.
class WeightPackWriter {
 public:
  // Keeps references to `q`'s tensors (the model's own; nothing is copied until Write).
  void Add(const std::string& name, const QuantizedWeight& q);
  int64_t tensors() const { return static_cast<int64_t>(entries_.size()) / 2; }
  int64_t bytes() const;
  // Writes WeightPack::PathFor(dir, ...) (creating cdcca-packed/) atomically, one tensor at a
  // time. Unavailable naming the file when it cannot be written.
  absl::Status Write(const std::string& dir, Precision precision, int64_t group,
                     uint64_t fingerprint) const;

 private:
  std::vector<std::pair<std::string, torch::Tensor>> entries_;
};

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_WEIGHT_PACK_H_
