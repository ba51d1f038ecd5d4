#include "distill/job.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace cdcca::distill {

absl::Status CheckFp8BaseMode(const std::string& mode, const std::string& what) {
  if (mode == "native" || mode == "on" || mode == "off") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " must be native, on or off, got \"", mode, "\""));
}

bool PastBudget(const JobOptions& options, std::chrono::steady_clock::time_point start) {
  return options.time_budget_s > 0 &&
         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >=
             options.time_budget_s;
}

int PrepareBatch(const JobOptions& options) {
  return std::max(1, options.prepare_batch > 0 ? options.prepare_batch : 2 * options.batch_size);
}

LossTerm SummarizeLossTerm(const std::string& name, const std::vector<double>& per_step) {
  LossTerm term;
  term.name = name;
  term.first = per_step.front();
  const size_t tail = std::min<size_t>(10, per_step.size());
  for (size_t i = per_step.size() - tail; i < per_step.size(); ++i) {
    term.last += per_step[i] / tail;
  }
  for (double v : per_step) term.mean += v / per_step.size();
  return term;
}

}  // namespace cdcca::distill
