// `cdcca` sub-commands of the distillation module (sim/cdcca_main.cc's table).
#ifndef CDCCA_DISTILL_COMMANDS_H_
#define CDCCA_DISTILL_COMMANDS_H_

#include <string>
#include <vector>

namespace cdcca::distill {

// `cdcca adapt-eval`: the adaptation experiment of distill/adapt_eval.h (AKD vs PL, UTS vs
// random tokens). Flags: see `cdcca adapt-eval --helpfull`. Returns the exit code.
int AdaptEvalCommand(const std::vector<std::string>& args);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_COMMANDS_H_
