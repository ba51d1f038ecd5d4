#include "cloud/open_cloud.h"

#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "cloud/data_dir_lock.h"
#include "cloud/device_registry.h"
#include "cloud/sample_store.h"
#include "cloud/token_authenticator.h"
#include "cloud/update_store.h"
#include "model/runtime/threads.h"
#include "nlohmann/json.hpp"
#include "proto/wire.h"
#include "storage/env.h"
#ifdef CDCCA_HAVE_POSTGRESQL
#include "cloud/cluster_roles.h"
#include "cloud/pg/pg_cloud_store.h"
#endif

namespace cdcca::cloud {

namespace {

using Log = std::function<void(const nlohmann::json&)>;

#ifdef CDCCA_HAVE_POSTGRESQL
std::string HostPid() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, ":", ::getpid());
}
#endif

// A guard verdict, its two agreements named as the comparison has them.
nlohmann::json VerdictJson(const GuardVerdict& v, const char* before, const char* after) {
  return nlohmann::json({{"pool", v.pool},
                         {before, v.before},
                         {after, v.after},
                         {"gain", v.gain},
                         {"se", v.se},
                         {"decision", v.decision}});
}

// What one job did, as one event (the embedded scheduler's and the shared queue's workers
// alike); nothing for a device without new samples.
void LogJob(const Log& log, const absl::StatusOr<JobReport>& r) {
  if (!r.ok()) {
    if (!absl::IsNotFound(r.status())) {
      log({{"event", "job_failed"}, {"error", r.status().ToString()}});
    }
    return;
  }
  log({{"event", "job"},
       {"device_id", r->device_id},
       {"base_version", r->base_version},
       {"new_version", r->new_version},
       {"state_digest", absl::StrFormat("%016x", r->state_digest)},
       {"batches", {r->first_sequence, r->last_sequence}},
       {"samples", r->samples},
       {"quarantined_samples", r->quarantined_samples},
       {"replay_samples", r->replay_samples},
       {"pool_samples", r->pool_samples},
       {"steps", r->steps},
       {"stopped_by_budget", r->stopped_by_budget},
       {"queue_s", r->queue_seconds},
       {"train_s", r->train_seconds},
       {"loss_first", r->loss_first},
       {"loss_last", r->loss_last},
       {"payload_bytes", r->payload_bytes},
       {"bits_per_param", r->bits_per_param},
       {"relative_error", r->relative_error},
       {"budget_raised_to", r->budget_raised_to},
       {"train_device", r->train_device},
       {"held_out_samples", r->held_out_samples},
       {"update_withheld", r->update_withheld},
       {"guard", VerdictJson(r->guard, "before", "after")},
       {"restored_base", r->restored_base},
       {"base_guard", VerdictJson(r->base_guard, "current", "base")},
       {"notes", r->notes}});
}

// Tells the trigger (or the caller's observer), and logs what devices report.
class LoggingObserver final : public CloudObserver {
 public:
  LoggingObserver(CloudObserver* next, Log log) : next_(next), log_(std::move(log)) {}
  void OnSamplesStored(const std::string& id, uint64_t highest) override {
    if (next_ != nullptr) next_->OnSamplesStored(id, highest);
  }
  void OnApplied(const std::string& id, uint64_t version, bool in_sync) override {
    log_({{"event", "applied"}, {"device_id", id}, {"version", version}, {"in_sync", in_sync}});
    if (next_ != nullptr) next_->OnApplied(id, version, in_sync);
  }
  void OnUplinkRefused(const std::string& id, uint64_t sequence, v1::UplinkRefusal refusal,
                       v1::RefusalReason reason, const absl::Status& status) override {
    log_({{"event", "uplink_refused"},
          {"device_id", id},
          {"sequence", sequence},
          {"reason", wire::RefusalReasonName(reason)},
          {"refusal", refusal == v1::UPLINK_REFUSAL_PERMANENT    ? "permanent"
                      : refusal == v1::UPLINK_REFUSAL_RESEQUENCE ? "resequence"
                                                                 : "transient"},
          {"error", std::string(status.message())}});
    if (next_ != nullptr) next_->OnUplinkRefused(id, sequence, refusal, reason, status);
  }
  void OnBatchDropped(const std::string& id, const v1::DroppedBatch& d) override {
    log_({{"event", "device_dropped_batch"},
          {"device_id", id},
          {"sequence", d.sequence()},
          {"samples", d.sample_count()},
          {"reason", wire::RefusalReasonName(d.reason())}});
    if (next_ != nullptr) next_->OnBatchDropped(id, d);
  }
  absl::StatusOr<RollbackResult> OnRollback(const std::string& id, uint64_t device_version,
                                            uint64_t to_version) override {
    if (next_ == nullptr) return CloudObserver::OnRollback(id, device_version, to_version);
    absl::StatusOr<RollbackResult> r = next_->OnRollback(id, device_version, to_version);
    if (!r.ok()) {
      log_({{"event", "rollback_refused"},
            {"device_id", id},
            {"device_version", device_version},
            {"error", r.status().ToString()}});
    }
    return r;
  }

 private:
  CloudObserver* const next_;
  const Log log_;
};

bool HasModel(const PerDeviceStrategyOptions& o) {
  return !o.checkpoint_dir.empty() || !o.teacher_dir.empty() || !o.student_base_dir.empty();
}

}  // namespace

// Members in construction order: destroyed in reverse, each piece after what uses it.
struct Cloud::Parts {
  CloudOptions options;
  std::optional<DataDirLock> lock;
  std::unique_ptr<TokenAuthenticator> auth;
  std::unique_ptr<DeviceRegistry> file_registry;
  std::unique_ptr<SampleStore> file_samples;
  std::unique_ptr<UpdateStore> file_updates;
#ifdef CDCCA_HAVE_POSTGRESQL
  std::unique_ptr<pg::PgCloudStore> shared;
  std::unique_ptr<pg::PgMirrorStates> shared_states;
#endif
  DeviceStore* registry = nullptr;
  SampleLog* samples = nullptr;
  UpdateLog* updates = nullptr;
  std::unique_ptr<PerDeviceStrategy> strategy;
  std::unique_ptr<JobScheduler> scheduler;
#ifdef CDCCA_HAVE_POSTGRESQL
  std::unique_ptr<JobQueueTrigger> queue_trigger;
  std::unique_ptr<JobWorker> worker;
#endif
  std::unique_ptr<LoggingObserver> logging_observer;
  CloudServiceOptions service_options;
  std::unique_ptr<CloudService> service;
  std::unique_ptr<CloudServer> server;
  absl::Notification stop_status;
  std::thread status_thread;
  bool shut_down = false;

  ~Parts() {
    StopWork(absl::Seconds(2));
    // The server before the service it serves; the service (whose pool may still run a
    // rollback on the strategy) before the strategy and the stores.
    server.reset();
    service.reset();
  }

  void StopWork(absl::Duration grace) {
    if (shut_down) return;
    shut_down = true;
    if (server != nullptr) server->Shutdown(grace);
    stop_status.Notify();
    if (status_thread.joinable()) status_thread.join();
    scheduler.reset();  // waits for a running job; its state file commits or not, atomically
#ifdef CDCCA_HAVE_POSTGRESQL
    worker.reset();  // waits for running jobs; each publishes under its lease or not at all
#endif
  }

  nlohmann::json Status(absl::Time started) const;
};

nlohmann::json Cloud::Parts::Status(absl::Time started) const {
  const SampleStoreStats stats = samples->Stats();
  nlohmann::json s = {{"status", "SERVING"},
                      {"uptime_s", absl::ToInt64Seconds(absl::Now() - started)},
                      {"role", options.role},
                      {"registered_devices", registry->size()},
                      {"stored_batches", stats.records},
                      {"sample_log_damaged_ranges", stats.damaged_ranges},
                      {"sample_log_damaged_bytes", stats.damaged_bytes},
                      {"sample_log_truncated_tail_bytes", stats.truncated_tail_bytes},
                      {"sample_log_bytes", stats.bytes},
                      {"sample_log_deleted_segments", stats.deleted_segments}};
  // Uplink refusals since start: by reason over all devices, and per device with the drops
  // each device reported.
  nlohmann::json refused = nlohmann::json::object();
  nlohmann::json refusals = nlohmann::json::object();
  for (const auto& [id, r] :
       service != nullptr ? service->Refusals() : std::map<std::string, DeviceRefusals>{}) {
    for (const auto& [reason, n] : r.refused) {
      refused[reason] = refused.value(reason, uint64_t{0}) + n;
    }
    refusals[id] = {{"refused", r.refused}, {"dropped_by_device", r.dropped}};
  }
  s["uplink_refused"] = refused;
  s["uplink_refusals"] = refusals;
  if (scheduler != nullptr) {
    s["jobs_done"] = scheduler->jobs_done();
    s["jobs_failed"] = scheduler->jobs_failed();
    nlohmann::json devices = nlohmann::json::object();
    uint64_t withheld = 0;
    uint64_t quarantined = 0;
    for (const std::string& id : file_registry->DeviceIds()) {
      DeviceTrainingState t = strategy->State(id);
      withheld += t.updates_withheld;
      auto record = file_registry->Get(id);
      quarantined += t.quarantined_samples;
      devices[id] = {{"mirror_version", t.version},
                     {"sample_log_bytes", file_samples->DeviceBytes(id)},
                     {"quarantined_samples", t.quarantined_samples},
                     {"last_quarantine_reason", t.last_quarantine_reason},
                     {"mirror_digest", absl::StrFormat("%016x", t.state_digest)},
                     {"consumed_sequence", t.consumed_sequence},
                     {"durable_sequence", file_samples->HighestDurable(id)},
                     {"device_version", record.ok() ? record->applied_version() : 0},
                     {"device_in_sync", record.ok() && record->in_sync()},
                     {"updates_withheld", t.updates_withheld},
                     {"rollbacks", t.rollbacks},
                     {"holdout_pool", t.holdout_pool}};
    }
    s["devices"] = devices;
    s["resident_mirrors"] = strategy->ResidentMirrors();
    s["mirror_evictions"] = strategy->MirrorEvictions();
    s["updates_withheld"] = withheld;
    s["quarantined_samples"] = quarantined;
  }
#ifdef CDCCA_HAVE_POSTGRESQL
  if (worker != nullptr) {
    s["jobs_done"] = worker->jobs_done();
    s["jobs_failed"] = worker->jobs_failed();
    s["job_leases_lost"] = worker->leases_lost();
    s["resident_mirrors"] = strategy->ResidentMirrors();
  }
#endif
  return s;
}

namespace {

// The embedded stores under the data directory.
absl::Status OpenFileStores(const CloudOptions& o, storage::Env* env, Cloud::Parts& p) {
  auto registry = DeviceRegistry::Open(o.data_dir + "/registry", env);
  if (!registry.ok()) return registry.status();
  p.file_registry = *std::move(registry);
  SampleStoreOptions sample_options;
  sample_options.dir = o.data_dir + "/samples";
  sample_options.max_device_bytes = o.device_quota_bytes;
  sample_options.env = env;
  auto samples = SampleStore::Open(sample_options);
  if (!samples.ok()) return samples.status();
  p.file_samples = *std::move(samples);
  if (o.log) {
    for (const SampleLogDamage& d : p.file_samples->Damage()) {
      o.log({{"event", d.torn_tail ? "sample_log_torn_tail" : "sample_log_corrupt"},
             {"file", d.path},
             {"offset", d.offset},
             {"bytes", d.bytes},
             {"why", d.why},
             {"action", d.torn_tail ? "truncated (never acked)" : "skipped; intact records kept"}});
    }
  }
  auto updates = UpdateStore::Open({o.data_dir + "/updates", 16, env});
  if (!updates.ok()) return updates.status();
  p.file_updates = *std::move(updates);
  p.registry = p.file_registry.get();
  p.samples = p.file_samples.get();
  p.updates = p.file_updates.get();
  return absl::OkStatus();
}

// The shared PostgreSQL store: the registry, the sample log, the updates and the mirrors.
absl::Status OpenSharedStore(const CloudOptions& o, bool serves, Cloud::Parts& p) {
#ifdef CDCCA_HAVE_POSTGRESQL
  pg::PgCloudStoreOptions pg_options;
  pg_options.conninfo = o.store;
  pg_options.max_device_bytes = o.device_quota_bytes;
  pg_options.sessions =
      serves ? std::max(1, o.store_sessions) : std::max(1, o.scheduler.threads) + 2;
  auto opened = pg::PgCloudStore::Open(pg_options);
  if (!opened.ok()) return opened.status();
  p.shared = *std::move(opened);
  p.shared_states = std::make_unique<pg::PgMirrorStates>(p.shared.get());
  p.registry = p.shared.get();
  p.samples = p.shared.get();
  p.updates = p.shared.get();
  return absl::OkStatus();
#else
  (void)o;
  (void)serves;
  (void)p;
  return absl::UnimplementedError(
      "this cdcca-cloud was built without PostgreSQL (libpq-dev): --store is unavailable");
#endif
}

// The checks of the options that hold before anything opens.
absl::Status CheckOptions(const CloudOptions& o) {
  if (o.data_dir.empty()) return absl::InvalidArgumentError("--data_dir is required");
  if (o.role != "all" && o.role != "front" && o.role != "trainer") {
    return absl::InvalidArgumentError(
        absl::StrCat("--role must be front, trainer or all, not '", o.role, "'"));
  }
  if (o.role != "all" && o.store.empty()) {
    return absl::InvalidArgumentError(
        "--role front and --role trainer share their state through --store "
        "postgresql://...; without --store the one process is both (--role all)");
  }
  return absl::OkStatus();
}

// The trainer's own checks, before the models load.
absl::Status CheckStrategyOptions(const PerDeviceStrategyOptions& so) {
  if (so.teacher_dir.empty() != so.student_base_dir.empty()) {
    return absl::InvalidArgumentError(
        "a Hugging Face pair needs both --teacher DIR and --student_base DIR");
  }
  if (!HasModel(so)) return absl::OkStatus();
  if (!(so.guard.holdout_fraction >= 0 && so.guard.holdout_fraction < 1)) {
    return absl::InvalidArgumentError("--guard_holdout_fraction must be in [0, 1)");
  }
  if (!(so.guard.confident_fraction > 0 && so.guard.confident_fraction <= 1)) {
    return absl::InvalidArgumentError("--guard_confident_fraction must be in (0, 1]");
  }
  return absl::OkStatus();
}

// The job triggers: the embedded scheduler, or (shared store) the queue of due jobs that
// fronts fill and trainers' workers drain. Returns who hears the service's events.
absl::StatusOr<CloudObserver*> StartJobs(const CloudOptions& o, bool serves, bool trains,
                                         Cloud::Parts& p) {
  std::function<void(const absl::StatusOr<JobReport>&)> on_job =
      [log = o.log, next = o.on_job](const absl::StatusOr<JobReport>& r) {
        if (log) LogJob(log, r);
        if (next) next(r);
      };
  JobSchedulerOptions jo = o.scheduler;
  jo.trigger_samples = std::max(1, jo.trigger_samples);
  jo.threads = std::max(1, jo.threads);
  if (o.store.empty()) {
    if (o.observer != nullptr || p.strategy == nullptr) return o.observer;
    p.scheduler = std::make_unique<JobScheduler>(jo, p.strategy.get(), p.file_samples.get());
    p.scheduler->SetJobCallback(on_job);
    return p.scheduler.get();
  }
#ifdef CDCCA_HAVE_POSTGRESQL
  CloudObserver* trigger = o.observer;
  if (serves && o.observer == nullptr) {
    p.queue_trigger = std::make_unique<JobQueueTrigger>(
        JobQueueTriggerOptions{jo.trigger_samples, jo.trigger_interval}, p.shared.get(),
        p.strategy.get(), p.shared_states.get(), absl::StrCat("front ", HostPid()));
    trigger = p.queue_trigger.get();
  }
  if (trains) {
    if (p.strategy == nullptr) {
      return absl::InvalidArgumentError(
          "--role trainer (or all) on --store needs a model: --checkpoint_dir or "
          "--teacher with --student_base");
    }
    JobWorkerOptions wo;
    wo.owner = o.trainer_id.empty() ? HostPid() : o.trainer_id;
    wo.threads = jo.threads;
    wo.lease = std::max(absl::Seconds(1), o.lease);
    wo.poll = o.worker_poll;
    p.worker =
        std::make_unique<JobWorker>(wo, p.shared.get(), p.shared_states.get(), p.strategy.get());
    p.worker->SetJobCallback(on_job);
    if (o.log) {
      o.log({{"event", "trainer_started"},
             {"owner", wo.owner},
             {"threads", wo.threads},
             {"blas_threads", model::BlasThreads()}});
    }
  }
  return trigger;
#else
  (void)serves;
  (void)trains;
  return absl::UnimplementedError("no PostgreSQL in this build");
#endif
}

// The service's options: the caller's, with the model's fingerprints and sample shape.
CloudServiceOptions ServiceOptionsFor(const CloudOptions& o, const PerDeviceStrategy* strategy) {
  CloudServiceOptions svc = o.service;
  if (strategy != nullptr) {
    svc.expected_fingerprint = strategy->BaseFingerprint();
    svc.base_state_digest = strategy->BaseDigest();
    svc.expected_vision_fingerprint = strategy->VisionFingerprint();
    // Ingest checks batches against the model (transport only: as given).
    svc.sample_spec = strategy->Spec();
  }
  if (o.expected_fingerprint.has_value()) svc.expected_fingerprint = *o.expected_fingerprint;
  return svc;
}

void StartStatusFile(Cloud::Parts& p) {
  if (p.options.status_file.empty()) return;
  p.status_thread = std::thread([&p] {
    const absl::Time started = absl::Now();
    do {
      (void)storage::WriteFileAtomically(*storage::Env::Default(), p.options.status_file,
                                         p.Status(started).dump() + "\n");
    } while (!p.stop_status.WaitForNotificationWithTimeout(p.options.status_interval));
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<Cloud>> OpenCloud(const CloudOptions& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  auto parts = std::make_unique<Cloud::Parts>();
  Cloud::Parts& p = *parts;
  p.options = options;
  const CloudOptions& o = p.options;
  // Held until the cloud is gone, before any store opens: a second process stops here.
  if (o.lock_data_dir) {
    auto lock = DataDirLock::Acquire(o.data_dir);
    if (!lock.ok()) return lock.status();
    p.lock.emplace(*std::move(lock));
  }
  const bool serves = o.role != "trainer";
  const bool trains = o.role != "front";
  if (serves) {
    absl::StatusOr<std::unique_ptr<TokenAuthenticator>> auth;
    if (!o.tokens_text.empty()) {
      auth = TokenAuthenticator::FromString(o.tokens_text, "tokens");
    } else if (!o.tokens_file.empty()) {
      auth = TokenAuthenticator::FromFile(o.tokens_file);
    } else {
      return absl::InvalidArgumentError("--tokens is required (see --help)");
    }
    if (!auth.ok()) return auth.status();
    p.auth = *std::move(auth);
  }
  storage::Env* env = o.env != nullptr ? o.env : storage::Env::Default();
  if (absl::Status s = o.store.empty() ? OpenFileStores(o, env, p) : OpenSharedStore(o, serves, p);
      !s.ok()) {
    return s;
  }

  // The trainer (absent in transport-only mode).
  if (absl::Status s = CheckStrategyOptions(o.strategy); !s.ok()) return s;
  if (HasModel(o.strategy)) {
    PerDeviceStrategyOptions so = o.strategy;
    if (so.state_dir.empty()) so.state_dir = o.data_dir + "/trainer";
    if (o.env != nullptr) so.env = o.env;
#ifdef CDCCA_HAVE_POSTGRESQL
    so.mirror_states = p.shared_states.get();
#endif
    auto created = PerDeviceStrategy::Create(so, p.samples, p.updates, p.registry);
    if (!created.ok()) return created.status();
    p.strategy = *std::move(created);
    if (absl::Status s = p.strategy->Recover(); !s.ok()) return s;
  }
  absl::StatusOr<CloudObserver*> trigger = StartJobs(o, serves, trains, p);
  if (!trigger.ok()) return trigger.status();
  CloudObserver* observer = *trigger;
  if (o.log) {
    p.logging_observer = std::make_unique<LoggingObserver>(observer, o.log);
    observer = p.logging_observer.get();
  }

  p.service_options = ServiceOptionsFor(o, p.strategy.get());
  if (!(p.service_options.guard_holdout_fraction >= 0 &&
        p.service_options.guard_holdout_fraction < 1)) {
    return absl::InvalidArgumentError("--guard_holdout_fraction must be in [0, 1)");
  }
  if (!o.client_cert_map_file.empty()) {
    auto map = ReadCertificateMap(o.client_cert_map_file);
    if (!map.ok()) return map.status();
    p.service_options.client_certificates = *std::move(map);
  }
  if (serves) {
    p.service = std::make_unique<CloudService>(p.service_options, p.auth.get(), p.registry,
                                               p.samples, p.updates, observer);
    auto started = CloudServer::Start(o.server, p.service.get());
    if (!started.ok()) return started.status();
    p.server = *std::move(started);
    if (o.log) {
      o.log({{"event", "serving"},
             {"port", p.server->port()},
             {"role", o.role},
             {"store", o.store.empty() ? "files" : "postgresql"},
             {"tokens", p.auth->size()},
             {"data_dir", o.data_dir},
             {"trainer", p.strategy != nullptr},
             {"blas_threads", model::BlasThreads()},
             {"fingerprint", absl::StrFormat("%016x", p.service_options.expected_fingerprint)},
             {"vision_fingerprint",
              absl::StrFormat("%016x", p.service_options.expected_vision_fingerprint)},
             {"tls", !o.server.insecure}});
    }
  }
  StartStatusFile(p);
  return std::unique_ptr<Cloud>(new Cloud(std::move(parts)));
}

Cloud::Cloud(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}
Cloud::~Cloud() = default;

int Cloud::port() const { return parts_->server != nullptr ? parts_->server->port() : 0; }
uint64_t Cloud::fingerprint() const { return parts_->service_options.expected_fingerprint; }
CloudService* Cloud::service() const { return parts_->service.get(); }
PerDeviceStrategy* Cloud::strategy() const { return parts_->strategy.get(); }
JobScheduler* Cloud::scheduler() const { return parts_->scheduler.get(); }
DeviceStore* Cloud::registry() const { return parts_->registry; }
SampleLog* Cloud::samples() const { return parts_->samples; }
UpdateLog* Cloud::updates() const { return parts_->updates; }
DeviceRegistry* Cloud::device_registry() const { return parts_->file_registry.get(); }
SampleStore* Cloud::sample_store() const { return parts_->file_samples.get(); }
UpdateStore* Cloud::update_store() const { return parts_->file_updates.get(); }

void Cloud::Shutdown(absl::Duration grace) { parts_->StopWork(grace); }

void Cloud::Wait() {
  if (parts_->server != nullptr) parts_->server->Wait();
}

}  // namespace cdcca::cloud
