#include "distill/job.h"

#include <algorithm>

namespace cdcca::distill {

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
