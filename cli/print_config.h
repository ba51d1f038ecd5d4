// A program's configuration as JSON, both ways. `--config FILE`: a JSON object whose keys are
// the program's flag names sets those flags (the command line wins). `--print_config`: a
// program prints the configuration it would run with (every one of its flags, after the
// command line and any config file, as one JSON object keyed by the flag's name) and exits 0
// without starting anything. The names are the settings' one names
// (settings/defaults.h), so the output of cdcca-cloud, cdcca-device and cdcca-sim can be
// compared key by key. `--profile` (ApplyProfile) fills in the settings whose default depends
// on the profile and the student's family before either is read. Secrets are not printed: a flag
// named in `secrets` that is set reads
// "(set)". Header-only, as cli/flags_help.h; needs the absl flags libraries and nlohmann_json.
#ifndef CDCCA_CLI_PRINT_CONFIG_H_
#define CDCCA_CLI_PRINT_CONFIG_H_

#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <utility>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cli/flags_help.h"
#include "nlohmann/json.hpp"
#include "settings/defaults.h"

namespace cdcca::cli {

// One flag's current value as JSON: bools and numbers typed, everything else a string.
inline nlohmann::json FlagValueJson(const absl::CommandLineFlag& flag) {
  const std::string text = flag.CurrentValue();
  if (flag.IsOfType<bool>()) return text == "true";
  if (flag.IsOfType<int>() || flag.IsOfType<int64_t>() || flag.IsOfType<uint64_t>() ||
      flag.IsOfType<double>() || flag.IsOfType<float>()) {
    nlohmann::json number = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!number.is_discarded() && number.is_number()) return number;
  }
  return text;
}

// The flags `filter` accepts (a program's own), by name, with their current values.
inline nlohmann::json FlagsJson(const FlagFilter& filter,
                                const std::set<std::string>& secrets = {}) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!filter(*flag)) continue;
    const std::string key(name);
    if (secrets.count(key) > 0) {
      out[key] = flag->CurrentValue().empty() ? "" : "(set)";
    } else {
      out[key] = FlagValueJson(*flag);
    }
  }
  return out;
}

// The flag names argv[1..] sets ("--name", "--name=v", "--noname" counts as "name" too).
inline std::set<std::string> CommandLineNames(int argc, char** argv) {
  std::set<std::string> given;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;
    if (a.rfind("--", 0) != 0) continue;
    a = a.substr(2);
    a = a.substr(0, a.find('='));
    if (a.rfind("no", 0) == 0) given.insert(a.substr(2));
    given.insert(a);
  }
  return given;
}

// Applies the JSON object in file `path` ("" = none): every key not given on the command line
// (argv) sets the flag of that name, parsed as its command-line text would be. A key that is
// not one of the flags `own` accepts (or names --config or --print_config) is refused,
// naming the nearest that is; nothing is applied then. NOT_FOUND for an unreadable file,
// INVALID_ARGUMENT for bad JSON, a bad key or a value its flag does not parse.
inline absl::Status ApplyConfigFile(const std::string& path, int argc, char** argv,
                                    const FlagFilter& own) {
  if (path.empty()) return absl::OkStatus();
  const std::set<std::string> given = CommandLineNames(argc, argv);
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --config ", path));
  nlohmann::json config =
      nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--config ", path, ": not a JSON object of flag names and values"));
  }
  std::vector<std::pair<absl::CommandLineFlag*, std::string>> values;
  for (const auto& [key, value] : config.items()) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(key);
    if (flag == nullptr || !own(*flag) || key == "config" || key == "print_config") {
      return absl::InvalidArgumentError(absl::StrCat("--config ", path, ": unknown key '", key,
                                                     "'; did you mean '",
                                                     NearestName(key, FlagNames(own)), "'?"));
    }
    if (given.count(key) > 0) continue;
    values.emplace_back(flag, value.is_string() ? value.get<std::string>() : value.dump());
  }
  for (const auto& [flag, text] : values) {
    std::string error;
    if (!flag->ParseFrom(text, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--config ", path, ": ", flag->Name(), ": ", error));
    }
  }
  return absl::OkStatus();
}

// The flags set on the command line or by the --config file `path` ("" = none; a file
// ApplyConfigFile accepted).
inline std::set<std::string> GivenFlags(int argc, char** argv, const std::string& path) {
  std::set<std::string> given = CommandLineNames(argc, argv);
  if (path.empty()) return given;
  std::ifstream in(path);
  const nlohmann::json config =
      nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/false);
  if (config.is_object()) {
    for (const auto& [key, value] : config.items()) given.insert(key);
  }
  return given;
}

// config.json's model_type of the model folder `dir` ("" where it cannot be read): the
// family ApplyProfile picks defaults for.
inline std::string FolderModelType(const std::string& dir) {
  std::ifstream in(dir + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!config.is_object() || !config.contains("model_type") || !config["model_type"].is_string()) {
    return "";
  }
  return config["model_type"].get<std::string>();
}

// --profile: sets `uplink_precision` and `lora_projector`, where the program has them and
// neither the command line nor the config file (`given`) did, to the profile's settings for
// a student of `model_type` (settings::ProfileDefaults). INVALID_ARGUMENT for an unknown
// profile.
inline absl::Status ApplyProfile(const std::string& profile, const std::string& model_type,
                                 const std::set<std::string>& given) {
  if (!settings::IsProfile(profile)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--profile must be measured or paper, not '", profile, "'"));
  }
  const settings::ProfileSettings p = settings::ProfileDefaults(profile, model_type);
  const std::pair<const char*, std::string> values[] = {
      {"uplink_precision", p.uplink_precision},
      {"lora_projector", p.lora_projector ? "true" : "false"}};
  for (const auto& [name, text] : values) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr || given.count(name) > 0) continue;
    std::string error;
    if (!flag->ParseFrom(text, &error)) return absl::InternalError(error);
  }
  return absl::OkStatus();
}

}  // namespace cdcca::cli

#endif  // CDCCA_CLI_PRINT_CONFIG_H_
