// The programs' event log: one JSON object per line on stderr ({"event": NAME, ...}), what
// operators and the tests read to follow a job, an ingest or a round. One write per line, so
// lines of concurrent threads never interleave; strings that are not UTF-8 are written with
// U+FFFD in place of the bad bytes rather than dropped. Thread-safe.
#ifndef CDCCA_STORAGE_EVENT_LOG_H_
#define CDCCA_STORAGE_EVENT_LOG_H_

#include <cstdio>
#include <string>

#include "nlohmann/json.hpp"

namespace cdcca {

inline void LogEvent(const nlohmann::json& event) {
  const std::string line =
      event.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace cdcca

#endif  // CDCCA_STORAGE_EVENT_LOG_H_
