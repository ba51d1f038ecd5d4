// For the fuzzers of a tokenizer folder's files (tokenizer.model, tokenizer_config.json):
// Tokenizer::FromFolder reads files, so each input is written into a scratch folder of the
// process's own, beside fixed files copied once from the committed fixtures.
#ifndef CDCCA_MODEL_TOKENIZER_FUZZ_FOLDER_FILES_H_
#define CDCCA_MODEL_TOKENIZER_FUZZ_FOLDER_FILES_H_

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer/tokenizer.h"

namespace cdcca::tokenizer::fuzz {

// A folder under $TMPDIR made once per process (libFuzzer runs one input at a time).
inline const std::string& ScratchRoot() {
  static const std::string root = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/cdcca_tok_fuzz_XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    return pattern;
  }();
  return root;
}

inline void WriteFileOrDie(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) std::abort();
}

inline std::string ReadFileOrDie(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) std::abort();
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Encodes and decodes a fixed text with what was accepted: the reader's output must be a
// usable tokenizer, not only a parsed file.
inline void Exercise(const Tokenizer& tok) {
  for (std::string_view text : {std::string_view("Hello  wörld 123\n\t<image> 中文 😀"),
                                std::string_view("USER: <image>\nWhat is shown? ASSISTANT:")}) {
    auto ids = tok.Encode(text, /*add_special_tokens=*/true);
    if (!ids.ok()) continue;
    (void)tok.Decode(*ids, false);
    (void)tok.Decode(*ids, true);
  }
  const std::vector<int32_t> odd = {-1, 0, 1 << 30};
  (void)tok.Decode(odd, false);
}

}  // namespace cdcca::tokenizer::fuzz

#endif  // CDCCA_MODEL_TOKENIZER_FUZZ_FOLDER_FILES_H_
