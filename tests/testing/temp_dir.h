// A fresh temporary directory per test, removed (with its contents) at destruction.
#ifndef CDCCA_TESTS_TESTING_TEMP_DIR_H_
#define CDCCA_TESTS_TESTING_TEMP_DIR_H_

#include <cstdlib>
#include <stdexcept>
#include <string>

#include <filesystem>

namespace cdcca::testing {

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/cdcca-test-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_TEMP_DIR_H_
