// OpenCloud: the one place a cloud is assembled from its pieces, as `cdcca-cloud` runs it:
// the data directory's lock, the stores (files under the data directory, or a PostgreSQL
// database several processes share), the token authenticator, the trainer
// (PerDeviceStrategy with its JobScheduler, or on PostgreSQL the shared queue's
// JobQueueTrigger and JobWorker), the CloudService and the CloudServer. The program, the
// harness (sim/harness.cc), the benchmarks and the test fixtures all open their cloud here.
//
//   CloudOptions o;
//   o.data_dir = "/var/lib/cdcca";
//   o.tokens_file = "tokens.txt";
//   o.strategy.checkpoint_dir = "models/small";
//   o.server.listen_address = "0.0.0.0:50051";
//   absl::StatusOr<std::unique_ptr<Cloud>> cloud = OpenCloud(o);
//   ... (*cloud)->port() ...
//   (*cloud)->Shutdown(absl::Seconds(5));   // or just destroy it
//
// Roles: with `store` empty the one process is everything (role "all"). With a PostgreSQL
// `store`, role "front" serves devices and makes their jobs due in the shared queue, role
// "trainer" leases and runs due jobs and serves nothing, "all" does both.
#ifndef CDCCA_CLOUD_OPEN_CLOUD_H_
#define CDCCA_CLOUD_OPEN_CLOUD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cloud/cloud_server.h"
#include "cloud/cloud_service.h"
#include "cloud/trainer.h"
#include "nlohmann/json_fwd.hpp"

namespace cdcca::storage {
class Env;
}  // namespace cdcca::storage

namespace cdcca::cloud {

class DeviceRegistry;
class SampleStore;
class UpdateStore;

// What a cloud is made of. The fields that `cdcca-cloud` sets from a flag carry the flag's
// name, and the errors of OpenCloud name them as flags.
struct CloudOptions {
  // ---- where the state lives ----
  // Required. The embedded stores live under it (samples/, updates/, registry/), the mirrors
  // under DIR/trainer unless strategy.state_dir says otherwise. Created if missing.
  std::string data_dir;
  // Take DIR/LOCK (cloud/data_dir_lock.h) before any store opens and hold it while the cloud
  // lives: a second process on the directory fails with FAILED_PRECONDITION. Default: true.
  bool lock_data_dir = true;
  // "" = the embedded stores (files, one process); else a PostgreSQL conninfo or
  // postgresql:// URI whose database several processes share.
  std::string store;
  // "all", "front" or "trainer"; the last two only with `store`. Default: "all".
  std::string role = "all";
  // With `store`: a front's PostgreSQL sessions (its service gets as many I/O threads); a
  // trainer alone opens scheduler.threads + 2. Default: 16.
  int store_sessions = 16;
  // Most bytes of a device's unconsumed samples the sample log holds, embedded or shared
  // (SampleStoreOptions::max_device_bytes, pg::PgCloudStoreOptions::max_device_bytes; 0 = no
  // quota). Default: 1 GiB.
  uint64_t device_quota_bytes = 1ull << 30;
  // Every file call of the embedded stores and of the strategy's state files goes through it
  // (it replaces strategy.env). Not owned; must outlive the cloud. nullptr = the real file
  // system for the stores, strategy.env for the state files.
  storage::Env* env = nullptr;

  // ---- who may call ----
  // The devices' tokens: a file of `<device_id> <token>` lines, or the same text itself
  // (tokens_text wins when both are set). Required when the cloud serves.
  std::string tokens_file;
  std::string tokens_text;
  // Mutual TLS: a file of `<certificate name> <device_id>` lines, read into
  // service.client_certificates. "" = none.
  std::string client_cert_map_file;
  ServerOptions server;
  // The service's settings. With a model, its fingerprints and sample spec are the model's
  // (expected_fingerprint overrides the first); without one they are used as given.
  CloudServiceOptions service;
  // The student base devices must run; nullopt = the model's (0 without one), 0 = any.
  std::optional<uint64_t> expected_fingerprint;

  // ---- training ----
  // The model and the jobs' settings. A cloud trains when strategy.checkpoint_dir or the
  // pair (teacher_dir and student_base_dir) is set; else it serves transport only.
  // state_dir "" = DATA_DIR/trainer.
  PerDeviceStrategyOptions strategy;
  // When jobs run: the embedded scheduler's triggers (its clock too), and on PostgreSQL the
  // front's trigger (trigger_samples, trigger_interval) and the trainer's threads.
  JobSchedulerOptions scheduler;
  // With `store`, the trainer role: the name its job leases carry ("" = host:pid), a lease's
  // length, and how often an idle worker looks for a due job.
  std::string trainer_id;
  absl::Duration lease = absl::Seconds(30);
  absl::Duration worker_poll = absl::Milliseconds(200);

  // ---- watching ----
  // Hears what devices do instead of the cloud's own job trigger (the JobScheduler, or the
  // front's JobQueueTrigger), which is then not built: for callers that run jobs themselves
  // (strategy()->RunJob, or the shared queue's TriggerJob). Not owned; must outlive the
  // cloud. nullptr = the cloud's own trigger, where it has a model (or is a front).
  CloudObserver* observer = nullptr;
  // After each job of the scheduler or worker (successful or not), on its thread.
  std::function<void(const absl::StatusOr<JobReport>&)> on_job;
  // The cloud's events as JSON objects ({"event": "serving", ...}, "job", "applied",
  // "uplink_refused", ...: what `cdcca-cloud` writes to stderr). nullptr = none.
  std::function<void(const nlohmann::json&)> log;
  // Health and per-device training state as JSON, rewritten every status_interval until
  // shutdown. "" = none.
  std::string status_file;
  absl::Duration status_interval = absl::Seconds(2);
};

// A running cloud: owns every piece, and destroys them in the order that lets running work
// finish (server, status file, job trigger and workers, service, strategy, stores, lock).
// The accessors are safe from any thread while the cloud lives; the pieces they return keep
// their own thread-safety contracts.
class Cloud {
 public:
  ~Cloud();
  Cloud(const Cloud&) = delete;
  Cloud& operator=(const Cloud&) = delete;

  // The port the server listens on; 0 when the cloud serves nothing (role "trainer").
  int port() const;
  // The fingerprint of the student base Register accepts (0 = any).
  uint64_t fingerprint() const;
  // nullptr where the role has none.
  CloudService* service() const;
  // nullptr without a model.
  PerDeviceStrategy* strategy() const;
  // nullptr on PostgreSQL, without a model, with an injected observer, or after Shutdown.
  JobScheduler* scheduler() const;
  // The stores the service and the strategy use (embedded or shared).
  DeviceStore* registry() const;
  SampleLog* samples() const;
  UpdateLog* updates() const;
  // The embedded stores themselves; nullptr on PostgreSQL.
  DeviceRegistry* device_registry() const;
  SampleStore* sample_store() const;
  UpdateStore* update_store() const;

  // Stops serving (in-flight calls get `grace`), stops the status file, and waits for the
  // running jobs (each commits or not, atomically). Idempotent; the accessors keep working
  // (the stores stay open until the cloud is destroyed).
  void Shutdown(absl::Duration grace = absl::Seconds(2));
  // Blocks until the server has shut down (returns at once without one).
  void Wait();

  struct Parts;

 private:
  friend absl::StatusOr<std::unique_ptr<Cloud>> OpenCloud(const CloudOptions& options);
  explicit Cloud(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

// Opens the stores, recovers the trainer's state, starts the job trigger and serves.
// Errors: INVALID_ARGUMENT for options that contradict each other or a missing required one
// (named by its flag, e.g. "--tokens is required"), FAILED_PRECONDITION when another process
// holds the data directory, UNIMPLEMENTED for `store` in a build without PostgreSQL, and the
// stores', the strategy's and the server's own errors. Nothing keeps running after an error.
absl::StatusOr<std::unique_ptr<Cloud>> OpenCloud(const CloudOptions& options);

}  // namespace cdcca::cloud

#endif  // CDCCA_CLOUD_OPEN_CLOUD_H_
