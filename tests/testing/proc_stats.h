// What the kernel says of a process (/proc): its children, its resident memory and its CPU
// time. For the tests and benchmarks that start servers and watch them. Linux only; every
// reader returns 0 (or nothing) for a process that is gone.
#ifndef CDCCA_TESTS_TESTING_PROC_STATS_H_
#define CDCCA_TESTS_TESTING_PROC_STATS_H_

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace cdcca::testing {

namespace proc_internal {

inline std::string ReadProcFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The fields of /proc/<pid>/stat after "pid (comm)": comm may hold spaces and parentheses,
// so they start after the last ')'. Field 0 is the state, 1 the parent's pid.
inline std::vector<std::string> StatFields(pid_t pid) {
  const std::string stat = ReadProcFile("/proc/" + std::to_string(pid) + "/stat");
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 > stat.size()) return {};
  return absl::StrSplit(stat.substr(close + 2), ' ');
}

}  // namespace proc_internal

// The processes whose parent is `parent`.
inline std::vector<pid_t> ChildrenOf(pid_t parent) {
  std::vector<pid_t> children;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    int pid = 0;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &pid)) continue;
    const std::vector<std::string> fields = proc_internal::StatFields(pid);
    int ppid = 0;
    if (fields.size() > 1 && absl::SimpleAtoi(fields[1], &ppid) && ppid == parent) {
      children.push_back(pid);
    }
  }
  return children;
}

// A field of /proc/<pid>/status in kB ("VmRSS", "RssAnon", "RssShmem"); 0 when absent.
inline uint64_t StatusKib(pid_t pid, absl::string_view field) {
  const std::string status =
      proc_internal::ReadProcFile("/proc/" + std::to_string(pid) + "/status");
  for (absl::string_view line : absl::StrSplit(status, '\n')) {
    if (!absl::ConsumePrefix(&line, field) || !absl::ConsumePrefix(&line, ":")) continue;
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    uint64_t kib = 0;
    if (!parts.empty() && absl::SimpleAtoi(parts[0], &kib)) return kib;
  }
  return 0;
}

// CPU time the process used (user + system), with that of its children it reaped, in s.
inline double CpuSeconds(pid_t pid) {
  const std::vector<std::string> f = proc_internal::StatFields(pid);
  // utime, stime, cutime, cstime: fields 14-17 of stat, 11-14 here.
  if (f.size() < 15) return 0;
  double ticks = 0;
  for (int i = 11; i <= 14; ++i) {
    int64_t v = 0;
    if (absl::SimpleAtoi(f[i], &v)) ticks += static_cast<double>(v);
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_PROC_STATS_H_
