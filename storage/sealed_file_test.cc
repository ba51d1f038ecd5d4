#include "storage/sealed_file.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::storage {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint32_t kKind = SealKind("TEST");

TEST(SealedFileTest, RoundTripsAnyBody) {
  for (const std::string& body : {std::string(), std::string("x"), std::string(1000, '\0')}) {
    const std::string sealed = Seal(kKind, 3, body);
    EXPECT_TRUE(IsSealed(sealed));
    EXPECT_THAT(Unseal(sealed, kKind, 3, "f"),
                ::cdcca::testing::IsOkAndHolds(absl::string_view(body)));
  }
  EXPECT_FALSE(IsSealed("plain protobuf bytes"));
}

TEST(SealedFileTest, EveryFlippedBitAndEveryCutIsDataLoss) {
  const std::string sealed = Seal(kKind, 1, "version 7, digest 0123456789abcdef");
  for (size_t i = 0; i < sealed.size() * 8; ++i) {
    std::string damaged = sealed;
    damaged[i / 8] = static_cast<char>(damaged[i / 8] ^ (1 << (i % 8)));
    EXPECT_THAT(Unseal(damaged, kKind, 1, "f"), StatusIs(absl::StatusCode::kDataLoss))
        << "bit " << i;
  }
  for (size_t n = 0; n < sealed.size(); ++n) {
    EXPECT_THAT(Unseal(sealed.substr(0, n), kKind, 1, "f"), StatusIs(absl::StatusCode::kDataLoss))
        << "cut at " << n;
  }
  EXPECT_THAT(Unseal(sealed + "x", kKind, 1, "f"), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(SealedFileTest, AnotherKindOrFormatIsRefusedByName) {
  const std::string sealed = Seal(kKind, 2, "body");
  EXPECT_THAT(Unseal(sealed, SealKind("UPLQ"), 2, "/q/f"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("/q/f: holds 'TEST', not 'UPLQ'")));
  EXPECT_THAT(Unseal(sealed, kKind, 1, "f"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("format 2")));
}

}  // namespace
}  // namespace cdcca::storage
