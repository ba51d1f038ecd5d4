// `cdcca generate`: a greedy answer of a Hugging Face multimodal checkpoint for one image
// and prompt, as transformers' processor + generate give it; `cdcca answer`: a benchmark
// file answered into its official results format.
//
//   cdcca generate --model DIR --image FILE --prompt TEXT [--max_new_tokens N]
//       [--precision fp32|bf16|fp16|int8|int4] [--device cpu|cuda] [--json] [--template NAME]
//
//   cdcca answer: see AnswerRequest below.
//
// --prompt is exactly the text the processor receives (for LLaVA it contains <image>); no
// template is added unless --template names one (ResolvePromptFormat: chat, auto, llava, ...).
// --json prints one JSON object:
// {"input_ids", "tokens", "text", "first_logits"}.
#ifndef CDCCA_MODEL_ARCH_GENERATE_COMMAND_H_
#define CDCCA_MODEL_ARCH_GENERATE_COMMAND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/arch/answerer.h"

namespace cdcca::model {

struct GenerateRequest {
  std::string model_dir;
  std::string image_path;
  std::string prompt;
  std::string template_name;  // ResolvePromptFormat's names; "" = the prompt as given
  int64_t max_new_tokens = 32;
  std::string precision = "fp32";
  std::string device = "cpu";
  // An adapted state (adapter_state.h, `cdcca adapt --out`) to apply to the model
  // first; "" = the folder's weights as they are.
  std::string adapter_state;
};

// Loads model, tokenizer and image processor from the folder and answers. Errors name the
// file and field (model, tokenizer, image) or the flag.
absl::StatusOr<GenerateReply> RunGenerate(const GenerateRequest& request);

// The command: flags as above; returns the process exit code.
int GenerateCommand(const std::vector<std::string>& args);
// The flags `cdcca generate` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kGenerateFlags[];

// `cdcca answer`: a benchmark's questions (or images, for captions) answered by a folder,
// written as the benchmark's official results file, which `cdcca eval` scores.
struct AnswerRequest {
  std::string model_dir;
  // vqa: a VQAv2 questions file -> [{"question_id", "answer"}];
  // aokvqa: an A-OKVQA split -> {question_id: {"multiple_choice", "direct_answer"}} (the
  //   choice is the one the free answer names, else the one sharing most words with it);
  // caption: a COCO captions file (its "images") -> [{"image_id", "caption"}].
  std::string task = "vqa";
  std::string input_path;  // the questions, split or captions file
  // The folder of the images: found by the id in their file names (COCO_val2014_000000000042.jpg,
  // 000000000042.jpg) for vqa / aokvqa, by file_name for caption.
  std::string images_dir;
  std::string out_path;
  // The prompt format (ResolvePromptFormat): "auto" = the folder's chat template, else the
  // architecture's default.
  std::string template_name = "auto";
  // caption: the instruction; "" = the architecture's (AnswerInstruction).
  std::string caption_prompt;
  int64_t limit = 0;  // answer at most this many questions or images; 0 = all
  int64_t max_new_tokens = 32;
  std::string precision = "fp32";
  std::string device = "cpu";
  std::string adapter_state;  // as GenerateRequest::adapter_state
};

struct AnswerSummary {
  int64_t answered = 0;
  double seconds = 0;         // generating, load excluded
  std::string prompt_format;  // PromptFormat::Describe()
};

// The text put to a model of `model_type` for one question (vqa, aokvqa) or image (caption,
// `question` unused), before the prompt format: LLaVA, LLaVA-1.5's evaluation instructions
// (the question + "\nAnswer the question using a single word or phrase."; "Provide a
// one-sentence caption for the provided image."); BLIP-2 and InstructBLIP, the question as it
// is and no text for a caption.
std::string AnswerInstruction(const std::string& model_type, const std::string& task,
                              const std::string& question);

// Loads the folder (and the adapted state), answers and writes request.out_path. Errors name
// the file, the flag or the question.
absl::StatusOr<AnswerSummary> RunAnswer(const AnswerRequest& request);

// The command: flags as AnswerRequest (--questions, or --annotations for --task caption);
// returns the process exit code.
int AnswerCommand(const std::vector<std::string>& args);

// The flags `cdcca answer` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kAnswerFlags[];

// `cdcca pack --model DIR --precision int8|int4 [--device cpu|cuda]`: loads the folder at
// that precision and writes its weight pack (weight_pack.h), so that later loads at that
// precision read the packed weights instead of quantizing the checkpoint again. Prints what
// it wrote, or that the pack there is already the folder's.
int PackCommand(const std::vector<std::string>& args);
extern const char* const kPackFlags[];

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_GENERATE_COMMAND_H_
