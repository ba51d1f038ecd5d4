// A thin RAII layer over libpq: one connection, its results, statement parameters and a
// scoped transaction.
//
// Every statement that carries values goes through PQexecParams with the values as binary
// parameters (no value is ever spliced into SQL text), and asks for binary results, so a
// bytea payload crosses the wire as its raw bytes, never as hex text. Only the schema's
// migrations, which carry no values, run as plain multi-statement scripts (PQexec).
//
// Errors are absl::Status values carrying the server's message and SQLSTATE:
//   UNAVAILABLE          the connection is lost or the server is shutting down (class 08,
//                        57P01-57P03): the outcome of an in-flight COMMIT is unknown;
//   ABORTED              serialization failure or deadlock (40001, 40P01): retry the
//                        transaction;
//   ALREADY_EXISTS       unique violation (23505);
//   RESOURCE_EXHAUSTED   the server is out of disk, memory or connections (class 53);
//   INTERNAL             anything else.
//
// A Connection is not thread-safe: one thread uses it at a time (the caller serializes).
#ifndef CDCCA_CLOUD_PG_CONNECTION_H_
#define CDCCA_CLOUD_PG_CONNECTION_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

struct pg_conn;
struct pg_result;

namespace cdcca::cloud::pg {

// Values for one statement's $1, $2, ... in order, each sent in binary with its type.
class Params {
 public:
  Params& Text(absl::string_view value);
  Params& Bytes(absl::string_view value);  // bytea
  Params& Int64(int64_t value);            // bigint
  Params& Int32(int32_t value);            // integer
  Params& Bool(bool value);
  Params& Time(absl::Time value);  // timestamptz, microsecond precision

  size_t size() const { return values_.size(); }

 private:
  friend class Connection;
  void Add(uint32_t type_oid, std::string value);

  std::vector<uint32_t> types_;
  std::vector<std::string> values_;
};

// One statement's result rows, in binary format. Column accessors check the column's type
// and return INTERNAL for a mismatch or an out-of-range row or column; a NULL value reads
// as the type's zero unless checked with IsNull.
class Result {
 public:
  explicit Result(pg_result* result);
  ~Result();
  Result(Result&& other) noexcept;
  Result& operator=(Result&& other) noexcept;
  Result(const Result&) = delete;
  Result& operator=(const Result&) = delete;

  int rows() const;
  // Rows an INSERT, UPDATE or DELETE touched.
  int64_t affected() const;
  bool IsNull(int row, int column) const;
  // text, varchar or bytea: the raw bytes.
  absl::StatusOr<std::string> Bytes(int row, int column) const;
  // bigint, integer or smallint.
  absl::StatusOr<int64_t> Int64(int row, int column) const;
  absl::StatusOr<bool> Bool(int row, int column) const;
  absl::StatusOr<absl::Time> Time(int row, int column) const;  // timestamptz

 private:
  friend class Connection;
  friend class Transaction;
  absl::StatusOr<absl::string_view> Raw(int row, int column, uint32_t want_oid1,
                                        uint32_t want_oid2 = 0, uint32_t want_oid3 = 0) const;

  pg_result* result_;
};

class Connection {
 public:
  // Connects with a libpq connection string ("host=... port=... dbname=... user=..." or a
  // postgresql:// URI). UNAVAILABLE with the server's message when that fails.
  static absl::StatusOr<std::unique_ptr<Connection>> Open(const std::string& conninfo);

  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Runs one statement with `params` and returns its rows (none for a command).
  absl::StatusOr<Result> Exec(absl::string_view sql, const Params& params = Params());

  // Runs a script of statements that carry no values (schema migrations).
  absl::Status ExecScript(absl::string_view sql);

  // False once the connection to the server is lost (a statement failed with UNAVAILABLE).
  bool ok() const;

  // Reconnects with the same parameters (PQreset). UNAVAILABLE while the server cannot be
  // reached. Any transaction of the lost session is gone: the server rolled it back, unless
  // its COMMIT had been received.
  absl::Status Reset();

  // Test-only: runs before every statement (Exec and ExecScript) with its SQL; a non-OK
  // status is returned in place of the statement's, which is then never sent. Empty = none.
  using StatementHook = std::function<absl::Status(absl::string_view sql)>;
  void set_statement_hook(StatementHook hook) { hook_ = std::move(hook); }

 private:
  friend class Transaction;
  explicit Connection(pg_conn* conn) : conn_(conn) {}
  // Settings every session of this layer runs with.
  absl::Status SetUpSession();
  // The status of a finished statement: OK, or the server's error mapped to a code.
  absl::Status StatusOf(pg_result* result, absl::string_view sql) const;

  pg_conn* conn_;
  StatementHook hook_;
};

// A transaction that rolls back unless Commit() returned OK. Begin sends BEGIN; the
// destructor sends ROLLBACK for an open transaction (its errors are dropped: a failed
// transaction is rolled back by the server when the connection ends).
class Transaction {
 public:
  static absl::StatusOr<Transaction> Begin(Connection* conn);

  ~Transaction();
  Transaction(Transaction&& other) noexcept;
  Transaction& operator=(Transaction&&) = delete;
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;

  // Sends COMMIT. OK only when the server committed; otherwise nothing of the transaction
  // holds, except after UNAVAILABLE, when the outcome of a COMMIT in flight is unknown.
  absl::Status Commit();

 private:
  explicit Transaction(Connection* conn) : conn_(conn) {}

  Connection* conn_;  // nullptr once committed, rolled back or moved from
};

}  // namespace cdcca::cloud::pg

#endif  // CDCCA_CLOUD_PG_CONNECTION_H_
