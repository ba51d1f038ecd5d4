// Constants and checks that belong to the wire contract (cdcca.proto), shared by the cloud
// server and the device client so both ends enforce the same bounds.
#ifndef CDCCA_PROTO_WIRE_H_
#define CDCCA_PROTO_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"
#include "proto/cdcca.pb.h"

namespace cdcca::wire {

// Largest payload carried by one message (an uplink batch or a payload chunk).
inline constexpr size_t kMaxChunkBytes = 1u << 20;  // 1 MiB
// Largest serialized message either end accepts: a chunk plus its framing fields.
inline constexpr int kMaxMessageBytes = static_cast<int>(kMaxChunkBytes + (64u << 10));
inline constexpr size_t kMaxDeviceIdBytes = 64;
inline constexpr uint32_t kMaxSamplesPerBatch = 4096;
inline constexpr size_t kMaxTokenBytes = 256;
// Largest whole update or snapshot payload the cloud serves. Default: 256 MiB.
inline constexpr uint64_t kMaxPayloadBytes = 256ull << 20;
// Metadata key of the bearer token: "authorization: Bearer <token>".
inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

// OK when `id` is 1-64 bytes of [A-Za-z0-9._-] (and not "." or ".."); INVALID_ARGUMENT with
// the reason otherwise. Device ids name directories on the cloud, hence the strictness.
absl::Status ValidateDeviceId(absl::string_view id);

// SHA-256 of `data`, as 32 raw bytes. Thread-safe.
std::string Sha256(absl::string_view data);

// Status conversions at the RPC edge. The numeric codes are the same on both sides; the
// message is kept.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// Lower-case hex of `bytes`, for logs and messages.
std::string Hex(absl::string_view bytes);

// Most DroppedBatch reports one UplinkBatch carries.
inline constexpr int kMaxDroppedReports = 64;

// The name status files and events use for a refusal reason: the enum's name without its
// prefix, in lower case ("prompt_too_long"); "reason_<n>" for a number this build does not
// know.
std::string RefusalReasonName(v1::RefusalReason reason);

}  // namespace cdcca::wire

#endif  // CDCCA_PROTO_WIRE_H_
