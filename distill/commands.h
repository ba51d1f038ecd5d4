// `cdcca` sub-commands of the distillation module (sim/cdcca_main.cc's table).
#ifndef CDCCA_DISTILL_COMMANDS_H_
#define CDCCA_DISTILL_COMMANDS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "distill/adapt_eval.h"

namespace cdcca::distill {

// `cdcca adapt-eval`: the adaptation experiment of distill/adapt_eval.h (AKD vs PL, UTS vs
// random tokens). Flags: see `cdcca adapt-eval --helpfull`. Returns the exit code.
int AdaptEvalCommand(const std::vector<std::string>& args);

// adapt-eval's options from its flags (checkpoint, shift, scenes, UTS, arms, learners, job);
// InvalidArgument for a bad shift, errors of the settings file. For `cdcca adapt-eval` on a
// Hugging Face pair (sim/hub_adapt_eval.h), which reads the same flags.
absl::StatusOr<AdaptEvalOptions> AdaptEvalOptionsFromFlags();

// Prints the report's table on stdout and writes --out.md / --out.json; an error on stderr
// prefixed with `cdcca COMMAND:`. Returns the exit code (0, or 1 for an error).
int WriteAdaptReport(const std::string& command, const absl::StatusOr<AdaptReport>& report);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_COMMANDS_H_
