// The PostgreSQL store's schema, created and migrated forward by the program itself.
//
// The schema has a version: the highest row of table `schema_version`. Migrations form an
// ordered list (version 1, 2, ...); each is applied in a transaction of its own together
// with its schema_version row, so a database is always at exactly one version. Every such
// transaction first takes the advisory lock kSchemaLockKey (pg_advisory_xact_lock) and
// re-reads the version under it, so processes that start at once against one database
// apply each migration exactly once and all end at the newest version.
#ifndef CDCCA_CLOUD_PG_SCHEMA_H_
#define CDCCA_CLOUD_PG_SCHEMA_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "cloud/pg/connection.h"

namespace cdcca::cloud::pg {

struct Migration {
  int version;      // 1, 2, ... contiguous
  const char* sql;  // statements without values; run as one script
};

// Key of the advisory lock migrations take (ASCII "cdccaSCH").
inline constexpr int64_t kSchemaLockKey = 0x6364636361534348;

// The store's migrations, oldest first.
const std::vector<Migration>& StoreMigrations();

// The database's schema version; 0 when it has no schema_version table yet.
absl::StatusOr<int> SchemaVersion(Connection& conn);

// Applies every migration of `migrations` newer than the database's version, each in its
// own transaction, and returns the version reached (the last migration's). The database
// is left at the version of the last migration that committed when one fails, and its error
// is returned. FAILED_PRECONDITION when the database's version is newer than the newest
// of `migrations` (written by a newer program) or `migrations` are not numbered 1, 2, ...
absl::StatusOr<int> Migrate(Connection& conn, const std::vector<Migration>& migrations);

// Migrate(conn, StoreMigrations()).
absl::StatusOr<int> MigrateStore(Connection& conn);

}  // namespace cdcca::cloud::pg

#endif  // CDCCA_CLOUD_PG_SCHEMA_H_
