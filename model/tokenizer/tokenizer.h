// cdcca::tokenizer::Tokenizer: the tokenizer of a Hugging Face model folder, giving the ids
// transformers' `tokenizer(text)` gives and decoding as `tokenizer.decode` does.
//
// Reads `tokenizer.json` as the `tokenizers` library defines it (BPE, WordPiece, WordLevel,
// Unigram models; normalizers, pre-tokenizers, post-processors, decoders; added tokens), or,
// when a folder has none, a SentencePiece `tokenizer.model` converted the way transformers'
// LlamaTokenizer converts it, or T5's `spiece.model` (FromSentencePieceUnigram).
// `tokenizer_config.json` / `special_tokens_map.json` add the special tokens they name,
// add_bos_token / add_eos_token and clean_up_tokenization_spaces. Torch-free. A loaded Tokenizer is
// immutable: Encode/Decode are thread-safe.
#ifndef CDCCA_MODEL_TOKENIZER_TOKENIZER_H_
#define CDCCA_MODEL_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace cdcca::tokenizer {

class Normalizer;
class PreTokenizer;
class Model;
class PostProcessor;
class Decoder;
struct Piece;

// A token matched in the text before the model runs (tokenizer.json "added_tokens").
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;  // only as a whole word (no word character either side)
  bool lstrip = false;       // swallows the whitespace on its left
  bool rstrip = false;       // swallows the whitespace on its right
  bool normalized = true;    // matched in the normalized text rather than the raw text
  bool special = false;      // dropped by Decode(..., skip_special_tokens=true)
};

class Tokenizer {
 public:
  // Parses tokenizer.json text; `file` names it in errors. Touches no file.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(
      std::string_view json, std::string_view file = "tokenizer.json");
  // Loads a model folder (or a tokenizer subfolder such as qformer_tokenizer/):
  // tokenizer.json, else tokenizer.model, else spiece.model; then tokenizer_config.json and
  // special_tokens_map.json when present.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFolder(const std::string& dir);
  // A SentencePiece Unigram model (T5's spiece.model, the file a folder has when it has no
  // tokenizer.json or tokenizer.model) converted as transformers converts T5's: its
  // precompiled normalizer and runs of spaces folded to one, Metaspace (the dummy prefix as
  // add_dummy_prefix says), byte fallback as the model has it, eos appended. InvalidArgument
  // for a malformed file or another model type.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromSentencePieceUnigram(
      const std::string& model_path);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Ids of `text` (UTF-8; invalid UTF-8 is an error). With add_special_tokens the
  // post-processor adds its special tokens (e.g. <s>, [CLS] ... [SEP]).
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens = true) const;
  // Text of `ids`; unknown ids are skipped, as the reference does.
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;
  // One past the largest id (model vocabulary and added tokens).
  int64_t VocabSize() const;

  // Special tokens named by the config files (or found in added_tokens), when present.
  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }
  std::optional<int32_t> pad_id() const { return pad_id_; }
  std::optional<int32_t> unk_id() const { return unk_id_; }
  const std::vector<AddedToken>& added_tokens() const { return added_; }

 private:
  Tokenizer();
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromSentencePiece(const std::string& model_path,
                                                                      bool legacy);
  absl::Status ApplyConfig(const std::string& dir, bool from_sentencepiece);
  // Adds (or updates) an added token; `normalizer_` must be set already.
  absl::Status AddToken(AddedToken token);
  absl::Status SplitOnAddedTokens(std::vector<Piece>* pieces, bool normalized) const;

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<PostProcessor> post_processor_;
  std::unique_ptr<Decoder> decoder_;

  std::vector<AddedToken> added_;
  // Per added token (same index): the text matched, normalized when the token is.
  std::vector<std::string> added_pattern_;
  absl::flat_hash_map<std::string, int32_t> added_by_content_;
  absl::flat_hash_map<int32_t, size_t> added_by_id_;  // id -> index in added_

  bool clean_up_tokenization_spaces_ = false;
  std::optional<int32_t> bos_id_, eos_id_, pad_id_, unk_id_;
};

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_TOKENIZER_H_
