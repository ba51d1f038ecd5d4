// libFuzzer entry for a SentencePiece tokenizer.model (a downloaded folder's file, parsed by
// sentencepiece_reader.h and converted as transformers' LlamaTokenizer does): the input is the
// file, beside the fixture's tokenizer_config.json; Tokenizer::FromFolder, then encoding and
// decoding with what it accepted.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "model/tokenizer/fuzz/folder_files.h"
#include "model/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fz = cdcca::tokenizer::fuzz;
  static const std::string dir = [] {
    const std::string d = fz::ScratchRoot() + "/spm";
    if (::mkdir(d.c_str(), 0755) != 0) std::abort();
    fz::WriteFileOrDie(d + "/tokenizer_config.json",
                       fz::ReadFileOrDie(std::string(CDCCA_SOURCE_DIR) +
                                         "/tests/fixtures/hf/tokenizers/sentencepiece_llama/"
                                         "tokenizer_config.json"));
    return d;
  }();
  fz::WriteFileOrDie(dir + "/tokenizer.model",
                     std::string_view(reinterpret_cast<const char*>(data), size));
  auto tok = cdcca::tokenizer::Tokenizer::FromFolder(dir);
  if (tok.ok()) fz::Exercise(**tok);
  return 0;
}
