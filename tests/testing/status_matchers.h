// GoogleTest helpers for absl::Status and absl::StatusOr<T>.
//
//   EXPECT_OK(expr);                 // expr is a Status or StatusOr and is ok
//   ASSERT_OK(expr);
//   ASSERT_OK_AND_ASSIGN(auto x, expr);  // x = *expr, or the test stops with the status
//   EXPECT_THAT(expr, StatusIs(absl::StatusCode::kDataLoss));
//   EXPECT_THAT(expr, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("checksum")));
//   EXPECT_THAT(expr, IsOkAndHolds(ElementsAre(1, 2)));  // a StatusOr that is ok and matches
#ifndef CDCCA_TESTS_TESTING_STATUS_MATCHERS_H_
#define CDCCA_TESTS_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cdcca::testing {

inline const absl::Status& GetStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// Matches a Status or StatusOr whose code equals `code` and whose message matches
// `message_matcher` (anything by default).
MATCHER_P2(StatusIsImpl, code, message_matcher, "") {
  const absl::Status& status = ::cdcca::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(status.message()),
                                       result_listener);
}

inline auto StatusIs(absl::StatusCode code) { return StatusIsImpl(code, ::testing::_); }
template <typename M>
auto StatusIs(absl::StatusCode code, M message_matcher) {
  return StatusIsImpl(code, ::testing::Matcher<std::string>(message_matcher));
}

MATCHER(IsOk, "") {
  const absl::Status& status = ::cdcca::testing::GetStatus(arg);
  *result_listener << "status is " << status;
  return status.ok();
}

MATCHER_P(IsOkAndHolds, value_matcher, "") {
  if (!arg.ok()) {
    *result_listener << "status is " << arg.status();
    return false;
  }
  return ::testing::ExplainMatchResult(value_matcher, *arg, result_listener);
}

}  // namespace cdcca::testing

#define EXPECT_OK(expr) EXPECT_THAT((expr), ::cdcca::testing::IsOk())
#define ASSERT_OK(expr) ASSERT_THAT((expr), ::cdcca::testing::IsOk())

#define CDCCA_STATUS_CONCAT_INNER(a, b) a##b
#define CDCCA_STATUS_CONCAT(a, b) CDCCA_STATUS_CONCAT_INNER(a, b)
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  CDCCA_ASSERT_OK_AND_ASSIGN_IMPL(CDCCA_STATUS_CONCAT(_status_or_, __LINE__), lhs, expr)
#define CDCCA_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  ASSERT_TRUE(tmp.ok()) << tmp.status();                \
  lhs = std::move(tmp).value()

#endif  // CDCCA_TESTS_TESTING_STATUS_MATCHERS_H_
