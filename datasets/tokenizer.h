// Word-level tokenizer over the closed scene language.
//
// Ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 <unk>, then the words of the vocabulary in the order it
// was built with (SceneLanguage(): sorted, so ids are stable across runs and machines).
// Saved and loaded as JSON {"format": "cdcca-word-tokenizer", "version": 1,
// "tokens": [...]} with tokens[i] the word of id i; also loaded from the Hugging Face
// tokenizer.json (WordLevel) of a family's model folder (model::WordLevelTokenizerJson), whose
// words by id end at the first "<unused_N>" or "<image>". Immutable after construction, so
// const methods are thread-safe.
#ifndef CDCCA_DATASETS_TOKENIZER_H_
#define CDCCA_DATASETS_TOKENIZER_H_

#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cdcca::datasets {

class Tokenizer {
 public:
  static constexpr int kPad = 0;
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;
  static constexpr int kUnk = 3;
  static constexpr int kNumSpecial = 4;

  // The vocabulary of everything the scene generator can say (LanguageCorpus()), sorted.
  static Tokenizer SceneLanguage();
  // Specials followed by the distinct words of `texts` (split with Split), sorted.
  static Tokenizer FromTexts(const std::vector<std::string>& texts);
  // Errors: INVALID_ARGUMENT on bad JSON, a wrong format tag, specials not at 0-3, or
  // duplicate tokens. Untrusted text is fine (fuzzed: datasets/fuzz/); memory is bounded by
  // about 20 x the text's size.
  static absl::StatusOr<Tokenizer> FromJson(std::string_view json);
  static absl::StatusOr<Tokenizer> Load(const std::string& path);  // NOT_FOUND if missing

  std::string ToJson() const;
  absl::Status Save(const std::string& path) const;

  // Lower-cases and splits on whitespace; punctuation other than '-' and '\'' inside a
  // word becomes its own token ("what is it?" -> what, is, it, ?).
  static std::vector<std::string> Split(std::string_view text);

  // Ids of `text`'s words; unknown words map to kUnk.
  std::vector<int> Encode(std::string_view text, bool add_bos = false, bool add_eos = false) const;
  // Words of `ids` joined by spaces (no space before punctuation); stops at the first
  // kEos; skips <pad>/<bos>; unknown ids decode as "<unk>".
  std::string Decode(const std::vector<int>& ids) const;

  int size() const { return static_cast<int>(tokens_.size()); }
  int Id(std::string_view word) const;  // kUnk if absent
  const std::string& Word(int id) const;
  const std::vector<std::string>& tokens() const { return tokens_; }

 private:
  explicit Tokenizer(std::vector<std::string> tokens);
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> ids_;
};

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_TOKENIZER_H_
