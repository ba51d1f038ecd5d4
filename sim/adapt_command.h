// `cdcca adapt` and `cdcca export-adapter`: one CD-CCA round on a Hugging Face
// teacher-student pair, offline, and the PEFT export of its result; `cdcca adapt-eval` on a pair.
//
//   cdcca adapt --teacher DIR --student_base DIR --images DIR --prompt TEXT --out STATE
//     The device's side on each frame: the student (at --student_precision, the device's)
//     answers from its tower's tokens, and the device's step (device::SampleStep) runs UTS:
//     stage 1 keeps the frame by its answer's mean token entropy (--uts_keep_fraction, the
//     running quantile as on a device, or --entropy_alpha; default 0: every frame); on a kept
//     frame stage 2 (--uts_mc_passes MC-dropout passes at --uts_dropout) keeps the top
//     --uts_token_ratio tokens by VIS (device::SelectTokens); then the cloud's side:
//     an AKD job (distill/pair_distiller.h, --learner, --distill_config, --max_steps) trains the
//     student's adapters (--lora_rank, --lora_alpha) on the kept tokens, and the adapted state
//     is written to STATE (model/hub/adapter_state.h). One JSON line per frame and one for the
//     job on stderr.
//   cdcca export-adapter --state STATE --out DIR
//     The state as a PEFT LoRA adapter plus non_lora.safetensors.
//
// `cdcca generate --model DIR --adapter_state STATE` answers with the adapted student.
#ifndef CDCCA_SIM_HF_ADAPT_COMMAND_H_
#define CDCCA_SIM_HF_ADAPT_COMMAND_H_

#include <string>
#include <vector>

#include "distill/pair_side.h"

namespace cdcca::sim {

int AdaptCommand(const std::vector<std::string>& args);
// The flags `cdcca adapt` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kAdaptFlags[];

int ExportAdapterCommand(const std::vector<std::string>& args);
// The flags `cdcca export-adapter` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kExportAdapterFlags[];

// `cdcca adapt-eval` (sim/adapt_eval_pair.h) on the pair --teacher / --student_base, or on the
// family --checkpoint DIR read as its pair (DIR/teacher, DIR), with adapt's
// --student_template, --teacher_template, --student_precision, --teacher_precision, --device,
// --lora_*, --uts_* and job flags.
int AdaptEvalAnyPairCommand(const std::vector<std::string>& args);
// The flags `cdcca adapt-eval` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kAdaptEvalFlags[];

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_HF_ADAPT_COMMAND_H_
