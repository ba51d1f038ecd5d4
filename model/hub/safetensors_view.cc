#include "model/hub/safetensors_view.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

using nlohmann::json;

struct DtypeInfo {
  SafetensorsDtype dtype;
  const char* name;
  uint64_t bytes;
};
constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::kF64, "F64", 8}, {SafetensorsDtype::kF32, "F32", 4},
    {SafetensorsDtype::kF16, "F16", 2}, {SafetensorsDtype::kBF16, "BF16", 2},
    {SafetensorsDtype::kI64, "I64", 8}, {SafetensorsDtype::kI32, "I32", 4},
    {SafetensorsDtype::kI16, "I16", 2}, {SafetensorsDtype::kI8, "I8", 1},
    {SafetensorsDtype::kU8, "U8", 1},   {SafetensorsDtype::kBool, "BOOL", 1},
};

// The format is little-endian; so is every machine this builds for (x86-64, aarch64).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes little-endian");

absl::Status Lost(absl::string_view tensor, absl::string_view why) {
  if (tensor.empty()) return absl::DataLossError(absl::StrCat("safetensors: ", why));
  return absl::DataLossError(absl::StrCat("safetensors: tensor ", tensor, ": ", why));
}

// A JSON integer >= 0 as uint64 (rejecting floats, which would convert with undefined
// behaviour when out of range, and negatives).
bool NonNegativeInteger(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

absl::StatusOr<SafetensorsEntry> ReadEntry(const std::string& name, const json& v,
                                           uint64_t data_bytes) {
  SafetensorsEntry e;
  e.name = name;
  if (!v.is_object()) return Lost(name, "entry is not an object");
  const auto dtype = v.find("dtype");
  if (dtype == v.end() || !dtype->is_string() ||
      !ParseSafetensorsDtype(dtype->get_ref<const std::string&>(), &e.dtype)) {
    return Lost(name,
                absl::StrCat("unsupported dtype ", dtype == v.end() ? "(none)" : dtype->dump()));
  }
  const auto shape = v.find("shape");
  if (shape == v.end() || !shape->is_array()) return Lost(name, "shape is not an array");
  // numel x element size must fit in uint64 (and each dim in int64, torch's size type).
  uint64_t bytes = SafetensorsDtypeBytes(e.dtype);
  bool overflow = false;
  for (const json& d : *shape) {
    uint64_t dim = 0;
    if (!NonNegativeInteger(d, &dim) || dim > uint64_t{std::numeric_limits<int64_t>::max()}) {
      return Lost(name, "bad shape");
    }
    e.shape.push_back(static_cast<int64_t>(dim));
    if (dim != 0 && bytes > std::numeric_limits<uint64_t>::max() / dim) overflow = true;
    bytes *= dim;
  }
  const auto offsets = v.find("data_offsets");
  if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 ||
      !NonNegativeInteger((*offsets)[0], &e.begin) || !NonNegativeInteger((*offsets)[1], &e.end) ||
      e.begin > e.end || e.end > data_bytes) {
    return Lost(name, "data_offsets out of range");
  }
  // A zero dim makes the product 0 whatever overflowed before it.
  if (std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end()) {
    bytes = 0;
    overflow = false;
  }
  if (overflow || bytes != e.end - e.begin) {
    return Lost(name, absl::StrCat(e.end - e.begin, " bytes for ",
                                   overflow ? std::string("more than 2^64") : std::to_string(bytes),
                                   " needed"));
  }
  return e;
}

}  // namespace

absl::string_view SafetensorsDtypeName(SafetensorsDtype dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  return "?";
}

uint64_t SafetensorsDtypeBytes(SafetensorsDtype dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.bytes;
  }
  return 0;
}

bool ParseSafetensorsDtype(absl::string_view name, SafetensorsDtype* dtype) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      *dtype = d.dtype;
      return true;
    }
  }
  return false;
}

absl::StatusOr<SafetensorsView> ParseSafetensors(absl::string_view bytes) {
  if (bytes.size() < 8) return Lost("", "shorter than its header length");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  if (n > bytes.size() - 8) return Lost("", "header runs past the end");
  if (n > kMaxSafetensorsHeaderBytes) {
    return Lost("", absl::StrCat("header of ", n, " bytes exceeds the limit of ",
                                 kMaxSafetensorsHeaderBytes));
  }
  const absl::string_view text = bytes.substr(8, n);
  json header = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return Lost("", "bad header JSON");
  if (!header.is_object()) return Lost("", "header is not an object");
  const absl::string_view data = bytes.substr(8 + n);
  SafetensorsView out;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") {
      if (!item.value().is_object()) return Lost("", "__metadata__ is not an object");
      for (const auto& m : item.value().items()) {
        if (!m.value().is_string()) {
          return Lost("", absl::StrCat("__metadata__ value of ", m.key(), " is not a string"));
        }
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    absl::StatusOr<SafetensorsEntry> e = ReadEntry(item.key(), item.value(), data.size());
    if (!e.ok()) return e.status();
    out.tensors.push_back(*std::move(e));
  }
  // Empty tensors may share an offset with a neighbour: order by (begin, end).
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return std::make_pair(a.begin, a.end) < std::make_pair(b.begin, b.end);
            });
  uint64_t covered = 0;
  for (SafetensorsEntry& e : out.tensors) {
    if (e.begin != covered) return Lost(e.name, "data overlaps or leaves a gap");
    covered = e.end;
    e.bytes = data.substr(e.begin, e.end - e.begin);
  }
  if (covered != data.size()) return Lost("", "trailing bytes after the last tensor");
  return out;
}

}  // namespace cdcca::model
