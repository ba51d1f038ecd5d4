#include "cloud/trainer.h"

#include <torch/torch.h>

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
#include "cloud/internal/holdout_pool.h"
#include "cloud/internal/mirror_cache.h"
#include "cloud/internal/mirror_file.h"
#include "cloud/internal/mirror_trainer.h"
#include "cloud/internal/quarantine_log.h"
#include "cloud/train_round.h"
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
#include "storage/event_log.h"

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
  if (!options.fp8_base.empty()) {
    if (absl::Status s = distill::CheckFp8BaseMode(options.fp8_base, "--fp8_base"); !s.ok()) {
      return s;
    }
    settings.job.fp8_base = options.fp8_base;
  }
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
                            {"confidence_power", s->learner.confidence_power},
                            {"max_steps", s->job.max_steps},
                            {"batch_size", s->job.batch_size},
                            {"lr", s->job.lr},
                            {"replay_fraction", s->job.replay_fraction},
                            {"max_answer_tokens", s->job.max_answer_tokens},
                            {"prepare_batch", s->job.prepare_batch},
                            {"fp8_base", s->job.fp8_base}};
  return j.dump();
}

namespace {

using internal::DecodeMirrorFile;
using internal::EncodeMirrorFile;
using internal::HoldoutEntry;
using internal::HoldoutPool;
using internal::MirrorFile;
using internal::QuarantineEntry;
using internal::QuarantineLog;

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

}  // namespace

// ---- PerDeviceStrategy ----------------------------------------------------------------------

struct PerDeviceStrategy::Impl {
  using DeviceMirror = internal::DeviceMirror;

  explicit Impl(const PerDeviceStrategyOptions& o) : options(o), cache(o.max_resident_mirrors) {}

  const PerDeviceStrategyOptions options;
  SampleLog* samples = nullptr;
  UpdateLog* updates = nullptr;
  DeviceStore* registry = nullptr;
  // Where committed states live: options.mirror_states, else own_states (the files).
  MirrorStates* states = nullptr;
  std::unique_ptr<MirrorStates> own_states;

  // Constant after Create: the frozen models and what they train.
  std::unique_ptr<internal::MirrorTrainer> trainer;
  uint64_t base_digest = 0;

  internal::MirrorCache cache;
  std::unique_ptr<internal::GuardScorer> guard;  // of `trainer`

  std::string StatePath(const std::string& id) const {
    return absl::StrCat(options.state_dir, "/", id, ".mirror");
  }
  std::string QuarantinePath(const std::string& id) const {
    return absl::StrCat(options.state_dir, "/", id, ".quarantine");
  }

  // Records `entries` durably in the device's quarantine file and logs each. Call before
  // the cursor moves past them. Caller holds d.mu.
  absl::Status Quarantine(const std::string& id, DeviceMirror& d,
                          const std::vector<QuarantineEntry>& entries) {
    if (entries.empty()) return absl::OkStatus();
    for (const QuarantineEntry& e : entries) {
      nlohmann::json event = {{"event", "sample_quarantined"},
                              {"device_id", id},
                              {"sequence", e.sequence},
                              {"samples", e.samples},
                              {"reason", e.reason}};
      if (!e.whole_batch) event["sample_id"] = e.sample_id;
      LogEvent(event);
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

  // Whether the device has a state or quarantine file (NOT_FOUND for both: it never
  // trained; any other answer counts as having one).
  bool HasStateFiles(const std::string& id) const {
    if (states != own_states.get()) return true;  // a shared store: ask it by loading
    for (const std::string& path : {StatePath(id), QuarantinePath(id)}) {
      if (!absl::IsNotFound(options.env->OpenForRead(path).status())) return true;
    }
    return false;
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
  absl::Status Load(const std::string& id, DeviceMirror& d) {
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
      cache.MarkLoaded(id, d);
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
    // The replay buffer as the last commit left it, wherever that job ran (a state written
    // before it was kept has none). One that does not fit this trainer's capacity starts
    // empty, as it did before it was kept: replay is weaker for a round, nothing is lost.
    if (!f->replay.empty()) {
      if (absl::Status s = d.replay->Restore(f->replay, id); !s.ok()) {
        LogEvent({{"event", "replay_not_restored"}, {"device_id", id}, {"error", s.ToString()}});
      }
    }
    d.mirror = *std::move(mirror);
    d.version = f->version;
    d.consumed = f->consumed;
    d.digest = f->digest;
    // The cursor never points past the durable log: if the sample log lost its tail (a torn
    // write after a crash), the device renumbers from the log's end, and a cursor left
    // beyond it would skip those new batches forever. Commit the clamped cursor at once.
    if (d.consumed > *durable) {
      LogEvent({{"event", "cursor_clamped"},
                {"device_id", id},
                {"consumed", d.consumed},
                {"durable", *durable}});
      MirrorFile clamped = *f;
      clamped.consumed = *durable;
      if (absl::Status s = states->Commit(id, clamped, /*new_version=*/false); !s.ok()) return s;
      d.consumed = *durable;
    }
    cache.MarkLoaded(id, d);
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
  // that give nothing to train on. `replay` (default: the device's) is the replay buffer the
  // commit keeps. Caller holds d.mu.
  absl::Status SkipTo(const std::string& id, DeviceMirror& d, uint64_t last_sequence,
                      const distill::ReplayBuffer* replay = nullptr) {
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
    f.replay = (replay != nullptr ? replay : d.replay.get())->Serialize();
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
  absl::Status ReleaseConsumed(const std::string& id, const DeviceMirror& d) {
    uint64_t through = d.consumed;
    if (options.guard.enabled) {
      if (!d.holdout_built) return absl::OkStatus();
      if (!d.holdout.empty()) through = std::min(through, d.holdout.front()->sequence - 1);
    }
    // Likewise the batches that hold the pool.
    if (options.pool_samples > 0) {
      if (!d.pool_built) return absl::OkStatus();
      if (!d.pool.empty()) through = std::min(through, d.pool.front().first - 1);
    }
    if (through == 0) return absl::OkStatus();
    if (absl::Status s = samples->Release(id, through); !s.ok()) {
      LogEvent(
          {{"event", "sample_log_release_failed"}, {"device_id", id}, {"error", s.ToString()}});
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

  // Reads the device's batches up to `to` back from the sample log into `pool` (oldest first),
  // newest first in spans that double from `to` down, until `pool` holds `capacity` entries or
  // the log's start is reached; the oldest beyond `capacity` are dropped. Each batch that
  // decodes goes to take(sequence, batch, older), which appends what it keeps of it to `older`
  // (that span's entries). Batches that do not decode are passed over, as the jobs passed over
  // them.
  template <typename Pool, typename Take>
  absl::Status ReadBack(const std::string& id, uint64_t to, size_t capacity, Pool& pool,
                        Take take) const {
    uint64_t span = 16;
    while (to >= 1 && pool.size() < capacity) {
      const uint64_t from = to > span ? to - span + 1 : 1;
      absl::StatusOr<StoredBatches> stored =
          samples->ReadEach(id, from, static_cast<size_t>(to - from + 1));
      if (!stored.ok()) return stored.status();
      Pool older;
      for (const store::v1::SampleRecord& r : stored->records) {
        const uint64_t seq = r.batch().sequence();
        if (seq > to) break;
        absl::StatusOr<CheckedBatch> checked =
            DecodeCheckedPayload(r.batch().payload(), trainer->spec());
        if (checked.ok()) take(seq, *checked, older);
      }
      pool.insert(pool.begin(), std::make_move_iterator(older.begin()),
                  std::make_move_iterator(older.end()));
      if (from == 1) break;
      to = from - 1;
      span *= 2;
    }
    while (pool.size() > capacity) pool.pop_front();
    return absl::OkStatus();
  }

  // Builds d.holdout once after a load: the held-out samples of the device's batches up to
  // the cursor (ReadBack). Caller holds d.mu.
  absl::Status BuildHoldout(const std::string& id, DeviceMirror& d) {
    if (d.holdout_built) return absl::OkStatus();
    HoldoutPool pool;
    absl::Status read =
        ReadBack(id, d.consumed, options.guard.enabled ? options.guard.pool_capacity : 0, pool,
                 [&](uint64_t seq, CheckedBatch& batch, HoldoutPool& older) {
                   SplitHeldOut(id, seq, batch.samples, nullptr, &older);
                 });
    if (!read.ok()) return read;
    d.holdout = std::move(pool);
    d.holdout_built = true;
    return absl::OkStatus();
  }

  // Builds d.pool once after a load: the training samples (not held out, usable) of the
  // device's batches up to the cursor, newest first, until pool_samples are found or the
  // log's start is reached (ReadBack); batches the quarantine file's recent entries name whole
  // are passed over too. Caller holds d.mu.
  absl::Status BuildPool(const std::string& id, DeviceMirror& d) {
    if (d.pool_built) return absl::OkStatus();
    using Pool = std::deque<std::pair<uint64_t, compress::UplinkSample>>;
    Pool pool;
    absl::Status read = ReadBack(
        id, d.consumed, options.pool_samples, pool,
        [&](uint64_t seq, CheckedBatch& batch, Pool& older) {
          if (std::any_of(
                  d.quarantine.recent.begin(), d.quarantine.recent.end(),
                  [seq](const QuarantineEntry& e) { return e.whole_batch && e.sequence == seq; })) {
            return;
          }
          for (compress::UplinkSample& sample : batch.samples) {
            if (options.guard.enabled &&
                compress::IsHeldOutSample(id, sample.sample_id, options.guard.holdout_fraction)) {
              continue;
            }
            if (!trainer->CheckSample(sample).ok()) continue;
            older.emplace_back(seq, std::move(sample));
          }
        });
    if (!read.ok()) return read;
    d.pool = std::move(pool);
    d.pool_built = true;
    return absl::OkStatus();
  }

  // An update the guard did not let through: the batches are consumed (the cursor moves
  // durably), the trained samples join the replay buffer and the pool its new samples, the
  // learner state trained along with the update is dropped; mirror, version and residual
  // stay. Caller holds d.mu.
  absl::StatusOr<JobReport> Withhold(const std::string& id, DeviceMirror& d, HoldoutPool pool,
                                     const std::vector<compress::UplinkSample>& trained,
                                     JobReport& report) {
    distill::ReplayBuffer replay = *d.replay;
    replay.Add(trained);
    if (absl::Status s = SkipTo(id, d, report.last_sequence, &replay); !s.ok()) return s;
    d.holdout = std::move(pool);
    *d.replay = std::move(replay);
    trainer->Forget(id);
    ++d.jobs;
    ++d.withheld;
    d.PublishInfo();
    const GuardVerdict& v = report.guard;
    const GuardVerdict& b = report.base_guard;  // pool 0: the base was not scored
    const auto verdict = [](const GuardVerdict& g) {
      return nlohmann::json({{"pool", g.pool},
                             {"before", g.before},
                             {"after", g.after},
                             {"gain", g.gain},
                             {"se", g.se},
                             {"decision", g.decision}});
    };
    nlohmann::json event = {
        {"event", "update_withheld"}, {"device_id", id},
        {"version", d.version},       {"batches", {report.first_sequence, report.last_sequence}},
        {"z", options.guard.z},       {"payload_bytes", report.payload_bytes},
        {"base", verdict(b)}};
    event.update(verdict(v));
    LogEvent(event);
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
  // newest) as a new version: see PerDeviceStrategy::Rollback. Caller holds d.mu.
  absl::StatusOr<RollbackResult> Rollback(const std::string& id, DeviceMirror& d,
                                          uint64_t device_version, uint64_t to_version) {
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

  // Drops what Load brought into memory: the mirror, the encoder's residual, the replay
  // buffer, the held-out pool and the learner's state between jobs. All but the learner's
  // state are on disk or in the sample log, and the next Load brings them back; it restarts
  // empty, as after a restart. State() keeps answering from the published info. Caller
  // holds d.mu.
  void Evict(const std::string& id, DeviceMirror& d) {
    d.Clear();
    trainer->Forget(id);
    cache.MarkUnloaded(id, d);
  }

  // After a call that loaded `id`: the cache's bound of resident devices.
  void Touch(const std::string& id) {
    cache.Touch(id, [this](const std::string& r, DeviceMirror& d) { Evict(r, d); });
  }

  // ---- the one commit path: jobs, rollbacks and restores -------------------------------------

  // Commits `next` as the device's new version with its cursor at `consumed`, and takes it
  // as the device's state in memory. From here the version survives a crash (Load
  // republishes it). Caller holds d.mu.
  absl::Status CommitVersion(const std::string& id, DeviceMirror& d, NewVersion& next,
                             uint64_t consumed, const distill::ReplayBuffer* replay = nullptr) {
    MirrorFile f;
    f.version = next.version;
    f.consumed = consumed;
    f.digest = next.digest;
    f.mirror = next.snapshot;
    f.residual = next.residual;
    f.update = next.update.bytes;
    f.snapshot = next.snapshot;
    f.replay = (replay != nullptr ? replay : d.replay.get())->Serialize();
    if (absl::Status s = states->Commit(id, f, /*new_version=*/true); !s.ok()) return s;
    d.mirror = std::move(next.state);
    // The configured options (a raised budget holds for its update only), the new residual.
    compress::DeltaEncoder committed(d.encoder.options());
    if (committed.RestoreState(next.residual).ok()) d.encoder = std::move(committed);
    d.version = next.version;
    d.consumed = consumed;
    d.digest = next.digest;
    d.PublishInfo();
    return absl::OkStatus();
  }

  // Publishes a committed version's update and snapshot to the update store, unless the
  // store published them with the commit.
  absl::Status PublishVersion(const std::string& id, NewVersion& next) {
    if (states->PublishesOnCommit()) return absl::OkStatus();
    if (absl::Status s = updates->PutUpdate(id, next.base_version, next.version, next.digest,
                                            std::move(next.update.bytes));
        !s.ok()) {
      return s;
    }
    return updates->PutSnapshot(id, next.version, next.digest, std::move(next.snapshot));
  }

  // Moves the device back to the state it had at version `to` (< d.version; 0 = the
  // pretrained base) as a new version, logged as `event`. Caller holds d.mu, d is loaded.
  absl::StatusOr<RollbackResult> RestoreTo(const std::string& id, DeviceMirror& d, uint64_t to,
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
    absl::StatusOr<NewVersion> next =
        RestoreVersion(std::move(target), d.mirror, d.version, d.encoder.options());
    if (!next.ok()) return next.status();
    const uint64_t from = d.version;
    if (absl::Status s = CommitVersion(id, d, *next, d.consumed); !s.ok()) return s;
    ++d.rollbacks;
    trainer->Forget(id);  // the learner state was fitted along with the dropped updates
    d.PublishInfo();
    LogEvent({{"event", event},
              {"device_id", id},
              {"from_version", from},
              {"restored_version", to},
              {"new_version", next->version},
              {"state_digest", absl::StrFormat("%016x", next->digest)}});
    if (absl::Status s = PublishVersion(id, *next); !s.ok()) return s;
    return RollbackResult{next->version, to, next->digest};
  }

  // ---- a job ---------------------------------------------------------------------------------

  // What a job reads: the batches after the cursor within the job's bounds, decoded.
  struct JobBatches {
    std::vector<compress::UplinkSample> samples;
    std::vector<std::pair<uint64_t, uint64_t>> batches;  // sequence, samples (0: quarantined)
    std::vector<QuarantineEntry> quarantine;             // entries to write before the cursor moves
  };

  // Lists `count` samples of batch `seq` for quarantine, with `why`.
  static void QuarantineBatch(JobBatches& in, JobReport& report, uint64_t seq, uint64_t count,
                              const absl::Status& why) {
    in.quarantine.push_back({seq, true, 0, count, std::string(why.ToString())});
    report.quarantined_samples += count;
  }

  // Reads the device's batches after its cursor in sequence order, up to the job's bounds (the
  // batch that would pass one waits for the next job; a job always takes its first batch).
  // Batches that read back damaged or do not decode are listed for quarantine. Sets the
  // report's sequences. NOT_FOUND when there is no new batch; I/O errors as they come.
  absl::StatusOr<JobBatches> ReadBatches(const std::string& id, const DeviceMirror& d,
                                         JobReport& report) {
    absl::StatusOr<StoredBatches> stored =
        samples->ReadEach(id, d.consumed + 1, options.max_batches_per_job);
    if (!stored.ok()) return stored.status();  // I/O: the scheduler retries later
    const std::vector<store::v1::SampleRecord>& records = stored->records;
    const std::vector<UnreadableBatch>& unreadable = stored->unreadable;
    if (records.empty() && unreadable.empty()) {
      return absl::NotFoundError(absl::StrCat("no new samples of ", id));
    }
    JobBatches in;
    uint64_t decoded_bytes = 0;
    for (size_t r = 0, u = 0; r < records.size() || u < unreadable.size();) {
      if (u < unreadable.size() &&
          (r == records.size() || unreadable[u].sequence < records[r].batch().sequence())) {
        // Acked, then rotted on disk: it reads back DATA_LOSS now and would on every retry.
        const UnreadableBatch& bad = unreadable[u++];
        if (report.first_sequence == 0) report.first_sequence = bad.sequence;
        QuarantineBatch(in, report, bad.sequence, bad.samples, bad.status);
        in.batches.emplace_back(bad.sequence, 0);
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
        QuarantineBatch(in, report, seq, record.batch().sample_count(), checked.status());
        in.batches.emplace_back(seq, 0);
        report.last_sequence = seq;
        continue;
      }
      uint64_t bytes = 0;
      for (const compress::UplinkSample& sample : checked->samples) {
        bytes += DecodedSampleBytes(sample);
      }
      if (!in.samples.empty() &&
          (in.samples.size() + checked->samples.size() > options.max_samples_per_job ||
           decoded_bytes + bytes > options.max_decoded_bytes_per_job)) {
        break;
      }
      decoded_bytes += bytes;
      in.batches.emplace_back(seq, checked->samples.size());
      for (compress::UplinkSample& sample : checked->samples)
        in.samples.push_back(std::move(sample));
      report.last_sequence = seq;
    }
    return in;
  }

  // The job's samples split for the guard: its share joins the held-out pool when the job
  // commits and never trains.
  struct JobSplit {
    std::vector<compress::UplinkSample> train;
    std::vector<uint64_t> train_batch;  // each training sample's sequence
    HoldoutPool fresh;
  };

  JobSplit SplitJob(const std::string& id, JobBatches& in, JobReport& report) const {
    JobSplit split;
    auto next = in.samples.begin();
    for (const auto& [seq, count] : in.batches) {
      if (count == 0) continue;  // quarantined: nothing of it is in the samples
      std::vector<compress::UplinkSample> batch(std::make_move_iterator(next),
                                                std::make_move_iterator(next + count));
      next += static_cast<std::ptrdiff_t>(count);
      const size_t listed = in.quarantine.size();
      SplitHeldOut(id, seq, batch, &split.train, &split.fresh, &in.quarantine);
      report.quarantined_samples += in.quarantine.size() - listed;
      split.train_batch.resize(split.train.size(), seq);
    }
    report.samples = static_cast<int64_t>(split.train.size());
    report.held_out_samples = static_cast<int64_t>(split.fresh.size());
    return split;
  }

  // The job's trained samples join the pool (the newest pool_samples stay). Caller holds d.mu.
  void JoinPool(DeviceMirror& d, const JobSplit& split, const std::vector<bool>& rejected) {
    if (options.pool_samples == 0) return;
    for (size_t i = 0; i < split.train.size(); ++i) {
      if (!rejected[i]) d.pool.emplace_back(split.train_batch[i], split.train[i]);
    }
    while (d.pool.size() > options.pool_samples) d.pool.pop_front();
  }

  // The job's batches give nothing to train: quarantined what is listed, the cursor moved
  // past them. Caller holds d.mu.
  absl::Status ConsumeUntrained(const std::string& id, DeviceMirror& d, const JobBatches& in,
                                const JobReport& report) {
    if (absl::Status s = Quarantine(id, d, in.quarantine); !s.ok()) return s;
    return SkipTo(id, d, report.last_sequence);
  }

  absl::Status NoUsableSamples(const JobReport& report) const {
    return absl::NotFoundError(absl::StrCat("no usable samples in batches ", report.first_sequence,
                                            "-", report.last_sequence));
  }

  // Quarantines every usable batch of the job too (with `why`; whole batches, so single
  // samples of them listed before are dropped from the list), and moves the cursor past.
  absl::Status QuarantineJob(const std::string& id, DeviceMirror& d, JobBatches& in,
                             JobReport& report, const absl::Status& why) {
    for (const QuarantineEntry& e : in.quarantine) {
      if (!e.whole_batch) report.quarantined_samples -= e.samples;
    }
    in.quarantine.erase(std::remove_if(in.quarantine.begin(), in.quarantine.end(),
                                       [](const QuarantineEntry& e) { return !e.whole_batch; }),
                        in.quarantine.end());
    for (const auto& [seq, count] : in.batches) {
      if (count > 0) QuarantineBatch(in, report, seq, count, why);
    }
    return ConsumeUntrained(id, d, in, report);
  }

  // A job that fails in training at the same cursor kMaxJobAttempts times in a row gives up
  // on its batches: the failure comes from what they hold, or no retry would help.
  absl::Status TrainingFailed(const std::string& id, DeviceMirror& d, JobBatches& in,
                              JobReport& report, const absl::Status& why) {
    if (d.failed_cursor != d.consumed) d.failed_attempts = 0;
    d.failed_cursor = d.consumed;
    if (++d.failed_attempts < kMaxJobAttempts) return why;
    d.failed_attempts = 0;
    const absl::Status reason =
        absl::Status(why.code(), absl::StrCat("the job failed ", kMaxJobAttempts,
                                              " times on these batches: ", why.message()));
    if (absl::Status s = QuarantineJob(id, d, in, report, reason); !s.ok()) return s;
    return absl::DataLossError(absl::StrCat("job of ", id, " on batches ", report.first_sequence,
                                            "-", report.last_sequence, ": ", reason.message(),
                                            "; batches quarantined, mirror unchanged"));
  }

  absl::StatusOr<JobReport> RunJob(const std::string& id, DeviceMirror& d) {
    if (absl::Status s = Load(id, d); !s.ok()) return s;
    JobReport report;
    report.device_id = id;
    report.base_version = d.version;
    report.new_version = d.version + 1;
    absl::StatusOr<JobBatches> in = ReadBatches(id, d, report);
    if (!in.ok()) return in.status();
    if (in->samples.empty()) {
      if (absl::Status s = ConsumeUntrained(id, d, *in, report); !s.ok()) return s;
      return NoUsableSamples(report);
    }
    if (absl::Status s = BuildHoldout(id, d); !s.ok()) return s;
    if (absl::Status s = BuildPool(id, d); !s.ok()) return s;
    JobSplit split = SplitJob(id, *in, report);
    if (split.train.empty()) {
      if (absl::Status s = ConsumeUntrained(id, d, *in, report); !s.ok()) return s;
      d.holdout = internal::JoinHoldout(d.holdout, split.fresh, options.guard.pool_capacity);
      d.PublishInfo();
      report.new_version = d.version;
      report.state_digest = d.digest;
      report.notes.push_back("every sample of the job is held out for the guard: nothing trained");
      return report;
    }
    try {
      return TrainAndShip(id, d, *in, split, report);
    } catch (const c10::Error& e) {
      return TrainingFailed(
          id, d, *in, report,
          absl::InternalError(absl::StrCat("job of ", id, ": ", e.what_without_backtrace())));
    }
  }

  // The round's cloud step on the job's training samples (cloud/train_round.h), then the
  // guard, then the commit. Caller holds d.mu.
  absl::StatusOr<JobReport> TrainAndShip(const std::string& id, DeviceMirror& d, JobBatches& in,
                                         JobSplit& split, JobReport& report) {
    absl::StatusOr<TrainedRound> round = TrainRound(
        [&]() -> absl::StatusOr<TrainedSet> {
          if (options.before_training) {
            if (absl::Status s = options.before_training(id); !s.ok()) return s;
          }
          if (d.pool.empty()) {
            return trainer->Train(id, d.mirror, split.train, d.replay.get(), d.version);
          }
          // The pool's samples follow the round's (a rejected index past the round's is a
          // pool sample, used before, and is dropped).
          std::vector<compress::UplinkSample> with_pool = split.train;
          for (const auto& [seq, sample] : d.pool) with_pool.push_back(sample);
          return trainer->Train(id, d.mirror, with_pool, d.replay.get(), d.version);
        },
        d.mirror, d.version, d.encoder);
    if (!round.ok()) return round.status();
    if (round->outcome == RoundOutcome::kFailed) {
      return TrainingFailed(
          id, d, in, report,
          absl::Status(round->why.code(), absl::StrCat("job of ", id, ": ", round->why.message())));
    }
    if (round->outcome == RoundOutcome::kNonFinite) {
      trainer->Forget(id);  // phi/psi may have been fitted to the same features
      if (absl::Status s = QuarantineJob(id, d, in, report, round->why); !s.ok()) return s;
      // The pool as a rebuild from the log would have it.
      d.holdout = internal::JoinHoldout(d.holdout, split.fresh, options.guard.pool_capacity);
      d.PublishInfo();
      return absl::DataLossError(absl::StrCat(
          "the job on batches ", report.first_sequence, "-", report.last_sequence, " of ", id, ": ",
          round->why.message(), "; batches quarantined, mirror unchanged"));
    }
    // Samples the learner could not use (a frame that does not decode): the job went on
    // without them.
    std::vector<bool> rejected(split.train.size(), false);
    size_t rejected_count = 0;
    for (const auto& [index, why] : round->job.rejected) {
      if (index >= split.train.size() || rejected[index]) continue;
      rejected[index] = true;
      ++rejected_count;
      in.quarantine.push_back(
          {split.train_batch[index], false, split.train[index].sample_id, 1, why.ToString()});
      ++report.quarantined_samples;
    }
    report.samples = static_cast<int64_t>(split.train.size() - rejected_count);
    if (round->outcome == RoundOutcome::kNothingUsable || report.samples <= 0) {
      if (absl::Status s = ConsumeUntrained(id, d, in, report); !s.ok()) return s;
      return NoUsableSamples(report);
    }
    d.failed_attempts = 0;
    const distill::JobStats& stats = round->job.stats;
    report.pool_samples = std::min<int64_t>(static_cast<int64_t>(d.pool.size()),
                                            stats.current_samples - report.samples);
    report.replay_samples = stats.replay_samples;
    report.steps = stats.steps;
    report.stopped_by_budget = stats.stopped_by_budget;
    report.train_seconds = stats.train_seconds;
    report.train_device = stats.device;
    report.notes = round->job.notes;
    if (!stats.terms.empty()) {
      report.loss_first = stats.terms.front().first;
      report.loss_last = stats.terms.front().last;
    }
    NewVersion& next = round->next;
    report.state_digest = next.digest;
    report.payload_bytes = next.update.stats.payload_bytes;
    report.bits_per_param = next.update.stats.bits_per_param;
    report.relative_error = next.update.stats.relative_error;
    report.budget_raised_to = next.budget_raised_to;

    // The guard: the pool (with this job's held-out samples) before and after the update
    // the device would apply.
    HoldoutPool pool;
    std::vector<std::string> after_answers;
    std::vector<double> after_scores;
    if (options.guard.enabled) {
      pool = internal::JoinHoldout(d.holdout, split.fresh, options.guard.pool_capacity);
      absl::StatusOr<GuardVerdict> verdict =
          guard->ScoreUpdate(d.version, d.mirror, pool, next.state, &after_answers, &after_scores);
      if (!verdict.ok()) return verdict.status();
      report.guard = *verdict;
    }
    JoinPool(d, split, rejected);
    if (!report.guard.ship) {
      if (options.report_withheld_state) {
        absl::StatusOr<std::string> state = model::EncodeSafetensors(next.state, {});
        if (!state.ok()) return state.status();
        report.withheld_state = *std::move(state);
      }
      return Withheld(id, d, in, split, std::move(pool), report);
    }

    if (absl::Status s = Quarantine(id, d, in.quarantine); !s.ok()) return s;
    // The trained samples join the replay buffer in the commit, so that whichever trainer
    // runs the device's next job replays them.
    std::vector<compress::UplinkSample> usable;
    usable.reserve(split.train.size());
    for (size_t i = 0; i < split.train.size(); ++i) {
      if (!rejected[i]) usable.push_back(std::move(split.train[i]));
    }
    distill::ReplayBuffer replay = *d.replay;
    replay.Add(usable);
    if (absl::Status s = CommitVersion(id, d, next, report.last_sequence, &replay); !s.ok()) {
      return s;
    }
    *d.replay = std::move(replay);
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
    (void)ReleaseConsumed(id, d);
    if (absl::Status s = PublishVersion(id, next); !s.ok()) return s;
    return report;
  }

  // The guard did not let the update through. A device whose current version agrees with the
  // teacher on what it answers now worse than the pretrained base, beyond the same margin,
  // goes back to the base. Caller holds d.mu.
  absl::StatusOr<JobReport> Withheld(const std::string& id, DeviceMirror& d, JobBatches& in,
                                     const JobSplit& split, HoldoutPool pool, JobReport& report) {
    if (absl::Status s = Quarantine(id, d, in.quarantine); !s.ok()) return s;
    bool restore = false;
    if (options.guard.restore_base && d.version > 0 && !pool.empty()) {
      absl::StatusOr<GuardVerdict> base = guard->ScoreBase(
          d.version,
          internal::NewestOf(pool, std::max(split.fresh.size(), options.guard.min_pool)));
      if (!base.ok()) return base.status();
      report.base_guard = *base;
      restore = base->decision == "helps";
    }
    absl::StatusOr<JobReport> withheld = Withhold(id, d, std::move(pool), split.train, report);
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
  auto impl = std::make_unique<Impl>(pair);
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
      internal::MirrorTrainer::Create(pair);
  if (!trainer.ok()) return trainer.status();
  impl->trainer = *std::move(trainer);
  impl->guard = std::make_unique<internal::GuardScorer>(impl->trainer.get(), &impl->options.guard);
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
    Impl::DeviceMirror* d = impl_->cache.Get(id);
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
  Impl::DeviceMirror* d = impl_->cache.Get(device_id);
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
  Impl::DeviceMirror* d = impl_->cache.Get(device_id);
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
  Impl::DeviceMirror* d = impl_->cache.Get(device_id);
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

absl::StatusOr<std::string> PerDeviceStrategy::MirrorState(const std::string& device_id) const {
  Impl::DeviceMirror* d = impl_->cache.Get(device_id);
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
  Impl::DeviceMirror* d = impl_->cache.Get(device_id);
  absl::MutexLock lock(&d->mu);
  if (d->loaded && (d->version != version || d->consumed != consumed)) {
    impl_->Evict(device_id, *d);
  }
}

size_t PerDeviceStrategy::ResidentMirrors() const { return impl_->cache.resident(); }

uint64_t PerDeviceStrategy::MirrorEvictions() const { return impl_->cache.evictions(); }

uint64_t PerDeviceStrategy::BaseDigest() const { return impl_->base_digest; }
uint64_t PerDeviceStrategy::BaseFingerprint() const { return impl_->trainer->base_fingerprint(); }
uint64_t PerDeviceStrategy::VisionFingerprint() const {
  return impl_->trainer->vision_fingerprint();
}
SampleSpec PerDeviceStrategy::Spec() const { return impl_->trainer->spec(); }

}  // namespace cdcca::cloud
