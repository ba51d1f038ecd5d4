#include "cloud/token_authenticator.h"

#include <functional>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "proto/wire.h"
#include "storage/env.h"

namespace cdcca::cloud {
namespace {

constexpr size_t kMinTokenBytes = 16;

bool PrintableNoSpace(absl::string_view s) {
  for (unsigned char c : s) {
    if (c <= 0x20 || c >= 0x7f) return false;
  }
  return true;
}

using BadLine = std::function<absl::Status(absl::string_view why)>;

// Calls `entry(first, second, bad)` for every `<first> <second>` line of `text`, skipping
// blank lines and '#' comments; `bad(why)` makes the error that names origin:line.
absl::Status ForEachPair(absl::string_view text, absl::string_view origin,
                         absl::string_view expected,
                         const std::function<absl::Status(absl::string_view, absl::string_view,
                                                          const BadLine&)>& entry) {
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    const BadLine bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(origin, ":", line_no, ": ", why));
    };
    if (fields.size() != 2) return bad(absl::StrCat("expected `", expected, "`"));
    if (absl::Status s = entry(fields[0], fields[1], bad); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuthenticator>> TokenAuthenticator::FromFile(
    const std::string& path) {
  absl::StatusOr<std::string> text = storage::ReadFile(*storage::Env::Default(), path);
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
  absl::Status status = ForEachPair(
      text, origin, "<device_id> <token>",
      [&](absl::string_view device, absl::string_view token, const BadLine& bad) {
        if (absl::Status s = wire::ValidateDeviceId(device); !s.ok()) return bad(s.message());
        if (token.size() < kMinTokenBytes || token.size() > wire::kMaxTokenBytes ||
            !PrintableNoSpace(token)) {
          return bad(absl::StrCat("token must be ", kMinTokenBytes, "-", wire::kMaxTokenBytes,
                                  " printable bytes"));
        }
        if (!devices.insert(std::string(device)).second) return bad("device id listed twice");
        if (!auth->device_by_token_hash_.emplace(wire::Sha256(token), std::string(device)).second) {
          return bad("token listed twice");
        }
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return auth;
}

absl::StatusOr<std::string> TokenAuthenticator::Authenticate(
    absl::string_view authorization) const {
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

absl::StatusOr<CertificateMap> ParseCertificateMap(absl::string_view text,
                                                   absl::string_view origin) {
  CertificateMap map;
  absl::Status status =
      ForEachPair(text, origin, "<certificate name> <device_id>",
                  [&](absl::string_view name, absl::string_view device, const BadLine& bad) {
                    if (name.size() > 256 || !PrintableNoSpace(name)) {
                      return bad("certificate name must be 1-256 printable bytes");
                    }
                    if (absl::Status s = wire::ValidateDeviceId(device); !s.ok())
                      return bad(s.message());
                    if (!map.emplace(std::string(name), std::string(device)).second) {
                      return bad("certificate name listed twice");
                    }
                    return absl::OkStatus();
                  });
  if (!status.ok()) return status;
  return map;
}

absl::StatusOr<CertificateMap> ReadCertificateMap(const std::string& path) {
  absl::StatusOr<std::string> text = storage::ReadFile(*storage::Env::Default(), path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("reading certificate map: ", text.status().message()));
  }
  return ParseCertificateMap(*text, path);
}

absl::Status CheckCertificateIdentity(const std::vector<std::string>& names,
                                      const CertificateMap& map, const std::string& device_id) {
  for (const std::string& name : names) {
    auto it = map.find(name);
    if ((it != map.end() ? it->second : name) == device_id) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "the client certificate (", names.empty() ? "no CN or SAN" : absl::StrJoin(names, ", "),
      ") does not stand for device ", device_id,
      "; issue the device a certificate with its id as CN or SAN, or map the name to it"));
}

}  // namespace cdcca::cloud
