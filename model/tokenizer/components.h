// The stages of a tokenizer.json pipeline (normalizer, pre-tokenizer, model,
// post-processor, decoder) as the Hugging Face `tokenizers` library defines them, each
// built from its JSON object by a Parse* function. Internal to cdcca_tokenizers.
#ifndef CDCCA_MODEL_TOKENIZER_COMPONENTS_H_
#define CDCCA_MODEL_TOKENIZER_COMPONENTS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/tokenizer/json_fields.h"
#include "model/tokenizer/regex.h"

namespace cdcca::tokenizer {

// One piece of the input on its way through the pipeline.
struct Piece {
  std::string text;
  // >= 0 once the piece is a known token (an added token split out before the model).
  int32_t id = -1;
  // The piece begins at the first byte of the original input (Metaspace's "first" scheme).
  bool at_start = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual absl::Status Normalize(std::string* text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits (and may rewrite) every piece with id < 0; known tokens pass through untouched.
  virtual absl::Status PreTokenize(std::vector<Piece>* pieces) const = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  // Appends the ids of one pre-tokenized word.
  virtual absl::Status Tokenize(std::string_view word, std::vector<int32_t>* ids) const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual std::optional<std::string> IdToToken(int32_t id) const = 0;
  // One past the largest id of the model's vocabulary.
  virtual int64_t VocabSize() const = 0;
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Adds the special tokens of a single sequence.
  virtual void Process(std::vector<int32_t>* ids) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void DecodeChain(std::vector<std::string>* tokens) const = 0;
};

// Each returns an error naming the file and JSON path of an unsupported type or bad field.
absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(const JsonAt& json);
absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const JsonAt& json);
absl::StatusOr<std::unique_ptr<Model>> ParseModel(const JsonAt& json);
absl::StatusOr<std::unique_ptr<PostProcessor>> ParsePostProcessor(const JsonAt& json);
absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(const JsonAt& json);

// A post-processor adding fixed ids before and after the sequence (`bos $A eos`).
std::unique_ptr<PostProcessor> MakeWrapProcessor(std::vector<int32_t> before,
                                                 std::vector<int32_t> after);

// A {"String": s} or {"Regex": r} pattern (Split, Replace): literal text or a PCRE2 regex.
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;  // set for {"Regex": ...}

  // [start, end) byte ranges of the matches in `text`.
  absl::StatusOr<std::vector<std::pair<size_t, size_t>>> FindAll(std::string_view text) const;
  absl::StatusOr<std::string> ReplaceAll(std::string_view text, std::string_view content) const;
};
absl::StatusOr<Pattern> ParsePattern(const JsonAt& json);

// Byte-level BPE's byte <-> printable code point table (GPT-2).
const std::string& ByteToUnicode(uint8_t byte);
// The byte a code point stands for, or -1.
int UnicodeToByte(char32_t cp);

// transformers' clean_up_tokenization (" ." -> "." ...); the WordPiece decoder's cleanup.
std::string CleanUpTokenization(std::string text, bool wordpiece_variant);

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_COMPONENTS_H_
