#include "storage/exit_at_env.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace cdcca::storage {

ExitAtEnv::ExitAtEnv(Env* base, std::string pattern, uint64_t n)
    : base_(base), pattern_(std::move(pattern)), n_(n) {}

absl::StatusOr<std::unique_ptr<ExitAtEnv>> ExitAtEnv::Parse(Env* base, const std::string& spec) {
  std::string pattern = spec;
  uint64_t n = 1;
  if (const size_t at = spec.rfind('@'); at != std::string::npos) {
    pattern = spec.substr(0, at);
    if (!absl::SimpleAtoi(spec.substr(at + 1), &n) || n == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("exit point '", spec, "': N in PATTERN@N must be a count from 1"));
    }
  }
  if (pattern.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("exit point '", spec, "' has no pattern"));
  }
  return std::make_unique<ExitAtEnv>(base, std::move(pattern), n);
}

void ExitAtEnv::Changing(const char* call, const std::string& path, const std::string& other) {
  const bool matches = path.find(pattern_) != std::string::npos ||
                       (!other.empty() && other.find(pattern_) != std::string::npos);
  if (!matches || seen_.fetch_add(1) + 1 != n_) return;
  std::fprintf(stderr,
               "{\"event\":\"planned_crash\",\"before\":\"%s\",\"path\":\"%s\",\"match\":%llu}\n",
               call, path.c_str(), static_cast<unsigned long long>(n_));
  std::fflush(stderr);
  ::_exit(kPlannedCrashExitCode);
}

absl::StatusOr<std::unique_ptr<WritableFile>> ExitAtEnv::OpenForAppend(const std::string& path,
                                                                       bool truncate) {
  Changing("open_for_append", path);
  return base_->OpenForAppend(path, truncate);
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> ExitAtEnv::OpenForRead(const std::string& path) {
  return base_->OpenForRead(path);
}

absl::Status ExitAtEnv::Rename(const std::string& from, const std::string& to) {
  Changing("rename", from, to);
  return base_->Rename(from, to);
}

absl::Status ExitAtEnv::Remove(const std::string& path) {
  Changing("remove", path);
  return base_->Remove(path);
}

absl::Status ExitAtEnv::Truncate(const std::string& path, uint64_t size) {
  Changing("truncate", path);
  return base_->Truncate(path, size);
}

absl::Status ExitAtEnv::SyncDir(const std::string& dir) { return base_->SyncDir(dir); }

absl::Status ExitAtEnv::CreateDirs(const std::string& dir) { return base_->CreateDirs(dir); }

absl::StatusOr<std::vector<std::string>> ExitAtEnv::ListFiles(const std::string& dir) {
  return base_->ListFiles(dir);
}

absl::StatusOr<std::vector<std::string>> ExitAtEnv::ListDirs(const std::string& dir) {
  return base_->ListDirs(dir);
}

Env* ProgramEnv() {
  static Env* const env = [] {
    const char* spec = std::getenv("CDCCA_TEST_EXIT_AT");
    if (spec == nullptr || *spec == '\0') return Env::Default();
    absl::StatusOr<std::unique_ptr<ExitAtEnv>> planned = ExitAtEnv::Parse(Env::Default(), spec);
    if (!planned.ok()) {
      std::fprintf(stderr, "CDCCA_TEST_EXIT_AT: %s\n",
                   std::string(planned.status().message()).c_str());
      std::exit(2);
    }
    return static_cast<Env*>(planned->release());
  }();
  return env;
}

}  // namespace cdcca::storage
