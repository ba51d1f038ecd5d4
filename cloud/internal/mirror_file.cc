#include "cloud/internal/mirror_file.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "compress/hash64.h"

namespace cdcca::cloud::internal {
namespace {

constexpr uint32_t kStateMagic = 0x534d4443;  // "CDMS"
constexpr uint32_t kStateFormat = 1;

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

}  // namespace

std::string EncodeMirrorFile(const MirrorFile& f) {
  std::string out;
  Put(out, kStateMagic);
  Put(out, kStateFormat);
  Put(out, f.version);
  Put(out, f.consumed);
  Put(out, f.digest);
  for (const std::string* blob : {&f.mirror, &f.residual, &f.update, &f.snapshot}) {
    Put<uint64_t>(out, blob->size());
    out += *blob;
  }
  Put(out, compress::Hash64(out.data(), out.size()));
  return out;
}

absl::StatusOr<MirrorFile> DecodeMirrorFile(absl::string_view in, const std::string& path) {
  const auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("mirror state ", path, ": ", why));
  };
  if (in.size() < 40) return bad("truncated");
  uint64_t hash;
  std::memcpy(&hash, in.data() + in.size() - 8, 8);
  if (hash != compress::Hash64(in.data(), in.size() - 8)) return bad("checksum mismatch");
  size_t pos = 0;
  const auto get = [&](auto* v) {
    if (pos + sizeof(*v) > in.size() - 8) return false;
    std::memcpy(v, in.data() + pos, sizeof(*v));
    pos += sizeof(*v);
    return true;
  };
  uint32_t magic = 0, format = 0;
  MirrorFile f;
  if (!get(&magic) || !get(&format) || magic != kStateMagic || format != kStateFormat) {
    return bad("not a mirror state file of format 1");
  }
  if (!get(&f.version) || !get(&f.consumed) || !get(&f.digest)) return bad("truncated");
  for (std::string* blob : {&f.mirror, &f.residual, &f.update, &f.snapshot}) {
    uint64_t size = 0;
    if (!get(&size) || size > in.size() - 8 - pos) return bad("truncated blob");
    blob->assign(in.data() + pos, size);
    pos += size;
  }
  if (pos != in.size() - 8) return bad("trailing bytes");
  return f;
}

}  // namespace cdcca::cloud::internal
