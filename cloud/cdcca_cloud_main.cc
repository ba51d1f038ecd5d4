// cdcca-cloud: the cloud service. Serves the wire contract over gRPC (TLS by default),
// stores what devices uplink durably, runs AKD jobs per device on a trainer pool, and
// serves the DWC updates and snapshots they produce.
//
//   cdcca-cloud --data_dir=/var/lib/cdcca --tokens=tokens.txt --checkpoint_dir=models/small \
//       --tls_cert=server.pem --tls_key=server.key [--client_ca=ca.pem]
//   cdcca-cloud --config=cloud.json                      # the same flags as a JSON object
//   cdcca-cloud --data_dir=/tmp/cdcca --tokens=tokens.txt --insecure   # loopback only
//
// Logs are JSON lines on stderr ({"event": ...}). Health: the Health RPC (no token needed)
// and, with --status_file, a JSON file rewritten every few seconds.
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "cli/flags_help.h"
#include "cli/print_config.h"
#include "cloud/cloud_server.h"
#include "cloud/cloud_service.h"
#include "cloud/data_dir_lock.h"
#include "cloud/trainer.h"
#ifdef CDCCA_HAVE_POSTGRESQL
#include "cloud/cluster_roles.h"
#include "cloud/pg/pg_cloud_store.h"
#endif
#include "nlohmann/json.hpp"
#include "proto/wire.h"
#include "settings/defaults.h"
#include "storage/env.h"

ABSL_FLAG(std::string, config, "",
          "JSON file whose keys are these flags' names (e.g. {\"listen\": \"0.0.0.0:50051\", "
          "\"trigger_samples\": 64}); flags given on the command line win");
ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "host:port to serve on (port 0 picks one)");
ABSL_FLAG(std::string, data_dir, "",
          "directory of the sample log (samples/), update store (updates/), device registry "
          "(registry/) and per-device mirrors (trainer/); created if missing. One process per "
          "directory: it is locked (DIR/LOCK) while this one runs, and a second refuses to start");
ABSL_FLAG(std::string, store, "",
          "where the cloud's state lives: empty = files under --data_dir (one process); "
          "postgresql://user@host:port/db (or a libpq key=value string) = a PostgreSQL "
          "database that several cdcca-cloud processes share (fronts and trainers, --role). "
          "The schema is created and migrated by the program; --data_dir then holds only "
          "this process's lock and the trainer's quarantine records");
ABSL_FLAG(std::string, role, "all",
          "with --store: front (serves devices over gRPC, trains nothing, keeps no device "
          "state between calls), trainer (runs due jobs from the shared queue, serves "
          "nothing), or all (both in one process)");
ABSL_FLAG(std::string, trainer_id, "",
          "with --store: the name this trainer's job leases carry (empty = host:pid)");
ABSL_FLAG(double, lease_s, 30,
          "with --store: a job lease's length, s, renewed every third of it while the job runs; "
          "a trainer that dies loses its jobs to the other trainers after this long");
ABSL_FLAG(int, store_sessions, 16,
          "with --store: PostgreSQL sessions of a front (appends commit on them concurrently, "
          "sharing WAL flushes; as many service threads wait on them); a trainer alone opens "
          "--trainer_threads + 2");
ABSL_FLAG(std::string, tokens, "", "token file: one `<device_id> <token>` per line");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain");
ABSL_FLAG(std::string, tls_key, "", "PEM server private key");
ABSL_FLAG(std::string, client_ca, "",
          "PEM CA for client certificates: mutual TLS, every device must present a certificate "
          "signed by it (unless --allow_token_only_devices)");
ABSL_FLAG(bool, require_client_cert, false,
          "refuse devices without a client certificate (the default with --client_ca; kept for "
          "configs that say so)");
ABSL_FLAG(bool, allow_token_only_devices, false,
          "with --client_ca: also accept devices that present no client certificate, on their "
          "token alone (a certificate that is presented must still verify)");
ABSL_FLAG(std::string, client_cert_map, "",
          "mutual TLS: file of `<certificate name> <device_id>` lines. A client certificate "
          "must stand for the device of the call's token: its CN or a SAN equal to the "
          "device id, or mapped to it here; else PERMISSION_DENIED");
ABSL_FLAG(std::string, proxy_client_cert_header, "",
          "behind a proxy that ends mutual TLS (nginx): the request header in which it passes "
          "the client certificate it verified, percent-escaped PEM (nginx: grpc_set_header "
          "X-Client-Cert $ssl_client_escaped_cert; here x-client-cert). The certificate must "
          "stand for the token's device as with --client_ca; calls without it are refused "
          "unless --allow_token_only_devices. Only where nothing but the proxy reaches this "
          "process");
ABSL_FLAG(bool, insecure, false, "serve plaintext (loopback experiments only; prints a warning)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once serving");
ABSL_FLAG(std::string, expected_fingerprint, "",
          "hex fingerprint of the student base devices must run; empty = the checkpoint's "
          "(0 = accept any)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "a cdcca family (as written by `cdcca pretrain`), served as the pair it is: "
          "--teacher=DIR/teacher --student_base=DIR; empty (and no pair) = transport only, no "
          "training");
ABSL_FLAG(std::string, teacher, "",
          "a teacher-student pair instead of --checkpoint_dir: the teacher's folder (LLaVA, "
          "BLIP-2 or InstructBLIP), which must share its vision tower with --student_base");
ABSL_FLAG(std::string, student_base, "",
          "a Hugging Face pair: the student's folder, the model devices run before adaptation");
ABSL_FLAG(std::string, teacher_template, "auto",
          "a Hugging Face pair: the teacher's prompt (auto: the folder's chat template where it "
          "has one, else llava for LLaVA and none for BLIP-2; chat; none; llava; vicuna; "
          "chatml)");
ABSL_FLAG(std::string, student_template, "auto",
          "a Hugging Face pair: the student's prompt template, as the devices' --student_template");
ABSL_FLAG(std::string, teacher_precision, "",
          "a Hugging Face pair: the teacher's precision (fp32, bf16, fp16, int8, int4; empty = "
          "bf16 on cuda, fp32 on cpu)");
ABSL_FLAG(int64_t, lora_rank, cdcca::settings::kLoraRank,
          "a Hugging Face pair: LoRA rank on the LM's q and v (the devices' --lora_rank)");
ABSL_FLAG(double, lora_alpha, cdcca::settings::kLoraAlpha,
          "a Hugging Face pair: LoRA alpha (the devices' --lora_alpha)");
ABSL_FLAG(bool, lora_mlp, cdcca::settings::kLoraMlp,
          "a Hugging Face pair: LoRA on the LM's MLP too (the devices' --lora_mlp)");
ABSL_FLAG(bool, lora_qformer, cdcca::settings::kLoraQformer,
          "LoRA on the student's Q-Former attention query and value too (BLIP-2, "
          "InstructBLIP; the devices' --lora_qformer)");
ABSL_FLAG(bool, lora_projector, cdcca::settings::kLoraProjector,
          "LoRA on the student's projector into the LM too (LLaVA's multi_modal_projector, "
          "BLIP-2's language_projection; the devices' --lora_projector)");
ABSL_FLAG(std::string, student_precision, cdcca::settings::kStudentPrecision,
          "precision of the devices' frozen student base (fp32, int8, int4): the mirrors "
          "compute with exactly that base");
ABSL_FLAG(std::string, learner, "",
          "cloud learner: akd, pl, pkd or cwd (empty = --distill_config's, else akd)");
ABSL_FLAG(std::string, distill_config, "",
          "distill settings JSON (configs/distill/akd.json layout); empty = the learner's "
          "preset. With --learner too, that learner trains with these settings and only its "
          "own feature term (baselines on equal terms)");
ABSL_FLAG(int, max_steps, 0, "training steps per job (0 = from --distill_config, default 200)");
ABSL_FLAG(double, time_budget_s, 0, "wall-clock bound of one job's training loop, s (0 = none)");
ABSL_FLAG(int, batch_size, 0, "samples per training step (0 = from --distill_config, default 16)");
ABSL_FLAG(double, lr, 0, "learning rate of a job (0 = from --distill_config, default 0.001)");
ABSL_FLAG(int, max_answer_tokens, 0,
          "longest answer the teacher generates as a label, in tokens (0 = from "
          "--distill_config, default 6, the devices' --max_answer_tokens)");
ABSL_FLAG(bool, print_config, false,
          "print the configuration this command line runs (every flag, and the job settings "
          "resolved from --distill_config and the presets) as JSON on stdout, and exit");
ABSL_FLAG(int, max_batches_per_job, 64, "most uplink batches one job trains on");
ABSL_FLAG(int64_t, max_job_samples, 8192,
          "most samples one job trains on (the rest wait for the next job)");
ABSL_FLAG(int64_t, max_job_decoded_mib, 512,
          "most decoded uplink bytes one job takes, MiB (the rest wait for the next job)");
ABSL_FLAG(int64_t, max_batch_samples, 1024,
          "uplink: most samples one batch may hold; a batch past it is refused at ingest");
ABSL_FLAG(int64_t, max_batch_decoded_mib, 16,
          "uplink: most bytes one batch may decompress to, MiB; a batch past it is refused at "
          "ingest, before anything is decompressed");
ABSL_FLAG(int64_t, device_quota_mib, 1024,
          "uplink: most MiB of one device's samples its jobs have not consumed yet that the "
          "sample log holds; past it Uplink answers RESOURCE_EXHAUSTED (0 = no quota). "
          "Consumed samples are released and their segment files deleted once all of a "
          "file's samples are");
ABSL_FLAG(int64_t, replay_capacity, cdcca::settings::kReplayCapacity,
          "replay buffer per device, samples (0 = none)");
ABSL_FLAG(int64_t, max_resident_mirrors, 64,
          "most devices whose mirror and replay buffer stay in memory between jobs (least "
          "recently used evicted first; an evicted device reloads from its state file, its "
          "replay buffer empty); 0 = no bound");
ABSL_FLAG(int64_t, byte_budget, 0,
          "per-device byte budget of one update (0 = the device's Register capability, else "
          "--bits_per_param alone)");
ABSL_FLAG(double, bits_per_param, cdcca::settings::kBitsPerParam,
          "update size cap in bits per trainable parameter (0 = none)");
ABSL_FLAG(bool, guard, cdcca::settings::kGuard,
          "update guard: hold out --guard_holdout_fraction of each device's samples (never "
          "trained on) and publish an update only if it raises the student's score on them "
          "(--guard_measure) beyond --guard_z paired standard errors; else withhold it (the "
          "batches are consumed, the device stays where it is; event update_withheld)");
ABSL_FLAG(double, guard_holdout_fraction, cdcca::settings::kGuardHoldoutFraction,
          "update guard: share of each device's answers held out (picked before UTS stage 1 "
          "and uplinked whole), in [0, 1)");
ABSL_FLAG(int64_t, guard_pool, cdcca::settings::kGuardPool,
          "update guard: most held-out samples kept per device (the newest)");
ABSL_FLAG(int64_t, guard_min_pool, cdcca::settings::kGuardMinPool,
          "update guard: smallest pool the paired rule runs on; below it an update ships unless "
          "its agreement falls by more than --guard_z / sqrt(pool)");
ABSL_FLAG(double, guard_z, cdcca::settings::kGuardZ,
          "update guard: an update ships when its gain in agreement exceeds this many paired "
          "standard errors");
ABSL_FLAG(double, guard_confident_fraction, cdcca::settings::kGuardConfidentFraction,
          "update guard: share of the held-out pool compared, in (0, 1]: the samples the "
          "teacher answers most surely (lowest answer-token entropy)");
ABSL_FLAG(bool, guard_restore_base, cdcca::settings::kGuardRestoreBase,
          "update guard: when an update is withheld and the pretrained base agrees with the "
          "teacher on the held-out pool beyond --guard_z paired standard errors better than the "
          "device's current version, return the device to the base as a new version");
ABSL_FLAG(std::string, guard_measure, cdcca::settings::kGuardMeasure,
          "update guard: what a held-out answer is scored by: teacher_probability (the "
          "teacher's probability of the answer: with a calibrated teacher, the chance that it "
          "is right) or agreement (with the teacher's answer)");
ABSL_FLAG(int, trigger_samples, cdcca::settings::kTriggerSamples,
          "run a device's job once it has this many new samples");
ABSL_FLAG(double, trigger_interval_s, cdcca::settings::kTriggerIntervalS,
          "... or once this many seconds passed since its last job with any new sample (0 = off)");
ABSL_FLAG(int, trainer_threads, 1, "jobs run at once (of different devices)");
ABSL_FLAG(int, torch_threads, 0,
          "LibTorch intra-op threads of the trainer, process-wide (0 = automatic: 1, the BLAS "
          "threads matrix products)");
ABSL_FLAG(std::string, device, "cpu",
          "where jobs train: cpu, cuda, or cuda:N (the N-th GPU only: one trainer per GPU); "
          "falls back to cpu without CUDA");
ABSL_FLAG(double, uts_keep_fraction, cdcca::settings::kUtsKeepFraction,
          "UTS setting sent to devices: fraction of frames stage 1 keeps (0 = device default)");
ABSL_FLAG(
    double, uts_token_ratio, cdcca::settings::kUtsTokenRatio,
    "UTS setting sent to devices: fraction of visual tokens stage 2 keeps (0 = device default)");
ABSL_FLAG(int, uts_mc_passes, cdcca::settings::kUtsMcPasses,
          "UTS setting sent to devices: MC-dropout passes (0 = device default)");
ABSL_FLAG(std::string, status_file, "",
          "write health and per-device training state as JSON here every --status_interval_s");
ABSL_FLAG(double, status_interval_s, 2, "how often --status_file is rewritten");

namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "{\"event\":\"fatal\",\"error\":%s}\n",
               nlohmann::json(s.ToString()).dump().c_str());
  return 1;
}

void Log(const nlohmann::json& event) {
  std::fprintf(stderr, "%s\n", event.dump().c_str());
  std::fflush(stderr);
}

// The job's settings from the flags: what a job trains with, and what --print_config resolves.
void SetJobOptionsFromFlags(cdcca::cloud::PerDeviceStrategyOptions& so) {
  so.learner = absl::GetFlag(FLAGS_learner);
  so.distill_config = absl::GetFlag(FLAGS_distill_config);
  so.max_steps = absl::GetFlag(FLAGS_max_steps);
  so.time_budget_s = absl::GetFlag(FLAGS_time_budget_s);
  so.batch_size = absl::GetFlag(FLAGS_batch_size);
  so.lr = absl::GetFlag(FLAGS_lr);
  so.max_answer_tokens = absl::GetFlag(FLAGS_max_answer_tokens);
}

// --print_config: this program's flags and the job settings they resolve to, under the
// settings' names (settings/defaults.h).
int PrintConfig(const absl::FlagsUsageConfig& usage) {
  nlohmann::json config = cdcca::cli::FlagsJson([&usage](const absl::CommandLineFlag& flag) {
    return usage.contains_help_flags(flag.Filename());
  });
  config.erase("print_config");
  cdcca::cloud::PerDeviceStrategyOptions so;
  SetJobOptionsFromFlags(so);
  absl::StatusOr<std::string> job = cdcca::cloud::JobSettingsJson(so);
  if (!job.ok()) return Fail(job.status());
  config.update(nlohmann::json::parse(*job));
  std::printf("%s\n", config.dump(2).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the cdcca cloud service.\n"
      "  cdcca-cloud --data_dir=DIR --tokens=FILE --checkpoint_dir=DIR\n"
      "      (--tls_cert=F --tls_key=F [--client_ca=F [--allow_token_only_devices]] | --insecure)\n"
      "  cdcca-cloud --config=cloud.json\n"
      "Logs are JSON lines on stderr. See README (Deploying) for a worked example.");
  // --help lists this file's flags (absl matches the program name, spelt with '-').
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "cdcca_cloud_main");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  cdcca::cli::ParseFlagsOrHelp(argc, argv, [&usage](std::string_view file) {
    return usage.contains_help_flags(absl::string_view(file.data(), file.size()));
  });
  const cdcca::cli::FlagFilter own = [&usage](const absl::CommandLineFlag& flag) {
    return usage.contains_help_flags(flag.Filename());
  };
  if (absl::Status s = cdcca::cli::ApplyConfigFile(absl::GetFlag(FLAGS_config), argc, argv, own);
      !s.ok()) {
    return Fail(s);
  }
  if (absl::GetFlag(FLAGS_print_config)) return PrintConfig(usage);
  // Block SIGINT/SIGTERM in every thread (they inherit this mask) and wait for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  using namespace cdcca::cloud;  // NOLINT: a program's main
  namespace storage = cdcca::storage;
  const std::string data_dir = absl::GetFlag(FLAGS_data_dir);
  if (data_dir.empty()) return Fail(absl::InvalidArgumentError("--data_dir is required"));
  // Held until exit, before any store opens: a second process on this directory stops here.
  auto data_dir_lock = DataDirLock::Acquire(data_dir);
  if (!data_dir_lock.ok()) return Fail(data_dir_lock.status());
  const std::string store_url = absl::GetFlag(FLAGS_store);
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role != "all" && role != "front" && role != "trainer") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--role must be front, trainer or all, not '", role, "'")));
  }
  if (role != "all" && store_url.empty()) {
    return Fail(absl::InvalidArgumentError(
        "--role front and --role trainer share their state through --store "
        "postgresql://...; without --store the one process is both (--role all)"));
  }
  const bool serves = role != "trainer";
  const bool trains = role != "front";
  std::unique_ptr<TokenAuthenticator> auth;
  if (serves) {
    if (absl::GetFlag(FLAGS_tokens).empty()) {
      return Fail(absl::InvalidArgumentError("--tokens is required (see --help)"));
    }
    auto loaded = TokenAuthenticator::FromFile(absl::GetFlag(FLAGS_tokens));
    if (!loaded.ok()) return Fail(loaded.status());
    auth = *std::move(loaded);
  }
  // The stores: files under --data_dir (embedded), or the shared PostgreSQL database.
  std::unique_ptr<DeviceRegistry> file_registry;
  std::unique_ptr<SampleStore> file_samples;
  std::unique_ptr<UpdateStore> file_updates;
  DeviceStore* registry = nullptr;
  SampleLog* samples = nullptr;
  UpdateLog* updates = nullptr;
#ifdef CDCCA_HAVE_POSTGRESQL
  std::unique_ptr<pg::PgCloudStore> shared;
  std::unique_ptr<pg::PgMirrorStates> shared_states;
#endif
  if (store_url.empty()) {
    auto opened_registry = DeviceRegistry::Open(data_dir + "/registry");
    if (!opened_registry.ok()) return Fail(opened_registry.status());
    file_registry = *std::move(opened_registry);
    SampleStoreOptions sample_options;
    sample_options.dir = data_dir + "/samples";
    sample_options.max_device_bytes =
        static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_device_quota_mib))) << 20;
    auto opened_samples = SampleStore::Open(sample_options);
    if (!opened_samples.ok()) return Fail(opened_samples.status());
    file_samples = *std::move(opened_samples);
    for (const SampleLogDamage& d : file_samples->Damage()) {
      Log({{"event", d.torn_tail ? "sample_log_torn_tail" : "sample_log_corrupt"},
           {"file", d.path},
           {"offset", d.offset},
           {"bytes", d.bytes},
           {"why", d.why},
           {"action", d.torn_tail ? "truncated (never acked)" : "skipped; intact records kept"}});
    }
    auto opened_updates = UpdateStore::Open({data_dir + "/updates", 16});
    if (!opened_updates.ok()) return Fail(opened_updates.status());
    file_updates = *std::move(opened_updates);
    registry = file_registry.get();
    samples = file_samples.get();
    updates = file_updates.get();
  } else {
#ifdef CDCCA_HAVE_POSTGRESQL
    pg::PgCloudStoreOptions pg_options;
    pg_options.conninfo = store_url;
    pg_options.sessions = serves ? std::max(1, absl::GetFlag(FLAGS_store_sessions))
                                 : std::max(1, absl::GetFlag(FLAGS_trainer_threads)) + 2;
    auto opened = pg::PgCloudStore::Open(pg_options);
    if (!opened.ok()) return Fail(opened.status());
    shared = *std::move(opened);
    shared_states = std::make_unique<pg::PgMirrorStates>(shared.get());
    registry = shared.get();
    samples = shared.get();
    updates = shared.get();
#else
    return Fail(absl::UnimplementedError(
        "this cdcca-cloud was built without PostgreSQL (libpq-dev): --store is unavailable"));
#endif
  }

  // Per-batch bounds of the ingest check (the codec's own limits: 4096 samples, 64 MiB).
  const uint32_t max_batch_samples =
      static_cast<uint32_t>(std::clamp<int64_t>(absl::GetFlag(FLAGS_max_batch_samples), 1, 4096));
  const uint64_t max_batch_decoded_bytes =
      static_cast<uint64_t>(std::clamp<int64_t>(absl::GetFlag(FLAGS_max_batch_decoded_mib), 1, 64))
      << 20;

  // The trainer (absent in transport-only mode).
  std::unique_ptr<PerDeviceStrategy> strategy;
  std::unique_ptr<JobScheduler> scheduler;
  const bool hub_pair =
      !absl::GetFlag(FLAGS_teacher).empty() || !absl::GetFlag(FLAGS_student_base).empty();
  if (hub_pair &&
      (absl::GetFlag(FLAGS_teacher).empty() || absl::GetFlag(FLAGS_student_base).empty())) {
    return Fail(absl::InvalidArgumentError(
        "a Hugging Face pair needs both --teacher DIR and --student_base DIR"));
  }
  if (!absl::GetFlag(FLAGS_checkpoint_dir).empty() || hub_pair) {
    PerDeviceStrategyOptions so;
    so.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
    so.teacher_dir = absl::GetFlag(FLAGS_teacher);
    so.student_base_dir = absl::GetFlag(FLAGS_student_base);
    so.teacher_template = absl::GetFlag(FLAGS_teacher_template);
    so.student_template = absl::GetFlag(FLAGS_student_template);
    so.teacher_precision = absl::GetFlag(FLAGS_teacher_precision);
    so.lora_rank = absl::GetFlag(FLAGS_lora_rank);
    so.lora_alpha = absl::GetFlag(FLAGS_lora_alpha);
    so.lora_mlp = absl::GetFlag(FLAGS_lora_mlp);
    so.lora_qformer = absl::GetFlag(FLAGS_lora_qformer);
    so.lora_projector = absl::GetFlag(FLAGS_lora_projector);
    so.student_precision = absl::GetFlag(FLAGS_student_precision);
    so.state_dir = data_dir + "/trainer";
#ifdef CDCCA_HAVE_POSTGRESQL
    so.mirror_states = shared_states.get();
#endif
    SetJobOptionsFromFlags(so);
    so.torch_threads = absl::GetFlag(FLAGS_torch_threads);
    so.train_device = absl::GetFlag(FLAGS_device);
    if (absl::StartsWith(so.train_device, "cuda:")) {
      // One GPU for this process: the others are hidden before anything touches CUDA.
      int index = -1;
      if (!absl::SimpleAtoi(so.train_device.substr(5), &index) || index < 0) {
        return Fail(absl::InvalidArgumentError("--device must be cpu, cuda or cuda:N"));
      }
      ::setenv("CUDA_VISIBLE_DEVICES", std::to_string(index).c_str(), 1);
      so.train_device = "cuda";
    }
    so.max_batches_per_job =
        static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_max_batches_per_job)));
    so.byte_budget = static_cast<uint64_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_byte_budget)));
    so.max_samples_per_job =
        static_cast<uint64_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_max_job_samples)));
    so.max_decoded_bytes_per_job =
        static_cast<uint64_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_max_job_decoded_mib))) << 20;
    so.max_samples_per_batch = max_batch_samples;
    so.max_decoded_bytes_per_batch = max_batch_decoded_bytes;
    so.bits_per_param = absl::GetFlag(FLAGS_bits_per_param);
    so.replay_capacity =
        static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_replay_capacity)));
    so.max_resident_mirrors =
        static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_max_resident_mirrors)));
    so.guard.enabled = absl::GetFlag(FLAGS_guard);
    so.guard.holdout_fraction = absl::GetFlag(FLAGS_guard_holdout_fraction);
    if (!(so.guard.holdout_fraction >= 0 && so.guard.holdout_fraction < 1)) {
      return Fail(absl::InvalidArgumentError("--guard_holdout_fraction must be in [0, 1)"));
    }
    so.guard.pool_capacity =
        static_cast<size_t>(std::max<int64_t>(1, absl::GetFlag(FLAGS_guard_pool)));
    so.guard.min_pool =
        static_cast<size_t>(std::max<int64_t>(0, absl::GetFlag(FLAGS_guard_min_pool)));
    so.guard.z = absl::GetFlag(FLAGS_guard_z);
    so.guard.confident_fraction = absl::GetFlag(FLAGS_guard_confident_fraction);
    so.guard.restore_base = absl::GetFlag(FLAGS_guard_restore_base);
    if (!(so.guard.confident_fraction > 0 && so.guard.confident_fraction <= 1)) {
      return Fail(absl::InvalidArgumentError("--guard_confident_fraction must be in (0, 1]"));
    }
    absl::StatusOr<GuardMeasure> measure = ParseGuardMeasure(absl::GetFlag(FLAGS_guard_measure));
    if (!measure.ok()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--guard_measure: ", measure.status().message())));
    }
    so.guard.measure = *measure;
    if (const char* fault = std::getenv("CDCCA_TEST_FAULT")) so.fault = fault;
    auto created = PerDeviceStrategy::Create(so, samples, updates, registry);
    if (!created.ok()) return Fail(created.status());
    strategy = *std::move(created);
    if (absl::Status s = strategy->Recover(); !s.ok()) return Fail(s);
  }
  // What each job did, logged as one JSON line (the embedded scheduler's and the shared
  // queue's workers alike).
  // A guard verdict, its two agreements named as the comparison has them.
  const auto verdict = [](const GuardVerdict& v, const char* before, const char* after) {
    return nlohmann::json({{"pool", v.pool},
                           {before, v.before},
                           {after, v.after},
                           {"gain", v.gain},
                           {"se", v.se},
                           {"decision", v.decision}});
  };
  const auto log_job = [verdict](const absl::StatusOr<JobReport>& r) {
    if (!r.ok()) {
      if (!absl::IsNotFound(r.status())) {
        Log({{"event", "job_failed"}, {"error", r.status().ToString()}});
      }
      return;
    }
    Log({{"event", "job"},
         {"device_id", r->device_id},
         {"base_version", r->base_version},
         {"new_version", r->new_version},
         {"state_digest", absl::StrFormat("%016x", r->state_digest)},
         {"batches", {r->first_sequence, r->last_sequence}},
         {"samples", r->samples},
         {"quarantined_samples", r->quarantined_samples},
         {"replay_samples", r->replay_samples},
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
         {"guard", verdict(r->guard, "before", "after")},
         {"restored_base", r->restored_base},
         {"base_guard", verdict(r->base_guard, "current", "base")},
         {"notes", r->notes}});
  };
  const double interval = absl::GetFlag(FLAGS_trigger_interval_s);
  const absl::Duration trigger_interval =
      interval > 0 ? absl::Seconds(interval) : absl::InfiniteDuration();
  const int trigger_samples = std::max(1, absl::GetFlag(FLAGS_trigger_samples));
  // The job triggers: the embedded scheduler, or (shared store) the queue of due jobs that
  // fronts fill and trainers' workers drain.
  CloudObserver* trigger = nullptr;
#ifdef CDCCA_HAVE_POSTGRESQL
  std::unique_ptr<JobQueueTrigger> queue_trigger;
  std::unique_ptr<JobWorker> worker;
#endif
  if (store_url.empty() && strategy != nullptr) {
    JobSchedulerOptions jo;
    jo.trigger_samples = trigger_samples;
    jo.trigger_interval = trigger_interval;
    jo.threads = std::max(1, absl::GetFlag(FLAGS_trainer_threads));
    scheduler = std::make_unique<JobScheduler>(jo, strategy.get(), file_samples.get());
    scheduler->SetJobCallback(log_job);
    trigger = scheduler.get();
  }
#ifdef CDCCA_HAVE_POSTGRESQL
  if (!store_url.empty()) {
    if (serves) {
      char host[256] = {};
      ::gethostname(host, sizeof(host) - 1);
      queue_trigger = std::make_unique<JobQueueTrigger>(
          JobQueueTriggerOptions{trigger_samples, trigger_interval}, shared.get(), strategy.get(),
          shared_states.get(), absl::StrCat("front ", host, ":", ::getpid()));
      trigger = queue_trigger.get();
    }
    if (trains) {
      if (strategy == nullptr) {
        return Fail(absl::InvalidArgumentError(
            "--role trainer (or all) on --store needs a model: --checkpoint_dir or "
            "--teacher with --student_base"));
      }
      JobWorkerOptions wo;
      wo.owner = absl::GetFlag(FLAGS_trainer_id);
      if (wo.owner.empty()) {
        char host[256] = {};
        ::gethostname(host, sizeof(host) - 1);
        wo.owner = absl::StrCat(host, ":", ::getpid());
      }
      wo.threads = std::max(1, absl::GetFlag(FLAGS_trainer_threads));
      wo.lease = absl::Seconds(std::max(1.0, absl::GetFlag(FLAGS_lease_s)));
      worker = std::make_unique<JobWorker>(wo, shared.get(), shared_states.get(), strategy.get());
      worker->SetJobCallback(log_job);
      Log({{"event", "trainer_started"}, {"owner", wo.owner}, {"threads", wo.threads}});
    }
  }
#endif

  // Tells the scheduler, and logs what devices report.
  class Observer final : public CloudObserver {
   public:
    explicit Observer(CloudObserver* scheduler) : scheduler_(scheduler) {}
    void OnSamplesStored(const std::string& id, uint64_t highest) override {
      if (scheduler_ != nullptr) scheduler_->OnSamplesStored(id, highest);
    }
    void OnApplied(const std::string& id, uint64_t version, bool in_sync) override {
      Log({{"event", "applied"}, {"device_id", id}, {"version", version}, {"in_sync", in_sync}});
      if (scheduler_ != nullptr) scheduler_->OnApplied(id, version, in_sync);
    }
    void OnUplinkRefused(const std::string& id, uint64_t sequence, cdcca::v1::UplinkRefusal refusal,
                         cdcca::v1::RefusalReason reason, const absl::Status& status) override {
      Log({{"event", "uplink_refused"},
           {"device_id", id},
           {"sequence", sequence},
           {"reason", cdcca::wire::RefusalReasonName(reason)},
           {"refusal", refusal == cdcca::v1::UPLINK_REFUSAL_PERMANENT    ? "permanent"
                       : refusal == cdcca::v1::UPLINK_REFUSAL_RESEQUENCE ? "resequence"
                                                                         : "transient"},
           {"error", std::string(status.message())}});
    }
    void OnBatchDropped(const std::string& id, const cdcca::v1::DroppedBatch& d) override {
      Log({{"event", "device_dropped_batch"},
           {"device_id", id},
           {"sequence", d.sequence()},
           {"samples", d.sample_count()},
           {"reason", cdcca::wire::RefusalReasonName(d.reason())}});
    }

    absl::StatusOr<RollbackResult> OnRollback(const std::string& id, uint64_t device_version,
                                              uint64_t to_version) override {
      if (scheduler_ == nullptr) return CloudObserver::OnRollback(id, device_version, to_version);
      absl::StatusOr<RollbackResult> r = scheduler_->OnRollback(id, device_version, to_version);
      if (!r.ok()) {
        Log({{"event", "rollback_refused"},
             {"device_id", id},
             {"device_version", device_version},
             {"error", r.status().ToString()}});
      }
      return r;
    }

   private:
    CloudObserver* const scheduler_;
  } observer(trigger);

  uint64_t fingerprint = strategy != nullptr ? strategy->BaseFingerprint() : 0;
  const std::string fingerprint_flag = absl::GetFlag(FLAGS_expected_fingerprint);
  if (!fingerprint_flag.empty() && !absl::SimpleHexAtoi(fingerprint_flag, &fingerprint)) {
    return Fail(absl::InvalidArgumentError("--expected_fingerprint must be hex"));
  }
  CloudServiceOptions service_options;
  service_options.expected_fingerprint = fingerprint;
  service_options.expected_vision_fingerprint =
      strategy != nullptr ? strategy->VisionFingerprint() : 0;
  // Ingest checks batches against the model (transport only: any shape, the same bounds).
  if (strategy != nullptr) {
    service_options.sample_spec = strategy->Spec();
  } else {
    service_options.sample_spec.max_samples_per_batch = max_batch_samples;
    service_options.sample_spec.max_decoded_bytes_per_batch = max_batch_decoded_bytes;
  }
  // On the shared store the service's threads wait on the database: one per session.
  if (!store_url.empty())
    service_options.io_threads = std::max(2, absl::GetFlag(FLAGS_store_sessions));
  service_options.proxy_client_cert_header =
      absl::AsciiStrToLower(absl::GetFlag(FLAGS_proxy_client_cert_header));
  service_options.allow_token_only_devices = absl::GetFlag(FLAGS_allow_token_only_devices);
  if (!absl::GetFlag(FLAGS_client_cert_map).empty()) {
    auto map = ReadCertificateMap(absl::GetFlag(FLAGS_client_cert_map));
    if (!map.ok()) return Fail(map.status());
    service_options.client_certificates = *std::move(map);
  }
  service_options.uts.set_keep_fraction(static_cast<float>(absl::GetFlag(FLAGS_uts_keep_fraction)));
  service_options.uts.set_token_ratio(static_cast<float>(absl::GetFlag(FLAGS_uts_token_ratio)));
  service_options.uts.set_mc_passes(
      static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_uts_mc_passes))));
  // The guard's flags are read on every role, so a front role tells devices the share the
  // trainer role holds out when both are started with the same --guard flags.
  service_options.guard_holdout_fraction =
      absl::GetFlag(FLAGS_guard) ? absl::GetFlag(FLAGS_guard_holdout_fraction) : 0.0;
  if (!(service_options.guard_holdout_fraction >= 0 &&
        service_options.guard_holdout_fraction < 1)) {
    return Fail(absl::InvalidArgumentError("--guard_holdout_fraction must be in [0, 1)"));
  }
  std::unique_ptr<CloudService> service;
  std::unique_ptr<CloudServer> server;
  if (serves) {
    service = std::make_unique<CloudService>(service_options, auth.get(), registry, samples,
                                             updates, &observer);
    ServerOptions server_options;
    server_options.listen_address = absl::GetFlag(FLAGS_listen);
    server_options.insecure = absl::GetFlag(FLAGS_insecure);
    server_options.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                          absl::GetFlag(FLAGS_client_ca), absl::GetFlag(FLAGS_require_client_cert),
                          absl::GetFlag(FLAGS_allow_token_only_devices)};
    auto started = CloudServer::Start(server_options, service.get());
    if (!started.ok()) return Fail(started.status());
    server = *std::move(started);
    Log({{"event", "serving"},
         {"port", server->port()},
         {"role", role},
         {"store", store_url.empty() ? "files" : "postgresql"},
         {"tokens", auth->size()},
         {"data_dir", data_dir},
         {"trainer", strategy != nullptr},
         {"fingerprint", absl::StrFormat("%016x", fingerprint)},
         {"vision_fingerprint",
          absl::StrFormat("%016x", service_options.expected_vision_fingerprint)},
         {"tls", !absl::GetFlag(FLAGS_insecure)}});
    if (!absl::GetFlag(FLAGS_port_file).empty()) {
      if (absl::Status s =
              storage::WriteFileAtomically(*storage::Env::Default(), absl::GetFlag(FLAGS_port_file),
                                           absl::StrCat(server->port(), "\n"));
          !s.ok()) {
        return Fail(s);
      }
    }
  }

  // Health file: rewritten periodically until shutdown.
  absl::Notification stop_status;
  std::thread status_thread;
  const std::string status_file = absl::GetFlag(FLAGS_status_file);
  if (!status_file.empty()) {
    status_thread = std::thread([&] {
      const absl::Time started = absl::Now();
      do {
        nlohmann::json s = {
            {"status", "SERVING"},
            {"uptime_s", absl::ToInt64Seconds(absl::Now() - started)},
            {"role", role},
            {"registered_devices", registry->size()},
            {"stored_batches", samples->Stats().records},
            {"sample_log_damaged_ranges", samples->Stats().damaged_ranges},
            {"sample_log_damaged_bytes", samples->Stats().damaged_bytes},
            {"sample_log_truncated_tail_bytes", samples->Stats().truncated_tail_bytes},
            {"sample_log_bytes", samples->Stats().bytes},
            {"sample_log_deleted_segments", samples->Stats().deleted_segments}};
        // Uplink refusals since start: by reason over all devices, and per device with the
        // drops each device reported.
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
        (void)storage::WriteFileAtomically(*storage::Env::Default(), status_file, s.dump() + "\n");
      } while (!stop_status.WaitForNotificationWithTimeout(
          absl::Seconds(absl::GetFlag(FLAGS_status_interval_s))));
    });
  }

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  Log({{"event", "shutting_down"}, {"signal", signal_number}});
  if (server != nullptr) server->Shutdown(absl::Seconds(5));
  stop_status.Notify();
  if (status_thread.joinable()) status_thread.join();
  scheduler.reset();  // waits for a running job; its state file commits or not, atomically
#ifdef CDCCA_HAVE_POSTGRESQL
  worker.reset();  // waits for running jobs; each publishes under its lease or not at all
#endif
  return 0;
}
