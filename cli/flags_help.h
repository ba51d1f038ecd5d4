// The programs' shared command-line convention: `--help` (also -help, --helpfull,
// --helpshort) prints the program's usage message and its flags on stdout and exits 0;
// anything else goes to absl::ParseCommandLine, which rejects an unknown flag with
// "ERROR: Unknown command line flag 'NAME'" and exit code 1. (absl's own --help handling
// exits 1, which scripts read as a failure.) Header-only, so that every program main can
// use it without a library of its own; it needs only the absl flags libraries the mains
// already link.
#ifndef CDCCA_CLI_FLAGS_HELP_H_
#define CDCCA_CLI_FLAGS_HELP_H_

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"

namespace cdcca::cli {

// Which flags a program's help lists, by the file that defines them.
using FlagFileFilter = std::function<bool(std::string_view filename)>;
// Which flags a program's help lists, by the flag (e.g. a sub-command's own, by name).
using FlagFilter = std::function<bool(const absl::CommandLineFlag& flag)>;

// Every flag but absl's own (--flagfile, --fromenv, ...).
inline bool ProjectFlagFile(std::string_view filename) {
  return filename.find("absl/") == std::string_view::npos;
}

// True if argv[1..] asks for help before a "--" that ends the flags.
inline bool HelpRequested(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--") return false;
    for (std::string_view h : {"help", "helpfull", "helpshort"}) {
      if (a == std::string("-").append(h) || a == std::string("--").append(h)) return true;
    }
  }
  return false;
}

// Prints `usage` (if empty: "PROGRAM: " and absl's program usage message) and the flags
// `filter` accepts, sorted by name with their help and default, on stdout.
inline void PrintFlagsHelp(const char* program, std::string_view usage, const FlagFilter& filter) {
  if (usage.empty()) {
    std::string_view name = program;
    if (const size_t slash = name.rfind('/'); slash != std::string_view::npos) {
      name.remove_prefix(slash + 1);
    }
    std::printf("%s: %s\n", std::string(name).c_str(),
                std::string(absl::ProgramUsageMessage()).c_str());
  } else {
    std::printf("%s\n", std::string(usage).c_str());
  }
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (filter(*flag)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](absl::CommandLineFlag* a, absl::CommandLineFlag* b) {
    return a->Name() < b->Name();
  });
  std::printf("\nFlags:\n");
  for (const absl::CommandLineFlag* f : flags) {
    const std::string def = f->DefaultValue();
    std::printf("  --%s  %s (default: %s)\n", std::string(f->Name()).c_str(), f->Help().c_str(),
                def.empty() ? "\"\"" : def.c_str());
  }
  std::fflush(stdout);
}

// What a program's main calls instead of absl::ParseCommandLine: help -> print and exit 0;
// otherwise parse (exit 1 naming the flag on an unknown one) and return the positional
// arguments, argv[0] first.
inline std::vector<char*> ParseFlagsOrHelp(int argc, char** argv, const FlagFilter& filter,
                                           std::string_view usage = "") {
  if (HelpRequested(argc, argv)) {
    PrintFlagsHelp(argc > 0 ? argv[0] : "cdcca", usage, filter);
    std::exit(0);
  }
  return absl::ParseCommandLine(argc, argv);
}
inline std::vector<char*> ParseFlagsOrHelp(int argc, char** argv,
                                           const FlagFileFilter& filter = ProjectFlagFile,
                                           std::string_view usage = "") {
  return ParseFlagsOrHelp(
      argc, argv,
      FlagFilter([filter](const absl::CommandLineFlag& f) { return filter(f.Filename()); }), usage);
}

}  // namespace cdcca::cli

#endif  // CDCCA_CLI_FLAGS_HELP_H_
