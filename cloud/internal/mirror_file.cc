#include "cloud/internal/mirror_file.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "compress/hash64.h"
#include "storage/sealed_file.h"

namespace cdcca::cloud::internal {
namespace {

constexpr uint32_t kKind = storage::SealKind("CDMS");
constexpr uint32_t kFormat = 2;
// Format 1 (before the sealed envelope): u32 "CDMS" | u32 1 | fields | u64 Hash64.
constexpr uint32_t kLegacyMagic = 0x534d4443;
constexpr uint32_t kLegacyFormat = 1;

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// The fields: u64 version | u64 consumed | u64 digest | 4 x (u64 size | bytes).
void PutFields(std::string& out, const MirrorFile& f) {
  Put(out, f.version);
  Put(out, f.consumed);
  Put(out, f.digest);
  for (const std::string* blob : {&f.mirror, &f.residual, &f.update, &f.snapshot}) {
    Put<uint64_t>(out, blob->size());
    out += *blob;
  }
}

// Reads the fields from `in` (which must hold exactly them); the error's text, or "".
std::string GetFields(absl::string_view in, MirrorFile& f) {
  size_t pos = 0;
  const auto get = [&](auto* v) {
    if (pos + sizeof(*v) > in.size()) return false;
    std::memcpy(v, in.data() + pos, sizeof(*v));
    pos += sizeof(*v);
    return true;
  };
  if (!get(&f.version) || !get(&f.consumed) || !get(&f.digest)) return "truncated";
  for (std::string* blob : {&f.mirror, &f.residual, &f.update, &f.snapshot}) {
    uint64_t size = 0;
    if (!get(&size) || size > in.size() - pos) return "truncated blob";
    blob->assign(in.data() + pos, size);
    pos += size;
  }
  if (pos != in.size()) return "trailing bytes";
  return "";
}

absl::StatusOr<MirrorFile> DecodeLegacy(absl::string_view in, const std::string& path) {
  const auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("mirror state ", path, ": ", why));
  };
  if (in.size() < 16) return bad("truncated");
  uint64_t hash;
  std::memcpy(&hash, in.data() + in.size() - 8, 8);
  if (hash != compress::Hash64(in.data(), in.size() - 8)) return bad("checksum mismatch");
  uint32_t magic = 0, format = 0;
  std::memcpy(&magic, in.data(), 4);
  std::memcpy(&format, in.data() + 4, 4);
  if (magic != kLegacyMagic || format != kLegacyFormat) {
    return bad("not a mirror state file of format 1 or 2");
  }
  MirrorFile f;
  if (std::string why = GetFields(in.substr(8, in.size() - 16), f); !why.empty()) return bad(why);
  return f;
}

}  // namespace

std::string EncodeMirrorFile(const MirrorFile& f) {
  std::string body;
  PutFields(body, f);
  return storage::Seal(kKind, kFormat, body);
}

absl::StatusOr<MirrorFile> DecodeMirrorFile(absl::string_view in, const std::string& path) {
  if (!storage::IsSealed(in)) return DecodeLegacy(in, path);
  absl::StatusOr<absl::string_view> body = storage::Unseal(in, kKind, kFormat, path);
  if (!body.ok()) return body.status();
  MirrorFile f;
  if (std::string why = GetFields(*body, f); !why.empty()) {
    return absl::DataLossError(absl::StrCat("mirror state ", path, ": ", why));
  }
  return f;
}

}  // namespace cdcca::cloud::internal
