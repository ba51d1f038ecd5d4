// The vocabulary and the BPE model, shared by tokenizer.json and the SentencePiece
// conversion (which builds a BPE from tokenizer.model as transformers does).
#ifndef CDCCA_MODEL_TOKENIZER_MODELS_H_
#define CDCCA_MODEL_TOKENIZER_MODELS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "model/tokenizer/components.h"

namespace cdcca::tokenizer {

// token <-> id; ids need not be dense.
class Vocabulary {
 public:
  absl::Status Add(std::string token, int32_t id);
  std::optional<int32_t> Find(std::string_view token) const;
  std::optional<std::string> Token(int32_t id) const;
  // One past the largest id.
  int64_t IdBound() const { return id_bound_; }

 private:
  absl::flat_hash_map<std::string, int32_t> by_token_;
  // Sparse: a hostile file's id 2^30 must not allocate 2^30 slots.
  absl::flat_hash_map<int32_t, std::string> by_id_;
  int64_t id_bound_ = 0;
};

absl::StatusOr<Vocabulary> ParseVocabulary(const JsonAt& json);

struct BpeOptions {
  std::optional<std::string> unk_token;
  std::optional<std::string> continuing_subword_prefix;
  std::optional<std::string> end_of_word_suffix;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

class Bpe : public Model {
 public:
  Bpe(Vocabulary vocab, BpeOptions options);
  // Appends a merge; its rank is the number of merges before it. `where` names it in errors.
  absl::Status AddMerge(std::string_view left, std::string_view right, const JsonAt& where);

  absl::Status Tokenize(std::string_view word, std::vector<int32_t>* ids) const override;
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    return vocab_.Find(token);
  }
  std::optional<std::string> IdToToken(int32_t id) const override { return vocab_.Token(id); }
  int64_t VocabSize() const override { return vocab_.IdBound(); }

 private:
  struct MergeTarget {
    int32_t rank;
    int32_t id;
  };
  Vocabulary vocab_;
  BpeOptions options_;
  std::optional<int32_t> unk_id_;
  int32_t merge_count_ = 0;
  absl::flat_hash_map<uint64_t, MergeTarget> merges_;  // (left id, right id) -> merge
};

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_MODELS_H_
