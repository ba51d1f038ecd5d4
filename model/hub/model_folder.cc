#include "model/hub/model_folder.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/hub/folder_config.h"
#include "model/hub/weight_pack.h"

namespace cdcca::model {
namespace {

using nlohmann::json;

// Stored checkpoint names -> the canonical names (transformers 5's module tree), by
// config.json model_type; the first rule whose prefix matches applies. Published
// (transformers 4.x) LLaVA checkpoints store `language_model.model.*`,
// `language_model.lm_head.*` and `vision_tower.vision_model.*`; transformers 5.x saves the
// same legacy prefixes but the tower without `vision_model.`; a canonical name maps to itself.
struct NameRule {
  const char* model_type;
  const char* stored_prefix;
  const char* canonical_prefix;
  bool transformers4;  // only transformers-4.x checkpoints store this prefix
};
constexpr NameRule kNameRules[] = {
    {"llava", "language_model.model.", "model.language_model.", false},
    {"llava", "language_model.lm_head.", "lm_head.", false},
    {"llava", "vision_tower.vision_model.", "model.vision_tower.vision_model.", true},
    {"llava", "vision_tower.", "model.vision_tower.vision_model.", false},
    {"llava", "model.vision_tower.vision_model.", "model.vision_tower.vision_model.", false},
    {"llava", "model.vision_tower.", "model.vision_tower.vision_model.", false},
    {"llava", "multi_modal_projector.", "model.multi_modal_projector.", false},
};

bool ParseDtype(const std::string& name, torch::ScalarType* t) {
  static const std::pair<const char*, torch::ScalarType> kDtypes[] = {
      {"F64", torch::kDouble},    {"F32", torch::kFloat}, {"F16", torch::kHalf},
      {"BF16", torch::kBFloat16}, {"I64", torch::kLong},  {"I32", torch::kInt},
      {"I16", torch::kShort},     {"I8", torch::kChar},   {"U8", torch::kByte},
      {"BOOL", torch::kBool}};
  for (const auto& [n, type] : kDtypes) {
    if (name == n) {
      *t = type;
      return true;
    }
  }
  return false;
}

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<ModelFolder> ModelFolder::Open(const std::string& dir) {
  ModelFolder f;
  f.dir_ = dir;
  absl::StatusOr<json> config = ReadJsonFile(f.config_path());
  if (!config.ok()) return config.status();
  // An object whose model_type (read by IndexFile and the loaders) is a string, or absent.
  if (absl::StatusOr<std::string> type = ConfigModelType(*config, f.config_path()); !type.ok()) {
    return type.status();
  }
  f.config_ = *std::move(config);

  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  std::error_code ec;
  if (std::filesystem::exists(index, ec)) {
    absl::StatusOr<json> idx = ReadJsonFile(index);
    if (!idx.ok()) return idx.status();
    absl::StatusOr<std::map<std::string, std::string>> weight_map =
        ParseSafetensorsIndex(*idx, index);
    if (!weight_map.ok()) return weight_map.status();
    std::set<std::string> shards;
    for (const auto& [name, shard] : *weight_map) shards.insert(shard);
    for (const std::string& shard : shards) {
      if (absl::Status s = f.IndexFile(dir + "/" + shard); !s.ok()) return s;
    }
    // Every tensor the index names must be in the shard it names.
    std::map<std::string, std::string> file_of;  // disk name -> file
    for (const auto& [name, e] : f.tensors_) file_of[e.disk_name] = e.file;
    for (const auto& [name, shard] : *weight_map) {
      auto it = file_of.find(name);
      if (it == file_of.end() || it->second != dir + "/" + shard) {
        return absl::DataLossError(absl::StrCat(index, ": tensor ", name, " is not in ", shard));
      }
    }
  } else if (std::filesystem::exists(single, ec)) {
    if (absl::Status s = f.IndexFile(single); !s.ok()) return s;
  } else {
    return absl::NotFoundError(
        absl::StrCat(dir, ": neither model.safetensors nor model.safetensors.index.json"));
  }
  return f;
}

absl::StatusOr<ModelFolder> ModelFolder::OpenFile(const std::string& path) {
  ModelFolder f;
  f.dir_ = std::filesystem::path(path).parent_path().string();
  f.config_ = json::object();
  if (absl::Status s = f.IndexFile(path); !s.ok()) return s;
  return f;
}

absl::Status TensorSink::AdoptPacked(const std::string& local_name, const QuantizedWeight& q) {
  return absl::UnimplementedError(absl::StrCat("tensor ", local_name, " is not held packed"));
}

absl::Status ModelFolder::IndexFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  uint64_t n = 0;
  if (size < 8 || !in.read(reinterpret_cast<char*>(&n), 8)) {
    return absl::DataLossError(absl::StrCat(path, ": truncated (no header length)"));
  }
  if (n > size - 8) {
    return absl::DataLossError(
        absl::StrCat(path, ": truncated: header of ", n, " bytes, file has ", size));
  }
  std::string head(n, '\0');
  if (!in.read(head.data(), static_cast<std::streamsize>(n))) {
    return absl::DataLossError(absl::StrCat(path, ": cannot read header"));
  }
  json header;
  try {
    header = json::parse(head);
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": bad header JSON: ", e.what()));
  }
  if (!header.is_object()) return absl::DataLossError(absl::StrCat(path, ": header not an object"));
  // Open() checked it: a string, absent or null ("").
  const std::string model_type = ConfigModelType(config_, dir_).value_or("");
  const uint64_t data_start = 8 + n;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") {
      if (!item.value().is_object()) {
        return absl::DataLossError(absl::StrCat(path, ": __metadata__ is not an object"));
      }
      for (const auto& m : item.value().items()) {
        if (m.value().is_string()) metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    TensorEntry e;
    e.file = path;
    e.disk_name = item.key();
    try {
      const json& v = item.value();
      if (!ParseDtype(v.at("dtype").get<std::string>(), &e.dtype)) {
        return absl::DataLossError(absl::StrCat(path, ": tensor ", e.disk_name,
                                                ": unsupported dtype ", v.at("dtype").dump()));
      }
      e.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto offsets = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1]) {
        return absl::DataLossError(
            absl::StrCat(path, ": tensor ", e.disk_name, ": bad data_offsets"));
      }
      e.offset = data_start + offsets[0];
      e.bytes = offsets[1] - offsets[0];
    } catch (const json::exception& ex) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor ", e.disk_name, ": malformed entry: ", ex.what()));
    }
    uint64_t numel = 1;
    for (int64_t s : e.shape) {
      if (s < 0)
        return absl::DataLossError(absl::StrCat(path, ": tensor ", e.disk_name, ": bad shape"));
      numel *= static_cast<uint64_t>(s);
    }
    if (numel * c10::elementSize(e.dtype) != e.bytes) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", e.disk_name, ": ", e.bytes,
                                              " bytes for shape ", ShapeString(e.shape)));
    }
    if (e.offset + e.bytes > size) {
      return absl::DataLossError(absl::StrCat(path, ": truncated: tensor ", e.disk_name,
                                              " ends at byte ", e.offset + e.bytes, ", file has ",
                                              size));
    }
    std::string name = e.disk_name;
    for (const NameRule& r : kNameRules) {
      if (model_type == r.model_type && absl::StartsWith(name, r.stored_prefix)) {
        name = absl::StrCat(r.canonical_prefix, name.substr(std::strlen(r.stored_prefix)));
        if (r.transformers4) layout_ = NameLayout::kTransformers4;
        break;
      }
    }
    if (!tensors_.emplace(name, std::move(e)).second) {
      return absl::DataLossError(absl::StrCat(path, ": tensor ", name, " appears twice"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> ModelFolder::Names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, e] : tensors_) out.push_back(name);
  return out;
}

std::string ModelFolder::FileOf(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? "" : it->second.file;
}

absl::StatusOr<std::vector<int64_t>> ModelFolder::ShapeOf(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": tensor ", name, " missing"));
  }
  return it->second.shape;
}

namespace {

// A tensor's bytes read into `raw` (uint8 on a CUDA device) through page-locked host chunks:
// each chunk's copy to the device runs while the next chunk is read from the file. A chunk
// dropped while its copy is in flight is not reused before the copy ends (LibTorch's caching
// host allocator records the copy's stream), so this needs no synchronization of its own.
// The pageable path (read into host memory, then .to(device)) faults in and writes every byte
// once more and copies through the driver's staging buffer.
bool ReadPinned(std::ifstream& in, torch::Tensor& raw) {
  constexpr int64_t kChunk = int64_t{64} << 20;
  const int64_t bytes = raw.numel();
  for (int64_t off = 0; off < bytes; off += kChunk) {
    const int64_t n = std::min(kChunk, bytes - off);
    torch::Tensor host = torch::empty({n}, torch::dtype(torch::kUInt8).pinned_memory(true));
    if (!in.read(static_cast<char*>(host.data_ptr()), static_cast<std::streamsize>(n))) {
      return false;
    }
    raw.narrow(0, off, n).copy_(host, /*non_blocking=*/true);
  }
  return true;
}

// CDCCA_PAGEABLE_LOAD set: CUDA loads take the pageable path (for measuring the difference).
bool PinnedLoads() {
  static const bool pinned = std::getenv("CDCCA_PAGEABLE_LOAD") == nullptr;
  return pinned;
}

}  // namespace

absl::StatusOr<torch::Tensor> ModelFolder::Load(const std::string& name, torch::ScalarType dtype,
                                                torch::Device device) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(dir_, ": tensor ", name, " missing"));
  }
  const TensorEntry& e = it->second;
  std::ifstream in(e.file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", e.file));
  auto short_read = [&] {
    return absl::DataLossError(absl::StrCat(e.file, ": tensor ", e.disk_name, ": short read"));
  };
  try {
    in.seekg(static_cast<std::streamoff>(e.offset));
    torch::Tensor t;
    if (device.is_cuda() && e.bytes > 0 && PinnedLoads()) {
      torch::Tensor raw =
          torch::empty({static_cast<int64_t>(e.bytes)}, torch::dtype(torch::kUInt8).device(device));
      if (!ReadPinned(in, raw)) return short_read();
      t = raw.view(e.dtype).view(e.shape);
    } else {
      t = torch::empty(e.shape, torch::dtype(e.dtype));
      if (e.bytes > 0 &&
          !in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.bytes))) {
        return short_read();
      }
    }
    if (torch::isFloatingType(e.dtype)) return t.to(device, dtype);
    return t.to(device);
  } catch (const c10::Error& ex) {
    return absl::InternalError(
        absl::StrCat(e.file, ": tensor ", e.disk_name, ": ", ex.what_without_backtrace()));
  }
}

absl::Status ModelFolder::LoadInto(torch::nn::Module& module, const std::string& prefix,
                                   const LoadIntoOptions& options) const {
  torch::NoGradGuard no_grad;
  std::set<std::string> consumed;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    torch::nn::Module& m = *item.value();
    const std::string mod_prefix = item.key().empty() ? prefix : prefix + item.key() + ".";
    auto* sink = dynamic_cast<TensorSink*>(&m);
    std::vector<std::pair<std::string, torch::Tensor>> slots;
    for (const auto& p : m.named_parameters(/*recurse=*/false))
      slots.emplace_back(p.key(), p.value());
    for (const auto& b : m.named_buffers(/*recurse=*/false)) slots.emplace_back(b.key(), b.value());
    for (auto& [local, slot] : slots) {
      const std::string name = mod_prefix + local;
      if (sink != nullptr && pack_ != nullptr && pack_->Has(name)) {
        absl::StatusOr<QuantizedWeight> q = pack_->Load(name, options.device);
        if (!q.ok()) return q.status();
        if (absl::Status s = sink->AdoptPacked(local, *q); !s.ok()) {
          return absl::Status(s.code(),
                              absl::StrCat(pack_->path(), ": tensor ", name, ": ", s.message()));
        }
        consumed.insert(name);
        continue;
      }
      auto it = tensors_.find(name);
      if (it == tensors_.end()) {
        return absl::NotFoundError(absl::StrCat(
            dir_, ": tensor ", name, " missing (expected shape ", ShapeString(slot.sizes()), ")"));
      }
      if (c10::IntArrayRef(it->second.shape) != slot.sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            it->second.file, ": tensor ", it->second.disk_name, " has shape ",
            ShapeString(it->second.shape), ", the model expects ", ShapeString(slot.sizes())));
      }
      const torch::ScalarType dtype = options.dtype.value_or(slot.scalar_type());
      absl::StatusOr<torch::Tensor> t = Load(name, dtype, options.device);
      if (!t.ok()) return t.status();
      consumed.insert(name);
      if (sink != nullptr) {
        if (absl::Status s = sink->Adopt(local, *std::move(t)); !s.ok()) {
          return absl::Status(s.code(), absl::StrCat(it->second.file, ": tensor ",
                                                     it->second.disk_name, ": ", s.message()));
        }
        if (const QuantizedWeight* q = sink->Packed(local); q != nullptr) RecordPacked(name, *q);
      } else {
        slot.set_data(*t);
      }
    }
  }
  if (options.unused != nullptr) {
    options.unused->clear();
    for (const auto& [name, e] : tensors_) {
      if (absl::StartsWith(name, prefix) && consumed.count(name) == 0) {
        options.unused->push_back(name);
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<QuantizedWeight>> ModelFolder::PackedTensor(
    const std::string& name, torch::Device device) const {
  if (pack_ == nullptr || !pack_->Has(name)) return std::nullopt;
  absl::StatusOr<QuantizedWeight> q = pack_->Load(name, device);
  if (!q.ok()) return q.status();
  return *std::move(q);
}

void ModelFolder::RecordPacked(const std::string& name, const QuantizedWeight& q) const {
  if (pack_writer_ != nullptr) pack_writer_->Add(name, q);
}

}  // namespace cdcca::model
