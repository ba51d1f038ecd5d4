#include "cloud/token_authenticator.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kTokens[] =
    "# device tokens\n"
    "cam-1 aaaaaaaaaaaaaaaaaaaaaaaa\n"
    "\n"
    "cam-2   bbbbbbbbbbbbbbbbbbbbbbbb  \n";

TEST(TokenAuthenticatorTest, MapsTokensToDevices) {
  ASSERT_OK_AND_ASSIGN(auto auth, TokenAuthenticator::FromString(kTokens, "tokens"));
  EXPECT_EQ(auth->size(), 2u);
  ASSERT_OK_AND_ASSIGN(std::string id, auth->Authenticate("Bearer aaaaaaaaaaaaaaaaaaaaaaaa"));
  EXPECT_EQ(id, "cam-1");
  ASSERT_OK_AND_ASSIGN(id, auth->Authenticate("Bearer bbbbbbbbbbbbbbbbbbbbbbbb"));
  EXPECT_EQ(id, "cam-2");
}

struct AuthCase {
  const char* authorization;
  const char* why;
};

TEST(TokenAuthenticatorTest, RejectsMissingMalformedAndUnknownTokens) {
  ASSERT_OK_AND_ASSIGN(auto auth, TokenAuthenticator::FromString(kTokens, "tokens"));
  const AuthCase cases[] = {
      {"", "missing bearer token"},
      {"aaaaaaaaaaaaaaaaaaaaaaaa", "must be `Bearer <token>`"},
      {"Basic aaaaaaaaaaaaaaaaaaaaaaaa", "must be `Bearer <token>`"},
      {"Bearer aaaaaaaaaaaaaaaaaaaaaaab", "unknown token"},
      {"Bearer ", "unknown token"},
  };
  for (const AuthCase& c : cases) {
    EXPECT_THAT(auth->Authenticate(c.authorization),
                StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr(c.why)))
        << c.authorization;
  }
}

TEST(TokenAuthenticatorTest, RejectsMalformedFilesNamingTheLine) {
  const std::pair<const char*, const char*> cases[] = {
      {"cam-1\n", "tokens:1: expected"},
      {"cam-1 short\n", "tokens:1: token must be"},
      {"# c\nbad/id aaaaaaaaaaaaaaaaaaaaaaaa\n", "tokens:2:"},
      {"a aaaaaaaaaaaaaaaaaaaaaaaa\na bbbbbbbbbbbbbbbbbbbbbbbb\n", "tokens:2: device id listed twice"},
      {"a aaaaaaaaaaaaaaaaaaaaaaaa\nb aaaaaaaaaaaaaaaaaaaaaaaa\n", "tokens:2: token listed twice"},
  };
  for (const auto& [text, why] : cases) {
    EXPECT_THAT(TokenAuthenticator::FromString(text, "tokens"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(why)))
        << text;
  }
}

TEST(TokenAuthenticatorTest, MissingFileSaysSo) {
  EXPECT_THAT(TokenAuthenticator::FromFile("/nonexistent/tokens"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("reading token file")));
}

TEST(CertificateIdentityTest, NameOrMappedNameMustBeTheDevice) {
  ASSERT_OK_AND_ASSIGN(CertificateMap map, ParseCertificateMap(
                                               "# lobby camera\nlobby.example cam-2\n", "map"));
  EXPECT_OK(CheckCertificateIdentity({"cam-1"}, map, "cam-1"));
  EXPECT_OK(CheckCertificateIdentity({"Lobby Cam", "lobby.example"}, map, "cam-2"));
  EXPECT_THAT(CheckCertificateIdentity({"cam-1"}, map, "cam-2"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("cam-1")));
  // A mapped name stands for its device only, not for its own spelling as a device id.
  EXPECT_THAT(CheckCertificateIdentity({"lobby.example"}, map, "lobby.example"),
              StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(CheckCertificateIdentity({}, map, "cam-1"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("no CN or SAN")));
  EXPECT_THAT(ParseCertificateMap("a cam-1\na cam-2\n", "map"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("map:2: certificate name")));
  EXPECT_THAT(ParseCertificateMap("a ../x\n", "map"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("map:1:")));
}

}  // namespace
}  // namespace cdcca::cloud
