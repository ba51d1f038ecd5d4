// `cdcca` sub-commands of the model module (flags are defined in commands.cc):
//   cdcca pretrain --config configs/models/small.json --out DIR [--threads N] [--cpu]
//   cdcca model-eval --checkpoint DIR [--scenes 200] [--table FILE]
#ifndef CDCCA_MODEL_FAMILY_COMMANDS_H_
#define CDCCA_MODEL_FAMILY_COMMANDS_H_

#include <string>
#include <vector>

namespace cdcca::model {

int PretrainCommand(const std::vector<std::string>& args);
int ModelEvalCommand(const std::vector<std::string>& args);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_COMMANDS_H_
