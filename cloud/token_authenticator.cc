#include "cloud/token_authenticator.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "cloud/internal/file_io.h"
#include "proto/wire.h"

namespace cdcca::cloud {
namespace {

constexpr size_t kMinTokenBytes = 16;

bool PrintableNoSpace(absl::string_view s) {
  for (unsigned char c : s) {
    if (c <= 0x20 || c >= 0x7f) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuthenticator>> TokenAuthenticator::FromFile(
    const std::string& path) {
  absl::StatusOr<std::string> text = internal::ReadFile(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("reading token file: ", text.status().message()));
  }
  return FromString(*text, path);
}

absl::StatusOr<std::unique_ptr<TokenAuthenticator>> TokenAuthenticator::FromString(
    absl::string_view text, absl::string_view origin) {
  auto auth = std::make_unique<TokenAuthenticator>();
  absl::flat_hash_set<std::string> devices;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ":", line_no, ": ", why));
    };
    if (fields.size() != 2) return bad("expected `<device_id> <token>`");
    if (absl::Status s = wire::ValidateDeviceId(fields[0]); !s.ok()) return bad(s.message());
    if (fields[1].size() < kMinTokenBytes || fields[1].size() > wire::kMaxTokenBytes ||
        !PrintableNoSpace(fields[1])) {
      return bad(absl::StrCat("token must be ", kMinTokenBytes, "-", wire::kMaxTokenBytes,
                              " printable bytes"));
    }
    if (!devices.insert(std::string(fields[0])).second) return bad("device id listed twice");
    if (!auth->device_by_token_hash_.emplace(wire::Sha256(fields[1]), std::string(fields[0]))
             .second) {
      return bad("token listed twice");
    }
  }
  return auth;
}

absl::StatusOr<std::string> TokenAuthenticator::Authenticate(absl::string_view authorization) const {
  if (authorization.empty()) {
    return absl::UnauthenticatedError(
        "missing bearer token: send metadata `authorization: Bearer <token>`");
  }
  if (!absl::ConsumePrefix(&authorization, wire::kBearerPrefix) ||
      authorization.size() > wire::kMaxTokenBytes) {
    return absl::UnauthenticatedError("authorization metadata must be `Bearer <token>`");
  }
  auto it = device_by_token_hash_.find(wire::Sha256(authorization));
  if (it == device_by_token_hash_.end()) return absl::UnauthenticatedError("unknown token");
  return it->second;
}

}  // namespace cdcca::cloud
