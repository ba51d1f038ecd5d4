#include "cloud/pg/connection.h"

#include <libpq-fe.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace cdcca::cloud::pg {
namespace {

// Type OIDs of pg_type (fixed by the server's catalog).
constexpr uint32_t kBoolOid = 16;
constexpr uint32_t kByteaOid = 17;
constexpr uint32_t kInt8Oid = 20;
constexpr uint32_t kInt2Oid = 21;
constexpr uint32_t kInt4Oid = 23;
constexpr uint32_t kTextOid = 25;
constexpr uint32_t kVarcharOid = 1043;
constexpr uint32_t kTimestamptzOid = 1184;

// timestamptz counts microseconds from 2000-01-01 00:00:00 UTC.
constexpr int64_t kPostgresEpochUnixMicros = 946684800LL * 1000000;

std::string BigEndian(uint64_t value, int bytes) {
  std::string out(bytes, '\0');
  for (int i = bytes - 1; i >= 0; --i) {
    out[i] = static_cast<char>(value & 0xff);
    value >>= 8;
  }
  return out;
}

uint64_t FromBigEndian(absl::string_view bytes) {
  uint64_t value = 0;
  for (unsigned char c : bytes) value = (value << 8) | c;
  return value;
}

absl::StatusCode CodeOf(absl::string_view sqlstate) {
  if (absl::StartsWith(sqlstate, "08") || sqlstate == "57P01" || sqlstate == "57P02" ||
      sqlstate == "57P03") {
    return absl::StatusCode::kUnavailable;
  }
  if (sqlstate == "40001" || sqlstate == "40P01") return absl::StatusCode::kAborted;
  if (sqlstate == "23505") return absl::StatusCode::kAlreadyExists;
  if (absl::StartsWith(sqlstate, "53")) return absl::StatusCode::kResourceExhausted;
  return absl::StatusCode::kInternal;
}

// The first line of a statement, for error messages.
absl::string_view Head(absl::string_view sql) {
  sql = absl::StripLeadingAsciiWhitespace(sql);
  const size_t end = sql.find('\n');
  return end == absl::string_view::npos ? sql : sql.substr(0, end);
}

}  // namespace

// ---- Params --------------------------------------------------------------------------------

void Params::Add(uint32_t type_oid, std::string value) {
  types_.push_back(type_oid);
  values_.push_back(std::move(value));
}

Params& Params::Text(absl::string_view value) {
  Add(kTextOid, std::string(value));
  return *this;
}
Params& Params::Bytes(absl::string_view value) {
  Add(kByteaOid, std::string(value));
  return *this;
}
Params& Params::Int64(int64_t value) {
  Add(kInt8Oid, BigEndian(static_cast<uint64_t>(value), 8));
  return *this;
}
Params& Params::Int32(int32_t value) {
  Add(kInt4Oid, BigEndian(static_cast<uint32_t>(value), 4));
  return *this;
}
Params& Params::Bool(bool value) {
  Add(kBoolOid, std::string(1, value ? '\1' : '\0'));
  return *this;
}
Params& Params::Time(absl::Time value) {
  const int64_t micros = absl::ToUnixMicros(value) - kPostgresEpochUnixMicros;
  Add(kTimestamptzOid, BigEndian(static_cast<uint64_t>(micros), 8));
  return *this;
}
// ---- Result --------------------------------------------------------------------------------

Result::Result(pg_result* result) : result_(result) {}
Result::~Result() {
  if (result_ != nullptr) PQclear(result_);
}
Result::Result(Result&& other) noexcept : result_(std::exchange(other.result_, nullptr)) {}
Result& Result::operator=(Result&& other) noexcept {
  if (this != &other) {
    if (result_ != nullptr) PQclear(result_);
    result_ = std::exchange(other.result_, nullptr);
  }
  return *this;
}

int Result::rows() const { return result_ == nullptr ? 0 : PQntuples(result_); }

int64_t Result::affected() const {
  if (result_ == nullptr) return 0;
  const char* n = PQcmdTuples(result_);
  return (n == nullptr || *n == '\0') ? 0 : std::strtoll(n, nullptr, 10);
}

bool Result::IsNull(int row, int column) const {
  return result_ == nullptr || row >= rows() || column >= PQnfields(result_) ||
         PQgetisnull(result_, row, column) != 0;
}

absl::StatusOr<absl::string_view> Result::Raw(int row, int column, uint32_t want_oid1,
                                              uint32_t want_oid2, uint32_t want_oid3) const {
  if (result_ == nullptr || row < 0 || row >= rows() || column < 0 ||
      column >= PQnfields(result_)) {
    return absl::InternalError(absl::StrFormat("no value at row %d, column %d", row, column));
  }
  const uint32_t oid = PQftype(result_, column);
  if (oid != want_oid1 && (want_oid2 == 0 || oid != want_oid2) &&
      (want_oid3 == 0 || oid != want_oid3)) {
    return absl::InternalError(absl::StrFormat("column %d (%s) has type oid %u, not %u", column,
                                               PQfname(result_, column), oid, want_oid1));
  }
  if (PQgetisnull(result_, row, column) != 0) return absl::string_view();
  return absl::string_view(PQgetvalue(result_, row, column), PQgetlength(result_, row, column));
}

absl::StatusOr<std::string> Result::Bytes(int row, int column) const {
  absl::StatusOr<absl::string_view> raw = Raw(row, column, kByteaOid, kTextOid, kVarcharOid);
  if (!raw.ok()) return raw.status();
  return std::string(*raw);
}

absl::StatusOr<int64_t> Result::Int64(int row, int column) const {
  absl::StatusOr<absl::string_view> raw = Raw(row, column, kInt8Oid, kInt4Oid, kInt2Oid);
  if (!raw.ok()) return raw.status();
  if (raw->empty()) return 0;
  const uint64_t v = FromBigEndian(*raw);
  switch (raw->size()) {
    case 2:
      return static_cast<int16_t>(v);
    case 4:
      return static_cast<int32_t>(v);
    default:
      return static_cast<int64_t>(v);
  }
}

absl::StatusOr<bool> Result::Bool(int row, int column) const {
  absl::StatusOr<absl::string_view> raw = Raw(row, column, kBoolOid);
  if (!raw.ok()) return raw.status();
  return !raw->empty() && (*raw)[0] != 0;
}

absl::StatusOr<absl::Time> Result::Time(int row, int column) const {
  absl::StatusOr<absl::string_view> raw = Raw(row, column, kTimestamptzOid);
  if (!raw.ok()) return raw.status();
  if (raw->empty()) return absl::UnixEpoch();
  const int64_t micros = static_cast<int64_t>(FromBigEndian(*raw));
  return absl::FromUnixMicros(micros + kPostgresEpochUnixMicros);
}

// ---- Connection ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Connection>> Connection::Open(const std::string& conninfo) {
  PGconn* conn = PQconnectdb(conninfo.c_str());
  if (conn == nullptr) return absl::ResourceExhaustedError("libpq could not allocate a connection");
  if (PQstatus(conn) != CONNECTION_OK) {
    std::string message(absl::StripTrailingAsciiWhitespace(PQerrorMessage(conn)));
    PQfinish(conn);
    return absl::UnavailableError(absl::StrCat("cannot connect to PostgreSQL: ", message));
  }
  auto connection = std::unique_ptr<Connection>(new Connection(conn));
  if (absl::Status s = connection->SetUpSession(); !s.ok()) return s;
  return connection;
}

absl::Status Connection::SetUpSession() {
  // Notices (e.g. "relation already exists, skipping") are not errors: keep them quiet.
  const std::string query = "SET client_min_messages = warning";
  Result result(PQexec(conn_, query.c_str()));
  return StatusOf(result.result_, query);
}

absl::Status Connection::Reset() {
  PQreset(conn_);
  if (PQstatus(conn_) != CONNECTION_OK) {
    return absl::UnavailableError(
        absl::StrCat("cannot reconnect to PostgreSQL: ",
                     absl::StripTrailingAsciiWhitespace(PQerrorMessage(conn_))));
  }
  return SetUpSession();
}

Connection::~Connection() { PQfinish(conn_); }

bool Connection::ok() const { return PQstatus(conn_) == CONNECTION_OK; }

absl::Status Connection::StatusOf(pg_result* result, absl::string_view sql) const {
  const ExecStatusType status = result == nullptr ? PGRES_FATAL_ERROR : PQresultStatus(result);
  if (status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK) return absl::OkStatus();
  const char* state = result == nullptr ? nullptr : PQresultErrorField(result, PG_DIAG_SQLSTATE);
  std::string message(absl::StripTrailingAsciiWhitespace(
      result != nullptr ? PQresultErrorMessage(result) : PQerrorMessage(conn_)));
  if (message.empty()) message = PQerrorMessage(conn_);
  absl::StatusCode code =
      state != nullptr ? CodeOf(state) : absl::StatusCode::kUnavailable;  // no reply at all
  if (!ok()) code = absl::StatusCode::kUnavailable;
  return absl::Status(
      code, absl::StrCat("PostgreSQL", state != nullptr ? " " : "", state != nullptr ? state : "",
                         ": ", message, " [in: ", Head(sql), "]"));
}

absl::StatusOr<Result> Connection::Exec(absl::string_view sql, const Params& params) {
  if (hook_) {
    if (absl::Status s = hook_(sql); !s.ok()) return s;
  }
  const int n = static_cast<int>(params.size());
  std::vector<const char*> values(n);
  std::vector<int> lengths(n);
  std::vector<int> formats(n, 1);
  for (int i = 0; i < n; ++i) {
    values[i] = params.values_[i].data();
    lengths[i] = static_cast<int>(params.values_[i].size());
  }
  const std::string query(sql);
  Result result(PQexecParams(conn_, query.c_str(), n, params.types_.data(), values.data(),
                             lengths.data(), formats.data(), /*resultFormat=*/1));
  if (absl::Status s = StatusOf(result.result_, sql); !s.ok()) return s;
  return result;
}

absl::Status Connection::ExecScript(absl::string_view sql) {
  if (hook_) {
    if (absl::Status s = hook_(sql); !s.ok()) return s;
  }
  const std::string query(sql);
  Result result(PQexec(conn_, query.c_str()));
  return StatusOf(result.result_, sql);
}

// ---- Transaction ---------------------------------------------------------------------------

absl::StatusOr<Transaction> Transaction::Begin(Connection* conn) {
  if (absl::Status s = conn->ExecScript("BEGIN"); !s.ok()) return s;
  return Transaction(conn);
}

Transaction::Transaction(Transaction&& other) noexcept
    : conn_(std::exchange(other.conn_, nullptr)) {}

Transaction::~Transaction() {
  if (conn_ == nullptr) return;
  // Not through ExecScript: the statement hook must not keep a transaction open.
  PQclear(PQexec(conn_->conn_, "ROLLBACK"));
}

absl::Status Transaction::Commit() {
  if (conn_ == nullptr) return absl::FailedPreconditionError("the transaction is over");
  Connection* conn = std::exchange(conn_, nullptr);
  // A COMMIT of a transaction in the aborted state answers with a ROLLBACK command tag and
  // no error; it is reported as what it is.
  const std::string query = "COMMIT";
  if (conn->hook_) {
    if (absl::Status s = conn->hook_(query); !s.ok()) {
      PQclear(PQexec(conn->conn_, "ROLLBACK"));
      return s;
    }
  }
  Result result(PQexec(conn->conn_, query.c_str()));
  if (absl::Status s = conn->StatusOf(result.result_, query); !s.ok()) return s;
  if (absl::string_view(PQcmdStatus(result.result_)) != "COMMIT") {
    return absl::AbortedError("PostgreSQL rolled the transaction back at COMMIT");
  }
  return absl::OkStatus();
}

}  // namespace cdcca::cloud::pg
