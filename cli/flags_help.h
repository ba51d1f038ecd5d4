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

// Edit distance between two names (insertions, deletions, substitutions), for suggestions.
inline size_t NameDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The name among `known` nearest to `name` (a misspelling's likely meaning); "" if none.
inline std::string NearestName(std::string_view name, const std::vector<std::string>& known) {
  std::string best;
  size_t best_distance = static_cast<size_t>(-1);
  for (const std::string& k : known) {
    const size_t d = NameDistance(name, k);
    if (d < best_distance) {
      best_distance = d;
      best = k;
    }
  }
  return best;
}

// The names of the flags `filter` accepts.
inline std::vector<std::string> FlagNames(const FlagFilter& filter) {
  std::vector<std::string> names;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (filter(*flag)) names.emplace_back(name);
  }
  return names;
}

// Checks that every flag on the command line (argv[1..], up to a "--") is one `filter`
// accepts (absl's own, such as --flagfile, too): a flag of another program or sub-command
// is as wrong as a misspelt one. On the first that is not, prints "ERROR: unknown flag
// '--NAME' ...; did you mean '--NEAREST'?" on stderr and exits 1.
inline void CheckFlagsKnown(int argc, char** argv, std::string_view program,
                            const FlagFilter& filter) {
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "--") return;
    if (a.size() < 2 || a[0] != '-') continue;
    a.remove_prefix(a[1] == '-' ? 2 : 1);
    const size_t eq = a.find('=');
    const bool has_value = eq != std::string_view::npos;
    std::string name(a.substr(0, eq));
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && name.rfind("no", 0) == 0) {  // --noNAME for a bool
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) {
        flag = negated;
        name = name.substr(2);
      }
    }
    const bool ours = flag != nullptr && (filter(*flag) || !ProjectFlagFile(flag->Filename()));
    if (!ours) {
      const std::string nearest = NearestName(name, FlagNames(filter));
      std::fprintf(stderr, "ERROR: unknown flag '--%s' for %s%s\n", name.c_str(),
                   std::string(program).c_str(),
                   nearest.empty() ? "" : ("; did you mean '--" + nearest + "'?").c_str());
      std::exit(1);
    }
    // "--name value": the value is the next argument, whatever it starts with.
    if (!has_value && !flag->IsOfType<bool>()) ++i;
  }
}

// What a program's main calls instead of absl::ParseCommandLine: help -> print and exit 0;
// otherwise check that every flag given is one of the program's (exit 1 naming it and the
// nearest known one), parse, and return the positional arguments, argv[0] first.
inline std::vector<char*> ParseFlagsOrHelp(int argc, char** argv, const FlagFilter& filter,
                                           std::string_view usage = "") {
  if (HelpRequested(argc, argv)) {
    PrintFlagsHelp(argc > 0 ? argv[0] : "cdcca", usage, filter);
    std::exit(0);
  }
  std::string_view program = usage.empty() ? std::string_view(argc > 0 ? argv[0] : "cdcca")
                                           : usage.substr(0, usage.find(" ["));
  if (const size_t slash = program.rfind('/'); slash != std::string_view::npos) {
    program.remove_prefix(slash + 1);
  }
  if (program.rfind("usage: ", 0) == 0) program.remove_prefix(7);
  CheckFlagsKnown(argc, argv, program, filter);
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
