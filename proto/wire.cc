#include "proto/wire.h"

#include <openssl/evp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace cdcca::wire {

absl::Status ValidateDeviceId(absl::string_view id) {
  if (id.empty()) return absl::InvalidArgumentError("device_id is empty");
  if (id.size() > kMaxDeviceIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_id is ", id.size(), " bytes; the limit is ", kMaxDeviceIdBytes));
  }
  if (id == "." || id == "..") return absl::InvalidArgumentError("device_id may not be . or ..");
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          "device_id may hold only letters, digits, '.', '_' and '-'");
    }
  }
  return absl::OkStatus();
}

std::string Sha256(absl::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md, &len, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(md), len);
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string Hex(absl::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

std::string RefusalReasonName(v1::RefusalReason reason) {
  absl::string_view name = v1::RefusalReason_Name(reason);
  if (!absl::ConsumePrefix(&name, "REFUSAL_REASON_")) {
    return absl::StrCat("reason_", static_cast<int>(reason));
  }
  return absl::AsciiStrToLower(name);
}

}  // namespace cdcca::wire
