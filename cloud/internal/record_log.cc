#include "cloud/internal/record_log.h"

#include <zlib.h>

#include <cstring>

namespace cdcca::cloud::internal {
namespace {

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Whether an intact record starts at `pos`; on failure `why` says what is wrong.
bool RecordAt(absl::string_view data, uint64_t pos,
              const std::function<bool(absl::string_view)>& accept, uint32_t* length,
              const char** why) {
  if (data.size() - pos < kRecordFrameBytes) {
    *why = "partial record header";
    return false;
  }
  const char* p = data.data() + pos;
  if (GetU32(p) != kRecordMagic) {
    *why = "bad record magic";
    return false;
  }
  const uint32_t len = GetU32(p + 4);
  if (len > kMaxRecordBodyBytes || data.size() - pos - kRecordFrameBytes < len) {
    *why = "record runs past the end of the file";
    return false;
  }
  const absl::string_view body(p + kRecordFrameBytes, len);
  if (RecordCrc(body) != GetU32(p + 8)) {
    *why = "record checksum mismatch";
    return false;
  }
  if (!accept(body)) {
    *why = "record does not parse";
    return false;
  }
  *length = len;
  return true;
}

}  // namespace

uint32_t RecordCrc(absl::string_view data) {
  return static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size())));
}

void AppendRecord(std::string& out, absl::string_view body) {
  PutU32(out, kRecordMagic);
  PutU32(out, static_cast<uint32_t>(body.size()));
  PutU32(out, RecordCrc(body));
  out.append(body.data(), body.size());
}

SegmentScan ScanSegment(absl::string_view data,
                        const std::function<bool(absl::string_view body)>& accept) {
  SegmentScan scan;
  char magic[4];
  {
    std::string m;
    PutU32(m, kRecordMagic);
    std::memcpy(magic, m.data(), 4);
  }
  uint64_t pos = 0;
  while (pos < data.size()) {
    uint32_t length = 0;
    const char* why = "";
    if (RecordAt(data, pos, accept, &length, &why)) {
      scan.records.push_back({pos + kRecordFrameBytes, length});
      pos += kRecordFrameBytes + length;
      scan.valid_end = pos;
      continue;
    }
    // Damage at `pos`: look for the next intact record after it. Its framing cannot be
    // trusted (a flipped length bit would make us skip good records), so search the magic.
    uint64_t next = pos + 1;
    bool found = false;
    while (next + kRecordFrameBytes <= data.size()) {
      const void* hit = std::memchr(data.data() + next, magic[0], data.size() - next);
      if (hit == nullptr) break;
      next = static_cast<uint64_t>(static_cast<const char*>(hit) - data.data());
      if (data.size() - next < kRecordFrameBytes) break;
      const char* ignored = "";
      if (std::memcmp(data.data() + next, magic, 4) == 0 &&
          RecordAt(data, next, accept, &length, &ignored)) {
        found = true;
        break;
      }
      ++next;
    }
    if (!found) {
      scan.tail_why = why;
      break;
    }
    scan.damaged.push_back({pos, next - pos, why});
    pos = next;
  }
  return scan;
}

}  // namespace cdcca::cloud::internal
