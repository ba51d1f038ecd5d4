// Program tests: a child process whose stderr goes to a log file, and the readers of the
// JSON and text files the programs write.
#ifndef CDCCA_TESTS_TESTING_CHILD_PROCESS_H_
#define CDCCA_TESTS_TESTING_CHILD_PROCESS_H_

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tests/testing/wait.h"

extern char** environ;

namespace cdcca::testing {

// A child process with its stderr appended to a log file (and its stdout written to
// `stdout_path` when one is given; else the test's). `exit_at` (when not empty) plans its
// crash: CDCCA_TEST_EXIT_AT for the programs' Env (storage/exit_at_env.h).
class Child {
 public:
  Child(std::vector<std::string> args, const std::string& log, const std::string& exit_at = "",
        const std::string& stdout_path = "") {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string(*e).rfind("CDCCA_TEST_EXIT_AT=", 0) != 0) env_strings.push_back(*e);
    }
    if (!exit_at.empty()) env_strings.push_back("CDCCA_TEST_EXIT_AT=" + exit_at);
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (!stdout_path.empty()) {
      posix_spawn_file_actions_addopen(&actions, 1, stdout_path.c_str(),
                                       O_WRONLY | O_CREAT | O_TRUNC, 0644);
    }
    if (posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
  }
  ~Child() { Kill(); }

  bool running() const { return pid_ > 0; }
  // The process id while it runs (until Wait or Kill reaped it); -1 after.
  pid_t pid() const { return pid_; }

  void Signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    Wait(absl::Seconds(30));
  }
  // The exit code (128 + signal if killed), or -1 if still running after `timeout`.
  int Wait(absl::Duration timeout) {
    if (pid_ <= 0) return exit_code_;
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        return exit_code_;
      }
      if (absl::Now() >= deadline) return -1;
      absl::SleepFor(absl::Milliseconds(50));
    }
  }

 private:
  pid_t pid_ = -1;
  int exit_code_ = -1;
};

inline nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  return j.is_discarded() ? nlohmann::json::object() : j;
}

inline std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The JSON lines of a program's log at `path` whose "event" is `event`, in order.
inline std::vector<nlohmann::json> LogEvents(const std::string& path, const std::string& event) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded() && j.is_object() && j.value("event", "") == event) {
      out.push_back(std::move(j));
    }
  }
  return out;
}

// The port a program wrote to its --port_file `path`; 0 after `timeout`, or as soon as
// `child` (when given) has exited.
inline int WaitForPortFile(const std::string& path, absl::Duration timeout,
                           Child* child = nullptr) {
  int port = 0;
  WaitUntil(
      [&] {
        std::ifstream in(path);
        if (in >> port && port > 0) return true;
        port = 0;
        return child != nullptr && child->Wait(absl::ZeroDuration()) != -1;
      },
      timeout);
  return port;
}

// The text of `path` once it contains `needle`, or as it is after `timeout`.
inline std::string WaitForText(const std::string& path, const std::string& needle,
                               absl::Duration timeout) {
  std::string text;
  WaitUntil(
      [&] {
        text = ReadText(path);
        return absl::StrContains(text, needle);
      },
      timeout, absl::Milliseconds(300));
  return text;
}

// Whether the device whose --status_file is `path` runs at least `version` and its last
// report matched the cloud within `timeout`.
inline bool WaitStatusInSync(const std::string& path, uint64_t version, absl::Duration timeout) {
  return WaitUntil(
      [&] {
        const nlohmann::json s = ReadJson(path);
        return s.value("version", 0ull) >= version && s.value("in_sync", false);
      },
      timeout, absl::Milliseconds(200));
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_CHILD_PROCESS_H_
