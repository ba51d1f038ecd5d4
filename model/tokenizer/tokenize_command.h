// `cdcca tokenize --model DIR --text TEXT`: prints {"ids": [...]}, the ids transformers'
// `tokenizer(text)` gives for the folder's tokenizer.
#ifndef CDCCA_MODEL_TOKENIZER_TOKENIZE_COMMAND_H_
#define CDCCA_MODEL_TOKENIZER_TOKENIZE_COMMAND_H_

#include <string>
#include <vector>

#include "absl/flags/declare.h"

// --model (the model folder) is defined once, in tokenize_command.cc; other commands of the
// same binary (e.g. `cdcca generate`) read it through this declaration rather than defining
// their own, which would clash at link time.
ABSL_DECLARE_FLAG(std::string, model);

namespace cdcca::tokenizer {

// Returns the process exit code: 0, 1 on a load or encode error, 2 on bad usage.
int TokenizeCommand(const std::vector<std::string>& args);
// The flags `cdcca tokenize` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kTokenizeFlags[];

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_TOKENIZE_COMMAND_H_
