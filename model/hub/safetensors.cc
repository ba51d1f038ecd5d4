#include "model/hub/safetensors.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "model/hub/safetensors_view.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

using nlohmann::json;

struct DtypePair {
  torch::ScalarType torch;
  SafetensorsDtype file;
};
constexpr DtypePair kDtypes[] = {
    {torch::kDouble, SafetensorsDtype::kF64}, {torch::kFloat, SafetensorsDtype::kF32},
    {torch::kHalf, SafetensorsDtype::kF16},   {torch::kBFloat16, SafetensorsDtype::kBF16},
    {torch::kLong, SafetensorsDtype::kI64},   {torch::kInt, SafetensorsDtype::kI32},
    {torch::kShort, SafetensorsDtype::kI16},  {torch::kChar, SafetensorsDtype::kI8},
    {torch::kByte, SafetensorsDtype::kU8},    {torch::kBool, SafetensorsDtype::kBool},
};

// The file name of a torch dtype; nullptr for one the format does not carry here.
const char* DtypeToName(torch::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.torch == t) return SafetensorsDtypeName(d.file).data();
  }
  return nullptr;
}

torch::ScalarType ToTorch(SafetensorsDtype dtype) {
  for (const auto& d : kDtypes) {
    if (d.file == dtype) return d.torch;
  }
  return torch::kFloat;  // unreachable: every SafetensorsDtype is listed
}

// The 8-byte length and the JSON header of `tensors` in the given order (padded so the data
// starts 8-byte aligned, as the reference writer does); *data_bytes = the data section's size.
absl::StatusOr<std::string> EncodeHeader(
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata, uint64_t* data_bytes) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__" || header.contains(name)) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate or reserved tensor name ", name));
    }
    const char* dtype = DtypeToName(tensor.scalar_type());
    if (dtype == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": unsupported dtype ",
                                                     c10::toString(tensor.scalar_type())));
    }
    const uint64_t bytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
    header[name] = {{"dtype", dtype},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');
  const uint64_t n = head.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  out.append(head);
  *data_bytes = offset;
  return out;
}

// Writes `path` through `path`.tmp and a rename; `write` puts the contents on the stream.
absl::Status WriteThroughTemporary(const std::string& path,
                                   const std::function<void(std::ofstream&)>& write) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    write(out);
    out.flush();
    if (!out) return absl::UnavailableError(absl::StrCat("write failed: ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// A tensor's bytes as the file holds them: on the CPU, contiguous.
torch::Tensor FileBytes(const torch::Tensor& tensor) {
  return tensor.detach().to(torch::kCPU).contiguous();
}

}  // namespace

absl::StatusOr<std::string> EncodeSafetensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  uint64_t data_bytes = 0;
  absl::StatusOr<std::string> out = EncodeHeader(tensors, metadata, &data_bytes);
  if (!out.ok()) return out.status();
  out->reserve(out->size() + data_bytes);
  for (const auto& [name, tensor] : tensors) {
    torch::Tensor t = FileBytes(tensor);
    out->append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  }
  return out;
}

absl::StatusOr<SafetensorsContents> DecodeSafetensors(absl::string_view bytes) {
  absl::StatusOr<SafetensorsView> view = ParseSafetensors(bytes);
  if (!view.ok()) return view.status();
  SafetensorsContents out;
  out.metadata = std::move(view->metadata);
  out.tensors.reserve(view->tensors.size());
  for (const SafetensorsEntry& e : view->tensors) {
    torch::Tensor t = torch::empty(e.shape, torch::dtype(ToTorch(e.dtype)));
    if (!e.bytes.empty()) std::memcpy(t.data_ptr(), e.bytes.data(), e.bytes.size());
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes) {
  return WriteThroughTemporary(path, [&](std::ofstream& out) {
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  });
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  uint64_t data_bytes = 0;
  absl::StatusOr<std::string> head = EncodeHeader(tensors, metadata, &data_bytes);
  if (!head.ok()) return head.status();
  // Streamed one tensor at a time: a checkpoint-sized file never sits in memory twice.
  return WriteThroughTemporary(path, [&](std::ofstream& out) {
    out.write(head->data(), static_cast<std::streamsize>(head->size()));
    for (const auto& [name, tensor] : tensors) {
      torch::Tensor t = FileBytes(tensor);
      out.write(static_cast<const char*>(t.data_ptr()),
                static_cast<std::streamsize>(t.numel() * t.element_size()));
    }
  });
}

absl::StatusOr<SafetensorsContents> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<SafetensorsContents> c = DecodeSafetensors(ss.str());
  if (!c.ok())
    return absl::Status(c.status().code(), absl::StrCat(path, ": ", c.status().message()));
  return c;
}

}  // namespace cdcca::model
