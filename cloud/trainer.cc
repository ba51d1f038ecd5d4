#include "cloud/trainer.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iterator>
#include <memory>
#include <unordered_map>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "cloud/device_registry.h"
#include "cloud/internal/mirror_file.h"
#include "cloud/internal/mirror_trainer.h"
#include "compress/delta_encoder.h"
#include "compress/hash64.h"
#include "compress/named_tensors.h"
#include "compress/uplink_codec.h"
#include "distill/akd.h"
#include "distill/replay_buffer.h"
#include "model/hub/safetensors.h"
#include "nlohmann/json.hpp"
#include "proto/wire.h"
#include "storage/env.h"

namespace cdcca::cloud {

namespace internal {

absl::StatusOr<distill::DistillSettings> JobSettings(const PerDeviceStrategyOptions& options) {
  distill::DistillSettings settings;
  if (!options.distill_config.empty()) {
    absl::StatusOr<distill::DistillSettings> s =
        distill::LoadDistillSettings(options.distill_config);
    if (!s.ok()) return s.status();
    settings = *std::move(s);
    if (!options.learner.empty()) {
      absl::StatusOr<distill::DistillConfig> c =
          distill::WithFeatureTermOf(options.learner, settings.learner);
      if (!c.ok()) return c.status();
      settings.learner = *std::move(c);
    }
  } else {
    absl::StatusOr<distill::DistillConfig> c =
        distill::PresetDistillConfig(options.learner.empty() ? "akd" : options.learner);
    if (!c.ok()) return c.status();
    settings.learner = *std::move(c);
  }
  if (options.max_steps > 0) settings.job.max_steps = options.max_steps;
  if (options.time_budget_s > 0) settings.job.time_budget_s = options.time_budget_s;
  if (options.batch_size > 0) settings.job.batch_size = options.batch_size;
  if (options.lr > 0) settings.job.lr = options.lr;
  if (options.max_answer_tokens > 0) settings.job.max_answer_tokens = options.max_answer_tokens;
  if (options.torch_threads > 0) settings.job.num_threads = options.torch_threads;
  return settings;
}

}  // namespace internal

absl::StatusOr<std::string> JobSettingsJson(const PerDeviceStrategyOptions& options) {
  absl::StatusOr<distill::DistillSettings> s = internal::JobSettings(options);
  if (!s.ok()) return s.status();
  const nlohmann::json j = {{"learner", s->learner.name},
                            {"l_ce", s->learner.l_ce},
                            {"l_query", s->learner.l_query},
                            {"l_repr", s->learner.l_repr},
                            {"l_kl", s->learner.l_kl},
                            {"temperature", s->learner.temperature},
                            {"max_steps", s->job.max_steps},
                            {"batch_size", s->job.batch_size},
                            {"lr", s->job.lr},
                            {"replay_fraction", s->job.replay_fraction},
                            {"max_answer_tokens", s->job.max_answer_tokens}};
  return j.dump();
}

namespace {

using internal::DecodeMirrorFile;
using internal::EncodeMirrorFile;
using internal::MirrorFile;

compress::NamedTensors CloneTensors(const compress::NamedTensors& in) {
  compress::NamedTensors out;
  out.reserve(in.size());
  for (const auto& [name, t] : in) out.emplace_back(name, t.detach().clone());
  return out;
}

absl::StatusOr<compress::NamedTensors> TensorsFromSafetensors(absl::string_view bytes) {
  absl::StatusOr<model::SafetensorsContents> c = model::DecodeSafetensors(bytes);
  if (!c.ok()) return c.status();
  compress::NamedTensors out;
  for (auto& [name, t] : c->tensors) out.emplace_back(name, t.to(torch::kFloat).contiguous());
  return out;
}

// The default MirrorStates: one file per device, <dir>/<device>.mirror, written atomically
// (temp, fsync, rename, fsync dir). The trainer publishes the update after the commit.
class StateFiles final : public MirrorStates {
 public:
  StateFiles(storage::Env* env, std::string dir) : env_(env), dir_(std::move(dir)) {}
  absl::StatusOr<MirrorFile> Read(const std::string& device_id) override {
    absl::StatusOr<std::string> bytes = storage::ReadFile(*env_, Path(device_id));
    if (!bytes.ok()) return bytes.status();
    return DecodeMirrorFile(*bytes, Path(device_id));
  }
  absl::Status Commit(const std::string& device_id, const MirrorFile& state,
                      bool /*new_version*/) override {
    return storage::WriteFileAtomically(*env_, Path(device_id), EncodeMirrorFile(state));
  }
  bool PublishesOnCommit() const override { return false; }

 private:
  std::string Path(const std::string& device_id) const {
    return absl::StrCat(dir_, "/", device_id, ".mirror");
  }
  storage::Env* const env_;
  const std::string dir_;
};

// What a decoded sample holds in memory: its features as floats, token ids and kept indices,
// and for a frame its bytes plus the float tokens the tower turns it into.
uint64_t DecodedSampleBytes(const compress::UplinkSample& s) {
  uint64_t bytes = s.features.size() * sizeof(float) +
                   (s.prompt_tokens.size() + s.answer_tokens.size()) * sizeof(uint32_t) +
                   s.kept_indices.size() * sizeof(uint16_t);
  if (!s.frame.empty()) {
    bytes += s.frame.size() + uint64_t{s.kept_indices.size()} * s.feature_dim * sizeof(float);
  }
  return bytes;
}

// One unusable sample (or a whole batch: sample_id unknown) and why.
struct QuarantineEntry {
  uint64_t sequence = 0;
  bool whole_batch = true;
  uint64_t sample_id = 0;  // when !whole_batch
  uint64_t samples = 0;
  std::string reason;
};

// A device's quarantine file: totals and the newest entries, JSON.
struct QuarantineLog {
  static constexpr size_t kRecent = 64;
  uint64_t samples = 0;
  // The highest batch sequence an entry names: a job that meets entries at or below it again
  // is a retry after a crash between this file and the cursor's commit; they are not counted
  // twice.
  uint64_t through_sequence = 0;
  std::vector<QuarantineEntry> recent;  // oldest first

  std::string Encode() const {
    nlohmann::json j = {{"samples", samples}, {"through_sequence", through_sequence}};
    nlohmann::json entries = nlohmann::json::array();
    for (const QuarantineEntry& e : recent) {
      nlohmann::json x = {{"sequence", e.sequence}, {"samples", e.samples}, {"reason", e.reason}};
      if (!e.whole_batch) x["sample_id"] = e.sample_id;
      entries.push_back(std::move(x));
    }
    j["recent"] = std::move(entries);
    return j.dump(1) + "\n";
  }

  static absl::StatusOr<QuarantineLog> Decode(const std::string& bytes, const std::string& path) {
    QuarantineLog log;
    try {
      const nlohmann::json j = nlohmann::json::parse(bytes);
      log.samples = j.at("samples").get<uint64_t>();
      log.through_sequence = j.at("through_sequence").get<uint64_t>();
      for (const nlohmann::json& x : j.at("recent")) {
        QuarantineEntry e;
        e.sequence = x.at("sequence").get<uint64_t>();
        e.samples = x.at("samples").get<uint64_t>();
        e.reason = x.at("reason").get<std::string>();
        e.whole_batch = !x.contains("sample_id");
        if (!e.whole_batch) e.sample_id = x.at("sample_id").get<uint64_t>();
        log.recent.push_back(std::move(e));
      }
    } catch (const nlohmann::json::exception& e) {
      return absl::DataLossError(absl::StrCat(path, ": not a quarantine file: ", e.what()));
    }
    return log;
  }

  // Adds the entries not already counted; returns whether anything changed.
  bool Add(const std::vector<QuarantineEntry>& entries) {
    bool changed = false;
    uint64_t through = through_sequence;
    for (const QuarantineEntry& e : entries) {
      if (e.sequence <= through_sequence) continue;
      samples += e.samples;
      recent.push_back(e);
      through = std::max(through, e.sequence);
      changed = true;
    }
    through_sequence = through;
    if (recent.size() > kRecent) recent.erase(recent.begin(), recent.end() - kRecent);
    return changed;
  }
};

[[noreturn]] void InjectedCrash(const char* where) {
  std::fprintf(stderr, "cdcca-cloud: test fault injected %s\n", where);
  std::fflush(stderr);
  _exit(86);
}

// `answers` of `n` held-out samples from `whose` (teacher, mirror, base), or why not.
absl::Status CheckAnswers(const absl::StatusOr<std::vector<std::string>>& answers, size_t n,
                          const char* whose) {
  if (!answers.ok()) return answers.status();
  if (answers->size() != n) {
    return absl::InternalError(
        absl::StrCat(whose, " answered ", answers->size(), " of ", n, " held-out samples"));
  }
  return absl::OkStatus();
}

}  // namespace

// ---- PerDeviceStrategy ----------------------------------------------------------------------

struct PerDeviceStrategy::Impl {
  // A held-out sample of the update guard and the answers known for it.
  struct HoldoutEntry {
    uint64_t sequence = 0;  // the uplink batch it came in
    std::shared_ptr<const compress::UplinkSample> sample;
    bool teacher_known = false;
    std::string teacher;         // MirrorTrainer::TeacherAnswers
    double teacher_entropy = 0;  // and how sure the teacher was of it
    bool student_known = false;
    uint64_t student_version = 0;  // the mirror version `student` was answered with
    std::string student;
    double student_score = 0;  // the guard's score of `student` (UpdateGuardOptions::measure)
    bool base_known = false;
    std::string base;  // the pretrained base's answer (UpdateGuardOptions::restore_base)
    double base_score = 0;
  };
  using HoldoutPool = std::deque<std::shared_ptr<HoldoutEntry>>;  // oldest first

  struct Device {
    absl::Mutex mu;  // held for a whole job: one job per device at a time
    uint64_t version = 0;
    uint64_t consumed = 0;
    uint64_t digest = 0;
    uint64_t jobs = 0;
    uint64_t withheld = 0;          // updates the guard withheld since the start
    uint64_t rollbacks = 0;         // since the start
    compress::NamedTensors mirror;  // fp32 CPU; equals the device's state at `version`
    compress::DeltaEncoder encoder;
    std::unique_ptr<distill::ReplayBuffer> replay;
    // The guard's held-out samples up to `consumed` (the newest pool_capacity); built from
    // the sample log at the first job after a load.
    HoldoutPool holdout;
    bool holdout_built = false;
    QuarantineLog quarantine;
    // Jobs that failed in training at cursor `failed_cursor`, in a row (not persisted).
    uint64_t failed_cursor = 0;
    int failed_attempts = 0;
    // Whether the fields above are in memory (Load); Evict drops them again.
    bool loaded = false;
    // When the device last left a Load'ing call (Impl::tick's value): the resident device
    // with the smallest one is evicted first. Guarded by Impl::mu.
    uint64_t last_used = 0;
    // A copy of the fields above for State(), which must not wait for a running job.
    absl::Mutex info_mu;
    DeviceTrainingState info ABSL_GUARDED_BY(info_mu);
    bool info_valid ABSL_GUARDED_BY(info_mu) = false;

    void PublishInfo() {
      absl::MutexLock lock(&info_mu);
      info.version = version;
      info.state_digest = digest;
      info.consumed_sequence = consumed;
      info.jobs = jobs;
      info.updates_withheld = withheld;
      info.rollbacks = rollbacks;
      info.holdout_pool = holdout.size();
      info.quarantined_samples = quarantine.samples;
      info.last_quarantine_reason =
          quarantine.recent.empty() ? "" : quarantine.recent.back().reason;
      info_valid = true;
    }
  };

  PerDeviceStrategyOptions options;
  SampleLog* samples = nullptr;
  UpdateLog* updates = nullptr;
  DeviceStore* registry = nullptr;
  // Where committed states live: options.mirror_states, else own_states (the files).
  MirrorStates* states = nullptr;
  std::unique_ptr<MirrorStates> own_states;

  // Constant after Create: the frozen models and what they train.
  std::unique_ptr<internal::MirrorTrainer> trainer;
  uint64_t base_digest = 0;

  mutable absl::Mutex mu;  // guards the map (not the devices' contents)
  std::unordered_map<std::string, std::unique_ptr<Device>> devices ABSL_GUARDED_BY(mu);
  uint64_t tick ABSL_GUARDED_BY(mu) = 0;
  // Devices whose state is in memory (Device::loaded), in no order.
  absl::flat_hash_set<std::string> resident ABSL_GUARDED_BY(mu);
  uint64_t evictions ABSL_GUARDED_BY(mu) = 0;

  std::string StatePath(const std::string& id) const {
    return absl::StrCat(options.state_dir, "/", id, ".mirror");
  }
  std::string QuarantinePath(const std::string& id) const {
    return absl::StrCat(options.state_dir, "/", id, ".quarantine");
  }

  // Records `entries` durably in the device's quarantine file and logs each. Call before
  // the cursor moves past them. Caller holds d.mu.
  absl::Status Quarantine(const std::string& id, Device& d,
                          const std::vector<QuarantineEntry>& entries) {
    if (entries.empty()) return absl::OkStatus();
    for (const QuarantineEntry& e : entries) {
      nlohmann::json event = {{"event", "sample_quarantined"},
                              {"device_id", id},
                              {"sequence", e.sequence},
                              {"samples", e.samples},
                              {"reason", e.reason}};
      if (!e.whole_batch) event["sample_id"] = e.sample_id;
      std::fprintf(stderr, "%s\n", event.dump().c_str());
    }
    QuarantineLog updated = d.quarantine;
    if (!updated.Add(entries)) return absl::OkStatus();
    if (absl::Status s =
            storage::WriteFileAtomically(*options.env, QuarantinePath(id), updated.Encode());
        !s.ok()) {
      return s;
    }
    d.quarantine = std::move(updated);
    d.PublishInfo();
    return absl::OkStatus();
  }

  Device* Get(const std::string& id) {
    absl::MutexLock lock(&mu);
    std::unique_ptr<Device>& d = devices[id];
    if (d == nullptr) d = std::make_unique<Device>();
    return d.get();
  }

  // After a call that Load'ed `id` (its d.mu released): marks it the most recently used and
  // evicts the least recently used resident devices beyond max_resident_mirrors. A device
  // whose job or call is running (its mu held) is skipped: the bound may be passed by the
  // devices in use at once, never by idle ones.
  void Touch(const std::string& id) {
    std::vector<std::pair<uint64_t, std::string>> idle;
    {
      absl::MutexLock lock(&mu);
      auto it = devices.find(id);
      if (it != devices.end()) it->second->last_used = ++tick;
      if (options.max_resident_mirrors == 0 || resident.size() <= options.max_resident_mirrors) {
        return;
      }
      for (const std::string& r : resident) idle.emplace_back(devices.at(r)->last_used, r);
    }
    std::sort(idle.begin(), idle.end());
    size_t excess = idle.size() - options.max_resident_mirrors;
    for (const auto& [used, r] : idle) {
      if (excess == 0) break;
      Device* d = nullptr;
      {
        absl::MutexLock lock(&mu);
        d = devices.at(r).get();
      }
      if (!d->mu.TryLock()) continue;
      if (d->loaded) {
        Evict(r, *d);
        --excess;
      }
      d->mu.Unlock();
    }
  }

  // Whether the device has a state or quarantine file (NOT_FOUND for both: it never
  // trained; any other answer counts as having one).
  bool HasStateFiles(const std::string& id) const {
    if (states != own_states.get()) return true;  // a shared store: ask it by loading
    for (const std::string& path : {StatePath(id), QuarantinePath(id)}) {
      if (!absl::IsNotFound(options.env->OpenForRead(path).status())) return true;
    }
    return false;
  }

  void MarkLoaded(const std::string& id, Device& d) {
    d.loaded = true;
    d.PublishInfo();
    absl::MutexLock lock(&mu);
    resident.insert(id);
  }

  // Drops what Load brought into memory: the mirror, the encoder's residual, the replay
  // buffer, the held-out pool and the learner's state between jobs. All but the replay
  // buffer and the learner's state are on disk or in the sample log, and the next Load
  // brings them back; those two restart empty, as after a restart. State() keeps answering
  // from the published info. Caller holds d.mu.
  void Evict(const std::string& id, Device& d) {
    d.mirror = compress::NamedTensors();
    d.encoder = compress::DeltaEncoder();
    d.replay.reset();
    d.holdout.clear();
    d.holdout_built = false;
    d.quarantine = QuarantineLog();
    trainer->Forget(id);
    d.loaded = false;
    absl::MutexLock lock(&mu);
    resident.erase(id);
    ++evictions;
  }

  compress::DeltaEncoderOptions EncoderOptions(const std::string& id) const {
    compress::DeltaEncoderOptions o;
    o.bits_per_param = options.bits_per_param;
    o.byte_budget = options.byte_budget;
    if (registry != nullptr) {
      absl::StatusOr<store::v1::DeviceRecord> r = registry->Get(id);
      if (r.ok()) {
        if (o.byte_budget == 0) o.byte_budget = r->capabilities().update_byte_budget();
        if (r->capabilities().delta_bit_widths_size() > 0) {
          o.allowed_bits.assign({0});
          for (uint32_t b : r->capabilities().delta_bit_widths()) {
            if (b != 0) o.allowed_bits.push_back(static_cast<int>(b));
          }
        }
      }
    }
    return o;
  }

  // Loads the device's state file (or starts it at the pretrained base). Caller holds d.mu.
  absl::Status Load(const std::string& id, Device& d) {
    if (d.loaded) return absl::OkStatus();
    d.encoder = compress::DeltaEncoder(EncoderOptions(id));
    d.replay = std::make_unique<distill::ReplayBuffer>(options.replay_capacity,
                                                       compress::Hash64(id.data(), id.size()));
    d.quarantine = QuarantineLog();
    if (absl::StatusOr<std::string> q = storage::ReadFile(*options.env, QuarantinePath(id));
        q.ok()) {
      absl::StatusOr<QuarantineLog> log = QuarantineLog::Decode(*q, QuarantinePath(id));
      if (!log.ok()) return log.status();
      d.quarantine = *std::move(log);
    } else if (!absl::IsNotFound(q.status())) {
      return q.status();
    }
    // Batches renumbered after the log lost its tail are new samples, not retries of the
    // quarantined ones.
    absl::StatusOr<uint64_t> durable = samples->Durable(id);
    if (!durable.ok()) return durable.status();
    d.quarantine.through_sequence = std::min(d.quarantine.through_sequence, *durable);
    absl::StatusOr<MirrorFile> f = states->Read(id);
    if (absl::IsNotFound(f.status())) {
      d.mirror = CloneTensors(trainer->base_trainable());
      d.version = 0;
      d.consumed = 0;
      d.digest = base_digest;
      MarkLoaded(id, d);
      return absl::OkStatus();
    }
    if (!f.ok()) return f.status();
    absl::StatusOr<compress::NamedTensors> mirror = TensorsFromSafetensors(f->mirror);
    if (!mirror.ok()) return mirror.status();
    if (compress::StateDigest(*mirror) != f->digest) {
      return absl::DataLossError(
          absl::StrCat("mirror state of ", id, " does not match its digest"));
    }
    if (absl::Status s = d.encoder.RestoreState(f->residual); !s.ok()) return s;
    d.mirror = *std::move(mirror);
    d.version = f->version;
    d.consumed = f->consumed;
    d.digest = f->digest;
    // The cursor never points past the durable log: if the sample log lost its tail (a torn
    // write after a crash), the device renumbers from the log's end, and a cursor left
    // beyond it would skip those new batches forever. Commit the clamped cursor at once.
    if (d.consumed > *durable) {
      std::fprintf(stderr,
                   "{\"event\":\"cursor_clamped\",\"device_id\":\"%s\",\"consumed\":%llu,"
                   "\"durable\":%llu}\n",
                   id.c_str(), static_cast<unsigned long long>(d.consumed),
                   static_cast<unsigned long long>(*durable));
      MirrorFile clamped = *f;
      clamped.consumed = *durable;
      if (absl::Status s = states->Commit(id, clamped, /*new_version=*/false); !s.ok()) return s;
      d.consumed = *durable;
    }
    MarkLoaded(id, d);
    (void)ReleaseConsumed(id, d);
    // Publish what the file committed if the update store lacks it (a crash between commit
    // and publish, or a damaged store file that the store refused to load). A store that
    // publishes with the commit cannot lack it.
    if (d.version > 0 && !states->PublishesOnCommit()) {
      absl::StatusOr<StoredUpdate> update = updates->UpdateAfter(id, d.version - 1);
      if (!update.ok() || update->new_version != d.version) {
        absl::Status s = updates->PutUpdate(id, d.version - 1, d.version, d.digest, f->update);
        // INVALID_ARGUMENT: the store already holds a newer update than this state (it
        // cannot, as the state file commits first, unless files were mixed up by hand).
        if (!s.ok() && !absl::IsInvalidArgument(s)) return s;
      }
      if (!updates->Snapshot(id, d.version).ok()) {
        absl::Status s = updates->PutSnapshot(id, d.version, d.digest, f->snapshot);
        if (!s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

  // Moves the device's cursor to `last_sequence` durably without a new version: for batches
  // that give nothing to train on. Caller holds d.mu.
  absl::Status SkipTo(const std::string& id, Device& d, uint64_t last_sequence) {
    MirrorFile f;
    absl::StatusOr<MirrorFile> old = states->Read(id);
    if (old.ok()) f = *std::move(old);
    if (!old.ok() || f.mirror.empty()) {
      absl::StatusOr<std::string> m = model::EncodeSafetensors(d.mirror, {});
      if (!m.ok()) return m.status();
      f.mirror = *std::move(m);
      f.residual = d.encoder.SerializeState();
      f.version = d.version;
      f.digest = d.digest;
    }
    f.consumed = last_sequence;
    if (absl::Status s = states->Commit(id, f, /*new_version=*/false); !s.ok()) return s;
    d.consumed = last_sequence;
    d.PublishInfo();
    return ReleaseConsumed(id, d);
  }

  // Lets the sample log delete what the device's jobs have consumed (the replay buffer holds
  // its own copies). A failure to delete a file is logged: the records are released anyway,
  // and the next release tries the file again.
  // With the guard on, the batches that hold the held-out pool stay (a restart rebuilds
  // the pool from them), and nothing is released before the pool is built.
  absl::Status ReleaseConsumed(const std::string& id, const Device& d) {
    uint64_t through = d.consumed;
    if (options.guard.enabled) {
      if (!d.holdout_built) return absl::OkStatus();
      if (!d.holdout.empty()) through = std::min(through, d.holdout.front()->sequence - 1);
    }
    if (through == 0) return absl::OkStatus();
    if (absl::Status s = samples->Release(id, through); !s.ok()) {
      std::fprintf(
          stderr, "%s\n",
          nlohmann::json(
              {{"event", "sample_log_release_failed"}, {"device_id", id}, {"error", s.ToString()}})
              .dump()
              .c_str());
    }
    return absl::OkStatus();
  }

  // The held-out samples of one decoded batch move to `held`, the others to `train`. A
  // held-out sample the trainer cannot use (MirrorTrainer::CheckSample) goes to neither: it
  // is listed in `unusable` when given (a job's first sight of it; a rebuild of the pool
  // from the log drops it silently, as it was quarantined then).
  void SplitHeldOut(const std::string& id, uint64_t sequence,
                    std::vector<compress::UplinkSample>& batch,
                    std::vector<compress::UplinkSample>* train, HoldoutPool* held,
                    std::vector<QuarantineEntry>* unusable = nullptr) const {
    for (size_t i = 0; i < batch.size(); ++i) {
      if (options.guard.enabled &&
          compress::IsHeldOutSample(id, batch[i].sample_id, options.guard.holdout_fraction)) {
        if (absl::Status usable = trainer->CheckSample(batch[i]); !usable.ok()) {
          if (unusable != nullptr) {
            unusable->push_back({sequence, false, batch[i].sample_id, 1, usable.ToString()});
          }
          continue;
        }
        auto entry = std::make_shared<HoldoutEntry>();
        entry->sequence = sequence;
        entry->sample = std::make_shared<const compress::UplinkSample>(std::move(batch[i]));
        held->push_back(std::move(entry));
      } else if (train != nullptr) {
        train->push_back(std::move(batch[i]));
      }
    }
  }

  // The newest `n` of `pool` (all of it when it holds fewer).
  static HoldoutPool NewestOf(const HoldoutPool& pool, size_t n) {
    if (n >= pool.size()) return pool;
    return HoldoutPool(pool.end() - static_cast<std::ptrdiff_t>(n), pool.end());
  }

  // `pool` followed by `fresh`, the newest pool_capacity of them.
  HoldoutPool JoinHoldout(const HoldoutPool& pool, const HoldoutPool& fresh) const {
    HoldoutPool out = pool;
    out.insert(out.end(), fresh.begin(), fresh.end());
    while (out.size() > options.guard.pool_capacity) out.pop_front();
    return out;
  }

  // Builds d.holdout once after a load: the held-out samples of the device's batches up to
  // the cursor, read back from the sample log in spans that double from the cursor down
  // until the pool is full or the log's start is reached. Batches that do not decode are
  // passed over, as the jobs passed over them. Caller holds d.mu.
  absl::Status BuildHoldout(const std::string& id, Device& d) {
    if (d.holdout_built) return absl::OkStatus();
    HoldoutPool pool;
    uint64_t to = d.consumed;
    uint64_t span = 16;
    while (options.guard.enabled && to >= 1 && pool.size() < options.guard.pool_capacity) {
      const uint64_t from = to > span ? to - span + 1 : 1;
      absl::StatusOr<StoredBatches> stored =
          samples->ReadEach(id, from, static_cast<size_t>(to - from + 1));
      if (!stored.ok()) return stored.status();
      HoldoutPool older;
      for (const store::v1::SampleRecord& r : stored->records) {
        const uint64_t seq = r.batch().sequence();
        if (seq > to) break;
        absl::StatusOr<CheckedBatch> checked =
            DecodeCheckedPayload(r.batch().payload(), trainer->spec());
        if (checked.ok()) SplitHeldOut(id, seq, checked->samples, nullptr, &older);
      }
      pool.insert(pool.begin(), older.begin(), older.end());
      if (from == 1) break;
      to = from - 1;
      span *= 2;
    }
    while (pool.size() > options.guard.pool_capacity) pool.pop_front();
    d.holdout = std::move(pool);
    d.holdout_built = true;
    return absl::OkStatus();
  }

  // The guard's score of each of `answers` (one per entry of `entries`, whose teachers are
  // known): agreement with the teacher's answer, or the teacher's probability of it
  // (UpdateGuardOptions::measure).
  absl::StatusOr<std::vector<double>> Scores(const std::vector<HoldoutEntry*>& entries,
                                             const std::vector<std::string>& answers) {
    std::vector<double> out;
    if (options.guard.measure == GuardMeasure::kAgreement) {
      for (size_t i = 0; i < entries.size(); ++i) {
        out.push_back(AnswerAgreement(answers[i], entries[i]->teacher));
      }
      return out;
    }
    std::vector<const compress::UplinkSample*> samples;
    for (const HoldoutEntry* e : entries) samples.push_back(e->sample.get());
    absl::StatusOr<std::vector<double>> p = trainer->TeacherProbabilities(samples, answers);
    if (!p.ok()) return p.status();
    if (p->size() != entries.size()) {
      return absl::InternalError(
          absl::StrCat("the teacher scored ", p->size(), " answers of ", entries.size()));
    }
    return p;
  }

  // Scores as Scores does, but an answer equal to the entry's current one (known at any
  // version) takes its cached score: a score depends only on the sample and the answer, and
  // most answers an update leaves as they were, so only the changed ones cost a teacher pass.
  absl::StatusOr<std::vector<double>> ScoresReusing(const std::vector<HoldoutEntry*>& entries,
                                                    const std::vector<std::string>& answers) {
    std::vector<HoldoutEntry*> changed_entries;
    std::vector<std::string> changed_answers;
    std::vector<size_t> changed_at;
    std::vector<double> out(entries.size(), 0.0);
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i]->student_known && entries[i]->student == answers[i]) {
        out[i] = entries[i]->student_score;
      } else {
        changed_entries.push_back(entries[i]);
        changed_answers.push_back(answers[i]);
        changed_at.push_back(i);
      }
    }
    if (changed_at.empty()) return out;
    absl::StatusOr<std::vector<double>> scored = Scores(changed_entries, changed_answers);
    if (!scored.ok()) return scored.status();
    for (size_t k = 0; k < changed_at.size(); ++k) out[changed_at[k]] = (*scored)[k];
    return out;
  }

  // Scores `pool` for the guard: the teacher's answers and the student's at d.version where
  // not cached (they are cached in the entries, with their scores), and the student's with
  // the `after` mirror (returned in `after_answers` and `after_scores`, in pool order).
  // Caller holds d.mu.
  absl::StatusOr<GuardVerdict> ScoreUpdate(Device& d, const HoldoutPool& pool,
                                           const compress::NamedTensors& after,
                                           std::vector<std::string>* after_answers,
                                           std::vector<double>* after_scores) {
    if (pool.empty()) return JudgeUpdate({}, {}, options.guard);
    std::vector<HoldoutEntry*> need_teacher, need_student, entries;
    std::vector<const compress::UplinkSample*> all;
    for (const std::shared_ptr<HoldoutEntry>& e : pool) {
      all.push_back(e->sample.get());
      entries.push_back(e.get());
      if (!e->teacher_known) need_teacher.push_back(e.get());
      if (!e->student_known || e->student_version != d.version) need_student.push_back(e.get());
    }
    auto samples_of = [](const std::vector<HoldoutEntry*>& entries) {
      std::vector<const compress::UplinkSample*> out;
      for (const HoldoutEntry* e : entries) out.push_back(e->sample.get());
      return out;
    };
    if (!need_teacher.empty()) {
      std::vector<double> entropies;
      absl::StatusOr<std::vector<std::string>> t =
          trainer->TeacherAnswers(samples_of(need_teacher), &entropies);
      if (absl::Status s = CheckAnswers(t, need_teacher.size(), "the teacher"); !s.ok()) return s;
      entropies.resize(need_teacher.size(), 0.0);
      for (size_t i = 0; i < need_teacher.size(); ++i) {
        need_teacher[i]->teacher = std::move((*t)[i]);
        need_teacher[i]->teacher_entropy = entropies[i];
        need_teacher[i]->teacher_known = true;
      }
    }
    if (!need_student.empty()) {
      absl::StatusOr<std::vector<std::string>> b =
          trainer->StudentAnswers(d.mirror, samples_of(need_student));
      if (absl::Status s = CheckAnswers(b, need_student.size(), "the mirror"); !s.ok()) return s;
      absl::StatusOr<std::vector<double>> scores = Scores(need_student, *b);
      if (!scores.ok()) return scores.status();
      for (size_t i = 0; i < need_student.size(); ++i) {
        need_student[i]->student = std::move((*b)[i]);
        need_student[i]->student_score = (*scores)[i];
        need_student[i]->student_version = d.version;
        need_student[i]->student_known = true;
      }
    }
    absl::StatusOr<std::vector<std::string>> a = trainer->StudentAnswers(after, all);
    if (absl::Status s = CheckAnswers(a, all.size(), "the updated mirror"); !s.ok()) return s;
    absl::StatusOr<std::vector<double>> scores = ScoresReusing(entries, *a);
    if (!scores.ok()) return scores.status();
    *after_answers = *std::move(a);
    *after_scores = *std::move(scores);
    return JudgeOnPool(pool, [&](size_t i) { return (*after_scores)[i]; });
  }

  // The guard's rule on `pool` (scored: teacher and current answers known): per compared
  // sample (UpdateGuardOptions::confident_fraction), the current version's score against
  // `candidate(i)`'s.
  GuardVerdict JudgeOnPool(const HoldoutPool& pool,
                           absl::FunctionRef<double(size_t)> candidate) const {
    std::vector<double> entropies;
    for (const std::shared_ptr<HoldoutEntry>& e : pool) entropies.push_back(e->teacher_entropy);
    std::vector<double> current, candidates;
    for (size_t i : ConfidentSamples(entropies, options.guard.confident_fraction)) {
      current.push_back(pool[i]->student_score);
      candidates.push_back(candidate(i));
    }
    return JudgeUpdate(current, candidates, options.guard);
  }

  // The pretrained base against the device's current version on `pool`, by the guard's rule
  // (base as "after"): the base's answers and scores are computed once per held-out sample
  // and cached; the current version's are those ScoreUpdate cached. Caller holds d.mu.
  absl::StatusOr<GuardVerdict> ScoreBase(Device& d, const HoldoutPool& pool) {
    std::vector<HoldoutEntry*> need;
    std::vector<const compress::UplinkSample*> inputs;
    for (const std::shared_ptr<HoldoutEntry>& e : pool) {
      if (!e->teacher_known || !e->student_known || e->student_version != d.version) {
        return absl::InternalError("the held-out pool was not scored before the base");
      }
      if (!e->base_known) {
        need.push_back(e.get());
        inputs.push_back(e->sample.get());
      }
    }
    if (!need.empty()) {
      absl::StatusOr<std::vector<std::string>> b =
          trainer->StudentAnswers(trainer->base_trainable(), inputs);
      if (absl::Status s = CheckAnswers(b, need.size(), "the base"); !s.ok()) return s;
      absl::StatusOr<std::vector<double>> scores = ScoresReusing(need, *b);
      if (!scores.ok()) return scores.status();
      for (size_t i = 0; i < need.size(); ++i) {
        need[i]->base = std::move((*b)[i]);
        need[i]->base_score = (*scores)[i];
        need[i]->base_known = true;
      }
    }
    return JudgeOnPool(pool, [&](size_t i) { return pool[i]->base_score; });
  }

  // An update the guard did not let through: the batches are consumed (the cursor moves
  // durably), the trained samples join the replay buffer and the pool its new samples, the
  // learner state trained along with the update is dropped; mirror, version and residual
  // stay. Caller holds d.mu.
  absl::StatusOr<JobReport> Withhold(const std::string& id, Device& d, HoldoutPool pool,
                                     const std::vector<compress::UplinkSample>& trained,
                                     JobReport& report) {
    if (absl::Status s = SkipTo(id, d, report.last_sequence); !s.ok()) return s;
    d.holdout = std::move(pool);
    d.replay->Add(trained);
    trainer->Forget(id);
    ++d.jobs;
    ++d.withheld;
    d.PublishInfo();
    const GuardVerdict& v = report.guard;
    const GuardVerdict& b = report.base_guard;  // pool 0: the base was not scored
    std::fprintf(stderr,
                 "{\"event\":\"update_withheld\",\"device_id\":\"%s\",\"version\":%llu,"
                 "\"batches\":[%llu,%llu],\"pool\":%lld,\"before\":%.4f,\"after\":%.4f,"
                 "\"gain\":%.4f,\"se\":%.4f,\"z\":%.3f,\"decision\":\"%s\","
                 "\"payload_bytes\":%llu,\"base\":{\"pool\":%lld,\"current\":%.4f,"
                 "\"base\":%.4f,\"gain\":%.4f,\"se\":%.4f,\"decision\":\"%s\"}}\n",
                 id.c_str(), static_cast<unsigned long long>(d.version),
                 static_cast<unsigned long long>(report.first_sequence),
                 static_cast<unsigned long long>(report.last_sequence),
                 static_cast<long long>(v.pool), v.before, v.after, v.gain, v.se, options.guard.z,
                 v.decision.c_str(), static_cast<unsigned long long>(report.payload_bytes),
                 static_cast<long long>(b.pool), b.before, b.after, b.gain, b.se,
                 b.decision.c_str());
    report.update_withheld = true;
    report.new_version = d.version;
    report.state_digest = d.digest;
    report.payload_bytes = 0;
    report.bits_per_param = 0;
    report.relative_error = 0;
    report.budget_raised_to = 0;
    return report;
  }

  // Moves the device back to the state it had at `to_version` (0 = the version before its
  // newest) as a new version: see TrainerStrategy::Rollback. Caller holds d.mu.
  absl::StatusOr<RollbackResult> Rollback(const std::string& id, Device& d, uint64_t device_version,
                                          uint64_t to_version) {
    if (absl::Status s = Load(id, d); !s.ok()) return s;
    if (d.version == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(id, " runs the pretrained base: there is nothing to roll back"));
    }
    if (device_version != d.version) {
      return absl::FailedPreconditionError(
          absl::StrCat(id, " reports version ", device_version, " but its mirror is at version ",
                       d.version, ": apply the newest update (or resync) first, then roll back"));
    }
    const uint64_t to = to_version == 0 ? d.version - 1 : to_version;
    if (to >= d.version) {
      return absl::InvalidArgumentError(
          absl::StrCat("a rollback goes to a version before ", d.version, ", not to ", to_version));
    }
    return RestoreTo(id, d, to, "device_rolled_back");
  }

  // Moves the device back to the state it had at version `to` (< d.version; 0 = the
  // pretrained base) as a new version, logged as `event`. Caller holds d.mu, d is loaded.
  absl::StatusOr<RollbackResult> RestoreTo(const std::string& id, Device& d, uint64_t to,
                                           const char* event) {
    compress::NamedTensors target;
    if (to == 0) {
      target = CloneTensors(trainer->base_trainable());
    } else {
      absl::StatusOr<StoredUpdate> kept = updates->Snapshot(id, to);
      if (!kept.ok() || kept->new_version != to) {
        return absl::NotFoundError(absl::StrCat(
            "no snapshot of version ", to, " of ", id,
            " is kept any more (the update store keeps the newest ones); choose a newer one"));
      }
      absl::StatusOr<compress::NamedTensors> state = TensorsFromSafetensors(*kept->payload);
      if (!state.ok()) return state.status();
      if (compress::StateDigest(*state) != kept->state_digest) {
        return absl::DataLossError(
            absl::StrCat("the snapshot of version ", to, " of ", id, " does not match its digest"));
      }
      target = *std::move(state);
    }
    const uint64_t digest = compress::StateDigest(target);
    // The update a device at d.version fetches: DWC towards the target without a byte cap
    // (a one-off); it cannot land exactly on the target, so such a device finds its digest
    // differs and loads the new version's snapshot, which is the target exactly. The
    // residual restarts empty: what the rolled-back jobs trained is dropped.
    compress::DeltaEncoderOptions uncapped = d.encoder.options();
    uncapped.byte_budget = 0;
    uncapped.bits_per_param = 0;
    compress::DeltaEncoder encoder(uncapped);
    absl::StatusOr<compress::UpdatePayload> payload =
        encoder.Encode(target, d.mirror, d.version, d.version + 1);
    if (!payload.ok()) return payload.status();
    absl::StatusOr<std::string> snapshot =
        model::EncodeSafetensors(target, {{"version", std::to_string(d.version + 1)}});
    if (!snapshot.ok()) return snapshot.status();
    const compress::DeltaEncoder fresh(d.encoder.options());
    MirrorFile f;
    f.version = d.version + 1;
    f.consumed = d.consumed;
    f.digest = digest;
    f.mirror = *snapshot;
    f.residual = fresh.SerializeState();
    f.update = payload->bytes;
    f.snapshot = *snapshot;
    if (absl::Status s = states->Commit(id, f, /*new_version=*/true); !s.ok()) return s;
    // Committed (Load republishes it after a crash from here on).
    const uint64_t from = d.version;
    d.mirror = std::move(target);
    d.encoder = fresh;
    d.version = f.version;
    d.digest = digest;
    ++d.rollbacks;
    trainer->Forget(id);  // the learner state was fitted along with the dropped updates
    d.PublishInfo();
    std::fprintf(stderr, "%s\n",
                 nlohmann::json({{"event", event},
                                 {"device_id", id},
                                 {"from_version", from},
                                 {"restored_version", to},
                                 {"new_version", f.version},
                                 {"state_digest", absl::StrFormat("%016x", digest)}})
                     .dump()
                     .c_str());
    if (!states->PublishesOnCommit()) {
      if (absl::Status s =
              updates->PutUpdate(id, from, f.version, digest, std::move(payload->bytes));
          !s.ok()) {
        return s;
      }
      if (absl::Status s = updates->PutSnapshot(id, f.version, digest, std::move(f.snapshot));
          !s.ok()) {
        return s;
      }
    }
    return RollbackResult{f.version, to, digest};
  }

  absl::StatusOr<JobReport> RunJob(const std::string& id, Device& d) {
    if (absl::Status s = Load(id, d); !s.ok()) return s;
    absl::StatusOr<StoredBatches> stored =
        samples->ReadEach(id, d.consumed + 1, options.max_batches_per_job);
    if (!stored.ok()) return stored.status();  // I/O: the scheduler retries later
    const std::vector<store::v1::SampleRecord>& records = stored->records;
    const std::vector<UnreadableBatch>& unreadable = stored->unreadable;
    if (records.empty() && unreadable.empty()) {
      return absl::NotFoundError(absl::StrCat("no new samples of ", id));
    }

    JobReport report;
    report.device_id = id;
    report.base_version = d.version;
    report.new_version = d.version + 1;
    std::vector<QuarantineEntry> quarantine;
    const auto quarantine_batch = [&](uint64_t seq, uint64_t count, const absl::Status& why) {
      quarantine.push_back({seq, true, 0, count, std::string(why.ToString())});
      report.quarantined_samples += count;
    };
    std::vector<compress::UplinkSample> batch_samples;
    std::vector<std::pair<uint64_t, uint64_t>> job_batches;  // sequence, samples
    uint64_t decoded_bytes = 0;
    // The readable and the unreadable batches, in sequence order.
    for (size_t r = 0, u = 0; r < records.size() || u < unreadable.size();) {
      if (u < unreadable.size() &&
          (r == records.size() || unreadable[u].sequence < records[r].batch().sequence())) {
        // Acked, then rotted on disk: it reads back DATA_LOSS now and would on every retry.
        const UnreadableBatch& bad = unreadable[u++];
        if (report.first_sequence == 0) report.first_sequence = bad.sequence;
        quarantine_batch(bad.sequence, bad.samples, bad.status);
        job_batches.emplace_back(bad.sequence, 0);
        report.last_sequence = bad.sequence;
        continue;
      }
      const store::v1::SampleRecord& record = records[r++];
      const uint64_t seq = record.batch().sequence();
      if (report.first_sequence == 0) report.first_sequence = seq;
      absl::StatusOr<CheckedBatch> checked =
          DecodeCheckedPayload(record.batch().payload(), trainer->spec());
      if (!checked.ok()) {
        // Ingest checks every batch against the model, but a log written by an older version
        // may hold one that does not fit.
        quarantine_batch(seq, record.batch().sample_count(), checked.status());
        job_batches.emplace_back(seq, 0);
        report.last_sequence = seq;
        continue;
      }
      uint64_t bytes = 0;
      for (const compress::UplinkSample& sample : checked->samples) {
        bytes += DecodedSampleBytes(sample);
      }
      // Bounded jobs: the batch that would pass a bound waits for the next job.
      if (!batch_samples.empty() &&
          (batch_samples.size() + checked->samples.size() > options.max_samples_per_job ||
           decoded_bytes + bytes > options.max_decoded_bytes_per_job)) {
        break;
      }
      decoded_bytes += bytes;
      job_batches.emplace_back(seq, checked->samples.size());
      for (compress::UplinkSample& sample : checked->samples) {
        batch_samples.push_back(std::move(sample));
      }
      report.last_sequence = seq;
    }
    // Quarantines every usable batch of the job too (with `why`), and moves the cursor past.
    const auto quarantine_job = [&](const absl::Status& why) -> absl::Status {
      // Whole batches now: single samples of them listed before are counted in these.
      for (const QuarantineEntry& e : quarantine) {
        if (!e.whole_batch) report.quarantined_samples -= e.samples;
      }
      quarantine.erase(std::remove_if(quarantine.begin(), quarantine.end(),
                                      [](const QuarantineEntry& e) { return !e.whole_batch; }),
                       quarantine.end());
      for (const auto& [seq, count] : job_batches) {
        if (count > 0) quarantine_batch(seq, count, why);
      }
      if (absl::Status s = Quarantine(id, d, quarantine); !s.ok()) return s;
      return SkipTo(id, d, report.last_sequence);
    };
    if (batch_samples.empty()) {
      if (absl::Status s = Quarantine(id, d, quarantine); !s.ok()) return s;
      if (absl::Status s = SkipTo(id, d, report.last_sequence); !s.ok()) return s;
      return absl::NotFoundError(absl::StrCat("no usable samples in batches ",
                                              report.first_sequence, "-", report.last_sequence));
    }

    // The guard's share never trains: it joins the held-out pool when the job commits.
    if (absl::Status s = BuildHoldout(id, d); !s.ok()) return s;
    std::vector<compress::UplinkSample> train_samples;
    std::vector<uint64_t> train_batch;  // each training sample's sequence
    HoldoutPool fresh;
    {
      auto next = batch_samples.begin();
      for (const auto& [seq, count] : job_batches) {
        if (count == 0) continue;  // quarantined: nothing of it is in batch_samples
        std::vector<compress::UplinkSample> batch(std::make_move_iterator(next),
                                                  std::make_move_iterator(next + count));
        next += static_cast<std::ptrdiff_t>(count);
        const size_t listed = quarantine.size();
        SplitHeldOut(id, seq, batch, &train_samples, &fresh, &quarantine);
        report.quarantined_samples += quarantine.size() - listed;
        train_batch.resize(train_samples.size(), seq);
      }
    }
    report.samples = static_cast<int64_t>(train_samples.size());
    report.held_out_samples = static_cast<int64_t>(fresh.size());
    if (train_samples.empty()) {
      if (absl::Status s = Quarantine(id, d, quarantine); !s.ok()) return s;
      if (absl::Status s = SkipTo(id, d, report.last_sequence); !s.ok()) return s;
      d.holdout = JoinHoldout(d.holdout, fresh);
      d.PublishInfo();
      report.new_version = d.version;
      report.state_digest = d.digest;
      report.notes.push_back("every sample of the job is held out for the guard: nothing trained");
      return report;
    }
    // A job that fails in training at the same cursor kMaxJobAttempts times in a row gives
    // up on its batches: the failure comes from what they hold, or no retry would help.
    const auto training_failed = [&](const absl::Status& why) -> absl::Status {
      if (d.failed_cursor != d.consumed) d.failed_attempts = 0;
      d.failed_cursor = d.consumed;
      if (++d.failed_attempts < kMaxJobAttempts) return why;
      d.failed_attempts = 0;
      const absl::Status reason =
          absl::Status(why.code(), absl::StrCat("the job failed ", kMaxJobAttempts,
                                                " times on these batches: ", why.message()));
      if (absl::Status s = quarantine_job(reason); !s.ok()) return s;
      return absl::DataLossError(absl::StrCat("job of ", id, " on batches ", report.first_sequence,
                                              "-", report.last_sequence, ": ", reason.message(),
                                              "; batches quarantined, mirror unchanged"));
    };

    try {
      absl::StatusOr<internal::MirrorJob> result =
          options.fault == "train_error"
              ? absl::StatusOr<internal::MirrorJob>(
                    absl::InternalError("test fault: training fails"))
              : trainer->Train(id, d.mirror, train_samples, d.replay.get(), d.version);
      if (!result.ok()) return training_failed(result.status());
      // Samples the trainer could not use (a frame that does not decode): the job went on
      // without them.
      std::vector<bool> rejected(train_samples.size(), false);
      size_t rejected_count = 0;
      for (const auto& [index, why] : result->rejected) {
        if (index >= train_samples.size() || rejected[index]) continue;
        rejected[index] = true;
        ++rejected_count;
        quarantine.push_back(
            {train_batch[index], false, train_samples[index].sample_id, 1, why.ToString()});
        ++report.quarantined_samples;
      }
      report.samples = static_cast<int64_t>(train_samples.size() - rejected_count);
      if (report.samples <= 0) {
        if (absl::Status s = Quarantine(id, d, quarantine); !s.ok()) return s;
        if (absl::Status s = SkipTo(id, d, report.last_sequence); !s.ok()) return s;
        return absl::NotFoundError(absl::StrCat("no usable samples in batches ",
                                                report.first_sequence, "-", report.last_sequence));
      }
      // Uplinked features are finite (the codec checks) but may be large enough to overflow
      // training: a non-finite result must never become an update. The batches are
      // quarantined (a retry would fail the same way) and the mirror stays.
      for (const auto& [name, t] : result->trainable) {
        if (torch::isfinite(t).all().item<bool>()) continue;
        trainer->Forget(id);  // phi/psi may have been fitted to the same features
        const absl::Status why = absl::DataLossError(
            absl::StrCat("training on them took ", name, " to a non-finite value"));
        if (absl::Status s = quarantine_job(why); !s.ok()) return s;
        d.holdout = JoinHoldout(d.holdout, fresh);  // as a rebuild from the log would have it
        d.PublishInfo();
        return absl::DataLossError(absl::StrCat("the job on batches ", report.first_sequence, "-",
                                                report.last_sequence, " of ", id, " trained ", name,
                                                " to a non-finite value; "
                                                "batches quarantined, mirror unchanged"));
      }
      d.failed_attempts = 0;
      report.replay_samples = result->stats.replay_samples;
      report.steps = result->stats.steps;
      report.stopped_by_budget = result->stats.stopped_by_budget;
      report.train_seconds = result->stats.train_seconds;
      report.train_device = result->stats.device;
      report.notes = result->notes;
      if (!result->stats.terms.empty()) {
        report.loss_first = result->stats.terms.front().first;
        report.loss_last = result->stats.terms.front().last;
      }

      // Encode on a copy of the encoder: it is committed only with the state file.
      compress::DeltaEncoder encoder = d.encoder;
      absl::StatusOr<compress::UpdatePayload> payload =
          encoder.Encode(result->trainable, d.mirror, d.version, d.version + 1);
      // A budget below the smallest payload (a small model under a bits-per-parameter cap:
      // the per-tensor headers alone exceed it) would block the device forever; send the
      // smallest budget that fits instead, and say so in the report.
      for (uint64_t budget = 4096; absl::IsResourceExhausted(payload.status()); budget *= 4) {
        compress::DeltaEncoderOptions raised = d.encoder.options();
        raised.bits_per_param = 0;
        raised.byte_budget = budget;
        encoder = compress::DeltaEncoder(raised);
        if (absl::Status s = encoder.RestoreState(d.encoder.SerializeState()); !s.ok()) return s;
        payload = encoder.Encode(result->trainable, d.mirror, d.version, d.version + 1);
        report.budget_raised_to = budget;
        if (budget > (1ull << 30)) break;
      }
      if (!payload.ok()) return payload.status();
      compress::NamedTensors mirror = CloneTensors(d.mirror);
      absl::StatusOr<uint64_t> applied = compress::ApplyUpdate(payload->bytes, d.version, mirror);
      if (!applied.ok()) return applied.status();
      const uint64_t digest = compress::StateDigest(mirror);
      absl::StatusOr<std::string> snapshot =
          model::EncodeSafetensors(mirror, {{"version", std::to_string(d.version + 1)}});
      if (!snapshot.ok()) return snapshot.status();
      report.state_digest = digest;
      report.payload_bytes = payload->stats.payload_bytes;
      report.bits_per_param = payload->stats.bits_per_param;
      report.relative_error = payload->stats.relative_error;

      // The guard: the pool (with this job's held-out samples) before and after the update
      // the device would apply.
      HoldoutPool pool;
      std::vector<std::string> after_answers;
      std::vector<double> after_scores;
      if (options.guard.enabled) {
        pool = JoinHoldout(d.holdout, fresh);
        absl::StatusOr<GuardVerdict> verdict =
            ScoreUpdate(d, pool, mirror, &after_answers, &after_scores);
        if (!verdict.ok()) return verdict.status();
        report.guard = *verdict;
      }
      if (!report.guard.ship) {
        if (absl::Status s = Quarantine(id, d, quarantine); !s.ok()) return s;
        // A device whose current version agrees with the teacher on what it answers now
        // worse than the pretrained base, beyond the same margin, goes back to the base.
        bool restore = false;
        if (options.guard.restore_base && d.version > 0 && !pool.empty()) {
          absl::StatusOr<GuardVerdict> base =
              ScoreBase(d, NewestOf(pool, std::max(fresh.size(), options.guard.min_pool)));
          if (!base.ok()) return base.status();
          report.base_guard = *base;
          restore = base->decision == "helps";
        }
        absl::StatusOr<JobReport> withheld =
            Withhold(id, d, std::move(pool), train_samples, report);
        if (!withheld.ok() || !restore) return withheld;
        absl::StatusOr<RollbackResult> restored = RestoreTo(id, d, 0, "device_restored_to_base");
        if (!restored.ok()) return restored.status();
        // The new version is the base: its answers are known where the base was scored (the
        // newest samples); the others are answered again at the next job.
        for (const std::shared_ptr<HoldoutEntry>& e : d.holdout) {
          e->student = e->base;
          e->student_score = e->base_score;
          e->student_version = d.version;
          e->student_known = e->base_known;
        }
        withheld->restored_base = true;
        withheld->new_version = restored->new_version;
        withheld->state_digest = restored->state_digest;
        return withheld;
      }
      if (options.fault == "after_train") InjectedCrash("after training");

      MirrorFile f;
      f.version = d.version + 1;
      f.consumed = report.last_sequence;
      f.digest = digest;
      f.mirror = *snapshot;
      f.residual = encoder.SerializeState();
      f.update = payload->bytes;
      f.snapshot = *snapshot;
      if (absl::Status s = Quarantine(id, d, quarantine); !s.ok()) return s;
      if (absl::Status s = states->Commit(id, f, /*new_version=*/true); !s.ok()) return s;
      // Committed: from here the job's result survives a crash (Load republishes it).
      d.mirror = std::move(mirror);
      {
        // Keep the configured options (a raised budget holds for this job only).
        compress::DeltaEncoder committed(d.encoder.options());
        if (committed.RestoreState(f.residual).ok()) d.encoder = std::move(committed);
      }
      d.version = f.version;
      d.consumed = f.consumed;
      d.digest = digest;
      ++d.jobs;
      if (options.guard.enabled) {
        // The pool's answers with the mirror just committed are the ones scored as "after".
        for (size_t i = 0; i < pool.size(); ++i) {
          pool[i]->student = std::move(after_answers[i]);
          pool[i]->student_score = after_scores[i];
          pool[i]->student_version = d.version;
          pool[i]->student_known = true;
        }
        d.holdout = std::move(pool);
      }
      d.PublishInfo();
      std::vector<compress::UplinkSample> usable;
      usable.reserve(train_samples.size());
      for (size_t i = 0; i < train_samples.size(); ++i) {
        if (!rejected[i]) usable.push_back(std::move(train_samples[i]));
      }
      d.replay->Add(usable);
      (void)ReleaseConsumed(id, d);
      if (options.fault == "after_commit") InjectedCrash("after the commit");
      if (!states->PublishesOnCommit()) {
        if (absl::Status s = updates->PutUpdate(id, report.base_version, report.new_version, digest,
                                                std::move(payload->bytes));
            !s.ok()) {
          return s;
        }
        if (absl::Status s = updates->PutSnapshot(id, f.version, digest, std::move(f.snapshot));
            !s.ok()) {
          return s;
        }
      }
    } catch (const c10::Error& e) {
      return training_failed(
          absl::InternalError(absl::StrCat("job of ", id, ": ", e.what_without_backtrace())));
    }
    return report;
  }
};

PerDeviceStrategy::PerDeviceStrategy(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PerDeviceStrategy::~PerDeviceStrategy() = default;

absl::StatusOr<std::unique_ptr<PerDeviceStrategy>> PerDeviceStrategy::Create(
    const PerDeviceStrategyOptions& options, SampleLog* samples, UpdateLog* updates,
    DeviceStore* registry) {
  if (options.state_dir.empty()) return absl::InvalidArgumentError("state_dir is required");
  if (options.train_device != "cpu" && options.train_device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("train device must be cpu or cuda, not '", options.train_device, "'"));
  }
  PerDeviceStrategyOptions pair = options;
  if (!options.checkpoint_dir.empty()) {
    if (!options.teacher_dir.empty() || !options.student_base_dir.empty()) {
      return absl::InvalidArgumentError(
          "give either a family (checkpoint_dir) or a teacher-student pair (teacher_dir and "
          "student_base_dir), not both");
    }
    pair.teacher_dir = options.checkpoint_dir + "/teacher";
    pair.student_base_dir = options.checkpoint_dir;
  }
  auto impl = std::make_unique<Impl>();
  impl->options = pair;
  impl->samples = samples;
  impl->updates = updates;
  impl->registry = registry;
  if (options.mirror_states != nullptr) {
    impl->states = options.mirror_states;
  } else {
    impl->own_states = std::make_unique<StateFiles>(options.env, options.state_dir);
    impl->states = impl->own_states.get();
  }
  if (options.env == nullptr) return absl::InvalidArgumentError("env is null");
  if (absl::Status s = options.env->CreateDirs(options.state_dir); !s.ok()) return s;

  absl::StatusOr<std::unique_ptr<internal::MirrorTrainer>> trainer =
      internal::CreateHubMirrorTrainer(pair);
  if (!trainer.ok()) return trainer.status();
  impl->trainer = *std::move(trainer);
  impl->base_digest = compress::StateDigest(impl->trainer->base_trainable());
  return std::unique_ptr<PerDeviceStrategy>(new PerDeviceStrategy(std::move(impl)));
}

absl::Status PerDeviceStrategy::Recover() {
  // A shared store publishes with each commit: there is nothing a crash left to republish.
  if (impl_->states != impl_->own_states.get()) return absl::OkStatus();
  // A state file found here may be one whose rename never became durable (the process
  // before stopped between the rename and the directory sync); make it durable before
  // anything is published from it, or a power loss could leave an update without its mirror.
  if (absl::Status s = impl_->options.env->SyncDir(impl_->options.state_dir); !s.ok()) return s;
  absl::StatusOr<std::vector<std::string>> files =
      impl_->options.env->ListFiles(impl_->options.state_dir);
  if (!files.ok()) return files.status();
  for (const std::string& name : *files) {
    absl::string_view stem = name;
    if (!absl::ConsumeSuffix(&stem, ".mirror")) continue;  // temp files of a crash
    const std::string id(stem);
    if (!wire::ValidateDeviceId(id).ok()) continue;
    Impl::Device* d = impl_->Get(id);
    {
      absl::MutexLock lock(&d->mu);
      if (absl::Status s = impl_->Load(id, *d); !s.ok()) return s;
    }
    impl_->Touch(id);
  }
  return absl::OkStatus();
}

absl::StatusOr<JobReport> PerDeviceStrategy::RunJob(const std::string& device_id) {
  if (absl::Status s = wire::ValidateDeviceId(device_id); !s.ok()) return s;
  Impl::Device* d = impl_->Get(device_id);
  absl::StatusOr<JobReport> report;
  {
    absl::MutexLock lock(&d->mu);
    report = impl_->RunJob(device_id, *d);
  }
  impl_->Touch(device_id);
  return report;
}

absl::StatusOr<RollbackResult> PerDeviceStrategy::Rollback(const std::string& device_id,
                                                           uint64_t device_version,
                                                           uint64_t to_version) {
  if (absl::Status s = wire::ValidateDeviceId(device_id); !s.ok()) return s;
  Impl::Device* d = impl_->Get(device_id);
  absl::StatusOr<RollbackResult> result;
  {
    absl::MutexLock lock(&d->mu);
    result = impl_->Rollback(device_id, *d, device_version, to_version);
  }
  impl_->Touch(device_id);
  return result;
}

uint64_t PerDeviceStrategy::ConsumedSequence(const std::string& device_id) const {
  return State(device_id).consumed_sequence;
}

DeviceTrainingState PerDeviceStrategy::State(const std::string& device_id) const {
  Impl::Device* d = impl_->Get(device_id);
  {
    absl::MutexLock lock(&d->info_mu);
    if (d->info_valid) return d->info;
  }
  // Not loaded yet. A device with no state file holds the pretrained base: its info is
  // published once without bringing a mirror into memory (the status file asks for every
  // registered device on every tick); its first job's Load replaces it. Else load it.
  DeviceTrainingState info;
  {
    absl::MutexLock lock(&d->mu);
    if (!d->loaded && !impl_->HasStateFiles(device_id)) {
      d->digest = impl_->base_digest;
      d->PublishInfo();
      absl::MutexLock info_lock(&d->info_mu);
      return d->info;
    }
    if (!impl_->Load(device_id, *d).ok()) return DeviceTrainingState{};
    absl::MutexLock info_lock(&d->info_mu);
    info = d->info;
  }
  impl_->Touch(device_id);
  return info;
}

void PerDeviceStrategy::OnApplied(const std::string& device_id, uint64_t version, bool in_sync) {
  // Nothing to change on the cloud side: a device out of sync is told to load the newest
  // snapshot, which is the mirror itself.
}

absl::StatusOr<std::string> PerDeviceStrategy::MirrorState(const std::string& device_id) const {
  Impl::Device* d = impl_->Get(device_id);
  absl::StatusOr<std::string> state;
  {
    absl::MutexLock lock(&d->mu);
    if (absl::Status s = impl_->Load(device_id, *d); !s.ok()) return s;
    state = model::EncodeSafetensors(d->mirror, {{"version", std::to_string(d->version)}});
  }
  impl_->Touch(device_id);
  return state;
}

void PerDeviceStrategy::DropUnless(const std::string& device_id, uint64_t version,
                                   uint64_t consumed) {
  Impl::Device* d = impl_->Get(device_id);
  absl::MutexLock lock(&d->mu);
  if (d->loaded && (d->version != version || d->consumed != consumed)) {
    impl_->Evict(device_id, *d);
  }
}

size_t PerDeviceStrategy::ResidentMirrors() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->resident.size();
}

uint64_t PerDeviceStrategy::MirrorEvictions() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->evictions;
}

uint64_t PerDeviceStrategy::BaseDigest() const { return impl_->base_digest; }
uint64_t PerDeviceStrategy::BaseFingerprint() const { return impl_->trainer->base_fingerprint(); }
uint64_t PerDeviceStrategy::VisionFingerprint() const {
  return impl_->trainer->vision_fingerprint();
}
SampleSpec PerDeviceStrategy::Spec() const { return impl_->trainer->spec(); }

// ---- JobScheduler ---------------------------------------------------------------------------

JobScheduler::JobScheduler(JobSchedulerOptions options, TrainerStrategy* strategy,
                           SampleStore* samples)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : Clock::Real()),
      strategy_(strategy),
      samples_(samples) {
  pool_ = std::make_unique<internal::WorkPool>(std::max(1, options_.threads));
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    for (const std::string& id : samples_->Devices()) {
      DeviceSchedule& d = devices_[id];
      d.highest_durable = samples_->HighestDurable(id);
      d.last_job = now;
    }
    dirty_ = true;
  }
  thread_ = std::thread([this] { Loop(); });
}

JobScheduler::~JobScheduler() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  pool_.reset();  // runs queued jobs' remaining closures and joins
}

void JobScheduler::OnSamplesStored(const std::string& device_id, uint64_t highest_durable) {
  absl::MutexLock lock(&mu_);
  DeviceSchedule& d = devices_[device_id];
  if (d.last_job == absl::InfinitePast()) d.last_job = clock_->Now();
  d.highest_durable = std::max(d.highest_durable, highest_durable);
  dirty_ = true;
}

absl::StatusOr<RollbackResult> JobScheduler::OnRollback(const std::string& device_id,
                                                        uint64_t device_version,
                                                        uint64_t to_version) {
  return strategy_->Rollback(device_id, device_version, to_version);
}

void JobScheduler::OnApplied(const std::string& device_id, uint64_t version, bool in_sync) {
  strategy_->OnApplied(device_id, version, in_sync);
}

void JobScheduler::SetJobCallback(std::function<void(const absl::StatusOr<JobReport>&)> callback) {
  absl::MutexLock lock(&mu_);
  callback_ = std::move(callback);
}

uint64_t JobScheduler::jobs_done() const {
  absl::MutexLock lock(&mu_);
  return jobs_done_;
}

uint64_t JobScheduler::jobs_failed() const {
  absl::MutexLock lock(&mu_);
  return jobs_failed_;
}

int JobScheduler::peak_in_flight() const {
  absl::MutexLock lock(&mu_);
  return peak_in_flight_;
}

int JobScheduler::peak_running() const {
  absl::MutexLock lock(&mu_);
  return peak_running_;
}

bool JobScheduler::Due(const std::string& device_id, DeviceSchedule& d, absl::Time now) {
  if (d.running || now < d.retry_at) return false;
  const uint64_t consumed = strategy_->ConsumedSequence(device_id);
  if (d.highest_durable <= consumed) {
    d.pending_samples = 0;
    d.counted_upto = consumed;
    return false;
  }
  if (d.counted_upto < consumed) {
    d.counted_upto = consumed;
    d.pending_samples = 0;
  }
  if (d.counted_upto < d.highest_durable) {
    // From the store's index: scheduling never reads a payload.
    d.pending_samples += static_cast<int64_t>(
        samples_->SampleCount(device_id, d.counted_upto + 1, d.highest_durable));
    d.counted_upto = d.highest_durable;
  }
  if (d.pending_samples <= 0) return false;
  return d.pending_samples >= options_.trigger_samples ||
         now - d.last_job >= options_.trigger_interval;
}

void JobScheduler::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    const absl::Time now = clock_->Now();
    for (auto& [id, d] : devices_) {
      if (!Due(id, d, now)) continue;
      d.running = true;
      d.triggered_at = absl::Now();
      ++running_;
      peak_in_flight_ = std::max(peak_in_flight_, running_);
      const std::string device_id = id;
      pool_->Schedule([this, device_id] { Run(device_id); });
    }
    dirty_ = false;
    // Wake on new samples, a finished job, or every 200 ms for the time trigger.
    auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || dirty_; };
    clock_->AwaitWithTimeout(&mu_, absl::Condition(&wake), absl::Milliseconds(200));
  }
}

void JobScheduler::Run(const std::string& device_id) {
  double queue_seconds = 0;
  {
    absl::MutexLock lock(&mu_);
    queue_seconds = absl::ToDoubleSeconds(absl::Now() - devices_[device_id].triggered_at);
    ++executing_;
    peak_running_ = std::max(peak_running_, executing_);
  }
  absl::StatusOr<JobReport> report = strategy_->RunJob(device_id);
  if (report.ok()) report->queue_seconds = queue_seconds;
  std::function<void(const absl::StatusOr<JobReport>&)> callback;
  {
    absl::MutexLock lock(&mu_);
    DeviceSchedule& d = devices_[device_id];
    d.running = false;
    --running_;
    --executing_;
    d.last_job = clock_->Now();
    if (report.ok() || absl::IsNotFound(report.status())) d.retry_delay = absl::ZeroDuration();
    if (report.ok()) {
      ++jobs_done_;
    } else if (!absl::IsNotFound(report.status())) {
      ++jobs_failed_;
      d.retry_delay = d.retry_delay == absl::ZeroDuration()
                          ? options_.retry_after
                          : std::min(d.retry_delay * 2, options_.max_retry_after);
      d.retry_at = clock_->Now() + d.retry_delay;
    }
    dirty_ = true;
    callback = callback_;
  }
  if (callback) callback(report);
}

bool JobScheduler::WaitIdle(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    {
      absl::MutexLock lock(&mu_);
      bool idle = running_ == 0;
      const absl::Time now = clock_->Now();
      for (auto& [id, d] : devices_) {
        if (!idle) break;
        if (Due(id, d, now)) idle = false;
      }
      if (idle) return true;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

}  // namespace cdcca::cloud
