#include "compress/apply.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "compress/hash64.h"

namespace cdcca::compress {

absl::StatusOr<uint64_t> ApplyUpdateToViews(absl::string_view payload,
                                            uint64_t expected_base_version,
                                            absl::Span<const TensorView> live,
                                            const ParseLimits& limits) {
  absl::StatusOr<ParsedPayload> parsed = ParsePayload(payload, limits);
  if (!parsed.ok()) return parsed.status();
  if (parsed->info.base_version != expected_base_version) {
    return absl::FailedPreconditionError(
        absl::StrFormat("update applies to version %d but the trainable set is at version %d",
                        parsed->info.base_version, expected_base_version));
  }
  absl::flat_hash_map<absl::string_view, size_t> by_name;
  for (size_t i = 0; i < live.size(); ++i) {
    if (!by_name.emplace(live[i].name, i).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("live set holds tensor '%s' twice", live[i].name));
    }
  }
  // Names and shapes first, for every tensor, before any decoding work.
  std::vector<size_t> target(parsed->tensors.size());
  for (size_t t = 0; t < parsed->tensors.size(); ++t) {
    const TensorRecord& r = parsed->tensors[t];
    auto it = by_name.find(r.name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("update names tensor '%s', which the live set lacks", r.name));
    }
    const TensorView& v = live[it->second];
    if (v.shape != r.shape) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s': update shape [%s], live shape [%s]", r.name,
                          absl::StrJoin(r.shape, ","), absl::StrJoin(v.shape, ",")));
    }
    if (v.data == nullptr && v.numel() != 0) {
      return absl::InvalidArgumentError(absl::StrFormat("tensor '%s' has no data", r.name));
    }
    target[t] = it->second;
  }
  if (parsed->tensors.size() != live.size()) {
    // Every payload name was found and names are unique, so live has extra tensors.
    return absl::InvalidArgumentError(absl::StrFormat(
        "update carries %d tensors, the live set has %d", parsed->tensors.size(), live.size()));
  }
  // Decode everything into staging; only a fully decoded update touches the weights.
  std::vector<std::vector<float>> staging(parsed->tensors.size());
  for (size_t t = 0; t < parsed->tensors.size(); ++t) {
    const TensorRecord& r = parsed->tensors[t];
    if (r.bits == 0) continue;
    staging[t].resize(r.numel());
    if (absl::Status s = DecodeRecord(r, absl::MakeSpan(staging[t])); !s.ok()) return s;
  }
  for (size_t t = 0; t < parsed->tensors.size(); ++t) {
    if (staging[t].empty()) continue;
    float* dst = live[target[t]].data;
    const float* src = staging[t].data();
    const size_t n = staging[t].size();
    for (size_t i = 0; i < n; ++i) dst[i] += src[i];
  }
  return parsed->info.new_version;
}

uint64_t DigestViews(absl::Span<const TensorView> tensors) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors[a].name < tensors[b].name; });
  uint64_t h = Hash64(nullptr, 0, tensors.size());
  for (size_t i : order) {
    const TensorView& v = tensors[i];
    // Lengths go in first so that (name, shape, data) boundaries cannot be shifted.
    const uint64_t sizes[2] = {v.name.size(), v.shape.size()};
    h = Hash64(sizes, sizeof(sizes), h);
    h = Hash64(v.name.data(), v.name.size(), h);
    h = Hash64(v.shape.data(), v.shape.size() * sizeof(int64_t), h);
    h = Hash64(v.data, v.numel() * sizeof(float), h);
  }
  return h;
}

}  // namespace cdcca::compress
