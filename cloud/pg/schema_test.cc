// The libpq layer and the schema's migrations, against a real PostgreSQL server.
#include "cloud/pg/schema.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "cloud/pg/connection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::cloud::pg {
namespace {

using ::cdcca::testing::IsOkAndHolds;
using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

class PgSchemaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(conninfo_, testing::CreateSharedPostgresDatabase());
  }

  std::unique_ptr<Connection> Connect() {
    absl::StatusOr<std::unique_ptr<Connection>> conn = Connection::Open(conninfo_);
    EXPECT_TRUE(conn.ok()) << conn.status();
    return conn.ok() ? std::move(*conn) : nullptr;
  }

  int64_t Count(Connection& conn, const std::string& sql) {
    absl::StatusOr<Result> r = conn.Exec(sql);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return -1;
    absl::StatusOr<int64_t> n = r->Int64(0, 0);
    return n.ok() ? *n : -1;
  }

  std::string conninfo_;
};

TEST_F(PgSchemaTest, BytesRoundTripInBinaryWithEveryByteValue) {
  std::unique_ptr<Connection> conn = Connect();
  ASSERT_NE(conn, nullptr);
  std::string bytes;
  for (int i = 0; i < 3 * 256; ++i) bytes.push_back(static_cast<char>(i % 256));
  ASSERT_OK_AND_ASSIGN(Result r,
                       conn->Exec("SELECT $1::bytea, length($1), $2::bigint, $3::text",
                                  Params().Bytes(bytes).Int64(-5).Text("it's; DROP TABLE x")));
  EXPECT_THAT(r.Bytes(0, 0), IsOkAndHolds(bytes));
  EXPECT_THAT(r.Int64(0, 1), IsOkAndHolds(3 * 256));
  EXPECT_THAT(r.Int64(0, 2), IsOkAndHolds(-5));
  EXPECT_THAT(r.Bytes(0, 3), IsOkAndHolds("it's; DROP TABLE x"));
  // A column read as the wrong type is an error, not a misread value.
  EXPECT_THAT(r.Int64(0, 0), StatusIs(absl::StatusCode::kInternal));
}

TEST_F(PgSchemaTest, ErrorsCarryTheServersMessageAndCode) {
  std::unique_ptr<Connection> conn = Connect();
  ASSERT_NE(conn, nullptr);
  ASSERT_OK(conn->ExecScript("CREATE TABLE t (k integer PRIMARY KEY)"));
  ASSERT_OK(conn->Exec("INSERT INTO t VALUES ($1)", Params().Int32(1)).status());
  EXPECT_THAT(conn->Exec("INSERT INTO t VALUES ($1)", Params().Int32(1)),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("duplicate key")));
  EXPECT_THAT(conn->Exec("SELEC 1"), StatusIs(absl::StatusCode::kInternal, HasSubstr("42601")));
  EXPECT_THAT(Connection::Open("host=127.0.0.1 port=1 connect_timeout=2"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot connect")));
}

TEST_F(PgSchemaTest, TransactionRollsBackUnlessCommitted) {
  std::unique_ptr<Connection> conn = Connect();
  ASSERT_NE(conn, nullptr);
  ASSERT_OK(conn->ExecScript("CREATE TABLE t (k integer)"));
  {
    ASSERT_OK_AND_ASSIGN(Transaction txn, Transaction::Begin(conn.get()));
    ASSERT_OK(conn->Exec("INSERT INTO t VALUES (1)").status());
  }  // dropped: rolled back
  EXPECT_EQ(Count(*conn, "SELECT count(*) FROM t"), 0);
  {
    ASSERT_OK_AND_ASSIGN(Transaction txn, Transaction::Begin(conn.get()));
    ASSERT_OK(conn->Exec("INSERT INTO t VALUES (2)").status());
    ASSERT_OK(txn.Commit());
  }
  EXPECT_EQ(Count(*conn, "SELECT count(*) FROM t"), 1);
  {
    // A statement that failed aborts the transaction: COMMIT does not report success.
    ASSERT_OK_AND_ASSIGN(Transaction txn, Transaction::Begin(conn.get()));
    ASSERT_OK(conn->Exec("INSERT INTO t VALUES (3)").status());
    EXPECT_FALSE(conn->Exec("SELECT 1/0").ok());
    EXPECT_THAT(txn.Commit(), StatusIs(absl::StatusCode::kAborted));
  }
  EXPECT_EQ(Count(*conn, "SELECT count(*) FROM t"), 1);
}

// A server that stops under a session: the session's next statement is UNAVAILABLE (the
// outcome of anything in flight unknown), and a new connection finds every commit.
TEST_F(PgSchemaTest, AServerRestartEndsSessionsAndKeepsCommits) {
  std::unique_ptr<Connection> conn = Connect();
  ASSERT_NE(conn, nullptr);
  ASSERT_OK(conn->ExecScript("CREATE TABLE t (k integer)"));
  ASSERT_OK(conn->Exec("INSERT INTO t VALUES (1)").status());
  ASSERT_OK((*testing::SharedPostgresServer())->Restart());
  EXPECT_THAT(conn->Exec("SELECT count(*) FROM t"), StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_FALSE(conn->ok());
  std::unique_ptr<Connection> fresh = Connect();
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(Count(*fresh, "SELECT count(*) FROM t"), 1);
}

// A server of its own with a setting of the caller's, kept across a restart; a setting that
// is not name=value is refused before anything starts.
TEST(PgServerTest, AServerRunsWithTheSettingsItIsGivenAcrossARestart) {
  EXPECT_THAT(testing::PostgresServer::Start(absl::Seconds(60), {"shared_buffers"}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<testing::PostgresServer> server,
                       testing::PostgresServer::Start(absl::Seconds(60), {"work_mem=7MB"}));
  for (int start = 0; start < 2; ++start) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Connection> conn, Connection::Open(server->ConnInfo()));
    ASSERT_OK_AND_ASSIGN(Result r, conn->Exec("SHOW work_mem"));
    EXPECT_THAT(r.Bytes(0, 0), IsOkAndHolds("7MB"));
    if (start == 0) ASSERT_OK(server->Restart());
  }
}

TEST_F(PgSchemaTest, MigrationIsIdempotent) {
  std::unique_ptr<Connection> conn = Connect();
  ASSERT_NE(conn, nullptr);
  EXPECT_THAT(SchemaVersion(*conn), IsOkAndHolds(0));
  const int newest = static_cast<int>(StoreMigrations().size());
  EXPECT_THAT(MigrateStore(*conn), IsOkAndHolds(newest));
  EXPECT_THAT(MigrateStore(*conn), IsOkAndHolds(newest));
  EXPECT_THAT(SchemaVersion(*conn), IsOkAndHolds(newest));
  EXPECT_EQ(Count(*conn, "SELECT count(*) FROM schema_version"), newest);
  for (const char* table : {"devices", "samples", "mirror_states", "updates", "jobs"}) {
    EXPECT_EQ(Count(*conn, std::string("SELECT count(*) FROM ") + table), 0) << table;
  }
  // Version 2: mirror states out of line and uncompressed.
  EXPECT_EQ(Count(*conn,
                  "SELECT count(*) FROM pg_attribute WHERE attrelid = 'mirror_states'::regclass "
                  "AND attname = 'state' AND attstorage = 'e'"),
            1);
}

// Each process that starts runs Migrate; a slow first migration widens the window in which
// they all read version 0. Without the advisory lock the second CREATE TABLE fails.
TEST_F(PgSchemaTest, ConcurrentMigrationsApplyEachMigrationOnce) {
  const std::vector<Migration> migrations = {
      {1, "CREATE TABLE a (k integer); SELECT pg_sleep(0.3);"},
      {2, "CREATE TABLE b (k integer); INSERT INTO b VALUES (1);"},
  };
  constexpr int kProcesses = 4;
  std::vector<std::unique_ptr<Connection>> conns;
  for (int i = 0; i < kProcesses; ++i) {
    conns.push_back(Connect());
    ASSERT_NE(conns.back(), nullptr);
  }
  absl::Notification go;
  std::vector<absl::StatusOr<int>> results(kProcesses, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kProcesses; ++i) {
    threads.emplace_back([&, i] {
      go.WaitForNotification();
      results[i] = Migrate(*conns[i], migrations);
    });
  }
  go.Notify();
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kProcesses; ++i) EXPECT_THAT(results[i], IsOkAndHolds(2)) << i;
  EXPECT_EQ(Count(*conns[0], "SELECT count(*) FROM schema_version"), 2);
  EXPECT_EQ(Count(*conns[0], "SELECT count(*) FROM b"), 1);

  // The same with the store's own schema on a fresh database.
  ASSERT_OK_AND_ASSIGN(conninfo_, testing::CreateSharedPostgresDatabase());
  conns.clear();
  for (int i = 0; i < kProcesses; ++i) {
    conns.push_back(Connect());
    ASSERT_NE(conns.back(), nullptr);
  }
  absl::Notification go_store;
  threads.clear();
  for (int i = 0; i < kProcesses; ++i) {
    threads.emplace_back([&, i] {
      go_store.WaitForNotification();
      results[i] = MigrateStore(*conns[i]);
    });
  }
  go_store.Notify();
  for (std::thread& t : threads) t.join();
  const int newest = static_cast<int>(StoreMigrations().size());
  for (int i = 0; i < kProcesses; ++i) EXPECT_THAT(results[i], IsOkAndHolds(newest)) << i;
  EXPECT_EQ(Count(*conns[0], "SELECT count(*) FROM schema_version"), newest);
}

TEST_F(PgSchemaTest, FailedMigrationLeavesThePreviousVersionWhole) {
  std::unique_ptr<Connection> conn = Connect();
  ASSERT_NE(conn, nullptr);
  const std::vector<Migration> migrations = {
      {1, "CREATE TABLE a (k integer);"},
      {2, "CREATE TABLE b (k integer); SELECT no_such_function();"},
  };
  EXPECT_THAT(Migrate(*conn, migrations),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("migration to version 2")));
  EXPECT_THAT(SchemaVersion(*conn), IsOkAndHolds(1));
  EXPECT_EQ(Count(*conn, "SELECT count(*) FROM pg_tables WHERE tablename = 'b'"), 0);
  EXPECT_EQ(Count(*conn, "SELECT count(*) FROM pg_tables WHERE tablename = 'a'"), 1);
}

TEST_F(PgSchemaTest, RefusesASchemaNewerThanTheProgram) {
  std::unique_ptr<Connection> conn = Connect();
  ASSERT_NE(conn, nullptr);
  const std::vector<Migration> two = {{1, "CREATE TABLE a (k integer);"},
                                      {2, "CREATE TABLE b (k integer);"}};
  ASSERT_THAT(Migrate(*conn, two), IsOkAndHolds(2));
  EXPECT_THAT(Migrate(*conn, {two[0]}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("newer")));
  EXPECT_THAT(Migrate(*conn, {two[1]}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("expected 1")));
}

}  // namespace
}  // namespace cdcca::cloud::pg
