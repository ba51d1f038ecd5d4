#include "compress/delta_encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_format.h"
#include "compress/group_codec.h"
#include "compress/hash64.h"
#include "compress/wire_format.h"

namespace cdcca::compress {
namespace {

constexpr uint32_t kStateMagic = 0x52574443u;  // bytes "CDWR"
constexpr uint16_t kStateVersion = 1;

// One way to code a tensor: a (bits, group size) choice, its record bytes beyond the dense
// record header, and the squared error it leaves.
struct Candidate {
  int bits = 0;
  uint32_t group_size = 0;
  uint64_t extra_bytes = 0;
  double error = 0.0;
  std::string block;
};

struct TensorPlan {
  const TensorView* fresh = nullptr;
  std::vector<float> delta;    // dense, residual included
  std::vector<uint64_t> kept;  // top-k flat indices, ascending (empty when dense)
  std::vector<float> values;   // what is coded: delta, or delta at `kept`
  std::string indices;         // varint gaps of `kept`
  uint64_t header_bytes = 0;   // dense record header size
  double delta_sq = 0.0;
  std::vector<Candidate> candidates;  // [0] is bits 0
  size_t choice = 0;
};

uint64_t DenseHeaderBytes(const TensorView& v) {
  return 2 + v.name.size() + 1 + 8 * v.shape.size() + 1 + 1 + 4 + 8 + 8;
}

void PutLe(uint64_t v, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Greedy allocation: from all-skipped, repeatedly take the upgrade (any tensor, any
// candidate with more bytes) with the largest error reduction per added byte that still
// fits `data_budget`; stop when none fits or the error target is met. Ties keep the first
// tensor in order, so the result is deterministic.
void Allocate(std::vector<TensorPlan>& plans, uint64_t data_budget, double target_error_sq) {
  double total_error = 0.0;
  for (TensorPlan& p : plans) {
    p.choice = 0;
    total_error += p.candidates[0].error;
  }
  uint64_t used = 0;
  while (total_error > target_error_sq) {
    double best_ratio = 0.0;
    size_t best_t = 0, best_c = 0;
    bool found = false;
    for (size_t t = 0; t < plans.size(); ++t) {
      const Candidate& cur = plans[t].candidates[plans[t].choice];
      for (size_t c = 1; c < plans[t].candidates.size(); ++c) {
        const Candidate& cand = plans[t].candidates[c];
        if (cand.extra_bytes <= cur.extra_bytes || cand.error >= cur.error) continue;
        const uint64_t add = cand.extra_bytes - cur.extra_bytes;
        if (used + add > data_budget) continue;
        const double ratio = (cur.error - cand.error) / static_cast<double>(add);
        if (!found || ratio > best_ratio) {
          found = true;
          best_ratio = ratio;
          best_t = t;
          best_c = c;
        }
      }
    }
    if (!found) break;
    TensorPlan& p = plans[best_t];
    used = used - p.candidates[p.choice].extra_bytes + p.candidates[best_c].extra_bytes;
    total_error = total_error - p.candidates[p.choice].error + p.candidates[best_c].error;
    p.choice = best_c;
  }
}

absl::StatusOr<std::string> Serialize(const std::vector<TensorPlan>& plans, uint64_t base,
                                      uint64_t next, int zstd_level) {
  std::vector<TensorRecord> records(plans.size());
  for (size_t t = 0; t < plans.size(); ++t) {
    const TensorPlan& p = plans[t];
    const Candidate& c = p.candidates[p.choice];
    TensorRecord& r = records[t];
    r.name = p.fresh->name;
    r.shape = p.fresh->shape;
    r.bits = c.bits;
    r.group_size = c.group_size;
    if (c.bits != 0) {
      r.sparse = !p.kept.empty() || p.values.size() != p.delta.size();
      r.coded_count = p.values.size();
      if (r.sparse) r.indices = p.indices;
      r.block = c.block;
    }
  }
  return SerializePayload(base, next, records, zstd_level);
}

}  // namespace

DeltaEncoder::DeltaEncoder(DeltaEncoderOptions options) : options_(std::move(options)) {}

absl::StatusOr<UpdatePayload> DeltaEncoder::Encode(absl::Span<const TensorView> theta_new,
                                                   absl::Span<const TensorView> theta_mirror,
                                                   uint64_t base_version, uint64_t new_version) {
  std::vector<int> widths;
  for (int b : options_.allowed_bits) {
    if (!IsSupportedBits(b)) {
      return absl::InvalidArgumentError(absl::StrFormat("bit width %d is not supported", b));
    }
    if (b != 0 && std::find(widths.begin(), widths.end(), b) == widths.end()) widths.push_back(b);
  }
  std::sort(widths.begin(), widths.end());
  if (options_.group_size == 0 || options_.group_size > kMaxGroupSize / 4) {
    return absl::InvalidArgumentError("group_size must be in [1, 2^22]");
  }
  std::vector<uint32_t> groups = {options_.group_size};
  if (options_.coarse_groups) groups.push_back(options_.group_size * 4);

  absl::flat_hash_map<absl::string_view, const TensorView*> mirror_by_name;
  for (const TensorView& v : theta_mirror) {
    if (!mirror_by_name.emplace(v.name, &v).second) {
      return absl::InvalidArgumentError(absl::StrFormat("mirror names '%s' twice", v.name));
    }
  }
  if (theta_mirror.size() != theta_new.size()) {
    return absl::InvalidArgumentError(absl::StrFormat("new set has %d tensors, mirror has %d",
                                                      theta_new.size(), theta_mirror.size()));
  }

  // Delta, top-k and every candidate coding, per tensor.
  std::vector<TensorPlan> plans(theta_new.size());
  uint64_t params = 0;
  double delta_sq_total = 0.0;
  for (size_t t = 0; t < theta_new.size(); ++t) {
    const TensorView& fresh = theta_new[t];
    auto it = mirror_by_name.find(fresh.name);
    if (it == mirror_by_name.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s' is missing from the mirror", fresh.name));
    }
    const TensorView& old = *it->second;
    if (old.shape != fresh.shape) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s' changed shape between mirror and new", fresh.name));
    }
    TensorPlan& p = plans[t];
    p.fresh = &fresh;
    const uint64_t n = fresh.numel();
    params += n;
    p.delta.resize(n);
    for (uint64_t i = 0; i < n; ++i) p.delta[i] = fresh.data[i] - old.data[i];
    if (options_.error_feedback) {
      auto r = residual_.find(fresh.name);
      if (r != residual_.end() && r->second.size() == n) {
        for (uint64_t i = 0; i < n; ++i) p.delta[i] += r->second[i];
      }
    }
    for (float d : p.delta) {
      if (!std::isfinite(d)) {
        return absl::InvalidArgumentError(
            absl::StrFormat("tensor '%s' has a non-finite delta", fresh.name));
      }
      p.delta_sq += static_cast<double>(d) * d;
    }
    delta_sq_total += p.delta_sq;
    p.header_bytes = DenseHeaderBytes(fresh);

    const bool sparse = options_.topk_fraction > 0.0 && options_.topk_fraction < 1.0;
    double dropped_sq = 0.0;
    if (sparse) {
      const auto k =
          static_cast<uint64_t>(std::ceil(options_.topk_fraction * static_cast<double>(n)));
      std::vector<uint64_t> order(n);
      std::iota(order.begin(), order.end(), uint64_t{0});
      auto larger = [&](uint64_t a, uint64_t b) {
        const float fa = std::fabs(p.delta[a]), fb = std::fabs(p.delta[b]);
        return fa > fb || (fa == fb && a < b);
      };
      if (k < n) std::nth_element(order.begin(), order.begin() + k, order.end(), larger);
      p.kept.assign(order.begin(), order.begin() + std::min(k, n));
      std::sort(p.kept.begin(), p.kept.end());
      uint64_t next = 0;
      for (uint64_t i : p.kept) {
        AppendVarint(i - next, &p.indices);
        next = i + 1;
        p.values.push_back(p.delta[i]);
      }
      double kept_sq = 0.0;
      for (float v : p.values) kept_sq += static_cast<double>(v) * v;
      dropped_sq = std::max(0.0, p.delta_sq - kept_sq);
    } else {
      p.values = p.delta;
    }

    p.candidates.push_back(Candidate{0, 0, 0, p.delta_sq, {}});
    if (n == 0) continue;
    std::vector<float> decoded(p.values.size());
    for (int bits : widths) {
      for (uint32_t g : groups) {
        if (g != groups.front() && g >= p.values.size() * 2) continue;  // no coarser groups
        Candidate c;
        c.bits = bits;
        c.group_size = g;
        QuantizeBlock(p.values.data(), p.values.size(), bits, g, &c.block);
        // The error is measured on the decoder's own output, the one the device will add.
        if (absl::Status s = DequantizeBlock(c.block, decoded.size(), bits, g, decoded.data());
            !s.ok()) {
          return absl::InternalError(absl::StrCat("self-decode failed: ", s.message()));
        }
        double err = dropped_sq;
        for (size_t i = 0; i < decoded.size(); ++i) {
          const double d = static_cast<double>(p.values[i]) - decoded[i];
          err += d * d;
        }
        c.error = err;
        c.extra_bytes = c.block.size() + (sparse ? 8 + p.indices.size() : 0);
        p.candidates.push_back(std::move(c));
      }
    }
  }

  uint64_t budget = options_.byte_budget;
  if (options_.bits_per_param > 0.0) {
    const auto by_bits = static_cast<uint64_t>(
        std::floor(options_.bits_per_param * static_cast<double>(params) / 8.0));
    budget = budget == 0 ? by_bits : std::min(budget, by_bits);
  }
  uint64_t fixed = kFixedHeaderBytes + kChecksumBytes;
  for (const TensorPlan& p : plans) fixed += p.header_bytes;
  const double target_sq =
      options_.target_relative_error > 0.0
          ? options_.target_relative_error * options_.target_relative_error * delta_sq_total
          : 0.0;
  const bool capped = budget != 0 || options_.bits_per_param > 0.0;
  if (capped && budget < fixed) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "byte budget %d is below the smallest payload for this set (%d bytes)", budget, fixed));
  }

  // The allocator counts uncompressed bytes; zstd then usually saves a little. Re-run with
  // the data budget moved by the measured slack or overshoot, keeping the best payload that
  // fits (lowest error). Bits 0 everywhere always fits, since budget >= fixed.
  uint64_t data_budget = capped ? budget - fixed : std::numeric_limits<uint64_t>::max();
  std::string best_bytes;
  std::vector<size_t> best_choice;
  double best_error = std::numeric_limits<double>::infinity();
  for (int attempt = 0; attempt < 6; ++attempt) {
    Allocate(plans, data_budget, target_sq);
    absl::StatusOr<std::string> bytes =
        Serialize(plans, base_version, new_version, options_.zstd_level);
    if (!bytes.ok()) return bytes.status();
    double err = 0.0;
    for (const TensorPlan& p : plans) err += p.candidates[p.choice].error;
    const uint64_t size = bytes->size();
    const bool fits = !capped || size <= budget;
    if (fits && err < best_error) {
      best_error = err;
      best_bytes = *std::move(bytes);
      best_choice.clear();
      for (const TensorPlan& p : plans) best_choice.push_back(p.choice);
    }
    if (!capped) break;
    if (!fits) {
      const uint64_t over = size - budget;
      data_budget = data_budget > over ? data_budget - over : 0;
    } else {
      const uint64_t slack = budget - size;
      if (slack * 200 < budget) break;  // within 0.5 %
      data_budget += slack;
    }
  }
  if (best_choice.empty()) {
    // Every attempt overshot (zstd expanded); all-skipped is header-sized and fits.
    for (TensorPlan& p : plans) p.choice = 0;
    absl::StatusOr<std::string> bytes =
        Serialize(plans, base_version, new_version, options_.zstd_level);
    if (!bytes.ok()) return bytes.status();
    best_bytes = *std::move(bytes);
    best_choice.assign(plans.size(), 0);
  }

  UpdatePayload out;
  out.base_version = base_version;
  out.new_version = new_version;
  EncodeStats& stats = out.stats;
  stats.params = params;
  stats.payload_bytes = best_bytes.size();
  stats.budget_bytes = capped ? budget : 0;
  stats.bits_per_param =
      params == 0 ? 0.0
                  : 8.0 * static_cast<double>(best_bytes.size()) / static_cast<double>(params);
  double err_total = 0.0;
  std::vector<float> decoded;
  for (size_t t = 0; t < plans.size(); ++t) {
    TensorPlan& p = plans[t];
    p.choice = best_choice[t];
    const Candidate& c = p.candidates[p.choice];
    err_total += c.error;
    TensorEncodeStats ts;
    ts.name = p.fresh->name;
    ts.numel = p.delta.size();
    ts.bits = c.bits;
    ts.group_size = c.group_size;
    ts.coded_count = c.bits == 0 ? 0 : p.values.size();
    ts.record_bytes = p.header_bytes + c.extra_bytes;
    ts.delta_sq_norm = p.delta_sq;
    ts.error_sq_norm = c.error;
    stats.tensors.push_back(std::move(ts));
    if (!options_.error_feedback) continue;
    // New residual: delta minus exactly what the device adds.
    std::vector<float>& res = residual_[p.fresh->name];
    res = p.delta;
    if (c.bits == 0) continue;
    decoded.assign(p.values.size(), 0.0f);
    if (absl::Status s =
            DequantizeBlock(c.block, decoded.size(), c.bits, c.group_size, decoded.data());
        !s.ok()) {
      return absl::InternalError(absl::StrCat("self-decode failed: ", s.message()));
    }
    if (p.kept.empty() && p.values.size() == res.size()) {
      for (size_t i = 0; i < res.size(); ++i) res[i] -= decoded[i];
    } else {
      for (size_t k = 0; k < p.kept.size(); ++k) res[p.kept[k]] -= decoded[k];
    }
  }
  if (options_.error_feedback) {
    // Tensors that left the trainable set take their residual with them.
    for (auto it = residual_.begin(); it != residual_.end();) {
      const bool present = std::any_of(theta_new.begin(), theta_new.end(),
                                       [&](const TensorView& v) { return v.name == it->first; });
      if (present) {
        ++it;
      } else {
        residual_.erase(it++);
      }
    }
  }
  stats.relative_error = delta_sq_total > 0.0 ? std::sqrt(err_total / delta_sq_total) : 0.0;
  out.bytes = std::move(best_bytes);
  return out;
}

std::string DeltaEncoder::SerializeState() const {
  // Sorted by name so equal states serialise to equal bytes.
  std::vector<const std::pair<const std::string, std::vector<float>>*> entries;
  for (const auto& e : residual_) entries.push_back(&e);
  std::sort(entries.begin(), entries.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  std::string out;
  PutLe(kStateMagic, 4, &out);
  PutLe(kStateVersion, 2, &out);
  PutLe(entries.size(), 4, &out);
  for (const auto* e : entries) {
    PutLe(e->first.size(), 2, &out);
    out.append(e->first);
    PutLe(e->second.size(), 8, &out);
    for (float f : e->second) {
      uint32_t u;
      std::memcpy(&u, &f, sizeof(u));
      PutLe(u, 4, &out);
    }
  }
  PutLe(Hash64(out.data(), out.size()), 8, &out);
  return out;
}

absl::Status DeltaEncoder::RestoreState(absl::string_view bytes) {
  if (bytes.size() < 18) return absl::DataLossError("encoder state truncated");
  const size_t covered = bytes.size() - 8;
  if (GetLe(bytes.data() + covered, 8) != Hash64(bytes.data(), covered)) {
    return absl::DataLossError("encoder state checksum mismatch");
  }
  if (GetLe(bytes.data(), 4) != kStateMagic || GetLe(bytes.data() + 4, 2) != kStateVersion) {
    return absl::DataLossError("not a DWC encoder state of a known version");
  }
  const uint64_t count = GetLe(bytes.data() + 6, 4);
  size_t pos = 10;
  absl::flat_hash_map<std::string, std::vector<float>> restored;
  for (uint64_t e = 0; e < count; ++e) {
    if (covered - pos < 2) return absl::DataLossError("encoder state truncated");
    const uint64_t name_len = GetLe(bytes.data() + pos, 2);
    pos += 2;
    if (covered - pos < name_len + 8) return absl::DataLossError("encoder state truncated");
    std::string name(bytes.data() + pos, name_len);
    pos += name_len;
    const uint64_t n = GetLe(bytes.data() + pos, 8);
    pos += 8;
    if (n > (covered - pos) / 4) return absl::DataLossError("encoder state truncated");
    std::vector<float> values(n);
    for (uint64_t i = 0; i < n; ++i, pos += 4) {
      const auto u = static_cast<uint32_t>(GetLe(bytes.data() + pos, 4));
      std::memcpy(&values[i], &u, sizeof(u));
    }
    restored[std::move(name)] = std::move(values);
  }
  if (pos != covered) return absl::DataLossError("encoder state has trailing bytes");
  residual_ = std::move(restored);
  return absl::OkStatus();
}

double DeltaEncoder::ResidualSquaredNorm() const {
  double sum = 0.0;
  for (const auto& e : residual_) {
    for (float v : e.second) sum += static_cast<double>(v) * v;
  }
  return sum;
}

}  // namespace cdcca::compress
