// libFuzzer entry for the Hugging Face tokenizer.json reader (a downloaded model folder's
// file): Tokenizer::FromJson, then encoding and decoding with what it accepted.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto tok = cdcca::tokenizer::Tokenizer::FromJson(bytes);
  if (!tok.ok()) return 0;
  // Encode a fixed text with Unicode, digits and whitespace runs, and the file's own bytes.
  for (std::string_view text :
       {std::string_view("Hello  wörld 123\n\t<image> 中文 😀"), bytes.substr(0, 256)}) {
    auto ids = (*tok)->Encode(text, /*add_special_tokens=*/true);
    if (!ids.ok()) continue;
    (void)(*tok)->Decode(*ids, false);
    (void)(*tok)->Decode(*ids, true);
  }
  const std::vector<int32_t> odd = {-1, 0, 1 << 30};
  (void)(*tok)->Decode(odd, false);
  return 0;
}
