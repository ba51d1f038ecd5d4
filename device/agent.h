// DeviceAgent: the device side of one CD-CCA round, around an InferenceRuntime and a
// CloudClient.
//
//   Process(frames)  answers frames with the student (the caller's thread) -> the device
//                    step of each answer (SampleStep: held out for the guard?, UTS stage 1,
//                    stage 2, the checked uplink sample) -> the on-disk UplinkQueue, in
//                    batches.
//   link thread      registers (UTS settings from the reply override local defaults),
//                    uplinks queued batches under a bandwidth cap, polls FetchUpdate,
//                    applies an update in place (the runtime's writer lock: between
//                    answers), saves the new state, reports the digest, and resyncs from a
//                    snapshot when the cloud says the state differs or the chain is broken.
//
// Every refusal ends. A batch the cloud refuses for good (UPLINK_REFUSAL_PERMANENT: its
// shape, size, codec or question length is not what the cloud's model takes) leaves the
// queue with an "uplink_batch_dropped" event and a count by reason, the batches behind it
// are renumbered and go on, and the drop is reported to the cloud with the next batch sent.
// A transient refusal (quota, storage) holds the uplink back for a bounded, jittered,
// exponentially growing while (updates are still fetched); a sequence the cloud does not
// expect (its log lost a tail) makes the agent register again and renumber its queue. A
// kept sample that cannot be uplinked (a question longer than the codec carries, a batch
// over the wire's 1 MiB) is still answered, counted and logged ("sample_not_uplinked"):
// Process fails only when the model cannot answer.
//
// The last good trainable state lives in <state_dir>/trainable.state, rewritten durably
// after every successful apply or resync and loaded at Create, so a crash mid-apply
// restarts on the state before the update (which is then fetched again). The file is
//   u64 version | u64 state digest | safetensors of the trainable set | u64 Hash64,
// and a damaged file is ignored (the runtime goes back to the pretrained state; the cloud
// then resyncs it). At every Register the device reports its version and state digest, the
// pretrained base (version 0) included, and loads what the cloud's answer says when they
// differ from the cloud's mirror: the snapshot it names, or, where the cloud holds none (its
// mirror of the device is the pretrained base), the base the runtime started on, which the
// Register fingerprint ties to the cloud's. When the cloud is away, Process keeps answering
// and queueing; the link thread retries with backoff.
//
// Time (batch age, sample ids, the poll interval, bandwidth pacing) is read from a Clock:
// the real one in `cdcca-device`; the harness runs its fleet's link threads on a
// VirtualClock.
//
// Thread-safety: Process/Flush from one thread at a time; everything else from any thread.
#ifndef CDCCA_DEVICE_AGENT_H_
#define CDCCA_DEVICE_AGENT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "compress/uplink_codec.h"
#include "device/cloud_client.h"
#include "device/inference_runtime.h"
#include "device/sample_step.h"
#include "device/uplink_queue.h"
#include "device/uts.h"
#include "proto/clock.h"
#include "storage/env.h"

namespace cdcca::device {

struct AgentOptions {
  // Holds trainable.state and the uplink queue (queue/). Created if missing.
  std::string state_dir;
  // Every file call on state_dir goes through it (not owned; must outlive the agent).
  storage::Env* env = storage::Env::Default();
  // Local UTS defaults; non-zero fields of the cloud's Register reply override them.
  UtsOptions uts;
  // Kept samples per uplink batch; a partial batch is flushed after batch_max_age.
  // Defaults: 8 and 5 s.
  int batch_samples = 8;
  absl::Duration batch_max_age = absl::Seconds(5);
  // Uplink bandwidth cap in bytes per second of payload (0 = none). Default: 0.
  uint64_t bandwidth_bytes_per_s = 0;
  // Most batches / payload bytes sent in one Uplink stream. Defaults: 32 and 4 MiB.
  size_t uplink_max_batches = 32;
  uint64_t uplink_max_bytes = 4ull << 20;
  // How often the link thread polls for updates (and retries a lost link). Default: 2 s.
  absl::Duration poll_interval = absl::Seconds(2);
  // After the n-th transient uplink refusal in a row, the uplink waits
  // min(max, initial * 2^(n-1)) * uniform(0.5, 1). Defaults: 1 s and 60 s.
  absl::Duration refusal_backoff_initial = absl::Seconds(1);
  absl::Duration refusal_backoff_max = absl::Seconds(60);
  // Bounds of the on-disk uplink queue.
  uint64_t queue_max_bytes = 64ull << 20;
  size_t queue_max_batches = 4096;
  // Downlink budget per update announced at Register (0 = the cloud's default).
  uint64_t update_byte_budget = 0;
  // Where time comes from (not owned; must outlive the agent). nullptr = Clock::Real().
  Clock* clock = nullptr;
  // Non-zero: UTS stage 2's dropout passes for the n-th answer draw from a generator
  // seeded with a hash of (score_seed, n) (InferenceRuntime::TokenScores' seed), so the
  // uplink does not depend on other threads of the process. 0 = the process's generator.
  uint64_t score_seed = 0;
};

// One answered frame.
struct FrameResult {
  std::string answer;
  float entropy = 0;
  bool uplinked = false;       // queued: kept by UTS stage 1, or held out for the guard
  int kept_tokens = 0;         // UTS stage 2
  uint64_t model_version = 0;  // version that answered
  double latency_ms = 0;
};

struct AgentStats {
  uint64_t answered = 0;
  uint64_t kept_samples = 0;     // passed stage 1
  uint64_t dropped_samples = 0;  // kept but refused by a full queue
  uint64_t unsent_samples = 0;   // kept, answered, but not uplinkable (see the class comment)
  // Samples uplinked whole (every visual token) because the cloud's update guard holds them
  // out (RegisterReply.guard_holdout_fraction): that share of every answer, whether it passed
  // stage 1 or not.
  uint64_t held_out_samples = 0;
  uint64_t batches_queued = 0;
  uint64_t batches_acked = 0;  // highest durable sequence the cloud acked (its numbering)
  // Batches dropped from the queue because the cloud refused them for good, in all and by
  // reason (wire::RefusalReasonName).
  uint64_t dropped_batches = 0;
  std::map<std::string, uint64_t> dropped_batches_by_reason;
  uint64_t uplink_backoffs = 0;  // transient refusals the uplink backed off after
  // The uplink waits now after a refusal (transient, or a sequence to renumber), and the
  // last refusal it met ("batch N (reason): message"; "" = none yet).
  bool uplink_backing_off = false;
  std::string last_refusal;
  uint64_t renumbered = 0;    // times the queue was renumbered to the cloud's log
  uint64_t uplink_bytes = 0;  // payload bytes sent (resends included)
  // Real time spent in Uplink calls, and in fetching, applying and reporting updates and
  // snapshots (measured, cumulative).
  double uplink_seconds = 0;
  double update_seconds = 0;
  uint64_t updates_applied = 0;
  uint64_t resyncs = 0;           // snapshots loaded, or the pretrained base restored
  uint64_t rollbacks = 0;         // RollBack()s that completed
  uint64_t rejected_updates = 0;  // payloads that failed verification or apply
  uint64_t version = 0;
  uint64_t state_digest = 0;
  bool registered = false;
  bool link_up = false;
  std::string link_error;  // how the link thread's last pass failed ("" = it did not)
  bool in_sync = false;    // the last ReportApplied matched the cloud's mirror
  // Passes of the link thread (SyncOnce) finished, and whether the thread now waits for its
  // next poll (or a wake-up) with nothing left to do in the pass.
  uint64_t link_passes = 0;
  bool link_idle = false;
  UplinkQueueStats queue;
};

class DeviceAgent {
 public:
  // `runtime` and `client` must outlive the agent. Loads the last good state from
  // state_dir into the runtime and opens the uplink queue. Does not contact the cloud.
  static absl::StatusOr<std::unique_ptr<DeviceAgent>> Create(const AgentOptions& options,
                                                             InferenceRuntime* runtime,
                                                             CloudClient* client);
  // Stops the link thread (if started). Queued batches stay on disk.
  ~DeviceAgent();

  // Starts the link thread.
  void Start();
  // Stops it (waits for the call in flight, bounded by the client's deadlines).
  void Stop();

  // Answers `frames` as one batch and runs UTS on them. Errors only when the model cannot
  // answer them; a sample that cannot be uplinked, a full queue or an absent cloud never
  // fail it.
  absl::StatusOr<std::vector<FrameResult>> Process(const std::vector<Frame>& frames);
  // Encodes and queues the kept samples that wait for a full batch. OK: what cannot be
  // queued is counted (AgentStats), as in Process.
  absl::Status Flush();

  // One pass of the link thread's work, synchronously: register if needed, uplink what is
  // queued, fetch and apply an update (resyncing as needed). For tests and the harness;
  // do not mix with Start().
  absl::Status SyncOnce();

  // Returns the device to its state at `to_version` (0 = the one before its newest
  // update), with the cloud (CloudClient::Rollback): registers if needed, brings the
  // device to the cloud's newest version first, then loads the snapshot of the new version
  // the cloud made, saves it and reports it. The cloud's error as it is where it refuses
  // (a device on the pretrained base, a version no longer kept). Synchronous; call before
  // Start() or after Stop().
  absl::StatusOr<v1::RollbackReply> RollBack(uint64_t to_version);

  AgentStats Stats() const;

 private:
  DeviceAgent(AgentOptions options, InferenceRuntime* runtime, CloudClient* client,
              std::unique_ptr<UplinkQueue> queue);
  absl::Status LoadState();
  absl::Status SaveState();
  absl::Status RegisterWithCloud();
  absl::Status UplinkQueued();
  absl::Status PullUpdate();
  absl::Status Resync(uint64_t version);
  // Loads the pretrained base (base_state_) as version 0, saves it and reports it.
  // FAILED_PRECONDITION when the agent did not start on the base.
  absl::Status ResyncToBase();
  absl::Status Report(bool allow_resync);
  void FlushLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(batch_mu_);
  // Encodes `samples` and queues them, split into as many batches as the wire's 1 MiB per
  // batch needs. What cannot be queued is counted: a sample that alone exceeds 1 MiB, or a
  // batch the queue fails to write, as unsent; a batch a full queue refuses, as dropped.
  void EnqueueSamples(std::vector<compress::UplinkSample> samples,
                      compress::FeaturePrecision precision);
  void CountUnsent(uint64_t samples, absl::string_view why);
  // Handles a refusal in `ack` (after the acked part was acknowledged): true when the
  // refused batch was dropped and the uplink may go on; false when it must wait (backoff,
  // and registering again).
  bool OnRefused(const v1::UplinkAck& ack);
  void LinkLoop();

  // Constant after construction.
  const AgentOptions options_;
  InferenceRuntime* const runtime_;
  CloudClient* const client_;
  const std::unique_ptr<UplinkQueue> queue_;
  Clock* const clock_;
  // The runtime's trainable set as it started, when that was the pretrained base (version
  // 0); empty otherwise. Set in Create, then constant.
  std::string base_state_;

  // Samples waiting to fill a batch, and the UTS state (Process's thread; Flush).
  absl::Mutex batch_mu_;
  std::vector<compress::UplinkSample> batch_ ABSL_GUARDED_BY(batch_mu_);
  absl::Time batch_started_ ABSL_GUARDED_BY(batch_mu_);
  // Held-out choice, UTS and the sample of each answer (reconfigured by Register replies).
  SampleStep step_ ABSL_GUARDED_BY(batch_mu_);

  // Serialises the link work (apply, resync, save) so SyncOnce and the thread never overlap.
  absl::Mutex link_mu_;

  mutable absl::Mutex mu_;
  UtsOptions uts_ ABSL_GUARDED_BY(mu_);
  bool uts_changed_ ABSL_GUARDED_BY(mu_) = false;
  // The cloud's held-out share, from its last Register reply (0 until then, or no guard).
  double holdout_fraction_ ABSL_GUARDED_BY(mu_) = 0;
  AgentStats stats_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time sent_since_ ABSL_GUARDED_BY(mu_);  // start of the bandwidth accounting window
  uint64_t sent_bytes_window_ ABSL_GUARDED_BY(mu_) = 0;
  // Transient refusals in a row, and when the uplink may try again.
  int refusals_in_row_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time uplink_not_before_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Drops not yet reported to the cloud; sent with the first batch of the next stream.
  std::vector<v1::DroppedBatch> unreported_drops_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 jitter_rng_ ABSL_GUARDED_BY(mu_){std::random_device{}()};

  std::thread link_thread_;
};

}  // namespace cdcca::device

#endif  // CDCCA_DEVICE_AGENT_H_
