// CloudService: the server side of the wire contract (proto/cdcca.proto), on gRPC's callback
// API. It authenticates every call by bearer token, bounds every field, stores uplinked
// batches durably before acking them, and streams updates and snapshots in chunks from
// any byte offset.
//
// Reactions stay short: uplink appends go to the sample log's commit thread (SampleStore's group
// commit, or the shared store's sessions); registry writes and every lookup a reply needs
// (the update or snapshot a fetch streams, the device a report names) run on a small pool,
// since on the shared store each is a database round trip; payloads are streamed from memory.
//
// What the payloads mean (UTS samples, DWC updates) is not this class's business; the
// trainer side plugs in through CloudObserver and the stores.
#ifndef CDCCA_CLOUD_CLOUD_SERVICE_H_
#define CDCCA_CLOUD_CLOUD_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cloud/internal/work_pool.h"
#include "cloud/stores.h"
#include "cloud/token_authenticator.h"
#include "cloud/uplink_check.h"
#include "proto/cdcca.grpc.pb.h"

namespace cdcca::cloud {

// Told about what devices do; called from service threads, so implementations must be
// thread-safe and return quickly (hand real work to their own threads).
// What a rollback made: the new version, the older version whose state it holds, and that
// state's digest.
struct RollbackResult {
  uint64_t new_version = 0;
  uint64_t restored_version = 0;
  uint64_t state_digest = 0;
};

class CloudObserver {
 public:
  virtual ~CloudObserver() = default;
  // Batches up to `highest_durable` of `device_id` are durable.
  virtual void OnSamplesStored(const std::string& device_id, uint64_t highest_durable) {}
  // The device reported running `version`; `in_sync` tells whether its digest matched.
  virtual void OnApplied(const std::string& device_id, uint64_t version, bool in_sync) {}
  // Batch `sequence` of `device_id` was refused for `reason` (`status` says more); the
  // device was told to act as `refusal` says.
  virtual void OnUplinkRefused(const std::string& device_id, uint64_t sequence,
                               v1::UplinkRefusal refusal, v1::RefusalReason reason,
                               const absl::Status& status) {}
  // The device reports it dropped a batch the cloud had refused for good.
  virtual void OnBatchDropped(const std::string& device_id, const v1::DroppedBatch& dropped) {}
  // The device asks to return to an older state (the Rollback RPC): the trainer behind the
  // observer does it (PerDeviceStrategy::Rollback) or says why not. Runs on an I/O thread.
  virtual absl::StatusOr<RollbackResult> OnRollback(const std::string& device_id,
                                                    uint64_t device_version, uint64_t to_version) {
    return absl::UnimplementedError("this cloud trains no model: there is nothing to roll back");
  }
};

// Uplink refusals of one device since the service started, by reason
// (wire::RefusalReasonName).
struct DeviceRefusals {
  std::map<std::string, uint64_t> refused;  // batches this service refused
  std::map<std::string, uint64_t> dropped;  // batches the device reported it dropped
};

struct CloudServiceOptions {
  // UTS settings sent in every Register reply.
  v1::UtsSettings uts;
  // The update guard's held-out share (UpdateGuardOptions::holdout_fraction; 0 = no guard),
  // sent in every Register reply so that devices uplink the held-out samples whole.
  double guard_holdout_fraction = 0;
  // What an uplink batch must be (the model's sample shape, per-batch bounds). Every batch is
  // decoded and checked before it is stored; one that fails is refused with
  // INVALID_ARGUMENT in the ack (error, rejected_sequence, refusal, refusal_reason) and never
  // stored.
  SampleSpec sample_spec;
  // Fingerprint of the student base devices must run; 0 = accept any.
  uint64_t expected_fingerprint = 0;
  // Digest of the pretrained student's trainable set (compress::StateDigest): what every
  // device runs at version 0, before its first update. ReportApplied checks a version-0
  // report against it and answers a mismatch as for any other version (in_sync false, resync
  // required). 0 = unknown (a cloud without the model): a version-0 report is in sync.
  uint64_t base_state_digest = 0;
  // The teacher's vision tower: Register refuses a device whose tower differs (0 = no check).
  uint64_t expected_vision_fingerprint = 0;
  // Downlink chunk size when the device asks for none. Default: 1 MiB (the maximum).
  uint32_t default_chunk_bytes = 1u << 20;
  // Threads for registry writes. Default: 2.
  int io_threads = 2;
  // Mutual TLS: a call that presents a verified client certificate is accepted only when
  // the certificate's CN or a SAN stands for the token's device (the name itself, or what
  // this map assigns to it); PERMISSION_DENIED otherwise. Calls without a certificate (TLS
  // without --client_ca or with --allow_token_only_devices, or plaintext) are decided by the
  // token alone.
  CertificateMap client_certificates;
  // Behind a proxy that terminates (mutual) TLS, e.g. nginx: the client certificate the
  // proxy verified arrives in this request header as percent-escaped PEM (nginx:
  // `grpc_set_header X-Client-Cert $ssl_client_escaped_cert;`, lower-case here), and binds
  // the call to the token's device as a certificate of this server's own TLS session does.
  // A call without the header is refused (UNAUTHENTICATED) unless allow_token_only_devices.
  // Set it only where nothing but the proxy can reach this server: the header is trusted as
  // the proxy's word. "" = off.
  std::string proxy_client_cert_header;
  bool allow_token_only_devices = false;
  // Fault injection for tests: the first FetchUpdate/FetchSnapshot stream that has sent this
  // many payload bytes ends with UNAVAILABLE, as a broken link would. 0 = off.
  uint64_t inject_cut_fetch_after_bytes = 0;
};

// Stores and authenticator must outlive the service. Thread-safe (gRPC calls it concurrently).
//
// Uplink is served raw (its messages arrive as bytes and are parsed here), so a message that
// does not parse ends the stream with INVALID_ARGUMENT instead of looking like the client's
// end of stream.
class CloudService final
    : public v1::Cloud::WithRawCallbackMethod_Uplink<v1::Cloud::CallbackService> {
 public:
  CloudService(CloudServiceOptions options, const TokenAuthenticator* auth, DeviceStore* registry,
               SampleLog* samples, UpdateLog* updates, CloudObserver* observer = nullptr);
  ~CloudService() override;

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterReply* reply) override;
  // Reads serialized v1::UplinkBatch messages; answers a serialized v1::UplinkAck.
  grpc::ServerReadReactor<grpc::ByteBuffer>* Uplink(grpc::CallbackServerContext* ctx,
                                                    grpc::ByteBuffer* ack) override;
  grpc::ServerWriteReactor<v1::PayloadChunk>* FetchUpdate(
      grpc::CallbackServerContext* ctx, const v1::FetchUpdateRequest* request) override;
  grpc::ServerWriteReactor<v1::PayloadChunk>* FetchSnapshot(
      grpc::CallbackServerContext* ctx, const v1::FetchSnapshotRequest* request) override;
  grpc::ServerUnaryReactor* ReportApplied(grpc::CallbackServerContext* ctx,
                                          const v1::ReportAppliedRequest* request,
                                          v1::ReportAppliedReply* reply) override;
  grpc::ServerUnaryReactor* Rollback(grpc::CallbackServerContext* ctx,
                                     const v1::RollbackRequest* request,
                                     v1::RollbackReply* reply) override;
  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* ctx,
                                   const v1::HealthRequest* request,
                                   v1::HealthReply* reply) override;

  // Per device, the uplink batches refused and the drops devices reported, since start.
  std::map<std::string, DeviceRefusals> Refusals() const;

 private:
  class UplinkReactor;
  class PayloadWriter;

  // Look up what a FetchUpdate / FetchSnapshot sends and start `writer` with it. Run on the
  // I/O pool: the stores may block.
  void StartUpdate(PayloadWriter* writer, const v1::FetchUpdateRequest& request);
  void StartSnapshot(PayloadWriter* writer, const v1::FetchSnapshotRequest& request);
  // A payload writer for the call: finished at once when the device id or the token is bad,
  // else handed to `start` on the I/O pool.
  grpc::ServerWriteReactor<v1::PayloadChunk>* NewPayloadWriter(
      grpc::CallbackServerContext* ctx, const std::string& device_id,
      std::function<void(PayloadWriter*)> start);

  // The device id the call's token names; UNAUTHENTICATED otherwise. When `claimed` is not
  // empty it must equal that id, and a client certificate must stand for that id
  // (PERMISSION_DENIED otherwise).
  absl::StatusOr<std::string> Authenticate(grpc::CallbackServerContext* ctx,
                                           const std::string& claimed) const;
  uint32_t ChunkBytesFor(const std::string& device_id) const;
  // True once: the stream that should be cut by fault injection.
  bool TakeInjectedCut();
  void RecordRefused(const std::string& device_id, uint64_t sequence, v1::RefusalReason reason,
                     const absl::Status& status);
  void RecordDropped(const std::string& device_id, v1::DroppedBatch dropped);

  // Constant after construction.
  const CloudServiceOptions options_;
  const TokenAuthenticator* const auth_;
  DeviceStore* const registry_;
  SampleLog* const samples_;
  UpdateLog* const updates_;
  CloudObserver* const observer_;
  const absl::Time started_;

  std::atomic<bool> cut_done_{false};
  mutable absl::Mutex refusals_mu_;
  std::map<std::string, DeviceRefusals> refusals_ ABSL_GUARDED_BY(refusals_mu_);
  internal::WorkPool io_pool_;
};

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_CLOUD_SERVICE_H_
