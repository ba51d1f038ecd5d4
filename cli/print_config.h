// `--print_config`: a program prints the configuration it would run with (every one of its
// flags, after the command line and any config file, as one JSON object keyed by the flag's
// name) and exits 0 without starting anything. The names are the settings' one names
// (settings/defaults.h), so the output of cdcca-cloud, cdcca-device and cdcca-sim can be
// compared key by key. Secrets are not printed: a flag named in `secrets` that is set reads
// "(set)". Header-only, as cli/flags_help.h; needs the absl flags libraries and nlohmann_json.
#ifndef CDCCA_CLI_PRINT_CONFIG_H_
#define CDCCA_CLI_PRINT_CONFIG_H_

#include <cstdint>
#include <set>
#include <string>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "cli/flags_help.h"
#include "nlohmann/json.hpp"

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

}  // namespace cdcca::cli

#endif  // CDCCA_CLI_PRINT_CONFIG_H_
