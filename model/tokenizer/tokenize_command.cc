#include "model/tokenizer/tokenize_command.h"

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "model/tokenizer/tokenizer.h"

ABSL_FLAG(std::string, model, "",
          "tokenize/generate: Hugging Face model folder (or a tokenizer subfolder)");
ABSL_FLAG(std::string, text, "", "tokenize: the text to encode");
ABSL_FLAG(bool, add_special_tokens, true,
          "tokenize: add the special tokens transformers adds (e.g. <s>, [CLS] ... [SEP])");

namespace cdcca::tokenizer {

const char* const kTokenizeFlags[] = {"model", "text", "add_special_tokens", nullptr};

int TokenizeCommand(const std::vector<std::string>& args) {
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty() || !args.empty()) {
    std::fprintf(stderr,
                 "usage: cdcca tokenize --model DIR --text TEXT [--noadd_special_tokens]\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromFolder(dir);
  if (!tok.ok()) {
    std::fprintf(stderr, "cdcca tokenize: %s\n", std::string(tok.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<std::vector<int32_t>> ids =
      (*tok)->Encode(absl::GetFlag(FLAGS_text), absl::GetFlag(FLAGS_add_special_tokens));
  if (!ids.ok()) {
    std::fprintf(stderr, "cdcca tokenize: %s\n", std::string(ids.status().message()).c_str());
    return 1;
  }
  std::printf("{\"ids\": [%s]}\n", absl::StrJoin(*ids, ", ").c_str());
  return 0;
}

}  // namespace cdcca::tokenizer
