// `cdcca` sub-commands of the model module (flags are defined in commands.cc):
//   cdcca pretrain --config configs/models/small.json --out DIR [--torch_threads N] [--cpu]
//   cdcca model-eval --checkpoint_dir DIR [--scenes 200] [--table FILE]
#ifndef CDCCA_MODEL_FAMILY_COMMANDS_H_
#define CDCCA_MODEL_FAMILY_COMMANDS_H_

#include <string>
#include <vector>

namespace cdcca::model {

int PretrainCommand(const std::vector<std::string>& args);
// The flags `cdcca pretrain` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kPretrainFlags[];

int ModelEvalCommand(const std::vector<std::string>& args);
// The flags `cdcca model-eval` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kModelEvalFlags[];

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_COMMANDS_H_
