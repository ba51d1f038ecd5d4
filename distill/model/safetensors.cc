#include "distill/model/safetensors.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

using nlohmann::json;

struct DtypeName {
  torch::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {torch::kDouble, "F64"},    {torch::kFloat, "F32"}, {torch::kHalf, "F16"},
    {torch::kBFloat16, "BF16"}, {torch::kLong, "I64"},  {torch::kInt, "I32"},
    {torch::kShort, "I16"},     {torch::kChar, "I8"},   {torch::kByte, "U8"},
    {torch::kBool, "BOOL"},
};

const char* DtypeToName(torch::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d.name;
  }
  return nullptr;
}

bool NameToDtype(const std::string& name, torch::ScalarType* t) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      *t = d.type;
      return true;
    }
  }
  return false;
}

// The format is little-endian; so is every machine this builds for (x86-64, aarch64).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes little-endian");

}  // namespace

absl::StatusOr<std::string> EncodeSafetensors(
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> cpu;
  cpu.reserve(tensors.size());
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
    torch::Tensor t = tensor.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    header[name] = {
        {"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    cpu.push_back(std::move(t));
  }
  std::string head = header.dump();
  // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
  head.append((8 - head.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + head.size() + offset);
  const uint64_t n = head.size();
  out.append(reinterpret_cast<const char*>(&n), 8);
  out.append(head);
  for (const torch::Tensor& t : cpu) {
    out.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  }
  return out;
}

absl::StatusOr<SafetensorsContents> DecodeSafetensors(absl::string_view bytes) {
  if (bytes.size() < 8) return absl::DataLossError("safetensors: shorter than its header length");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > bytes.size() - 8) return absl::DataLossError("safetensors: header runs past the end");
  json header;
  try {
    header = json::parse(bytes.substr(8, n));
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("safetensors: bad header JSON: ", e.what()));
  }
  if (!header.is_object()) return absl::DataLossError("safetensors: header is not an object");
  const absl::string_view data = bytes.substr(8 + n);
  SafetensorsContents out;
  struct Entry {
    uint64_t begin, end;
    std::string name;
    torch::ScalarType type;
    std::vector<int64_t> shape;
  };
  std::vector<Entry> entries;
  try {
    for (const auto& item : header.items()) {
      if (item.key() == "__metadata__") {
        for (const auto& m : item.value().items()) {
          out.metadata[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      Entry e;
      e.name = item.key();
      const json& v = item.value();
      if (!NameToDtype(v.at("dtype").get<std::string>(), &e.type)) {
        return absl::DataLossError(absl::StrCat("safetensors: tensor ", e.name,
                                                ": unsupported dtype ", v.at("dtype").dump()));
      }
      e.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto offsets = v.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data.size()) {
        return absl::DataLossError(
            absl::StrCat("safetensors: tensor ", e.name, ": data_offsets out of range"));
      }
      e.begin = offsets[0];
      e.end = offsets[1];
      entries.push_back(std::move(e));
    }
  } catch (const json::exception& e) {
    return absl::DataLossError(absl::StrCat("safetensors: malformed header: ", e.what()));
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  uint64_t covered = 0;
  for (const Entry& e : entries) {
    if (e.begin != covered) {
      return absl::DataLossError(
          absl::StrCat("safetensors: tensor ", e.name, ": data overlaps or leaves a gap"));
    }
    covered = e.end;
    int64_t numel = 1;
    for (int64_t s : e.shape) {
      if (s < 0)
        return absl::DataLossError(absl::StrCat("safetensors: tensor ", e.name, ": bad shape"));
      numel *= s;
    }
    const uint64_t want = static_cast<uint64_t>(numel) * c10::elementSize(e.type);
    if (want != e.end - e.begin) {
      return absl::DataLossError(absl::StrCat("safetensors: tensor ", e.name, ": ", e.end - e.begin,
                                              " bytes for ", want, " needed"));
    }
    torch::Tensor t = torch::empty(e.shape, torch::dtype(e.type));
    if (want > 0) std::memcpy(t.data_ptr(), data.data() + e.begin, want);
    out.tensors.emplace_back(e.name, std::move(t));
  }
  if (covered != data.size()) {
    return absl::DataLossError("safetensors: trailing bytes after the last tensor");
  }
  return out;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> bytes = EncodeSafetensors(tensors, metadata);
  if (!bytes.ok()) return bytes.status();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
    out.flush();
    if (!out) return absl::UnavailableError(absl::StrCat("write failed: ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
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
