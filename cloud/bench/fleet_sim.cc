#include "cloud/bench/fleet_sim.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <queue>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/cdcca.grpc.pb.h"
#include "proto/wire.h"
#include "tests/testing/transport_fixture.h"

namespace cdcca::fleet {
namespace {

constexpr double kBucketBase = 0.01;  // ms: the first bucket's upper edge
constexpr double kBucketGrowth = 1.02;
constexpr int kBuckets = 1000;  // up to ~0.01 ms * 1.02^1000, about 3 hours

enum Rpc { kRegister, kReport, kUplink, kFetchUpdate, kFetchSnapshot, kRpcs };
constexpr const char* kRpcNames[kRpcs] = {"register", "report_applied", "uplink", "fetch_update",
                                          "fetch_snapshot"};

std::string CodeName(int code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  if (code >= 0 && code < static_cast<int>(std::size(kNames))) return kNames[code];
  return absl::StrCat("CODE_", code);
}

}  // namespace

// ---- LatencyHistogram -----------------------------------------------------------------------

LatencyHistogram::LatencyHistogram() : buckets_(kBuckets, 0) {}

void LatencyHistogram::Add(absl::Duration latency) {
  const double ms = std::max(0.0, absl::ToDoubleMilliseconds(latency));
  int b = ms <= kBucketBase
              ? 0
              : static_cast<int>(std::ceil(std::log(ms / kBucketBase) / std::log(kBucketGrowth)));
  ++buckets_[std::clamp(b, 0, kBuckets - 1)];
  ++count_;
  max_ms_ = std::max(max_ms_, ms);
}

double LatencyHistogram::QuantileMs(double q) const {
  if (count_ == 0) return 0;
  const uint64_t rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(count_)));
  uint64_t seen = 0;
  for (int b = 0; b < kBuckets; ++b) {
    seen += buckets_[b];
    if (seen >= std::max<uint64_t>(rank, 1)) {
      return std::min(max_ms_, kBucketBase * std::pow(kBucketGrowth, b));
    }
  }
  return max_ms_;
}

nlohmann::json LatencyHistogram::ToJson() const {
  return {{"count", count_},
          {"p50_ms", QuantileMs(0.5)},
          {"p99_ms", QuantileMs(0.99)},
          {"max_ms", max_ms_}};
}

// ---- state ----------------------------------------------------------------------------------

// A batch a device made and holds until the cloud acks it: its payload is one of the
// fleet's pre-encoded ones (Shared::payloads).
struct QueuedBatch {
  uint64_t sequence = 0;
  uint64_t model_version = 0;
  int payload = 0;
};

// One simulated device. The scheduler thread and the call that ends hand it over through
// the wake-up heap: at any time either one call of it is open or one wake-up is queued.
struct Fleet::Device {
  int index = 0;
  std::string id;
  std::string token;
  v1::Cloud::Stub* stub = nullptr;

  absl::Mutex mu;
  bool online ABSL_GUARDED_BY(mu) = true;
  bool registered ABSL_GUARDED_BY(mu) = false;
  bool need_report ABSL_GUARDED_BY(mu) = true;
  bool need_snapshot ABSL_GUARDED_BY(mu) = false;
  uint64_t snapshot_version ABSL_GUARDED_BY(mu) = 0;
  uint64_t version ABSL_GUARDED_BY(mu) = 0;
  uint64_t digest ABSL_GUARDED_BY(mu) = 0;
  uint64_t next_sequence ABSL_GUARDED_BY(mu) = 1;
  uint64_t acked_sequence ABSL_GUARDED_BY(mu) = 0;
  uint64_t acked_batches ABSL_GUARDED_BY(mu) = 0;
  std::deque<QueuedBatch> queue ABSL_GUARDED_BY(mu);
  absl::Time next_poll ABSL_GUARDED_BY(mu);
  absl::Time next_batch ABSL_GUARDED_BY(mu);
  absl::Time retry_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  absl::Time back_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  int failures ABSL_GUARDED_BY(mu) = 0;
  Call* call ABSL_GUARDED_BY(mu) = nullptr;  // the open call, if any
  bool cut ABSL_GUARDED_BY(mu) = false;      // its call was cut by Drop
  bool dropped ABSL_GUARDED_BY(mu) = false;  // taken offline by Drop, not recovered yet
  std::mt19937_64 rng ABSL_GUARDED_BY(mu);
};

struct Fleet::Shared {
  std::vector<std::string> payloads;  // 4 encoded samples each; constant after Create
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<v1::Cloud::Stub>> stubs;
  std::vector<std::unique_ptr<Device>> devices;
  std::atomic<bool> producing{true};
  std::atomic<int> open_calls{0};

  absl::Mutex heap_mu;
  absl::CondVar heap_cv;
  using Entry = std::pair<absl::Time, int>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap ABSL_GUARDED_BY(heap_mu);
  bool stop ABSL_GUARDED_BY(heap_mu) = false;
  std::thread scheduler;

  mutable absl::Mutex stats_mu;
  absl::Time start ABSL_GUARDED_BY(stats_mu);
  LatencyHistogram latency[kRpcs] ABSL_GUARDED_BY(stats_mu);
  std::map<std::string, uint64_t> errors[kRpcs] ABSL_GUARDED_BY(stats_mu);
  uint64_t cut[kRpcs] ABSL_GUARDED_BY(stats_mu) = {};
  std::map<std::string, uint64_t> refusals ABSL_GUARDED_BY(stats_mu);
  std::vector<absl::Time> failures ABSL_GUARDED_BY(stats_mu);
  std::vector<uint32_t> successes_per_100ms ABSL_GUARDED_BY(stats_mu);
  // Per second of the run (by when the call started): calls that took over FleetOptions::slow_call,
  // and the longest call; what lines stalls up with the cloud's own logs.
  std::vector<std::pair<uint32_t, double>> slow_per_s ABSL_GUARDED_BY(stats_mu);
  CallCounts counts ABSL_GUARDED_BY(stats_mu);
  uint64_t batches_made ABSL_GUARDED_BY(stats_mu) = 0;
  uint64_t batches_acked ABSL_GUARDED_BY(stats_mu) = 0;
  uint64_t updates_applied ABSL_GUARDED_BY(stats_mu) = 0;
  uint64_t resyncs ABSL_GUARDED_BY(stats_mu) = 0;
  uint64_t ack_regressions ABSL_GUARDED_BY(stats_mu) = 0;
  uint64_t offline_episodes ABSL_GUARDED_BY(stats_mu) = 0;
  uint64_t payload_mismatches ABSL_GUARDED_BY(stats_mu) = 0;
  int drop_pending ABSL_GUARDED_BY(stats_mu) = 0;
  absl::Time drop_recovered ABSL_GUARDED_BY(stats_mu) = absl::InfinitePast();
};

namespace {

// What one call's end changed, for the fleet's totals.
struct Totals {
  uint64_t acked = 0;
  uint64_t regressions = 0;
  uint64_t applied = 0;
  uint64_t resyncs = 0;
  uint64_t mismatches = 0;
  std::string refusal;  // the reason of a refused batch, if any
};

}  // namespace

// One open call: its context, and what the device does when it ends (Fleet::Finish).
struct Fleet::Call {
  virtual ~Call() = default;
  // Starts the call; its end calls Done().
  virtual void Begin() = 0;
  // Fills in the device from a call that ended OK; false when the reply breaks the contract
  // (counted as a failure).
  virtual bool Apply(Fleet::Device& d, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d.mu) = 0;
  void Done(grpc::Status s) {
    status = std::move(s);
    fleet->Finish(this);
  }

  Fleet* fleet = nullptr;
  v1::Cloud::Stub* stub = nullptr;
  int device = 0;
  int rpc = kRegister;
  absl::Time started;
  absl::Time deadline;
  grpc::ClientContext ctx;
  grpc::Status status;
  Totals totals;
};

namespace {

void Prepare(grpc::ClientContext& ctx, const std::string& token, absl::Time deadline) {
  ctx.AddMetadata(wire::kAuthMetadataKey, std::string(wire::kBearerPrefix) + token);
  ctx.set_deadline(absl::ToChronoTime(deadline));
}

// Drops the queued batches the cloud holds (sequence <= `highest`) as acked; counts an ack
// that the cloud later denies (a `highest` below what it acked) as a regression.
void TakeAcks(Fleet::Device& d, uint64_t highest, uint64_t* acked, uint64_t* regressions)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(d.mu) {
  if (highest < d.acked_sequence) ++*regressions;
  while (!d.queue.empty() && d.queue.front().sequence <= highest) {
    d.queue.pop_front();
    ++d.acked_batches;
    ++*acked;
  }
  d.acked_sequence = std::max(d.acked_sequence, highest);
}

// Numbers the queue from `first` on, contiguously.
void Renumber(Fleet::Device& d, uint64_t first) ABSL_EXCLUSIVE_LOCKS_REQUIRED(d.mu) {
  for (QueuedBatch& b : d.queue) b.sequence = first++;
  d.next_sequence = first;
}

}  // namespace

// Every kind of call: how it starts and what its reply does to the device.
struct RegisterCall : Fleet::Call {
  v1::RegisterRequest request;
  v1::RegisterReply reply;
  void Begin() override;
  bool Apply(Fleet::Device& d, absl::Time) override {
    const uint64_t highest = reply.next_uplink_sequence() - 1;
    TakeAcks(d, highest, &totals.acked, &totals.regressions);
    Renumber(d, highest + 1);
    d.registered = true;
    d.need_report = true;
    if (reply.resync_required()) {
      d.need_snapshot = true;
      d.snapshot_version = 0;
    }
    return reply.next_uplink_sequence() >= 1;
  }
};

struct ReportCall : Fleet::Call {
  v1::ReportAppliedRequest request;
  v1::ReportAppliedReply reply;
  uint64_t base_digest = 0;
  void Begin() override;
  bool Apply(Fleet::Device& d, absl::Time) override {
    d.need_report = false;
    if (reply.in_sync() || !reply.resync_required()) return true;
    ++totals.resyncs;
    if (reply.snapshot_version() == 0) {  // back to the base the device has
      d.version = 0;
      d.digest = base_digest;
      d.need_report = true;
    } else {
      d.need_snapshot = true;
      d.snapshot_version = reply.snapshot_version();
    }
    return true;
  }
};

struct UplinkCall : Fleet::Call, grpc::ClientWriteReactor<v1::UplinkBatch> {
  std::vector<v1::UplinkBatch> batches;
  size_t next = 0;
  v1::UplinkAck ack;
  void Begin() override;
  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the stream broke: OnDone tells how
    if (++next < batches.size()) {
      StartWrite(&batches[next]);
    } else {
      StartWritesDone();
    }
  }
  void OnDone(const grpc::Status& s) override;
  bool Apply(Fleet::Device& d, absl::Time now) override {
    if (!ack.has_error()) {
      TakeAcks(d, ack.highest_durable_sequence(), &totals.acked, &totals.regressions);
      return true;
    }
    // A refused stream acks what it stored before the refusal; a store that could not be
    // read says 0, which denies nothing.
    uint64_t ignored = 0;
    TakeAcks(d, std::max(ack.highest_durable_sequence(), d.acked_sequence), &totals.acked,
             &ignored);
    totals.refusal = wire::RefusalReasonName(ack.refusal_reason());
    switch (ack.refusal()) {
      case v1::UPLINK_REFUSAL_PERMANENT:
        // Dropped for good: the next batch takes its sequence.
        if (!d.queue.empty() && d.queue.front().sequence == ack.rejected_sequence()) {
          d.queue.pop_front();
          Renumber(d, ack.rejected_sequence());
        }
        return true;
      case v1::UPLINK_REFUSAL_RESEQUENCE:
        d.registered = false;
        return true;
      default:  // TRANSIENT, or a cloud that does not say: later
        d.retry_at = now + absl::Seconds(1);
        return true;
    }
  }
};

struct PayloadCall : Fleet::Call, grpc::ClientReadReactor<v1::PayloadChunk> {
  v1::FetchUpdateRequest update_request;      // kFetchUpdate
  v1::FetchSnapshotRequest snapshot_request;  // kFetchSnapshot
  v1::PayloadChunk chunk;
  v1::PayloadInfo info;
  std::string bytes;
  bool broken = false;  // a chunk out of place
  absl::Duration poll_interval;
  void Begin() override;
  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (chunk.has_info() && !info.available() && bytes.empty()) info = chunk.info();
    if (!chunk.data().empty()) {
      if (chunk.offset() != bytes.size()) broken = true;
      bytes.append(chunk.data());
    }
    StartRead(&chunk);
  }
  void OnDone(const grpc::Status& s) override;
  bool Apply(Fleet::Device& d, absl::Time now) override {
    if (rpc == kFetchUpdate) d.next_poll = now + poll_interval;
    if (!info.available()) return rpc == kFetchUpdate;  // nothing newer
    if (broken || bytes.size() != info.total_bytes() || wire::Sha256(bytes) != info.sha256()) {
      ++totals.mismatches;
      return false;
    }
    d.version = info.new_version();
    d.digest = info.state_digest();
    d.need_report = true;
    if (rpc == kFetchSnapshot) {
      d.need_snapshot = false;
    } else {
      ++totals.applied;
      d.next_poll = now;  // a newer one may wait
    }
    return true;
  }
};

void RegisterCall::Begin() {
  stub->async()->Register(&ctx, &request, &reply, [this](grpc::Status s) { Done(std::move(s)); });
}

void ReportCall::Begin() {
  stub->async()->ReportApplied(&ctx, &request, &reply,
                               [this](grpc::Status s) { Done(std::move(s)); });
}

void UplinkCall::Begin() {
  stub->async()->Uplink(&ctx, &ack, this);
  StartWrite(&batches[0]);
  StartCall();
}

void UplinkCall::OnDone(const grpc::Status& s) { Done(s); }

void PayloadCall::Begin() {
  if (rpc == kFetchUpdate) {
    stub->async()->FetchUpdate(&ctx, &update_request, this);
  } else {
    stub->async()->FetchSnapshot(&ctx, &snapshot_request, this);
  }
  StartRead(&chunk);
  StartCall();
}

void PayloadCall::OnDone(const grpc::Status& s) { Done(s); }

// ---- Fleet ----------------------------------------------------------------------------------

Fleet::Fleet(FleetOptions options)
    : options_(std::move(options)), shared_(std::make_unique<Shared>()) {}

Fleet::~Fleet() { Stop(); }

absl::StatusOr<std::unique_ptr<Fleet>> Fleet::Create(FleetOptions options) {
  if (options.devices.empty()) return absl::InvalidArgumentError("a fleet needs devices");
  if (options.target.empty()) return absl::InvalidArgumentError("a fleet needs a target");
  const int n = static_cast<int>(options.devices.size());
  const int connections = options.connections <= 0 ? n : std::min(options.connections, n);
  std::unique_ptr<Fleet> fleet(new Fleet(std::move(options)));
  Shared& sh = *fleet->shared_;
  for (int k = 0; k < std::max(1, fleet->options_.distinct_payloads); ++k) {
    sh.payloads.push_back(testing::MakeModelBatch(fleet->options_.spec, k, 1).payload());
  }
  for (int c = 0; c < connections; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(wire::kMaxMessageBytes);
    args.SetMaxSendMessageSize(wire::kMaxMessageBytes);
    // Each channel its own connection, as each device has (channels with equal arguments
    // would share one from gRPC's global pool).
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    sh.channels.push_back(grpc::CreateCustomChannel(fleet->options_.target,
                                                    grpc::InsecureChannelCredentials(), args));
    sh.stubs.push_back(v1::Cloud::NewStub(sh.channels.back()));
  }
  for (int i = 0; i < n; ++i) {
    auto d = std::make_unique<Device>();
    d->index = i;
    d->id = fleet->options_.devices[i].id;
    d->token = fleet->options_.devices[i].token;
    d->stub = sh.stubs[i % connections].get();
    absl::MutexLock lock(&d->mu);
    d->digest = fleet->options_.base_digest;
    d->rng.seed(fleet->options_.seed * 1000003ull + i);
    sh.devices.push_back(std::move(d));
  }
  return fleet;
}

void Fleet::Start() {
  Shared& sh = *shared_;
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&sh.stats_mu);
    sh.start = now;
  }
  for (auto& d : sh.devices) {
    absl::Time first;
    {
      absl::MutexLock lock(&d->mu);
      std::uniform_real_distribution<double> phase(0, 1);
      first = now + options_.poll_interval * phase(d->rng);
      d->next_poll = first;
      d->next_batch = now + options_.batch_interval * phase(d->rng);
    }
    Wake(d->index, first);
  }
  sh.scheduler = std::thread([this] { SchedulerLoop(); });
}

void Fleet::StopProducing() { shared_->producing = false; }

int Fleet::Drop(double fraction, absl::Duration offline_for) {
  Shared& sh = *shared_;
  const absl::Time now = absl::Now();
  int dropped = 0;
  std::mt19937_64 rng(options_.seed ^ 0xD50Bu);
  std::bernoulli_distribution pick(fraction);
  for (auto& d : sh.devices) {
    if (!pick(rng)) continue;
    absl::MutexLock lock(&d->mu);
    if (!d->online) continue;
    d->online = false;
    d->dropped = true;
    d->back_at = now + offline_for;
    if (d->call != nullptr) {
      d->cut = true;
      d->call->ctx.TryCancel();
    }
    ++dropped;
  }
  absl::MutexLock lock(&sh.stats_mu);
  sh.drop_pending += dropped;
  sh.drop_recovered = absl::InfinitePast();
  return dropped;
}

std::optional<absl::Time> Fleet::DroppedRecoveredAt() const {
  absl::MutexLock lock(&shared_->stats_mu);
  if (shared_->drop_pending > 0) return std::nullopt;
  return shared_->drop_recovered;
}

void Fleet::Stop() {
  Shared& sh = *shared_;
  {
    absl::MutexLock lock(&sh.heap_mu);
    if (sh.stop) return;
    sh.stop = true;
    sh.heap_cv.SignalAll();
  }
  if (sh.scheduler.joinable()) sh.scheduler.join();
  for (auto& d : sh.devices) {
    absl::MutexLock lock(&d->mu);
    if (d->call != nullptr) {
      d->cut = true;  // not a failure of the cloud's
      d->call->ctx.TryCancel();
    }
  }
  // The calls end on gRPC's threads; they touch the devices until then.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (sh.open_calls.load() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
}

void Fleet::Wake(int device, absl::Time at) {
  absl::MutexLock lock(&shared_->heap_mu);
  shared_->heap.emplace(at, device);
  shared_->heap_cv.Signal();
}

void Fleet::SchedulerLoop() {
  Shared& sh = *shared_;
  std::vector<int> due;
  while (true) {
    due.clear();
    {
      absl::MutexLock lock(&sh.heap_mu);
      while (!sh.stop && (sh.heap.empty() || sh.heap.top().first > absl::Now())) {
        const absl::Time until =
            sh.heap.empty() ? absl::Now() + absl::Seconds(1) : sh.heap.top().first;
        sh.heap_cv.WaitWithDeadline(&sh.heap_mu, until);
      }
      if (sh.stop) return;
      const absl::Time now = absl::Now();
      while (!sh.heap.empty() && sh.heap.top().first <= now && due.size() < 256) {
        due.push_back(sh.heap.top().second);
        sh.heap.pop();
      }
    }
    for (int i : due) Step(i);
  }
}

void Fleet::Step(int index) {
  Device& d = *shared_->devices[index];
  absl::Time wake = absl::InfiniteFuture();
  Call* call = nullptr;
  {
    absl::MutexLock lock(&d.mu);
    if (d.call != nullptr) return;  // its end queues the next step
    call = Plan(d, absl::Now(), &wake);
  }
  if (call == nullptr) {
    Wake(index, wake);
    return;
  }
  shared_->open_calls.fetch_add(1);
  call->Begin();
}

void Fleet::MakeBatches(Device& d, absl::Time now) {
  if (!shared_->producing.load()) return;
  uint64_t made = 0;
  while (now >= d.next_batch) {
    const uint64_t sequence = d.next_sequence++;
    const int payload = static_cast<int>((static_cast<uint64_t>(d.index) * 7919 + sequence) %
                                         shared_->payloads.size());
    d.queue.push_back({sequence, d.version, payload});
    d.next_batch += options_.batch_interval;
    ++made;
  }
  if (made == 0) return;
  absl::MutexLock lock(&shared_->stats_mu);
  shared_->batches_made += made;
}

Fleet::Call* Fleet::Plan(Device& d, absl::Time now, absl::Time* wake) {
  if (!d.online) {
    if (now < d.back_at) {
      *wake = d.back_at;
      return nullptr;
    }
    d.online = true;
    d.registered = false;
  }
  MakeBatches(d, now);
  if (now < d.retry_at) {
    *wake = d.retry_at;
    return nullptr;
  }
  Call* call = nullptr;
  if (!d.registered) {
    auto* c = new RegisterCall;
    c->rpc = kRegister;
    c->request.set_device_id(d.id);
    c->request.set_model_fingerprint(options_.model_fingerprint);
    c->request.set_vision_fingerprint(options_.vision_fingerprint);
    c->request.set_model_version(d.version);
    c->request.set_agent_version("fleet_bench");
    c->request.mutable_capabilities()->add_feature_precisions(v1::FEATURE_PRECISION_FP16);
    call = c;
  } else if (d.need_snapshot) {
    call = NewPayloadCall(d, /*snapshot=*/true);
  } else if (d.need_report) {
    auto* c = new ReportCall;
    c->rpc = kReport;
    c->base_digest = options_.base_digest;
    c->request.set_device_id(d.id);
    c->request.set_version(d.version);
    c->request.set_state_digest(d.digest);
    call = c;
  } else if (!d.queue.empty()) {
    call = NewUplink(d);
  } else if (now >= d.next_poll) {
    std::bernoulli_distribution leave(options_.offline_probability);
    if (shared_->producing.load() && leave(d.rng)) {
      std::uniform_real_distribution<double> away(absl::ToDoubleSeconds(options_.offline_min),
                                                  absl::ToDoubleSeconds(options_.offline_max));
      d.online = false;
      d.back_at = now + absl::Seconds(away(d.rng));
      d.next_poll = d.back_at;
      *wake = d.back_at;
      absl::MutexLock lock(&shared_->stats_mu);
      ++shared_->offline_episodes;
      return nullptr;
    }
    call = NewPayloadCall(d, /*snapshot=*/false);
  } else {
    *wake = shared_->producing.load() ? std::min(d.next_poll, d.next_batch) : d.next_poll;
    return nullptr;
  }
  call->fleet = this;
  call->stub = d.stub;
  call->device = d.index;
  call->started = now;
  const bool stream =
      call->rpc == kUplink || call->rpc == kFetchUpdate || call->rpc == kFetchSnapshot;
  call->deadline = now + (stream ? options_.stream_timeout : options_.call_timeout);
  Prepare(call->ctx, d.token, call->deadline);
  d.call = call;
  return call;
}

Fleet::Call* Fleet::NewUplink(Device& d) {
  auto* c = new UplinkCall;
  c->rpc = kUplink;
  for (const QueuedBatch& q : d.queue) {
    if (static_cast<int>(c->batches.size()) >= options_.max_batches_per_stream) break;
    v1::UplinkBatch& b = c->batches.emplace_back();
    b.set_sequence(q.sequence);
    b.set_model_version(q.model_version);
    b.set_sample_count(4);
    b.set_codec_version(1);
    b.set_payload(shared_->payloads[q.payload]);
  }
  return c;
}

Fleet::Call* Fleet::NewPayloadCall(Device& d, bool snapshot) {
  auto* c = new PayloadCall;
  c->poll_interval = options_.poll_interval;
  if (snapshot) {
    c->rpc = kFetchSnapshot;
    c->snapshot_request.set_device_id(d.id);
    c->snapshot_request.set_version(d.snapshot_version);
  } else {
    c->rpc = kFetchUpdate;
    c->update_request.set_device_id(d.id);
    c->update_request.set_base_version(d.version);
  }
  return c;
}

void Fleet::Finish(Call* call) {
  Device& d = *shared_->devices[call->device];
  const absl::Time now = absl::Now();
  absl::Time wake = now;
  bool failed = false, cut = false;
  {
    absl::MutexLock lock(&d.mu);
    d.call = nullptr;
    cut = d.cut;
    d.cut = false;
    failed = !cut && (!call->status.ok() || !call->Apply(d, now));
    if (failed) {
      ++d.failures;
      const double scale = std::min(absl::ToDoubleSeconds(options_.max_backoff),
                                    absl::ToDoubleSeconds(options_.initial_backoff) *
                                        std::pow(2.0, std::min(d.failures - 1, 30)));
      std::uniform_real_distribution<double> jitter(0.5, 1.0);
      d.retry_at = now + absl::Seconds(scale * jitter(d.rng));
      wake = d.retry_at;
    } else if (!cut) {
      d.failures = 0;
      wake = std::max(now, d.retry_at);
    }
    if (d.dropped && d.online && d.registered && d.queue.empty()) {
      d.dropped = false;
      absl::MutexLock stats(&shared_->stats_mu);
      --shared_->drop_pending;
      shared_->drop_recovered = std::max(shared_->drop_recovered, now);
    }
  }
  Record(*call, now, failed, cut);
  const int index = call->device;
  delete call;
  shared_->open_calls.fetch_sub(1);
  Wake(index, wake);
}

void Fleet::Record(const Call& call, absl::Time now, bool failed, bool cut) {
  Shared& sh = *shared_;
  absl::MutexLock lock(&sh.stats_mu);
  const Totals& t = call.totals;
  sh.batches_acked += t.acked;
  sh.ack_regressions += t.regressions;
  sh.updates_applied += t.applied;
  sh.resyncs += t.resyncs;
  sh.payload_mismatches += t.mismatches;
  if (cut) {
    ++sh.cut[call.rpc];
    return;
  }
  if (failed) {
    ++sh.counts.failed;
    ++sh.errors[call.rpc]
               [call.status.ok() ? std::string("BAD_REPLY") : CodeName(call.status.error_code())];
    sh.failures.push_back(now);
    return;
  }
  sh.latency[call.rpc].Add(now - call.started);
  if (now - call.started > options_.slow_call) {
    const size_t second =
        static_cast<size_t>(std::max<int64_t>(0, absl::ToInt64Seconds(call.started - sh.start)));
    if (second >= sh.slow_per_s.size()) sh.slow_per_s.resize(second + 1, {0, 0.0});
    ++sh.slow_per_s[second].first;
    sh.slow_per_s[second].second =
        std::max(sh.slow_per_s[second].second, absl::ToDoubleMilliseconds(now - call.started));
  }
  if (!t.refusal.empty()) {
    ++sh.counts.refused;
    ++sh.refusals[t.refusal];
  } else {
    ++sh.counts.ok;
  }
  const size_t bucket =
      static_cast<size_t>(std::max<int64_t>(0, absl::ToInt64Milliseconds(now - sh.start) / 100));
  if (bucket >= sh.successes_per_100ms.size()) sh.successes_per_100ms.resize(bucket + 1, 0);
  ++sh.successes_per_100ms[bucket];
}

// ---- figures --------------------------------------------------------------------------------

std::pair<int, uint64_t> Fleet::Queued() const {
  int devices = 0;
  uint64_t batches = 0;
  for (const auto& d : shared_->devices) {
    absl::MutexLock lock(&d->mu);
    if (!d->queue.empty()) ++devices;
    batches += d->queue.size();
  }
  return {devices, batches};
}

std::vector<DeviceOutcome> Fleet::Outcomes() const {
  std::vector<DeviceOutcome> out;
  const absl::Time now = absl::Now();
  for (const auto& d : shared_->devices) {
    absl::MutexLock lock(&d->mu);
    DeviceOutcome& o = out.emplace_back();
    o.id = d->id;
    o.acked_sequence = d->acked_sequence;
    o.acked_batches = d->acked_batches;
    o.queued_batches = d->queue.size();
    o.version = d->version;
    o.online = d->online;
    o.registered = d->registered;
    o.in_call = d->call != nullptr;
    o.first_queued = d->queue.empty() ? 0 : d->queue.front().sequence;
    o.failures = d->failures;
    if (d->call != nullptr) {
      o.call = absl::StrCat(
          kRpcNames[d->call->rpc], " open for ",
          absl::FormatDuration(absl::Trunc(now - d->call->started, absl::Milliseconds(1))));
      o.hung = now > d->call->deadline + options_.hung_after;
    }
  }
  return out;
}

std::vector<absl::Time> Fleet::FailuresSince(absl::Time since) const {
  absl::MutexLock lock(&shared_->stats_mu);
  std::vector<absl::Time> out;
  for (absl::Time t : shared_->failures) {
    if (t >= since) out.push_back(t);
  }
  return out;
}

uint64_t Fleet::SuccessesSince(absl::Time since) const {
  absl::MutexLock lock(&shared_->stats_mu);
  const Shared& sh = *shared_;
  uint64_t n = 0;
  const int64_t from = std::max<int64_t>(0, absl::ToInt64Milliseconds(since - sh.start) / 100);
  for (size_t b = static_cast<size_t>(from); b < sh.successes_per_100ms.size(); ++b) {
    n += sh.successes_per_100ms[b];
  }
  return n;
}

CallCounts Fleet::Counts() const {
  absl::MutexLock lock(&shared_->stats_mu);
  return shared_->counts;
}

nlohmann::json Fleet::Report() const {
  const Shared& sh = *shared_;
  absl::MutexLock lock(&sh.stats_mu);
  nlohmann::json rpcs = nlohmann::json::object();
  for (int r = 0; r < kRpcs; ++r) {
    nlohmann::json j = sh.latency[r].ToJson();
    j["errors"] = sh.errors[r];
    j["cut_by_drop"] = sh.cut[r];
    rpcs[kRpcNames[r]] = j;
  }
  nlohmann::json slow = nlohmann::json::array();
  for (size_t second = 0; second < sh.slow_per_s.size(); ++second) {
    const auto& [calls, max_ms] = sh.slow_per_s[second];
    if (calls > 0) slow.push_back({{"second", second}, {"calls", calls}, {"max_ms", max_ms}});
  }
  return {{"rpcs", rpcs},
          {"refusals", sh.refusals},
          {"calls_ok", sh.counts.ok},
          {"calls_failed", sh.counts.failed},
          {"calls_refused", sh.counts.refused},
          {"batches_made", sh.batches_made},
          {"batches_acked", sh.batches_acked},
          {"samples_acked", sh.batches_acked * 4},
          {"updates_applied", sh.updates_applied},
          {"resyncs", sh.resyncs},
          {"ack_regressions", sh.ack_regressions},
          {"payload_mismatches", sh.payload_mismatches},
          {"offline_episodes", sh.offline_episodes},
          {"connections", sh.channels.size()},
          {"start_unix_s", absl::ToDoubleSeconds(sh.start - absl::UnixEpoch())},
          {"slow_call_ms", absl::ToDoubleMilliseconds(options_.slow_call)},
          {"slow_seconds", slow}};
}

}  // namespace cdcca::fleet
