#include "compress/wire_format.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "compress/group_codec.h"
#include "compress/hash64.h"
#include "compress/zstd_frame.h"

namespace cdcca::compress {
namespace {

void PutU8(uint8_t v, std::string* out) { out->push_back(static_cast<char>(v)); }
void PutLe(uint64_t v, int bytes, std::string* out) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Bounds-checked little-endian reader over the body; every failure is DATA_LOSS.
class Reader {
 public:
  explicit Reader(absl::string_view data) : data_(data) {}
  bool Read(int bytes, uint64_t* v) {
    if (remaining() < static_cast<size_t>(bytes)) return false;
    *v = GetLe(data_.data() + pos_, bytes);
    pos_ += bytes;
    return true;
  }
  bool ReadBytes(uint64_t n, std::string* out) {
    if (remaining() < n) return false;
    out->assign(data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  size_t remaining() const { return data_.size() - pos_; }
  size_t pos() const { return pos_; }

 private:
  absl::string_view data_;
  size_t pos_ = 0;
};

absl::Status Truncated(const char* what, size_t at) {
  return absl::DataLossError(
      absl::StrFormat("update body truncated while reading %s at body offset %d", what, at));
}

// Validates a record's fields against each other (not its block contents).
absl::Status CheckRecord(const TensorRecord& r) {
  if (r.name.empty() || r.name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor name length %d outside [1, %d]", r.name.size(), kMaxNameBytes));
  }
  if (r.shape.size() > static_cast<size_t>(kMaxRank)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s' has rank %d > %d", r.name, r.shape.size(), kMaxRank));
  }
  for (int64_t d : r.shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrFormat("'%s': negative dim", r.name));
  }
  if (!IsSupportedBits(r.bits)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s': unsupported bit width %d", r.name, r.bits));
  }
  const uint64_t numel = r.numel();
  if (numel == std::numeric_limits<uint64_t>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': shape overflows", r.name));
  }
  if (r.bits == 0) {
    if (r.group_size != 0 || r.sparse || r.coded_count != 0 || !r.block.empty() ||
        !r.indices.empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor '%s': a skipped tensor carries data", r.name));
    }
    return absl::OkStatus();
  }
  if (r.group_size == 0 || r.group_size > kMaxGroupSize) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': group size %d outside [1, %d]",
                                                      r.name, r.group_size, kMaxGroupSize));
  }
  if (r.sparse ? r.coded_count > numel : r.coded_count != numel) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor '%s': %d coded values for %d elements", r.name, r.coded_count, numel));
  }
  if (!r.sparse && !r.indices.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s': dense record has indices", r.name));
  }
  if (r.block.size() != CodedBlockBytes(r.coded_count, r.bits, r.group_size)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tensor '%s': block of %d bytes, expected %d", r.name, r.block.size(),
                        CodedBlockBytes(r.coded_count, r.bits, r.group_size)));
  }
  return absl::OkStatus();
}

absl::Status AsDataLoss(const absl::Status& s) {
  return s.ok() ? s : absl::DataLossError(s.message());
}

}  // namespace

uint64_t TensorRecord::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::numeric_limits<uint64_t>::max();
    const auto ud = static_cast<uint64_t>(d);
    if (ud != 0 && n > (std::numeric_limits<uint64_t>::max() - 1) / ud) {
      return std::numeric_limits<uint64_t>::max();
    }
    n *= ud;
  }
  return n;
}

void AppendVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

absl::StatusOr<std::string> SerializePayload(uint64_t base_version, uint64_t new_version,
                                             const std::vector<TensorRecord>& tensors,
                                             int zstd_level) {
  if (tensors.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError("too many tensors");
  }
  absl::flat_hash_set<absl::string_view> names;
  std::string body;
  for (const TensorRecord& r : tensors) {
    if (absl::Status s = CheckRecord(r); !s.ok()) return s;
    if (!names.insert(r.name).second) {
      return absl::InvalidArgumentError(absl::StrFormat("duplicate tensor name '%s'", r.name));
    }
    PutLe(r.name.size(), 2, &body);
    body.append(r.name);
    PutU8(static_cast<uint8_t>(r.shape.size()), &body);
    for (int64_t d : r.shape) PutLe(static_cast<uint64_t>(d), 8, &body);
    PutU8(static_cast<uint8_t>(r.bits), &body);
    PutU8(r.sparse ? kRecordSparse : 0, &body);
    PutLe(r.group_size, 4, &body);
    PutLe(r.coded_count, 8, &body);
    if (r.sparse) {
      PutLe(r.indices.size(), 8, &body);
      body.append(r.indices);
    }
    PutLe(r.block.size(), 8, &body);
    body.append(r.block);
  }

  std::string stored;
  uint16_t flags = 0;
  if (zstd_level > 0 && !body.empty()) {
    stored.resize(ZSTD_compressBound(body.size()));
    // The frame carries zstd's own content checksum too: damage inside the frame is caught
    // by decompression even where the outer checksum was recomputed (or collides).
    ZSTD_CCtx* cctx = ZSTD_createCCtx();
    if (cctx == nullptr) return absl::InternalError("zstd: out of memory");
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, std::clamp(zstd_level, 1, 19));
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
    const size_t n = ZSTD_compress2(cctx, stored.data(), stored.size(), body.data(), body.size());
    ZSTD_freeCCtx(cctx);
    if (ZSTD_isError(n)) {
      return absl::InternalError(absl::StrCat("zstd: ", ZSTD_getErrorName(n)));
    }
    stored.resize(n);
    if (n < body.size()) {
      flags |= kFlagBodyZstd;
    } else {
      stored.clear();
    }
  }
  if ((flags & kFlagBodyZstd) == 0) stored = body;

  std::string out;
  out.reserve(kFixedHeaderBytes + stored.size() + kChecksumBytes);
  PutLe(kPayloadMagic, 4, &out);
  PutLe(kFormatVersion, 2, &out);
  PutLe(flags, 2, &out);
  PutLe(base_version, 8, &out);
  PutLe(new_version, 8, &out);
  PutLe(tensors.size(), 4, &out);
  PutLe(0, 4, &out);
  PutLe(body.size(), 8, &out);
  PutLe(stored.size(), 8, &out);
  out.append(stored);
  PutLe(Hash64(out.data(), out.size()), 8, &out);
  return out;
}

absl::StatusOr<ParsedPayload> ParsePayload(absl::string_view payload, const ParseLimits& limits) {
  if (payload.size() < kFixedHeaderBytes + kChecksumBytes) {
    return absl::DataLossError(
        absl::StrFormat("update payload truncated: %d bytes, a payload has at least %d",
                        payload.size(), kFixedHeaderBytes + kChecksumBytes));
  }
  const char* p = payload.data();
  if (GetLe(p, 4) != kPayloadMagic) {
    return absl::DataLossError("not a DWC update payload (bad magic)");
  }
  const size_t covered = payload.size() - kChecksumBytes;
  const uint64_t stored_sum = GetLe(p + covered, 8);
  const uint64_t actual_sum = Hash64(p, covered);
  if (stored_sum != actual_sum) {
    return absl::DataLossError(absl::StrFormat(
        "update payload checksum mismatch (stored %016x, computed %016x): corrupted or "
        "truncated",
        stored_sum, actual_sum));
  }
  ParsedPayload parsed;
  PayloadInfo& info = parsed.info;
  info.format_version = static_cast<uint16_t>(GetLe(p + 4, 2));
  info.flags = static_cast<uint16_t>(GetLe(p + 6, 2));
  info.base_version = GetLe(p + 8, 8);
  info.new_version = GetLe(p + 16, 8);
  const uint64_t count = GetLe(p + 24, 4);
  const uint64_t reserved = GetLe(p + 28, 4);
  info.body_bytes = GetLe(p + 32, 8);
  info.stored_body_bytes = GetLe(p + 40, 8);
  info.checksum = stored_sum;
  if (info.format_version != kFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrFormat("update format version %d not supported (this build reads %d)",
                        info.format_version, kFormatVersion));
  }
  if ((info.flags & ~kFlagBodyZstd) != 0 || reserved != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "update header has unknown flags %#x / reserved %#x", info.flags, reserved));
  }
  if (info.stored_body_bytes != covered - kFixedHeaderBytes) {
    return absl::DataLossError(
        absl::StrFormat("update header declares %d body bytes but %d are present",
                        info.stored_body_bytes, covered - kFixedHeaderBytes));
  }
  if (info.body_bytes > limits.max_body_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "update body of %d bytes exceeds the limit of %d", info.body_bytes, limits.max_body_bytes));
  }
  const absl::string_view stored(p + kFixedHeaderBytes, info.stored_body_bytes);
  std::string decompressed;
  absl::string_view body;
  if ((info.flags & kFlagBodyZstd) != 0) {
    absl::StatusOr<std::string> d = DecompressBoundedFrame(stored, info.body_bytes,
                                                           limits.max_body_bytes, "update body");
    if (!d.ok()) return d.status();
    decompressed = *std::move(d);
    body = decompressed;
  } else {
    if (info.body_bytes != info.stored_body_bytes) {
      return absl::DataLossError("raw update body size differs from the header");
    }
    body = stored;
  }

  Reader in(body);
  absl::flat_hash_set<std::string> names;
  // Each record takes at least 24 body bytes, which bounds the reservation.
  parsed.tensors.reserve(std::min<uint64_t>(count, body.size() / 24 + 1));
  for (uint64_t t = 0; t < count; ++t) {
    TensorRecord r;
    uint64_t v = 0;
    if (!in.Read(2, &v) || !in.ReadBytes(v, &r.name)) return Truncated("a name", in.pos());
    if (!in.Read(1, &v)) return Truncated("a rank", in.pos());
    if (v > static_cast<uint64_t>(kMaxRank)) {
      return absl::DataLossError(absl::StrFormat("tensor '%s' has rank %d", r.name, v));
    }
    r.shape.resize(v);
    for (int64_t& d : r.shape) {
      if (!in.Read(8, &v)) return Truncated("a dim", in.pos());
      d = static_cast<int64_t>(v);
    }
    uint64_t flags = 0;
    if (!in.Read(1, &v) || !in.Read(1, &flags)) return Truncated("bits", in.pos());
    r.bits = static_cast<int>(v);
    if ((flags & ~static_cast<uint64_t>(kRecordSparse)) != 0) {
      return absl::DataLossError(
          absl::StrFormat("tensor '%s' has unknown record flags %#x", r.name, flags));
    }
    r.sparse = (flags & kRecordSparse) != 0;
    if (!in.Read(4, &v)) return Truncated("a group size", in.pos());
    r.group_size = static_cast<uint32_t>(v);
    if (!in.Read(8, &r.coded_count)) return Truncated("a value count", in.pos());
    if (r.sparse && (!in.Read(8, &v) || !in.ReadBytes(v, &r.indices))) {
      return Truncated("indices", in.pos());
    }
    if (!in.Read(8, &v) || !in.ReadBytes(v, &r.block)) return Truncated("a block", in.pos());
    if (absl::Status s = CheckRecord(r); !s.ok()) return AsDataLoss(s);
    if (!names.insert(r.name).second) {
      return absl::DataLossError(absl::StrFormat("duplicate tensor name '%s'", r.name));
    }
    parsed.tensors.push_back(std::move(r));
  }
  if (in.remaining() != 0) {
    return absl::DataLossError(
        absl::StrFormat("%d unexpected bytes after the last tensor record", in.remaining()));
  }
  return parsed;
}

absl::Status DecodeRecord(const TensorRecord& record, absl::Span<float> out) {
  const uint64_t numel = record.numel();
  if (out.size() != numel) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor '%s': output holds %d values, record has %d", record.name, out.size(), numel));
  }
  if (absl::Status s = CheckRecord(record); !s.ok()) return AsDataLoss(s);
  if (!record.sparse) {
    return DequantizeBlock(record.block, out.size(), record.bits, record.group_size, out.data());
  }
  std::vector<float> values(record.coded_count);
  if (absl::Status s = DequantizeBlock(record.block, values.size(), record.bits, record.group_size,
                                       values.data());
      !s.ok()) {
    return s;
  }
  std::fill(out.begin(), out.end(), 0.0f);
  const auto* p = reinterpret_cast<const unsigned char*>(record.indices.data());
  const auto* end = p + record.indices.size();
  uint64_t next = 0;  // smallest index the next entry may take
  for (uint64_t k = 0; k < record.coded_count; ++k) {
    uint64_t v = 0;
    int shift = 0;
    while (true) {
      if (p == end || shift > 63) {
        return absl::DataLossError(
            absl::StrFormat("tensor '%s': malformed sparse index list", record.name));
      }
      const unsigned char b = *p++;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      shift += 7;
      if ((b & 0x80) == 0) break;
    }
    if (v >= numel || next > numel - 1 - v) {
      return absl::DataLossError(
          absl::StrFormat("tensor '%s': sparse index out of range", record.name));
    }
    const uint64_t index = next + v;
    out[index] = values[k];
    next = index + 1;
  }
  if (p != end) {
    return absl::DataLossError(
        absl::StrFormat("tensor '%s': bytes left after the sparse indices", record.name));
  }
  return absl::OkStatus();
}

}  // namespace cdcca::compress
