// TokenAuthenticator: maps per-device bearer tokens to device ids.
//
// Token file format, one device per line: `<device_id> <token>`; blank lines and lines
// starting with '#' are ignored. Tokens are 16-256 printable, non-space bytes. Only their
// SHA-256 is kept in memory, so a lookup's timing does not depend on how much of a guessed
// token is right.
//
// Thread-safe after construction (read-only).
#ifndef CDCCA_CLOUD_TOKEN_AUTHENTICATOR_H_
#define CDCCA_CLOUD_TOKEN_AUTHENTICATOR_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::cloud {

class TokenAuthenticator {
 public:
  // Reads a token file. INVALID_ARGUMENT naming the line for a malformed entry or a
  // duplicated device id or token.
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> FromFile(const std::string& path);
  // Same, from the file's contents; `origin` names the source in error messages.
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> FromString(absl::string_view text,
                                                                        absl::string_view origin);

  // The device id of `authorization` metadata of the form "Bearer <token>".
  // UNAUTHENTICATED if it is missing, malformed or unknown.
  absl::StatusOr<std::string> Authenticate(absl::string_view authorization) const;

  size_t size() const { return device_by_token_hash_.size(); }

 private:
  absl::flat_hash_map<std::string, std::string> device_by_token_hash_;
};

// Mutual TLS: which device a client certificate speaks for. A certificate name (its CN or
// any subject alternative name) stands for the device of that id, unless a certificate map
// says otherwise. Map file format, one entry per line: `<certificate name> <device_id>`;
// blank lines and lines starting with '#' are ignored; a name may be listed once.
using CertificateMap = std::map<std::string, std::string>;

// Parses a certificate map. INVALID_ARGUMENT naming `origin` and the line for a malformed
// entry, a bad device id or a name listed twice.
absl::StatusOr<CertificateMap> ParseCertificateMap(absl::string_view text,
                                                   absl::string_view origin);
absl::StatusOr<CertificateMap> ReadCertificateMap(const std::string& path);

// OK when one of `names` (the verified client certificate's CN and SANs) stands for
// `device_id` under `map`; PERMISSION_DENIED naming the certificate's names otherwise.
absl::Status CheckCertificateIdentity(const std::vector<std::string>& names,
                                      const CertificateMap& map, const std::string& device_id);

// The names a client certificate stands for (its subject's CN, then its DNS, URI and email
// subject alternative names), from the certificate as a TLS-terminating proxy passes it on:
// PEM, percent-escaped (nginx's $ssl_client_escaped_cert). INVALID_ARGUMENT for anything
// that is not one PEM certificate of at most 16 KiB. The proxy verified the certificate;
// this only reads it.
absl::StatusOr<std::vector<std::string>> CertificateNamesFromEscapedPem(absl::string_view escaped);

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_TOKEN_AUTHENTICATOR_H_
