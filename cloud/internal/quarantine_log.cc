#include "cloud/internal/quarantine_log.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace cdcca::cloud::internal {

std::string QuarantineLog::Encode() const {
  nlohmann::json j = {{"samples", samples}, {"through_sequence", through_sequence}};
  nlohmann::json entries = nlohmann::json::array();
  for (const QuarantineEntry& e : recent) {
    nlohmann::json x = {{"sequence", e.sequence}, {"samples", e.samples}, {"reason", e.reason}};
    if (!e.whole_batch) x["sample_id"] = e.sample_id;
    entries.push_back(std::move(x));
  }
  j["recent"] = std::move(entries);
  return j.dump(1) + "\n";
}

absl::StatusOr<QuarantineLog> QuarantineLog::Decode(const std::string& bytes,
                                                    const std::string& path) {
  QuarantineLog log;
  try {
    const nlohmann::json j = nlohmann::json::parse(bytes);
    log.samples = j.at("samples").get<uint64_t>();
    log.through_sequence = j.at("through_sequence").get<uint64_t>();
    for (const nlohmann::json& x : j.at("recent")) {
      QuarantineEntry e;
      e.sequence = x.at("sequence").get<uint64_t>();
      e.samples = x.at("samples").get<uint64_t>();
      e.reason = x.at("reason").get<std::string>();
      e.whole_batch = !x.contains("sample_id");
      if (!e.whole_batch) e.sample_id = x.at("sample_id").get<uint64_t>();
      log.recent.push_back(std::move(e));
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": not a quarantine file: ", e.what()));
  }
  return log;
}

bool QuarantineLog::Add(const std::vector<QuarantineEntry>& entries) {
  bool changed = false;
  uint64_t through = through_sequence;
  for (const QuarantineEntry& e : entries) {
    if (e.sequence <= through_sequence) continue;
    samples += e.samples;
    recent.push_back(e);
    through = std::max(through, e.sequence);
    changed = true;
  }
  through_sequence = through;
  if (recent.size() > kRecent) recent.erase(recent.begin(), recent.end() - kRecent);
  return changed;
}

}  // namespace cdcca::cloud::internal
