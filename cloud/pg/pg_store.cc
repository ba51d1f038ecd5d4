#include "cloud/pg/pg_store.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cloud/pg/schema.h"

namespace cdcca::cloud::pg {
namespace {

// File-local shorthands for the status plumbing of every call below.
#define PG_RETURN_IF_ERROR(expr)              \
  do {                                        \
    if (absl::Status _s = (expr); !_s.ok()) { \
      return _s;                              \
    }                                         \
  } while (false)
#define PG_CONCAT_INNER(a, b) a##b
#define PG_CONCAT(a, b) PG_CONCAT_INNER(a, b)
#define PG_ASSIGN_OR_RETURN(lhs, expr) \
  PG_ASSIGN_OR_RETURN_IMPL(PG_CONCAT(_or_, __LINE__), lhs, expr)
#define PG_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

constexpr uint64_t kMaxOrdered = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// Sequences and versions are compared in SQL as bigint, so they must fit one.
absl::Status CheckOrdered(uint64_t value, absl::string_view what) {
  if (value > kMaxOrdered) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", value, " is not below 2^63"));
  }
  return absl::OkStatus();
}

int64_t Ordered(uint64_t value) { return static_cast<int64_t>(value); }
int64_t BitCast(uint64_t value) { return static_cast<int64_t>(value); }
int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

// Samples in the device's ($1) stored batches past its mirror's cursor.
constexpr char kSamplesPastCursor[] =
    "coalesce((SELECT sum(sample_count) FROM samples WHERE device_id = $1 AND sequence > "
    "coalesce((SELECT consumed_sequence FROM mirror_states WHERE device_id = $1), 0)), 0)";

// A front's job trigger as one statement: the device's ($1) job row due now once `fresh`
// (a query of one row whose column fresh counts its new samples) reaches $first, else $first+1
// microseconds from now when $first+2 and any are new, or earlier if it already was due.
// Its parameters come from AddTriggerParams.
std::string JobTriggerSql(absl::string_view fresh, int first) {
  const std::string min = absl::StrCat("$", first), wait = absl::StrCat("$", first + 1),
                    waits = absl::StrCat("$", first + 2);
  return absl::StrCat("INSERT INTO jobs (device_id, due_at) SELECT $1, CASE WHEN fresh >= ", min,
                      " THEN now() ELSE now() + ", wait, " * interval '1 microsecond' END FROM (",
                      fresh, ") f WHERE f.fresh >= ", min, " OR (", waits,
                      " AND f.fresh > 0) ON CONFLICT (device_id) DO UPDATE SET due_at = "
                      "least(coalesce(jobs.due_at, excluded.due_at), excluded.due_at)");
}

void AddTriggerParams(Params& params, uint64_t min_samples, absl::Duration max_wait) {
  const bool waits = max_wait != absl::InfiniteDuration();
  params.Int64(static_cast<int64_t>(std::min<uint64_t>(min_samples, kMaxOrdered)))
      .Int64(waits ? Micros(max_wait) : 0)
      .Bool(waits);
}

std::string LeaseName(const JobLease& lease) {
  return absl::StrFormat("the lease of device %s's job by %s with fencing token %d",
                         lease.device_id, lease.owner, lease.fencing_token);
}

absl::StatusOr<store::v1::DeviceRecord> DeviceRow(const Result& r) {
  store::v1::DeviceRecord record;
  PG_ASSIGN_OR_RETURN(std::string id, r.Bytes(0, 0));
  PG_ASSIGN_OR_RETURN(int64_t fingerprint, r.Int64(0, 1));
  PG_ASSIGN_OR_RETURN(std::string capabilities, r.Bytes(0, 2));
  PG_ASSIGN_OR_RETURN(int64_t applied_version, r.Int64(0, 3));
  PG_ASSIGN_OR_RETURN(int64_t applied_digest, r.Int64(0, 4));
  PG_ASSIGN_OR_RETURN(bool in_sync, r.Bool(0, 5));
  PG_ASSIGN_OR_RETURN(absl::Time registered, r.Time(0, 6));
  PG_ASSIGN_OR_RETURN(absl::Time last_seen, r.Time(0, 7));
  record.set_device_id(id);
  record.set_model_fingerprint(static_cast<uint64_t>(fingerprint));
  if (!record.mutable_capabilities()->ParseFromString(capabilities)) {
    return absl::DataLossError(absl::StrCat("device ", id, ": stored capabilities do not parse"));
  }
  record.set_applied_version(static_cast<uint64_t>(applied_version));
  record.set_applied_digest(static_cast<uint64_t>(applied_digest));
  record.set_in_sync(in_sync);
  record.set_registered_unix_ms(absl::ToUnixMillis(registered));
  record.set_last_seen_unix_ms(absl::ToUnixMillis(last_seen));
  return record;
}

constexpr char kDeviceColumns[] =
    "device_id, model_fingerprint, capabilities, applied_version, applied_digest, in_sync, "
    "registered_at, last_seen_at";
constexpr char kPayloadColumns[] =
    "snapshot, base_version, new_version, state_digest, sha256, payload";

}  // namespace

absl::StatusOr<std::unique_ptr<PgStore>> PgStore::Open(const PgStoreOptions& options) {
  if (options.keep_per_device < 1) {
    return absl::InvalidArgumentError("keep_per_device must be at least 1");
  }
  PG_ASSIGN_OR_RETURN(std::unique_ptr<Connection> conn, Connection::Open(options.conninfo));
  PG_RETURN_IF_ERROR(MigrateStore(*conn).status());
  return std::unique_ptr<PgStore>(new PgStore(options, std::move(conn)));
}

absl::Status PgStore::ReconnectIfLost() {
  if (conn_->ok()) return absl::OkStatus();
  return conn_->Reset();
}

// ---- device registry -----------------------------------------------------------------------

absl::StatusOr<store::v1::DeviceRecord> PgStore::Register(const std::string& device_id,
                                                          uint64_t model_fingerprint,
                                                          const v1::Capabilities& capabilities) {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  // The update's WHERE leaves a device of another fingerprint untouched: no row returned.
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec(absl::StrCat("INSERT INTO devices (device_id, model_fingerprint, capabilities) "
                               "VALUES ($1, $2, $3) ON CONFLICT (device_id) DO UPDATE SET "
                               "capabilities = excluded.capabilities, last_seen_at = now() "
                               "WHERE devices.model_fingerprint = excluded.model_fingerprint "
                               "RETURNING ",
                               kDeviceColumns),
                  Params()
                      .Text(device_id)
                      .Int64(BitCast(model_fingerprint))
                      .Bytes(capabilities.SerializeAsString())));
  if (r.rows() == 0) {
    PG_ASSIGN_OR_RETURN(Result old, conn_->Exec("SELECT model_fingerprint FROM devices WHERE "
                                                "device_id = $1",
                                                Params().Text(device_id)));
    PG_ASSIGN_OR_RETURN(int64_t stored, old.Int64(0, 0));
    return absl::FailedPreconditionError(absl::StrFormat(
        "device %s registered before with model fingerprint %016x, now %016x: it runs a "
        "different base model",
        device_id, static_cast<uint64_t>(stored), model_fingerprint));
  }
  return DeviceRow(r);
}

absl::Status PgStore::SetApplied(const std::string& device_id, uint64_t version, uint64_t digest,
                                 bool in_sync) {
  PG_RETURN_IF_ERROR(CheckOrdered(version, "version"));
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec(
          "UPDATE devices SET applied_version = $2, "
          "applied_digest = $3, in_sync = $4, last_seen_at = "
          "now() WHERE device_id = $1",
          Params().Text(device_id).Int64(Ordered(version)).Int64(BitCast(digest)).Bool(in_sync)));
  if (r.affected() == 0) {
    return absl::NotFoundError(absl::StrCat("device ", device_id, " is not registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<store::v1::DeviceRecord> PgStore::GetDevice(const std::string& device_id) {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(Result r, conn_->Exec(absl::StrCat("SELECT ", kDeviceColumns,
                                                         " FROM devices WHERE device_id = $1"),
                                            Params().Text(device_id)));
  if (r.rows() == 0) {
    return absl::NotFoundError(absl::StrCat("device ", device_id, " is not registered"));
  }
  return DeviceRow(r);
}

absl::Status PgStore::SetTokenHash(const std::string& device_id, const std::string& token_sha256) {
  if (token_sha256.size() != 32) {
    return absl::InvalidArgumentError("a token hash is a 32-byte SHA-256");
  }
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  absl::StatusOr<Result> r =
      conn_->Exec("UPDATE devices SET token_sha256 = $2 WHERE device_id = $1",
                  Params().Text(device_id).Bytes(token_sha256));
  if (!r.ok()) {
    if (r.status().code() == absl::StatusCode::kAlreadyExists) {
      return absl::AlreadyExistsError(
          absl::StrCat("another device has the token given to device ", device_id));
    }
    return r.status();
  }
  if (r->affected() == 0) {
    return absl::NotFoundError(absl::StrCat("device ", device_id, " is not registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PgStore::DeviceForTokenHash(const std::string& token_sha256) {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(Result r, conn_->Exec("SELECT device_id FROM devices WHERE token_sha256 = $1",
                                            Params().Bytes(token_sha256)));
  if (r.rows() == 0) return absl::NotFoundError("no device has this token");
  return r.Bytes(0, 0);
}

// ---- sample log ----------------------------------------------------------------------------

absl::StatusOr<uint64_t> PgStore::HighestSequenceLocked(const std::string& device_id) {
  PG_ASSIGN_OR_RETURN(Result r, conn_->Exec("SELECT coalesce(max(sequence), 0) FROM samples "
                                            "WHERE device_id = $1",
                                            Params().Text(device_id)));
  PG_ASSIGN_OR_RETURN(int64_t highest, r.Int64(0, 0));
  return static_cast<uint64_t>(highest);
}

absl::StatusOr<uint64_t> PgStore::HighestSequence(const std::string& device_id) {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  return HighestSequenceLocked(device_id);
}

absl::StatusOr<AppendOutcome> PgStore::Append(const std::string& device_id,
                                              const v1::UplinkBatch& batch,
                                              const std::optional<AppendTrigger>& trigger) {
  if (batch.sequence() == 0) return absl::InvalidArgumentError("sequences start at 1");
  PG_RETURN_IF_ERROR(CheckOrdered(batch.sequence(), "sequence"));
  v1::UplinkBatch stored = batch;
  stored.clear_dropped();
  const std::string bytes = stored.SerializeAsString();
  // The quota as a bigint; 0 = none.
  const int64_t quota = Ordered(std::min(options_.max_device_bytes, kMaxOrdered));
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  // One statement, its own transaction: the batch is inserted only when it follows the
  // highest committed sequence (so no gap can be stored; Release never deletes the newest)
  // and fits the device's quota, and the call returns after its commit. A concurrent insert
  // of the same sequence makes it wait for that transaction; if that commits, this inserts
  // nothing. With a trigger, the job row's upsert rides in the same statement: it runs only
  // when the batch was inserted, and counts the new batch beside the committed ones past the
  // cursor (the statement's snapshot does not see its own insert).
  constexpr char kInsert[] =
      "INSERT INTO samples (device_id, sequence, sample_count, batch) "
      "SELECT $1, $2, $3, $4 WHERE $2 = 1 + coalesce((SELECT max(sequence) FROM "
      "samples WHERE device_id = $1), 0) AND ($5 = 0 OR octet_length($4) + "
      "coalesce((SELECT sum(octet_length(batch)) FROM samples WHERE device_id = "
      "$1), 0) <= $5) ON CONFLICT DO NOTHING RETURNING sequence, sample_count";
  Params params = Params()
                      .Text(device_id)
                      .Int64(Ordered(batch.sequence()))
                      .Int32(static_cast<int32_t>(batch.sample_count()))
                      .Bytes(bytes)
                      .Int64(quota);
  std::string query = kInsert;
  if (trigger.has_value()) {
    query = absl::StrCat("WITH stored AS (", kInsert, "), job AS (",
                         JobTriggerSql(absl::StrCat("SELECT s.sample_count + ", kSamplesPastCursor,
                                                    " AS fresh FROM stored s"),
                                       6),
                         ") SELECT sequence FROM stored");
    AddTriggerParams(params, trigger->min_samples, trigger->max_wait);
  }
  PG_ASSIGN_OR_RETURN(Result r, conn_->Exec(query, params));
  if (r.rows() == 1) return AppendOutcome{false, batch.sequence()};
  // Not inserted: a duplicate of a committed batch, a sequence that skips ahead, or a batch
  // past the quota. The highest sequence read here is committed, so a duplicate is durable
  // before it is reported.
  PG_ASSIGN_OR_RETURN(uint64_t highest, HighestSequenceLocked(device_id));
  if (batch.sequence() <= highest) return AppendOutcome{true, highest};
  if (batch.sequence() > highest + 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("device ", device_id, ": batch sequence ", batch.sequence(),
                     " skips ahead of the highest stored ", highest));
  }
  if (quota != 0) {
    PG_ASSIGN_OR_RETURN(
        Result held,
        conn_->Exec("SELECT coalesce(sum(octet_length(batch)), 0)::bigint FROM samples WHERE "
                    "device_id = $1",
                    Params().Text(device_id)));
    PG_ASSIGN_OR_RETURN(int64_t held_bytes, held.Int64(0, 0));
    if (held_bytes + static_cast<int64_t>(bytes.size()) > quota) {
      return absl::ResourceExhaustedError(
          absl::StrCat("device ", device_id, " has ", held_bytes,
                       " bytes in the sample log; batch ", batch.sequence(), " (", bytes.size(),
                       " bytes) would pass its quota of ", quota, " bytes"));
    }
  }
  // Its predecessor committed between the two statements: the device resends.
  return absl::AbortedError(absl::StrCat("device ", device_id, ": batch ", batch.sequence(),
                                         " raced its predecessor's commit; send it again"));
}

absl::StatusOr<std::vector<store::v1::SampleRecord>> PgStore::ReadBatches(
    const std::string& device_id, uint64_t after_sequence, int max_batches) {
  PG_RETURN_IF_ERROR(CheckOrdered(after_sequence, "sequence"));
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec(
          "SELECT sequence, batch, received_at FROM samples WHERE device_id = "
          "$1 AND sequence > $2 ORDER BY sequence LIMIT $3",
          Params().Text(device_id).Int64(Ordered(after_sequence)).Int64(std::max(max_batches, 0))));
  std::vector<store::v1::SampleRecord> records;
  records.reserve(r.rows());
  for (int i = 0; i < r.rows(); ++i) {
    PG_ASSIGN_OR_RETURN(int64_t sequence, r.Int64(i, 0));
    PG_ASSIGN_OR_RETURN(std::string bytes, r.Bytes(i, 1));
    PG_ASSIGN_OR_RETURN(absl::Time received, r.Time(i, 2));
    store::v1::SampleRecord& record = records.emplace_back();
    if (!record.mutable_batch()->ParseFromString(bytes)) {
      return absl::DataLossError(
          absl::StrCat("device ", device_id, ": stored batch ", sequence, " does not parse"));
    }
    record.set_device_id(device_id);
    record.set_received_unix_ms(absl::ToUnixMillis(received));
  }
  return records;
}

absl::StatusOr<uint64_t> PgStore::Release(const std::string& device_id, uint64_t through_sequence) {
  PG_RETURN_IF_ERROR(CheckOrdered(through_sequence, "sequence"));
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  // The newest row stays: Append and HighestSequence read the highest sequence from it.
  PG_ASSIGN_OR_RETURN(
      Result r, conn_->Exec("DELETE FROM samples WHERE device_id = $1 AND sequence <= $2 AND "
                            "sequence < (SELECT max(sequence) FROM samples WHERE device_id = $1)",
                            Params().Text(device_id).Int64(Ordered(through_sequence))));
  return static_cast<uint64_t>(r.affected());
}

absl::StatusOr<uint64_t> PgStore::SampleCount(const std::string& device_id, uint64_t from_sequence,
                                              uint64_t to_sequence) {
  PG_RETURN_IF_ERROR(CheckOrdered(from_sequence, "sequence"));
  to_sequence = std::min(to_sequence, kMaxOrdered);
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec(
          "SELECT coalesce(sum(sample_count), 0)::bigint FROM "
          "samples WHERE device_id = $1 AND sequence BETWEEN "
          "$2 AND $3",
          Params().Text(device_id).Int64(Ordered(from_sequence)).Int64(Ordered(to_sequence))));
  PG_ASSIGN_OR_RETURN(int64_t count, r.Int64(0, 0));
  return static_cast<uint64_t>(count);
}

// ---- mirrors and updates -------------------------------------------------------------------

absl::StatusOr<MirrorState> PgStore::LoadMirror(const std::string& device_id) {
  return ReadMirror(device_id, /*with_state=*/true);
}

absl::StatusOr<MirrorState> PgStore::MirrorCursor(const std::string& device_id) {
  return ReadMirror(device_id, /*with_state=*/false);
}

absl::StatusOr<MirrorState> PgStore::ReadMirror(const std::string& device_id, bool with_state) {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(Result r,
                      conn_->Exec(with_state ? "SELECT version, consumed_sequence, state FROM "
                                               "mirror_states WHERE device_id = $1"
                                             : "SELECT version, consumed_sequence FROM "
                                               "mirror_states WHERE device_id = $1",
                                  Params().Text(device_id)));
  if (r.rows() == 0) {
    return absl::NotFoundError(absl::StrCat("no mirror published for device ", device_id));
  }
  MirrorState mirror;
  PG_ASSIGN_OR_RETURN(int64_t version, r.Int64(0, 0));
  PG_ASSIGN_OR_RETURN(int64_t consumed, r.Int64(0, 1));
  if (with_state) {
    PG_ASSIGN_OR_RETURN(mirror.state, r.Bytes(0, 2));
  }
  mirror.version = static_cast<uint64_t>(version);
  mirror.consumed_sequence = static_cast<uint64_t>(consumed);
  return mirror;
}

absl::StatusOr<uint64_t> PgStore::DigestOf(const std::string& device_id, uint64_t version) {
  PG_RETURN_IF_ERROR(CheckOrdered(version, "version"));
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(Result r, conn_->Exec("SELECT state_digest FROM updates WHERE device_id = "
                                            "$1 AND new_version = $2 LIMIT 1",
                                            Params().Text(device_id).Int64(Ordered(version))));
  if (r.rows() == 0) {
    return absl::NotFoundError(
        absl::StrCat("no update or snapshot of version ", version, " of ", device_id));
  }
  PG_ASSIGN_OR_RETURN(int64_t digest, r.Int64(0, 0));
  return static_cast<uint64_t>(digest);
}

absl::StatusOr<uint64_t> PgStore::DeviceCount() {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(Result r, conn_->Exec("SELECT count(*) FROM devices"));
  PG_ASSIGN_OR_RETURN(int64_t n, r.Int64(0, 0));
  return static_cast<uint64_t>(n);
}

absl::StatusOr<StoredPayload> PgStore::PayloadRow(const Result& r, int row) {
  StoredPayload p;
  PG_ASSIGN_OR_RETURN(p.snapshot, r.Bool(row, 0));
  PG_ASSIGN_OR_RETURN(int64_t base, r.Int64(row, 1));
  PG_ASSIGN_OR_RETURN(int64_t version, r.Int64(row, 2));
  PG_ASSIGN_OR_RETURN(int64_t digest, r.Int64(row, 3));
  PG_ASSIGN_OR_RETURN(p.sha256, r.Bytes(row, 4));
  PG_ASSIGN_OR_RETURN(p.payload, r.Bytes(row, 5));
  p.base_version = static_cast<uint64_t>(base);
  p.new_version = static_cast<uint64_t>(version);
  p.state_digest = static_cast<uint64_t>(digest);
  return p;
}

absl::StatusOr<uint64_t> PgStore::LatestVersionLocked(const std::string& device_id) {
  PG_ASSIGN_OR_RETURN(Result r, conn_->Exec("SELECT coalesce(max(new_version), 0) FROM updates "
                                            "WHERE device_id = $1",
                                            Params().Text(device_id)));
  PG_ASSIGN_OR_RETURN(int64_t latest, r.Int64(0, 0));
  return static_cast<uint64_t>(latest);
}

absl::StatusOr<uint64_t> PgStore::LatestVersion(const std::string& device_id) {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  return LatestVersionLocked(device_id);
}

absl::StatusOr<StoredPayload> PgStore::UpdateAfter(const std::string& device_id,
                                                   uint64_t base_version) {
  PG_RETURN_IF_ERROR(CheckOrdered(base_version, "version"));
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  // One statement, so one snapshot of the table: the newest version and the update on top
  // of base_version agree. Every device polls with it, most finding nothing newer: one round
  // trip, no transaction of its own.
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec(absl::StrCat("WITH latest AS (SELECT coalesce(max(new_version), 0) AS v FROM "
                               "updates WHERE device_id = $1) SELECT u.*, latest.v FROM latest "
                               "LEFT JOIN LATERAL (SELECT ",
                               kPayloadColumns,
                               " FROM updates WHERE device_id = $1 AND NOT snapshot AND "
                               "base_version = $2 AND $2 < latest.v ORDER BY new_version LIMIT 1) "
                               "u ON true"),
                  Params().Text(device_id).Int64(Ordered(base_version))));
  PG_ASSIGN_OR_RETURN(int64_t latest_signed, r.Int64(0, 6));
  const uint64_t latest = static_cast<uint64_t>(latest_signed);
  if (base_version == latest) {
    return absl::NotFoundError(absl::StrCat("no update newer than version ", base_version));
  }
  if (base_version > latest) {
    return absl::FailedPreconditionError(absl::StrCat("device reports version ", base_version,
                                                      " but the cloud's newest is ", latest,
                                                      "; fetch a snapshot to resync"));
  }
  if (r.IsNull(0, 1)) {
    return absl::FailedPreconditionError(
        absl::StrCat("no stored update applies on top of version ", base_version,
                     " (too old or unknown); fetch a snapshot to resync"));
  }
  return PayloadRow(r, 0);
}

absl::StatusOr<StoredPayload> PgStore::Snapshot(const std::string& device_id, uint64_t version) {
  PG_RETURN_IF_ERROR(CheckOrdered(version, "version"));
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec(absl::StrCat("SELECT ", kPayloadColumns,
                               " FROM updates WHERE device_id = $1 AND snapshot AND ($2 = 0 OR "
                               "new_version = $2) ORDER BY new_version DESC LIMIT 1"),
                  Params().Text(device_id).Int64(Ordered(version))));
  if (r.rows() == 0) {
    return absl::NotFoundError(
        version == 0 ? absl::StrCat("no snapshot for device ", device_id)
                     : absl::StrCat("no snapshot of version ", version, " for device ", device_id));
  }
  return PayloadRow(r, 0);
}

// ---- job queue -----------------------------------------------------------------------------

absl::Status PgStore::ScheduleJob(const std::string& device_id, absl::Time due_at) {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  return conn_
      ->Exec(
          "INSERT INTO jobs (device_id, due_at) VALUES ($1, $2) ON CONFLICT (device_id) DO "
          "UPDATE SET due_at = least(coalesce(jobs.due_at, excluded.due_at), excluded.due_at)",
          Params().Text(device_id).Time(due_at))
      .status();
}

absl::Status PgStore::TriggerJob(const std::string& device_id, uint64_t min_samples,
                                 absl::Duration max_wait) {
  Params params = Params().Text(device_id);
  AddTriggerParams(params, min_samples, max_wait);
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  return conn_
      ->Exec(JobTriggerSql(absl::StrCat("SELECT ", kSamplesPastCursor, " AS fresh"), 2), params)
      .status();
}

absl::StatusOr<std::optional<JobLease>> PgStore::LeaseJob(const std::string& owner,
                                                          absl::Duration lease) {
  if (lease <= absl::ZeroDuration()) return absl::InvalidArgumentError("a lease must be positive");
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  // SKIP LOCKED: a row another trainer is leasing (or publishing) is passed over, never
  // waited for; the lock is re-checked against the row's newest version, so a row leased
  // meanwhile is not taken.
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec("UPDATE jobs SET lease_owner = $1, lease_expires_at = clock_timestamp() + $2 "
                  "* interval '1 microsecond', fencing_token = fencing_token + 1 "
                  "WHERE device_id = (SELECT device_id FROM jobs WHERE due_at <= now() AND "
                  "(lease_expires_at IS NULL OR lease_expires_at <= clock_timestamp()) "
                  "ORDER BY due_at LIMIT 1 FOR UPDATE SKIP LOCKED) "
                  "RETURNING device_id, fencing_token, lease_expires_at, (extract(epoch FROM "
                  "clock_timestamp() - due_at) * 1000000)::bigint",
                  Params().Text(owner).Int64(Micros(lease))));
  if (r.rows() == 0) return std::optional<JobLease>();
  JobLease job;
  job.owner = owner;
  PG_ASSIGN_OR_RETURN(job.device_id, r.Bytes(0, 0));
  PG_ASSIGN_OR_RETURN(job.fencing_token, r.Int64(0, 1));
  PG_ASSIGN_OR_RETURN(job.expires_at, r.Time(0, 2));
  PG_ASSIGN_OR_RETURN(int64_t waited_us, r.Int64(0, 3));
  job.waited = absl::Microseconds(std::max<int64_t>(0, waited_us));
  return std::optional<JobLease>(std::move(job));
}

absl::StatusOr<std::optional<JobLease>> PgStore::LeaseDeviceJob(const std::string& device_id,
                                                                const std::string& owner,
                                                                absl::Duration lease) {
  if (lease <= absl::ZeroDuration()) return absl::InvalidArgumentError("a lease must be positive");
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  // The device's job row, not due unless it was: the lease is on the row, not on due work.
  PG_RETURN_IF_ERROR(conn_
                         ->Exec("INSERT INTO jobs (device_id) VALUES ($1) ON CONFLICT DO NOTHING",
                                Params().Text(device_id))
                         .status());
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec("UPDATE jobs SET lease_owner = $2, lease_expires_at = clock_timestamp() + $3 "
                  "* interval '1 microsecond', fencing_token = fencing_token + 1 "
                  "WHERE device_id = $1 AND (lease_expires_at IS NULL OR lease_expires_at <= "
                  "clock_timestamp()) RETURNING fencing_token, lease_expires_at",
                  Params().Text(device_id).Text(owner).Int64(Micros(lease))));
  if (r.rows() == 0) return std::optional<JobLease>();
  JobLease job;
  job.device_id = device_id;
  job.owner = owner;
  PG_ASSIGN_OR_RETURN(job.fencing_token, r.Int64(0, 0));
  PG_ASSIGN_OR_RETURN(job.expires_at, r.Time(0, 1));
  return std::optional<JobLease>(std::move(job));
}

absl::Status PgStore::Heartbeat(JobLease* lease, absl::Duration lease_duration) {
  if (lease_duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("a lease must be positive");
  }
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec("UPDATE jobs SET lease_expires_at = clock_timestamp() + $4 * interval "
                  "'1 microsecond' WHERE device_id = $1 AND lease_owner = $2 AND fencing_token = "
                  "$3 AND lease_expires_at > clock_timestamp() RETURNING lease_expires_at",
                  Params()
                      .Text(lease->device_id)
                      .Text(lease->owner)
                      .Int64(lease->fencing_token)
                      .Int64(Micros(lease_duration))));
  if (r.rows() == 0) {
    return absl::FailedPreconditionError(absl::StrCat(LeaseName(*lease), " is no longer held"));
  }
  PG_ASSIGN_OR_RETURN(lease->expires_at, r.Time(0, 0));
  return absl::OkStatus();
}

absl::Status PgStore::ReleaseLease(const JobLease& lease, absl::Time due_at) {
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(
      Result r,
      conn_->Exec("UPDATE jobs SET lease_owner = NULL, lease_expires_at = NULL, due_at = CASE "
                  "WHEN NOT $5 THEN $4::timestamptz WHEN EXISTS (SELECT 1 FROM samples WHERE "
                  "samples.device_id = $1 AND sequence > coalesce((SELECT consumed_sequence FROM "
                  "mirror_states WHERE mirror_states.device_id = $1), 0)) THEN now() ELSE NULL "
                  "END "
                  "WHERE device_id = $1 AND lease_owner = $2 AND fencing_token = $3 AND "
                  "lease_expires_at > clock_timestamp()",
                  Params()
                      .Text(lease.device_id)
                      .Text(lease.owner)
                      .Int64(lease.fencing_token)
                      .Time(due_at == absl::InfiniteFuture() ? absl::UnixEpoch() : due_at)
                      .Bool(due_at == absl::InfiniteFuture())));
  if (r.affected() == 0) {
    return absl::FailedPreconditionError(absl::StrCat(LeaseName(lease), " is no longer held"));
  }
  return absl::OkStatus();
}

absl::Status PgStore::LockHeldLease(const JobLease& lease) {
  PG_ASSIGN_OR_RETURN(Result r,
                      conn_->Exec("SELECT lease_owner, fencing_token, lease_expires_at > "
                                  "clock_timestamp() FROM jobs WHERE device_id = $1 FOR UPDATE",
                                  Params().Text(lease.device_id)));
  if (r.rows() == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(LeaseName(lease), " is not held: the device has no job"));
  }
  PG_ASSIGN_OR_RETURN(std::string owner, r.Bytes(0, 0));
  PG_ASSIGN_OR_RETURN(int64_t token, r.Int64(0, 1));
  PG_ASSIGN_OR_RETURN(bool live, r.Bool(0, 2));
  if (r.IsNull(0, 0) || owner != lease.owner || token != lease.fencing_token || !live) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s is no longer held (the job's fencing token is %d, its lease %s)", LeaseName(lease),
        token,
        r.IsNull(0, 0) ? "released"
                       : (live ? absl::StrCat("held by ", owner) : std::string("expired"))));
  }
  return absl::OkStatus();
}

absl::Status PgStore::Publish(const JobLease& lease, const Publication& p) {
  const uint64_t new_version = p.mirror.version;
  PG_RETURN_IF_ERROR(CheckOrdered(new_version, "version"));
  PG_RETURN_IF_ERROR(CheckOrdered(p.mirror.consumed_sequence, "sequence"));
  if (p.update_payload.has_value() ? new_version <= p.base_version
                                   : new_version != p.base_version) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a publication ", p.update_payload.has_value() ? "with" : "without", " an update from ",
        "version ", p.base_version, " cannot make version ", new_version));
  }
  absl::MutexLock lock(&mu_);
  PG_RETURN_IF_ERROR(ReconnectIfLost());
  PG_ASSIGN_OR_RETURN(Transaction txn, Transaction::Begin(conn_.get()));
  // The job row stays locked until the commit: no other trainer can lease it meanwhile.
  PG_RETURN_IF_ERROR(LockHeldLease(lease));
  PG_ASSIGN_OR_RETURN(Result mirror, conn_->Exec("SELECT version FROM mirror_states WHERE "
                                                 "device_id = $1",
                                                 Params().Text(lease.device_id)));
  int64_t stored_version = 0;
  if (mirror.rows() > 0) {
    PG_ASSIGN_OR_RETURN(stored_version, mirror.Int64(0, 0));
  }
  if (static_cast<uint64_t>(stored_version) != p.base_version) {
    return absl::FailedPreconditionError(
        absl::StrCat("device ", lease.device_id, ": the publication builds on version ",
                     p.base_version, " but the stored mirror is at version ", stored_version));
  }
  PG_RETURN_IF_ERROR(
      conn_
          ->Exec("INSERT INTO mirror_states (device_id, version, consumed_sequence, state) "
                 "VALUES ($1, $2, $3, $4) ON CONFLICT (device_id) DO UPDATE SET version = "
                 "excluded.version, consumed_sequence = excluded.consumed_sequence, state = "
                 "excluded.state, updated_at = now()",
                 Params()
                     .Text(lease.device_id)
                     .Int64(Ordered(new_version))
                     .Int64(Ordered(p.mirror.consumed_sequence))
                     .Bytes(p.mirror.state))
          .status());
  constexpr char kInsertPayload[] =
      "INSERT INTO updates (device_id, snapshot, base_version, new_version, state_digest, "
      "sha256, payload) VALUES ($1, $2, $3, $4, $5, sha256($6), $6)";
  if (p.update_payload.has_value()) {
    PG_RETURN_IF_ERROR(conn_
                           ->Exec(kInsertPayload, Params()
                                                      .Text(lease.device_id)
                                                      .Bool(false)
                                                      .Int64(Ordered(p.base_version))
                                                      .Int64(Ordered(new_version))
                                                      .Int64(BitCast(p.state_digest))
                                                      .Bytes(*p.update_payload))
                           .status());
  }
  if (p.snapshot_payload.has_value()) {
    PG_RETURN_IF_ERROR(conn_
                           ->Exec(kInsertPayload, Params()
                                                      .Text(lease.device_id)
                                                      .Bool(true)
                                                      .Int64(Ordered(new_version))
                                                      .Int64(Ordered(new_version))
                                                      .Int64(BitCast(p.state_digest))
                                                      .Bytes(*p.snapshot_payload))
                           .status());
  }
  PG_RETURN_IF_ERROR(
      conn_
          ->Exec("DELETE FROM updates WHERE device_id = $1 AND (snapshot, new_version) IN "
                 "(SELECT snapshot, new_version FROM (SELECT snapshot, new_version, "
                 "row_number() OVER (PARTITION BY snapshot ORDER BY new_version DESC) AS rank "
                 "FROM updates WHERE device_id = $1) ranked WHERE rank > $2)",
                 Params().Text(lease.device_id).Int64(options_.keep_per_device))
          .status());
  // The job ends; it stays due while samples beyond what it consumed are stored, but from
  // now, behind every device that was due before: a device whose samples never stop would
  // otherwise keep its first due time and a trainer to itself while others wait. A batch
  // committed after this statement's snapshot carries its front's trigger (Append's upsert
  // of this row, which waits for this commit), so no batch is left without a due job.
  PG_RETURN_IF_ERROR(
      conn_
          ->Exec("UPDATE jobs SET lease_owner = NULL, lease_expires_at = NULL, due_at = CASE "
                 "WHEN EXISTS (SELECT 1 FROM samples WHERE device_id = $1 AND sequence > $2) "
                 "THEN now() ELSE NULL END WHERE device_id = $1",
                 Params().Text(lease.device_id).Int64(Ordered(p.mirror.consumed_sequence)))
          .status());
  return txn.Commit();
}

#undef PG_ASSIGN_OR_RETURN_IMPL
#undef PG_ASSIGN_OR_RETURN
#undef PG_CONCAT
#undef PG_CONCAT_INNER
#undef PG_RETURN_IF_ERROR

}  // namespace cdcca::cloud::pg
