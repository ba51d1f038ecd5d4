// A simulated fleet: N devices speaking the wire contract (proto/cdcca.proto) to one address,
// each with its own token and schedule, on a few threads: one scheduler thread and gRPC's
// callback threads (every call is asynchronous; no thread per device).
//
// What each device does, as `cdcca-device` does it:
//   Register (again after every time it was offline), ReportApplied of the version it runs
//   (version 0 with the base state's digest), an Uplink stream of its queued batches
//   whenever it holds some (a batch of real samples every batch_interval, encoded by the
//   project's uplink codec, compress/uplink_codec.h, a few encoded once and reused),
//   FetchUpdate every poll_interval and,
//   when an update is there, the whole payload (checked against its SHA-256), then
//   ReportApplied of the new version with the digest the cloud announced; FetchSnapshot when
//   the cloud asks for a resync. Calls that fail are retried after a jittered, growing
//   backoff; refusals are handled as the contract says (TRANSIENT: later; PERMANENT: drop the
//   batch, the next takes its sequence; RESEQUENCE: register and renumber).
//   Between two polls a device goes offline with probability offline_probability, for a
//   uniform time in [offline_min, offline_max]; its batches queue meanwhile.
//
// Thread-safety: every public method may be called from any thread.
#ifndef CDCCA_CLOUD_BENCH_FLEET_SIM_H_
#define CDCCA_CLOUD_BENCH_FLEET_SIM_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cloud/uplink_check.h"
#include "nlohmann/json.hpp"

namespace cdcca::fleet {

// Latencies in buckets 2 % wide from 10 us to ~3 h: quantiles within 2 %, the max exact.
// Not thread-safe.
class LatencyHistogram {
 public:
  LatencyHistogram();
  void Add(absl::Duration latency);
  uint64_t count() const { return count_; }
  // The q-quantile (0..1) in milliseconds; 0 when empty.
  double QuantileMs(double q) const;
  double max_ms() const { return max_ms_; }
  // {"count", "p50_ms", "p99_ms", "max_ms"}.
  nlohmann::json ToJson() const;

 private:
  std::vector<uint64_t> buckets_;
  uint64_t count_ = 0;
  double max_ms_ = 0;
};

struct FleetDevice {
  std::string id;
  std::string token;
};

struct FleetOptions {
  std::string target;  // host:port every device dials
  std::vector<FleetDevice> devices;
  // gRPC connections the devices share (device i uses connection i % connections); 0 = one
  // per device, as real devices have. Default: 0.
  int connections = 0;
  // Time between two FetchUpdate polls of one device. Default: 30 s.
  absl::Duration poll_interval = absl::Seconds(30);
  // Time between two batches one device makes (4 samples each). Default: 60 s.
  absl::Duration batch_interval = absl::Seconds(60);
  // Chance that a device goes offline after a poll, and for how long. Defaults: 0.01, 30 s
  // to 2 min.
  double offline_probability = 0.01;
  absl::Duration offline_min = absl::Seconds(30);
  absl::Duration offline_max = absl::Minutes(2);
  // Deadline of a unary call and of one stream. Defaults: 10 s and 60 s.
  absl::Duration call_timeout = absl::Seconds(10);
  absl::Duration stream_timeout = absl::Seconds(60);
  // A call that takes longer counts in the report's slow seconds. Default: 500 ms.
  absl::Duration slow_call = absl::Milliseconds(500);
  // Backoff before the n-th retry: min(max, initial * 2^(n-1)) * uniform(0.5, 1). Defaults:
  // 0.5 s and 10 s.
  absl::Duration initial_backoff = absl::Milliseconds(500);
  absl::Duration max_backoff = absl::Seconds(10);
  // A call still open this long past its deadline counts as hung (DeviceOutcome::hung).
  // Default: 5 s.
  absl::Duration hung_after = absl::Seconds(5);
  // Most batches one Uplink stream carries. Default: 8.
  int max_batches_per_stream = 8;
  // Distinct sample payloads the devices uplink, encoded once when the fleet is created
  // (what the samples hold does not matter to the cloud's serving path; encoding a fresh
  // batch for every upload cost the bench more CPU than the front spent storing it).
  // Default: 64.
  int distinct_payloads = 64;
  uint64_t seed = 1;
  // What the devices run: the cloud's model (its fingerprints and base state's digest) and
  // the shape of its samples.
  uint64_t model_fingerprint = 0;
  uint64_t vision_fingerprint = 0;
  uint64_t base_digest = 0;
  cloud::SampleSpec spec;
};

// Where one device ended.
struct DeviceOutcome {
  std::string id;
  uint64_t acked_sequence = 0;  // highest sequence the cloud acked to it
  uint64_t acked_batches = 0;
  uint64_t queued_batches = 0;  // made and not acked yet
  uint64_t version = 0;
  bool online = true;
  bool registered = false;
  bool in_call = false;       // a call of it is open
  uint64_t first_queued = 0;  // the sequence at the head of its queue (0 = empty)
  int failures = 0;           // calls failed in a row
  // The open call (its RPC and how long it has been open) when in_call, else "".
  std::string call;
  // The open call has outlived its deadline by more than FleetOptions::hung_after: neither
  // gRPC's deadline nor anything else ended it (a bug of the client library or of ours).
  bool hung = false;
};

// Counts of calls that ended, per RPC.
struct CallCounts {
  uint64_t ok = 0;
  uint64_t failed = 0;  // errors, not the contract's refusals
  uint64_t refused = 0;
};

class Fleet {
 public:
  static absl::StatusOr<std::unique_ptr<Fleet>> Create(FleetOptions options);
  ~Fleet();
  Fleet(const Fleet&) = delete;
  Fleet& operator=(const Fleet&) = delete;

  // Starts the devices (each first at a random moment within one poll interval).
  void Start();
  // From now on devices make no more batches and do not go offline on their own; they go
  // on uplinking what they queued, and polling.
  void StopProducing();
  // Takes `fraction` of the online devices offline now, cutting the calls they have open
  // mid-stream; they come back after `offline_for`. Returns how many went offline.
  int Drop(double fraction, absl::Duration offline_for);
  // When every device that Drop took offline at `dropped_at` had come back and emptied its
  // queue; nullopt while one has not.
  std::optional<absl::Time> DroppedRecoveredAt() const;
  // Cancels what is open and stops the scheduler. Idempotent.
  void Stop();

  // Devices whose queue holds batches now, and batches queued in all.
  std::pair<int, uint64_t> Queued() const;
  std::vector<DeviceOutcome> Outcomes() const;
  // Calls that failed (not refused), with the time each ended, since `since`.
  std::vector<absl::Time> FailuresSince(absl::Time since) const;
  // Calls that succeeded since `since`.
  uint64_t SuccessesSince(absl::Time since) const;
  CallCounts Counts() const;
  // Per RPC: latency histogram, ok, errors by status code, refusals by reason, calls cut by
  // Drop; and the totals (acked batches and samples, updates applied, resyncs, ack
  // regressions: acks later denied by a Register, which would mean a loss).
  nlohmann::json Report() const;

  struct Device;
  struct Call;

 private:
  explicit Fleet(FleetOptions options);
  void SchedulerLoop();
  void Wake(int device, absl::Time at);
  void Step(int device);
  // The call `d` needs now (its `call` set, not started yet), or null with the time it
  // needs one in *wake. Caller holds d.mu.
  Call* Plan(Device& d, absl::Time now, absl::Time* wake);
  // Makes the batches `d` is due to make by `now`. Caller holds d.mu.
  void MakeBatches(Device& d, absl::Time now);
  Call* NewUplink(Device& d);
  Call* NewPayloadCall(Device& d, bool snapshot);
  // A call ended: the device takes its reply (or backs off), the figures count it, and the
  // device is queued for its next step.
  void Finish(Call* call);
  void Record(const Call& call, absl::Time now, bool failed, bool cut);

  const FleetOptions options_;
  struct Shared;
  std::unique_ptr<Shared> shared_;
};

}  // namespace cdcca::fleet

#endif  // CDCCA_CLOUD_BENCH_FLEET_SIM_H_
