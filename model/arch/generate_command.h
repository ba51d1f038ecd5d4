// `cdcca generate`: a greedy answer of a Hugging Face multimodal checkpoint for one image
// and prompt, as transformers' processor + generate give it.
//
//   cdcca generate --model DIR --image FILE --prompt TEXT [--max_new_tokens N]
//       [--precision fp32|bf16|fp16|int8|int4] [--device cpu|cuda] [--json] [--template NAME]
//
//   cdcca answer: see AnswerCommand below.
//
// --prompt is exactly the text the processor receives (for LLaVA it contains <image>); no
// template is added unless --template names one. --json prints one JSON object:
// {"input_ids", "tokens", "text", "first_logits"}.
#ifndef CDCCA_MODEL_ARCH_GENERATE_COMMAND_H_
#define CDCCA_MODEL_ARCH_GENERATE_COMMAND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/arch/hf_answerer.h"

namespace cdcca::model {

struct GenerateRequest {
  std::string model_dir;
  std::string image_path;
  std::string prompt;
  std::string template_name;  // "" = the prompt as given
  int64_t max_new_tokens = 32;
  std::string precision = "fp32";
  std::string device = "cpu";
  // An adapted state (hf_adapter_state.h, `cdcca hf-adapt --out`) to apply to the model
  // first; "" = the folder's weights as they are.
  std::string adapter_state;
};

// Loads model, tokenizer and image processor from the folder and answers. Errors name the
// file and field (model, tokenizer, image) or the flag.
absl::StatusOr<GenerateReply> RunGenerate(const GenerateRequest& request);

// The command: flags as above; returns the process exit code.
int GenerateCommand(const std::vector<std::string>& args);

// `cdcca answer --model DIR --questions FILE --images DIR --out FILE [--limit N]
//  [--template NAME] [--precision P] [--device D] [--max_new_tokens N]`: answers a VQAv2
// questions file or an A-OKVQA split over its image folder (images found by the id in their
// file names) and writes the official results format ([{question_id, answer}] or
// {qid: {multiple_choice, direct_answer}}). The prompt is the template (default llava)
// around the question and LLaVA-1.5's "Answer the question using a single word or phrase."
int AnswerCommand(const std::vector<std::string>& args);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_GENERATE_COMMAND_H_
