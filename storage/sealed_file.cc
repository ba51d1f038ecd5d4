#include "storage/sealed_file.h"

#include <zlib.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace cdcca::storage {
namespace {

constexpr uint32_t kMagic = SealKind("CDSF");
constexpr size_t kHeaderBytes = 20;
constexpr size_t kTrailerBytes = 4;

void Put(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t Get(absl::string_view in, size_t pos, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(in[pos + i]);
  return v;
}

uint32_t Crc(absl::string_view data) {
  return static_cast<uint32_t>(
      crc32_z(0L, reinterpret_cast<const Bytef*>(data.data()), data.size()));
}

std::string KindName(uint32_t kind) {
  std::string name;
  Put(name, kind, 4);
  return name;
}

}  // namespace

std::string Seal(uint32_t kind, uint32_t format, absl::string_view body) {
  std::string out;
  out.reserve(kHeaderBytes + body.size() + kTrailerBytes);
  Put(out, kMagic, 4);
  Put(out, kind, 4);
  Put(out, format, 4);
  Put(out, body.size(), 8);
  out.append(body.data(), body.size());
  Put(out, Crc(out), 4);
  return out;
}

bool IsSealed(absl::string_view bytes) { return bytes.size() >= 4 && Get(bytes, 0, 4) == kMagic; }

absl::StatusOr<absl::string_view> Unseal(absl::string_view bytes, uint32_t kind, uint32_t format,
                                         absl::string_view path) {
  const auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(path, ": ", why));
  };
  if (!IsSealed(bytes)) return bad("not a sealed file");
  if (bytes.size() < kHeaderBytes + kTrailerBytes) return bad("truncated");
  const size_t crc_at = bytes.size() - kTrailerBytes;
  if (Get(bytes, crc_at, 4) != Crc(bytes.substr(0, crc_at))) return bad("checksum mismatch");
  if (Get(bytes, 4, 4) != kind) {
    return bad(absl::StrCat("holds '", KindName(static_cast<uint32_t>(Get(bytes, 4, 4))),
                            "', not '", KindName(kind), "'"));
  }
  if (Get(bytes, 8, 4) != format) {
    return bad(absl::StrCat("format ", Get(bytes, 8, 4), ", this program reads format ", format));
  }
  if (Get(bytes, 12, 8) != crc_at - kHeaderBytes) return bad("body size does not match the file");
  return bytes.substr(kHeaderBytes, crc_at - kHeaderBytes);
}

}  // namespace cdcca::storage
