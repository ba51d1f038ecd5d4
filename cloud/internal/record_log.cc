#include "cloud/internal/record_log.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace cdcca::cloud::internal {
namespace {

constexpr char kSegmentMagic[8] = {'c', 'd', 'c', 'c', 'a', 'S', 'L', 'G'};
// The first bytes of a format-1 segment: its first record's magic, 0xCDCA5A11 little-endian.
constexpr char kFormat1Magic[4] = {0x11, 0x5a, static_cast<char>(0xca), static_cast<char>(0xcd)};
constexpr uint64_t kSyncPayloadBytes = kSyncFragmentBytes - kFragmentHeaderBytes;

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// The checksum of a fragment: its length and type bytes, then its payload.
uint32_t FragmentCrc(const char* length_and_type, absl::string_view payload) {
  uLong crc = crc32(0L, reinterpret_cast<const Bytef*>(length_and_type), 3);
  return static_cast<uint32_t>(crc32(crc, reinterpret_cast<const Bytef*>(payload.data()),
                                     static_cast<uInt>(payload.size())));
}

uint64_t BlockLeft(uint64_t offset) { return kLogBlockBytes - offset % kLogBlockBytes; }

struct Fragment {
  FragmentType type = FragmentType::kZero;
  absl::string_view payload;
  uint64_t end = 0;  // in `data`
};

// Whether an intact fragment has its header at `pos` of `data`, whose first byte is at file
// offset `base` (blocks are the file's). On false `why` says what is wrong. The caller skips
// block padding: at least kFragmentHeaderBytes are left in the block at `pos`.
bool FragmentAt(absl::string_view data, uint64_t pos, uint64_t base, Fragment* f,
                const char** why) {
  if (data.size() - pos < kFragmentHeaderBytes) {
    *why = "partial fragment header";
    return false;
  }
  const char* p = data.data() + pos;
  static constexpr char kZeros[kFragmentHeaderBytes] = {};
  if (std::memcmp(p, kZeros, kFragmentHeaderBytes) == 0) {
    *why = "zeroed bytes";
    return false;
  }
  const uint64_t length = GetLe(p + 4, 2);
  if (kFragmentHeaderBytes + length > BlockLeft(base + pos)) {
    *why = "fragment runs past its block";
    return false;
  }
  if (data.size() - pos - kFragmentHeaderBytes < length) {
    *why = "fragment runs past the end of the file";
    return false;
  }
  const absl::string_view payload(p + kFragmentHeaderBytes, length);
  if (FragmentCrc(p + 4, payload) != GetLe(p, 4)) {
    *why = "fragment checksum mismatch";
    return false;
  }
  const auto type = static_cast<uint8_t>(p[6]);
  if (type < static_cast<uint8_t>(FragmentType::kFull) ||
      type > static_cast<uint8_t>(FragmentType::kPadding)) {
    *why = "unknown fragment type";
    return false;
  }
  f->type = static_cast<FragmentType>(type);
  f->payload = payload;
  f->end = pos + kFragmentHeaderBytes + length;
  return true;
}

// Whether an intact SYNC fragment of the segment with `nonce` is at `pos`.
bool SyncAt(absl::string_view data, uint64_t pos, uint64_t nonce) {
  if (data.size() - pos < kSyncFragmentBytes || BlockLeft(pos) < kSyncFragmentBytes) return false;
  const char* p = data.data() + pos;
  if (GetLe(p + 4, 2) != kSyncPayloadBytes || p[6] != static_cast<char>(FragmentType::kSync) ||
      GetLe(p + kFragmentHeaderBytes, 8) != nonce ||
      GetLe(p + kFragmentHeaderBytes + 8, 8) != pos) {
    return false;
  }
  Fragment f;
  const char* why = "";
  return FragmentAt(data, pos, 0, &f, &why);
}

}  // namespace

uint32_t RecordCrc(absl::string_view data) {
  return static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size())));
}

std::string SegmentHeader(uint64_t nonce) {
  std::string out(kSegmentMagic, sizeof(kSegmentMagic));
  PutU32(out, kLogFormatVersion);
  PutU64(out, nonce);
  PutU32(out, RecordCrc(out));
  return out;
}

uint64_t NewSegmentNonce() {
  std::random_device rd;
  return (uint64_t{rd()} << 32) ^ rd();
}

void LogWriter::AddFragment(FragmentType type, absl::string_view payload, std::string& out) {
  char length_and_type[3] = {static_cast<char>(payload.size() & 0xff),
                             static_cast<char>((payload.size() >> 8) & 0xff),
                             static_cast<char>(type)};
  PutU32(out, FragmentCrc(length_and_type, payload));
  out.append(length_and_type, 3);
  out.append(payload.data(), payload.size());
  offset_ += kFragmentHeaderBytes + payload.size();
}

RecordSpan LogWriter::AddRecord(absl::string_view body, std::string& out) {
  RecordSpan span;
  bool first = true;
  do {
    uint64_t left = BlockLeft(offset_);
    if (left < kFragmentHeaderBytes) {
      out.append(left, '\0');
      offset_ += left;
      left = kLogBlockBytes;
    }
    if (first) span.offset = offset_;
    const uint64_t n = std::min<uint64_t>(body.size(), left - kFragmentHeaderBytes);
    const bool last = n == body.size();
    const FragmentType type = first ? (last ? FragmentType::kFull : FragmentType::kFirst)
                                    : (last ? FragmentType::kLast : FragmentType::kMiddle);
    AddFragment(type, body.substr(0, n), out);
    body.remove_prefix(n);
    first = false;
  } while (!body.empty());
  span.end = offset_;
  return span;
}

void LogWriter::AddSync(std::string& out) {
  const uint64_t left = BlockLeft(offset_);
  if (left < kSyncFragmentBytes) {
    if (left < kFragmentHeaderBytes) {
      out.append(left, '\0');
      offset_ += left;
    } else {
      AddFragment(FragmentType::kPadding, std::string(left - kFragmentHeaderBytes, '\0'), out);
    }
  }
  std::string payload;
  PutU64(payload, nonce_);
  PutU64(payload, offset_);
  AddFragment(FragmentType::kSync, payload, out);
}

uint64_t FramedBytes(uint64_t offset, uint64_t body_bytes) {
  uint64_t end = offset;
  bool first = true;
  while (first || body_bytes > 0) {
    uint64_t left = BlockLeft(end);
    if (left < kFragmentHeaderBytes) {
      end += left;
      left = kLogBlockBytes;
    }
    const uint64_t n = std::min(body_bytes, left - kFragmentHeaderBytes);
    end += kFragmentHeaderBytes + n;
    body_bytes -= n;
    first = false;
  }
  return end - offset;
}

absl::StatusOr<std::string> ReadRecord(absl::string_view span, uint64_t offset) {
  std::string body;
  uint64_t pos = 0;
  bool first = true;
  while (true) {
    if (!first) {
      const uint64_t left = BlockLeft(offset + pos);
      if (left < kFragmentHeaderBytes) pos += left;
    }
    if (pos >= span.size()) {
      return absl::DataLossError(
          absl::StrCat("record at ", offset, " ends before its last fragment"));
    }
    Fragment f;
    const char* why = "";
    if (!FragmentAt(span, pos, offset, &f, &why)) {
      return absl::DataLossError(
          absl::StrCat("record at ", offset, ": ", why, " at ", offset + pos));
    }
    const bool is_first = f.type == FragmentType::kFull || f.type == FragmentType::kFirst;
    const bool is_last = f.type == FragmentType::kFull || f.type == FragmentType::kLast;
    if (is_first != first || (!is_first && !is_last && f.type != FragmentType::kMiddle)) {
      return absl::DataLossError(
          absl::StrCat("record at ", offset, ": unexpected fragment type at ", offset + pos));
    }
    first = false;
    body.append(f.payload.data(), f.payload.size());
    pos = f.end;
    if (is_last) {
      if (pos != span.size()) {
        return absl::DataLossError(absl::StrCat("record at ", offset, " ends inside its span"));
      }
      return body;
    }
  }
}

absl::StatusOr<SegmentScan> ScanSegment(absl::string_view data,
                                        const std::function<bool(absl::string_view body)>& accept) {
  SegmentScan scan;
  if (data.size() >= sizeof(kFormat1Magic) &&
      std::memcmp(data.data(), kFormat1Magic, sizeof(kFormat1Magic)) == 0) {
    return absl::FailedPreconditionError(
        "a sample log segment of format 1 (records found by their magic; this cloud reads "
        "format 2, in blocks)");
  }
  if (data.size() < kSegmentHeaderBytes) {
    if (!data.empty()) scan.damaged.push_back({0, data.size(), "partial segment header"});
    scan.synced_end = 0;
    return scan;
  }
  const bool magic = std::memcmp(data.data(), kSegmentMagic, sizeof(kSegmentMagic)) == 0;
  const bool header_ok = magic && RecordCrc(data.substr(0, kSegmentHeaderBytes - 4)) ==
                                      GetLe(data.data() + kSegmentHeaderBytes - 4, 4);
  if (header_ok) {
    const uint64_t version = GetLe(data.data() + 8, 4);
    if (version != kLogFormatVersion) {
      return absl::FailedPreconditionError(absl::StrCat("a sample log segment of format ", version,
                                                        " (this cloud reads format ",
                                                        kLogFormatVersion, ")"));
    }
    scan.nonce_known = true;
    scan.nonce = GetLe(data.data() + 12, 8);
  }

  // The open damaged range, if any.
  bool damage_open = !header_ok;
  uint64_t damage_offset = 0;
  std::string damage_why =
      header_ok ? "" : (magic ? "segment header checksum mismatch" : "not a segment header");
  const auto begin_damage = [&](uint64_t at, const char* why) {
    if (damage_open) return;
    damage_open = true;
    damage_offset = at;
    damage_why = why;
  };
  const auto close_damage = [&](uint64_t at) {
    if (!damage_open) return;
    scan.damaged.push_back({damage_offset, at - damage_offset, damage_why});
    damage_open = false;
  };
  // The record being assembled from FIRST, MIDDLE... fragments.
  bool in_record = false;
  uint64_t record_offset = 0;
  std::string body;
  const auto complete = [&](uint64_t offset, uint64_t end, absl::string_view b) {
    if (!accept(b)) {
      begin_damage(offset, "record does not parse");
      return;
    }
    close_damage(offset);
    scan.records.push_back({{offset, end}, static_cast<uint32_t>(b.size())});
  };
  const auto drop_record = [&](const char* why) {
    if (!in_record) return;
    begin_damage(record_offset, why);
    in_record = false;
    body.clear();
  };

  uint64_t pos = kSegmentHeaderBytes;
  while (pos < data.size()) {
    const uint64_t left = BlockLeft(pos);
    if (left < kFragmentHeaderBytes) {
      pos += std::min<uint64_t>(left, data.size() - pos);  // block padding
      continue;
    }
    Fragment f;
    const char* why = "";
    if (!FragmentAt(data, pos, 0, &f, &why)) {
      if (in_record) {
        drop_record(why);
      } else {
        begin_damage(pos, why);
      }
      // Resume at the block's next SYNC fragment, else at the next block boundary.
      const uint64_t block_end = std::min<uint64_t>(pos + left, data.size());
      uint64_t next = block_end;
      if (scan.nonce_known) {
        for (uint64_t q = pos + 1; q + kSyncFragmentBytes <= block_end; ++q) {
          if (SyncAt(data, q, scan.nonce)) {
            next = q;
            break;
          }
        }
      }
      pos = next;
      continue;
    }
    switch (f.type) {
      case FragmentType::kFull:
        drop_record("record without its last fragment");
        complete(pos, f.end, f.payload);
        break;
      case FragmentType::kFirst:
        drop_record("record without its last fragment");
        in_record = true;
        record_offset = pos;
        body.assign(f.payload.data(), f.payload.size());
        break;
      case FragmentType::kMiddle:
      case FragmentType::kLast:
        if (!in_record) {
          begin_damage(pos, "fragment of a record whose start is lost");
          break;
        }
        if (body.size() + f.payload.size() > kMaxRecordBodyBytes) {
          drop_record("record longer than any the log writes");
          break;
        }
        body.append(f.payload.data(), f.payload.size());
        if (f.type == FragmentType::kLast) {
          in_record = false;
          complete(record_offset, f.end, body);
          body.clear();
        }
        break;
      case FragmentType::kSync: {
        drop_record("record without its last fragment");
        if (f.payload.size() != kSyncPayloadBytes || GetLe(f.payload.data() + 8, 8) != pos ||
            (scan.nonce_known && GetLe(f.payload.data(), 8) != scan.nonce)) {
          begin_damage(pos, "sync fragment of another segment or place");
          break;
        }
        const uint64_t nonce = GetLe(f.payload.data(), 8);
        scan.nonce_known = true;
        scan.nonce = nonce;
        close_damage(pos);
        scan.syncs.push_back(pos);
        scan.synced_end = f.end;
        break;
      }
      case FragmentType::kPadding:
        drop_record("record without its last fragment");
        if (!damage_open) scan.paddings.push_back({pos, f.end});
        break;
      case FragmentType::kZero:
        break;  // FragmentAt never returns one
    }
    pos = f.end;
  }
  drop_record("record without its last fragment");
  close_damage(data.size());
  return scan;
}

}  // namespace cdcca::cloud::internal
