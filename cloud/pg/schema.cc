#include "cloud/pg/schema.h"

#include "absl/strings/str_cat.h"

namespace cdcca::cloud::pg {
namespace {

// Version 1. uint64 values that are hashes (fingerprints, digests) are stored bit-cast in
// bigint; sequences and versions are below 2^63 (the store refuses larger ones), so their
// order is bigint's.
constexpr char kSchemaV1[] = R"sql(
CREATE TABLE devices (
  device_id text PRIMARY KEY,
  token_sha256 bytea UNIQUE,
  model_fingerprint bigint NOT NULL,
  capabilities bytea NOT NULL,
  applied_version bigint NOT NULL DEFAULT 0,
  applied_digest bigint NOT NULL DEFAULT 0,
  in_sync boolean NOT NULL DEFAULT true,
  registered_at timestamptz NOT NULL DEFAULT now(),
  last_seen_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE samples (
  device_id text NOT NULL,
  sequence bigint NOT NULL CHECK (sequence > 0),
  sample_count integer NOT NULL,
  batch bytea NOT NULL,
  received_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (device_id, sequence)
);
CREATE TABLE mirror_states (
  device_id text PRIMARY KEY,
  version bigint NOT NULL,
  consumed_sequence bigint NOT NULL,
  state bytea NOT NULL,
  updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE updates (
  device_id text NOT NULL,
  snapshot boolean NOT NULL,
  base_version bigint NOT NULL,
  new_version bigint NOT NULL,
  state_digest bigint NOT NULL,
  sha256 bytea NOT NULL,
  payload bytea NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (device_id, snapshot, new_version),
  CHECK (snapshot = (base_version = new_version)),
  CHECK (base_version <= new_version)
);
CREATE TABLE jobs (
  device_id text PRIMARY KEY,
  due_at timestamptz,
  lease_owner text,
  lease_expires_at timestamptz,
  fencing_token bigint NOT NULL DEFAULT 0,
  CHECK ((lease_owner IS NULL) = (lease_expires_at IS NULL))
);
CREATE INDEX jobs_due ON jobs (due_at) WHERE due_at IS NOT NULL;
)sql";

// A device's mirror state (the trainable set, the encoder's residual, the replay buffer: mostly
// floats) is stored out of line without compression: compressing it (pglz, PostgreSQL's
// default) on every publication cost the tiny family's trainer a fifth of its jobs in the
// 50-device fault run (docs/ARCHITECTURE.md, "Programs": the replay buffer in the state).
constexpr char kSchemaV2[] = R"sql(
ALTER TABLE mirror_states ALTER COLUMN state SET STORAGE EXTERNAL;
)sql";

}  // namespace

const std::vector<Migration>& StoreMigrations() {
  static const std::vector<Migration>* const kMigrations = new std::vector<Migration>{
      {1, kSchemaV1},
      {2, kSchemaV2},
  };
  return *kMigrations;
}

absl::StatusOr<int> SchemaVersion(Connection& conn) {
  absl::StatusOr<Result> exists = conn.Exec("SELECT to_regclass('schema_version') IS NOT NULL");
  if (!exists.ok()) return exists.status();
  absl::StatusOr<bool> has_table = exists->Bool(0, 0);
  if (!has_table.ok()) return has_table.status();
  if (!*has_table) return 0;
  absl::StatusOr<Result> max = conn.Exec("SELECT coalesce(max(version), 0) FROM schema_version");
  if (!max.ok()) return max.status();
  absl::StatusOr<int64_t> version = max->Int64(0, 0);
  if (!version.ok()) return version.status();
  return static_cast<int>(*version);
}

absl::StatusOr<int> Migrate(Connection& conn, const std::vector<Migration>& migrations) {
  for (size_t i = 0; i < migrations.size(); ++i) {
    if (migrations[i].version != static_cast<int>(i) + 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "migration ", i, " has version ", migrations[i].version, ", expected ", i + 1));
    }
  }
  const int newest = static_cast<int>(migrations.size());
  while (true) {
    absl::StatusOr<Transaction> txn = Transaction::Begin(&conn);
    if (!txn.ok()) return txn.status();
    // Everything below runs under the lock, so the version read is the one this transaction
    // moves from, whatever other processes do meanwhile.
    if (absl::StatusOr<Result> r =
            conn.Exec("SELECT pg_advisory_xact_lock($1)", Params().Int64(kSchemaLockKey));
        !r.ok()) {
      return r.status();
    }
    if (absl::Status s = conn.ExecScript(
            "CREATE TABLE IF NOT EXISTS schema_version ("
            "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())");
        !s.ok()) {
      return s;
    }
    absl::StatusOr<int> current = SchemaVersion(conn);
    if (!current.ok()) return current.status();
    if (*current > newest) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the database's schema is at version ", *current, ", newer than this program's newest (",
          newest, "): run the program that wrote it"));
    }
    if (*current == newest) {
      if (absl::Status s = txn->Commit(); !s.ok()) return s;
      return newest;
    }
    const Migration& next = migrations[*current];
    if (absl::Status s = conn.ExecScript(next.sql); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("schema migration to version ", next.version,
                                                 " failed: ", s.message()));
    }
    if (absl::StatusOr<Result> r = conn.Exec("INSERT INTO schema_version (version) VALUES ($1)",
                                             Params().Int32(next.version));
        !r.ok()) {
      return r.status();
    }
    if (absl::Status s = txn->Commit(); !s.ok()) return s;
  }
}

absl::StatusOr<int> MigrateStore(Connection& conn) { return Migrate(conn, StoreMigrations()); }

}  // namespace cdcca::cloud::pg
