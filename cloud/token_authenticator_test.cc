#include "cloud/token_authenticator.h"

#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_pki.h"

namespace cdcca::cloud {
namespace {

using ::cdcca::testing::IsOkAndHolds;
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
      {"a aaaaaaaaaaaaaaaaaaaaaaaa\na bbbbbbbbbbbbbbbbbbbbbbbb\n",
       "tokens:2: device id listed twice"},
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
  ASSERT_OK_AND_ASSIGN(CertificateMap map,
                       ParseCertificateMap("# lobby camera\nlobby.example cam-2\n", "map"));
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

// What nginx passes as $ssl_client_escaped_cert: the PEM with every byte outside
// [A-Za-z0-9] percent-escaped.
std::string Escape(const std::string& pem) {
  std::string out;
  for (unsigned char c : pem) {
    if (std::isalnum(c)) {
      out.push_back(static_cast<char>(c));
    } else {
      char hex[4];
      std::snprintf(hex, sizeof(hex), "%%%02X", c);
      out += hex;
    }
  }
  return out;
}

TEST(CertificateIdentityTest, ReadsTheNamesOfAProxiedCertificate) {
  testing::TempDir dir;
  testing::TestPki pki;
  ASSERT_TRUE(testing::GenerateTestPki(dir.path(), &pki));
  ASSERT_TRUE(testing::IssueClientCert(dir.path(), "cam", "cam-1", "cam-1.fleet.example"));
  std::ifstream in(dir.path() + "/cam.pem");
  std::stringstream pem;
  pem << in.rdbuf();
  EXPECT_THAT(CertificateNamesFromEscapedPem(Escape(pem.str())),
              IsOkAndHolds(::testing::ElementsAre("cam-1", "cam-1.fleet.example")));
  // nginx escapes only some bytes: an unescaped PEM reads the same.
  EXPECT_THAT(CertificateNamesFromEscapedPem(pem.str()),
              IsOkAndHolds(::testing::ElementsAre("cam-1", "cam-1.fleet.example")));
  EXPECT_THAT(CertificateNamesFromEscapedPem("not a certificate"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CertificateNamesFromEscapedPem(Escape(pem.str()).substr(0, 200)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CertificateNamesFromEscapedPem("%2"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CertificateNamesFromEscapedPem("%zz"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CertificateNamesFromEscapedPem(std::string(70000, 'A')),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace cdcca::cloud
