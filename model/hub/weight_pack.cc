#include "model/hub/weight_pack.h"

#include <torch/torch.h>

#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "model/hub/safetensors.h"

namespace cdcca::model {
namespace {

constexpr char kFormat[] = "cdcca-weight-pack";
constexpr char kVersion[] = "1";

std::string ValuesName(const std::string& name) { return name + ":values"; }
std::string ScalesName(const std::string& name) { return name + ":scales"; }

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

// What a pack of these weights at this precision says of itself.
std::map<std::string, std::string> PackMetadata(Precision precision, int64_t group,
                                                uint64_t fingerprint) {
  return {{"format", kFormat},
          {"version", kVersion},
          {"precision", std::string(PrecisionName(precision))},
          {"group", precision == Precision::kInt4 ? absl::StrCat(group) : ""},
          {"folder_fingerprint", Hex(fingerprint)}};
}

}  // namespace

std::string WeightPack::PathFor(const std::string& dir, Precision precision, int64_t group) {
  const std::string file = precision == Precision::kInt4 ? absl::StrCat("int4-g", group)
                                                         : std::string(PrecisionName(precision));
  return absl::StrCat(dir, "/cdcca-packed/", file, ".safetensors");
}

std::unique_ptr<WeightPack> WeightPack::Find(const std::string& dir, Precision precision,
                                             int64_t group, uint64_t fingerprint,
                                             std::string* why) {
  const std::string path = PathFor(dir, precision, group);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return nullptr;
  absl::StatusOr<ModelFolder> file = ModelFolder::OpenFile(path);
  if (!file.ok()) {
    *why = std::string(file.status().message());
    return nullptr;
  }
  for (const auto& [key, value] : PackMetadata(precision, group, fingerprint)) {
    auto it = file->metadata().find(key);
    const std::string found = it == file->metadata().end() ? "(absent)" : it->second;
    if (found != value) {
      *why = absl::StrCat(path, ": metadata ", key, " is ", found, ", this load needs ", value,
                          key == "folder_fingerprint" ? " (the folder's weights changed since "
                                                        "the pack was written)"
                                                      : "");
      return nullptr;
    }
  }
  return std::unique_ptr<WeightPack>(new WeightPack(path, *std::move(file)));
}

bool WeightPack::Has(const std::string& name) const {
  return file_.Has(ValuesName(name)) && file_.Has(ScalesName(name));
}

absl::StatusOr<QuantizedWeight> WeightPack::Load(const std::string& name,
                                                 torch::Device device) const {
  QuantizedWeight q;
  absl::StatusOr<torch::Tensor> values = file_.Load(ValuesName(name), torch::kFloat, device);
  if (!values.ok()) return values.status();
  absl::StatusOr<torch::Tensor> scales = file_.Load(ScalesName(name), torch::kFloat, device);
  if (!scales.ok()) return scales.status();
  q.values = *std::move(values);
  q.scales = *std::move(scales);
  ++loads_;
  return q;
}

void WeightPackWriter::Add(const std::string& name, const QuantizedWeight& q) {
  entries_.emplace_back(ValuesName(name), q.values);
  entries_.emplace_back(ScalesName(name), q.scales);
}

int64_t WeightPackWriter::bytes() const {
  int64_t n = 0;
  for (const auto& [name, t] : entries_) n += t.numel() * t.element_size();
  return n;
}

absl::Status WeightPackWriter::Write(const std::string& dir, Precision precision, int64_t group,
                                     uint64_t fingerprint) const {
  const std::string path = WeightPack::PathFor(dir, precision, group);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create ", path, ": ", ec.message()));
  return WriteSafetensors(path, entries_, PackMetadata(precision, group, fingerprint));
}

}  // namespace cdcca::model
