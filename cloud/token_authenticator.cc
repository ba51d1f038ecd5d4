#include "cloud/token_authenticator.h"

#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "openssl/bio.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "openssl/x509v3.h"
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

absl::StatusOr<std::vector<std::string>> CertificateNamesFromEscapedPem(absl::string_view escaped) {
  constexpr size_t kMaxBytes = 16 << 10;
  if (escaped.size() > 3 * kMaxBytes) {
    return absl::InvalidArgumentError("the proxied client certificate exceeds 16 KiB");
  }
  std::string pem;
  pem.reserve(escaped.size());
  for (size_t i = 0; i < escaped.size(); ++i) {
    if (escaped[i] != '%') {
      pem.push_back(escaped[i]);
      continue;
    }
    const auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = i + 2 < escaped.size() ? hex(escaped[i + 1]) : -1;
    const int lo = i + 2 < escaped.size() ? hex(escaped[i + 2]) : -1;
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError("the proxied client certificate is badly escaped");
    }
    pem.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  if (pem.size() > kMaxBytes) {
    return absl::InvalidArgumentError("the proxied client certificate exceeds 16 KiB");
  }
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  if (bio == nullptr) return absl::ResourceExhaustedError("cannot read the certificate");
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr), &X509_free);
  if (cert == nullptr) {
    return absl::InvalidArgumentError("the proxied client certificate is not a PEM certificate");
  }
  std::vector<std::string> names;
  const X509_NAME* subject = X509_get_subject_name(cert.get());
  for (int i = X509_NAME_get_index_by_NID(subject, NID_commonName, -1); i >= 0;
       i = X509_NAME_get_index_by_NID(subject, NID_commonName, i)) {
    const ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, i));
    unsigned char* utf8 = nullptr;
    const int n = ASN1_STRING_to_UTF8(&utf8, data);
    if (n >= 0) names.emplace_back(reinterpret_cast<const char*>(utf8), static_cast<size_t>(n));
    OPENSSL_free(utf8);
  }
  GENERAL_NAMES* sans = static_cast<GENERAL_NAMES*>(
      X509_get_ext_d2i(cert.get(), NID_subject_alt_name, nullptr, nullptr));
  if (sans != nullptr) {
    for (int i = 0; i < sk_GENERAL_NAME_num(sans); ++i) {
      const GENERAL_NAME* name = sk_GENERAL_NAME_value(sans, i);
      if (name->type != GEN_DNS && name->type != GEN_URI && name->type != GEN_EMAIL) continue;
      const ASN1_IA5STRING* text = name->d.ia5;
      names.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(text)),
                         static_cast<size_t>(ASN1_STRING_length(text)));
    }
    GENERAL_NAMES_free(sans);
  }
  return names;
}

}  // namespace cdcca::cloud
