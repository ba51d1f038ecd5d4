// CloudClient: the device's side of the wire contract. Every call has a deadline; calls
// that fail with UNAVAILABLE (the cloud is away, the link broke) are retried with jittered
// exponential backoff; payload downloads resume from the last byte received and are
// verified against the SHA-256 the cloud announced.
//
// Thread-safe: calls may run concurrently (each uses its own gRPC context).
#ifndef CDCCA_DEVICE_CLOUD_CLIENT_H_
#define CDCCA_DEVICE_CLOUD_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/cdcca.grpc.pb.h"

namespace cdcca::device {

struct ClientTlsFiles {
  std::string root_ca_path;      // PEM CA that signed the server's certificate
  std::string cert_chain_path;   // PEM client certificate, for mutual TLS (optional)
  std::string private_key_path;  // PEM client key, with cert_chain_path
  // Name to check the server certificate against instead of the target's host (optional).
  std::string server_name_override;
};

struct CloudClientOptions {
  std::string target;     // host:port of the cloud
  std::string device_id;  // must match the token's device
  std::string token;      // bearer token
  bool insecure = false;  // plaintext; loopback experiments only
  ClientTlsFiles tls;
  // Deadline of each unary call. Default: 10 s.
  absl::Duration call_timeout = absl::Seconds(10);
  // Deadline of each streaming call (one Uplink stream, one download attempt). Default: 120 s.
  absl::Duration stream_timeout = absl::Seconds(120);
  // Attempts per call on UNAVAILABLE without progress. Default: 6.
  int max_attempts = 6;
  // Backoff before the n-th retry: min(max, initial * 2^(n-1)) * uniform(0.5, 1). Defaults:
  // 100 ms and 5 s.
  absl::Duration initial_backoff = absl::Milliseconds(100);
  absl::Duration max_backoff = absl::Seconds(5);
};

// A downloaded update or snapshot; `bytes` is verified against info.sha256.
struct FetchedPayload {
  v1::PayloadInfo info;  // info.available == false: nothing newer than the base
  std::string bytes;
  int resumes = 0;  // times the download continued from an offset after a broken stream
};

struct ClientStats {
  uint64_t retries = 0;  // attempts repeated after UNAVAILABLE
  uint64_t resumes = 0;  // downloads continued from an offset
};

class CloudClient {
 public:
  static absl::StatusOr<std::unique_ptr<CloudClient>> Create(const CloudClientOptions& options);

  // The device this client speaks for (CloudClientOptions::device_id).
  const std::string& device_id() const { return options_.device_id; }

  // `request.device_id` is filled in from the options.
  absl::StatusOr<v1::RegisterReply> Register(v1::RegisterRequest request);

  // Sends `batches` in one stream. The ack tells the highest durable sequence; a batch the
  // cloud refused shows up in ack.error / ack.rejected_sequence (the stream stops there).
  // After a broken stream the whole list is resent; the cloud drops what it already has.
  absl::StatusOr<v1::UplinkAck> Uplink(const std::vector<v1::UplinkBatch>& batches);

  // Downloads the update that applies on top of `base_version` (resuming as needed).
  absl::StatusOr<FetchedPayload> FetchUpdate(uint64_t base_version);
  // Downloads the snapshot of `version` (0 = the newest).
  absl::StatusOr<FetchedPayload> FetchSnapshot(uint64_t version);

  absl::StatusOr<v1::ReportAppliedReply> ReportApplied(uint64_t version, uint64_t state_digest);
  // Asks the cloud to return this device, which runs `version`, to its state at `to_version`
  // (0 = the one before `version`) as a new version. One attempt, no retries: a rollback
  // is not repeated blindly (a lost reply is harmless: the device's next update pass
  // fetches the new version and resyncs to it).
  absl::StatusOr<v1::RollbackReply> Rollback(uint64_t version, uint64_t to_version);
  absl::StatusOr<v1::HealthReply> Health();

  ClientStats stats() const;

 private:
  CloudClient(CloudClientOptions options, std::unique_ptr<v1::Cloud::Stub> stub)
      : options_(std::move(options)), stub_(std::move(stub)) {}
  void Prepare(grpc::ClientContext* ctx, absl::Duration timeout) const;
  // Sleeps before retry number `attempt` (1-based).
  void Backoff(int attempt);
  // Runs `call` until it returns something other than UNAVAILABLE, at most max_attempts.
  template <typename Fn>
  auto WithRetries(Fn call) -> decltype(call());
  // One download: `open` starts a stream at an offset for an expected version.
  template <typename Open>
  absl::StatusOr<FetchedPayload> Download(Open open);

  const CloudClientOptions options_;
  const std::unique_ptr<v1::Cloud::Stub> stub_;
  mutable absl::Mutex mu_;
  ClientStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cdcca::device

#endif  // CDCCA_DEVICE_CLOUD_CLIENT_H_
