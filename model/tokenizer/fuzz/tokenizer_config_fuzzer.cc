// libFuzzer entry for tokenizer_config.json (a downloaded folder's file: special tokens,
// added_tokens_decoder, add_bos/eos, legacy, tokenizer_class). The input is the file; its
// length's parity picks the folder it joins: a fixture's tokenizer.json (even) or its
// SentencePiece tokenizer.model (odd), which read the config on different paths (so the
// committed configs seed both as they are). Then Tokenizer::FromFolder, encoding and decoding
// with what it accepted.
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "model/tokenizer/fuzz/folder_files.h"
#include "model/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = cdcca::tokenizer::fuzz;
  static const std::string dirs[2] = {
      [] {
        const std::string d = fz::ScratchRoot() + "/json";
        if (::mkdir(d.c_str(), 0755) != 0) std::abort();
        fz::WriteFileOrDie(d + "/tokenizer.json",
                           fz::ReadFileOrDie(std::string(CDCCA_SOURCE_DIR) +
                                             "/tests/fixtures/hf/tokenizers/bpe_metaspace_llama2/"
                                             "tokenizer.json"));
        return d;
      }(),
      [] {
        const std::string d = fz::ScratchRoot() + "/spm";
        if (::mkdir(d.c_str(), 0755) != 0) std::abort();
        fz::WriteFileOrDie(d + "/tokenizer.model",
                           fz::ReadFileOrDie(std::string(CDCCA_SOURCE_DIR) +
                                             "/tests/fixtures/hf/tokenizers/sentencepiece_llama/"
                                             "tokenizer.model"));
        return d;
      }()};
  const std::string& dir = dirs[size & 1];
  fz::WriteFileOrDie(dir + "/tokenizer_config.json",
                     std::string_view(reinterpret_cast<const char*>(data), size));
  auto tok = cdcca::tokenizer::Tokenizer::FromFolder(dir);
  if (tok.ok()) fz::Exercise(**tok);
  return 0;
}
