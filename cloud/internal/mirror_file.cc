#include "cloud/internal/mirror_file.h"

#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "compress/byte_io.h"
#include "compress/hash64.h"
#include "storage/sealed_file.h"

namespace cdcca::cloud::internal {
namespace {

constexpr uint32_t kKind = storage::SealKind("CDMS");
constexpr uint32_t kFormat = 3;
// Format 2: the same envelope without the replay buffer's blob (read, never written).
constexpr uint32_t kFormatWithoutReplay = 2;
// Format 1 (before the sealed envelope): u32 "CDMS" | u32 1 | fields | u64 Hash64.
constexpr uint32_t kLegacyMagic = 0x534d4443;
constexpr uint32_t kLegacyFormat = 1;

using compress::Put;

// The fields: u64 version | u64 consumed | u64 digest | 5 x (u64 size | bytes): mirror,
// residual, update, snapshot, replay (formats 1 and 2: the first four).
void PutFields(std::string& out, const MirrorFile& f) {
  Put(out, f.version);
  Put(out, f.consumed);
  Put(out, f.digest);
  for (const std::string* blob : {&f.mirror, &f.residual, &f.update, &f.snapshot, &f.replay}) {
    compress::PutBytes(out, *blob);
  }
}

// Reads the fields from `in` (which must hold exactly them; the replay blob only when
// `with_replay`); the error's text, or "".
std::string GetFields(absl::string_view in, MirrorFile& f, bool with_replay) {
  size_t pos = 0;
  const auto get = [&](auto* v) {
    if (pos + sizeof(*v) > in.size()) return false;
    std::memcpy(v, in.data() + pos, sizeof(*v));
    pos += sizeof(*v);
    return true;
  };
  if (!get(&f.version) || !get(&f.consumed) || !get(&f.digest)) return "truncated";
  std::vector<std::string*> blobs = {&f.mirror, &f.residual, &f.update, &f.snapshot};
  if (with_replay) blobs.push_back(&f.replay);
  for (std::string* blob : blobs) {
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
  if (std::string why = GetFields(in.substr(8, in.size() - 16), f, /*with_replay=*/false);
      !why.empty()) {
    return bad(why);
  }
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
  bool with_replay = true;
  absl::StatusOr<absl::string_view> body = storage::Unseal(in, kKind, kFormat, path);
  if (!body.ok()) {
    // A state written before the replay buffer was kept: read as it was (no replay).
    absl::StatusOr<absl::string_view> older =
        storage::Unseal(in, kKind, kFormatWithoutReplay, path);
    if (!older.ok()) return body.status();
    body = older;
    with_replay = false;
  }
  MirrorFile f;
  if (std::string why = GetFields(*body, f, with_replay); !why.empty()) {
    return absl::DataLossError(absl::StrCat("mirror state ", path, ": ", why));
  }
  return f;
}

}  // namespace cdcca::cloud::internal
