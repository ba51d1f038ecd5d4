// Generates a throwaway PKI for TLS tests with the openssl command-line tool: a CA, a
// server certificate for localhost / 127.0.0.1, and a client certificate for device dev-0,
// all signed by the CA; IssueClientCert adds more client certificates. Nothing is committed; every test run makes its own keys.
#ifndef CDCCA_TESTS_TESTING_TEST_PKI_H_
#define CDCCA_TESTS_TESTING_TEST_PKI_H_

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace cdcca::testing {

struct TestPki {
  std::string ca_cert, server_cert, server_key, client_cert, client_key;
};

// Writes the files into `dir`; returns false (and prints the failing command) on error.
inline bool GenerateTestPki(const std::string& dir, TestPki* pki) {
  {
    std::ofstream ext(dir + "/server.ext");
    ext << "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
  }
  const std::string q = " >/dev/null 2>&1";
  const std::string cmds[] = {
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=cdcca-test-ca -keyout " +
          dir + "/ca.key -out " + dir + "/ca.pem" + q,
      "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout " + dir +
          "/server.key -out " + dir + "/server.csr" + q,
      "openssl x509 -req -in " + dir + "/server.csr -CA " + dir + "/ca.pem -CAkey " + dir +
          "/ca.key -CAcreateserial -days 1 -extfile " + dir + "/server.ext -out " + dir +
          "/server.pem" + q,
      "openssl req -newkey rsa:2048 -nodes -subj /CN=dev-0 -keyout " + dir +
          "/client.key -out " + dir + "/client.csr" + q,
      "openssl x509 -req -in " + dir + "/client.csr -CA " + dir + "/ca.pem -CAkey " + dir +
          "/ca.key -CAcreateserial -days 1 -out " + dir + "/client.pem" + q,
  };
  for (const std::string& cmd : cmds) {
    if (std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr, "test PKI: command failed: %s\n", cmd.c_str());
      return false;
    }
  }
  pki->ca_cert = dir + "/ca.pem";
  pki->server_cert = dir + "/server.pem";
  pki->server_key = dir + "/server.key";
  pki->client_cert = dir + "/client.pem";
  pki->client_key = dir + "/client.key";
  return true;
}

// Issues `<dir>/<file>.pem` and `.key`, a client certificate with CN `common_name` and,
// when `san_dns` is not empty, that DNS subject alternative name, signed by the CA of
// GenerateTestPki(dir). Returns false (and prints the failing command) on error.
inline bool IssueClientCert(const std::string& dir, const std::string& file,
                            const std::string& common_name, const std::string& san_dns = "") {
  const std::string q = " >/dev/null 2>&1";
  const std::string base = dir + "/" + file;
  std::string ext;
  if (!san_dns.empty()) {
    std::ofstream out(base + ".ext");
    out << "subjectAltName=DNS:" << san_dns << "\n";
    ext = " -extfile " + base + ".ext";
  }
  const std::string cmds[] = {
      "openssl req -newkey rsa:2048 -nodes -subj /CN=" + common_name + " -keyout " + base +
          ".key -out " + base + ".csr" + q,
      "openssl x509 -req -in " + base + ".csr -CA " + dir + "/ca.pem -CAkey " + dir +
          "/ca.key -CAcreateserial -days 1" + ext + " -out " + base + ".pem" + q,
  };
  for (const std::string& cmd : cmds) {
    if (std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr, "test PKI: command failed: %s\n", cmd.c_str());
      return false;
    }
  }
  return true;
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_TEST_PKI_H_
