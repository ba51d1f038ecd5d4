// libFuzzer entry for the tokenizer vocabulary reader (a model folder's tokenizer.json):
// Tokenizer::FromJson, then encoding and decoding with what it accepted.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "datasets/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<cdcca::datasets::Tokenizer> tok = cdcca::datasets::Tokenizer::FromJson(text);
  if (!tok.ok()) return 0;
  if (tok->size() < cdcca::datasets::Tokenizer::kNumSpecial) __builtin_trap();
  // Every token's id round-trips; encode/decode stay in range on the file's own text.
  for (int id = 0; id < tok->size(); ++id) {
    if (tok->Id(tok->Word(id)) != id) __builtin_trap();
  }
  const std::vector<int> ids = tok->Encode(text.substr(0, 512), true, true);
  for (int id : ids) {
    if (id < 0 || id >= tok->size()) __builtin_trap();
  }
  (void)tok->Decode(ids);
  (void)tok->Decode({-1, 1 << 30, tok->size()});
  // What Save writes reads back the same.
  absl::StatusOr<cdcca::datasets::Tokenizer> again =
      cdcca::datasets::Tokenizer::FromJson(tok->ToJson());
  if (!again.ok() || again->tokens() != tok->tokens()) __builtin_trap();
  return 0;
}
