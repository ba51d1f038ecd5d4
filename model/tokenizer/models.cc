// Models of tokenizer.json: BPE (byte fallback, merges as "a b" or ["a", "b"],
// ignore_merges, unk fusing, continuing_subword_prefix / end_of_word_suffix), WordPiece,
// WordLevel, Unigram (Viterbi over the pieces' scores, unknown runs fused, byte fallback).
#include "model/tokenizer/models.h"

#include <algorithm>
#include <cstdio>
#include <queue>
#include <unordered_map>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "model/tokenizer/components.h"
#include "model/tokenizer/unicode.h"

namespace cdcca::tokenizer {

// ---- Vocabulary ------------------------------------------------------------------------------

absl::Status Vocabulary::Add(std::string token, int32_t id) {
  if (id < 0) return absl::InvalidArgumentError(Concat("negative id ", id));
  by_id_[id] = token;
  id_bound_ = std::max<int64_t>(id_bound_, int64_t{id} + 1);
  by_token_[std::move(token)] = id;
  return absl::OkStatus();
}

std::optional<int32_t> Vocabulary::Find(std::string_view token) const {
  auto it = by_token_.find(absl::string_view(token.data(), token.size()));
  if (it == by_token_.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Vocabulary::Token(int32_t id) const {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<Vocabulary> ParseVocabulary(const JsonAt& json) {
  if (absl::Status st = json.ExpectObject(); !st.ok()) return st;
  Vocabulary v;
  for (auto it = json.value.begin(); it != json.value.end(); ++it) {
    JsonAt entry = json.Field(it.key());
    absl::StatusOr<int64_t> id = entry.Int();
    if (!id.ok()) return id.status();
    if (*id < 0 || *id >= INT32_MAX) {
      return entry.Error(Concat("id ", *id, " is out of range"));
    }
    if (absl::Status st = v.Add(it.key(), static_cast<int32_t>(*id)); !st.ok()) return st;
  }
  return v;
}

// ---- BPE -------------------------------------------------------------------------------------

namespace {

uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

Bpe::Bpe(Vocabulary vocab, BpeOptions options)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  if (options_.unk_token) unk_id_ = vocab_.Find(*options_.unk_token);
}

absl::Status Bpe::AddMerge(std::string_view left, std::string_view right, const JsonAt& where) {
  const std::optional<int32_t> a = vocab_.Find(left);
  const std::optional<int32_t> b = vocab_.Find(right);
  if (!a || !b) {
    return where.Error(Concat("merge '", left, "' + '", right, "' uses a token not in the vocab"));
  }
  std::string merged(left);
  std::string_view r = right;
  if (options_.continuing_subword_prefix &&
      r.substr(0, options_.continuing_subword_prefix->size()) ==
          *options_.continuing_subword_prefix) {
    r.remove_prefix(options_.continuing_subword_prefix->size());
  }
  merged.append(r);
  const std::optional<int32_t> id = vocab_.Find(merged);
  if (!id) return where.Error(Concat("merge result '", merged, "' is not in the vocab"));
  // A repeated pair takes its last rank, as the reference's map collection does.
  merges_.insert_or_assign(PairKey(*a, *b), MergeTarget{merge_count_++, *id});
  return absl::OkStatus();
}

absl::Status Bpe::Tokenize(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return absl::OkStatus();
  if (options_.ignore_merges) {
    if (std::optional<int32_t> id = vocab_.Find(word)) {
      ids->push_back(*id);
      return absl::OkStatus();
    }
  }
  // Initial symbols: one per code point (with prefix/suffix), byte tokens or unk.
  std::vector<int32_t> symbols;
  std::optional<int32_t> pending_unk;
  auto unk_id = [&]() -> absl::StatusOr<int32_t> {
    if (!unk_id_) {
      return absl::FailedPreconditionError(
          Concat("BPE unk_token '", *options_.unk_token, "' is not in the vocab"));
    }
    return *unk_id_;
  };
  size_t pos = 0;
  while (pos < word.size()) {
    const size_t at = pos;
    NextCodePoint(word, &pos);
    std::string s(word.substr(at, pos - at));
    if (options_.continuing_subword_prefix && at != 0)
      s.insert(0, *options_.continuing_subword_prefix);
    if (options_.end_of_word_suffix && pos == word.size()) s += *options_.end_of_word_suffix;
    if (std::optional<int32_t> id = vocab_.Find(s)) {
      if (pending_unk) {
        symbols.push_back(*pending_unk);
        pending_unk.reset();
      }
      symbols.push_back(*id);
      continue;
    }
    if (options_.byte_fallback) {
      std::vector<int32_t> bytes;
      for (unsigned char b : s) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        std::optional<int32_t> id = vocab_.Find(name);
        if (!id) break;
        bytes.push_back(*id);
      }
      if (bytes.size() == s.size()) {
        // As the reference does, a pending unk is flushed after these bytes.
        symbols.insert(symbols.end(), bytes.begin(), bytes.end());
        continue;
      }
    }
    if (options_.unk_token) {
      absl::StatusOr<int32_t> unk = unk_id();
      if (!unk.ok()) return unk.status();
      if (pending_unk && !options_.fuse_unk) symbols.push_back(*pending_unk);
      pending_unk = *unk;
    }
    // Without an unk token the code point is dropped, as the reference does.
  }
  if (pending_unk) symbols.push_back(*pending_unk);

  // Merge lowest rank first (leftmost on ties) until no known pair is left.
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> sym(symbols.size());
  for (size_t i = 0; i < symbols.size(); ++i) {
    sym[i] = {symbols[i], static_cast<int>(i) - 1,
              i + 1 < symbols.size() ? static_cast<int>(i) + 1 : -1, true};
  }
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int left) {
    if (left < 0 || sym[left].next < 0) return;
    auto it = merges_.find(PairKey(sym[left].id, sym[sym[left].next].id));
    if (it != merges_.end()) queue.push({it->second.rank, left, it->second.id});
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i) push_pair(static_cast<int>(i));
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = sym[top.pos];
    if (!left.alive || left.next < 0) continue;
    auto it = merges_.find(PairKey(left.id, sym[left.next].id));
    if (it == merges_.end() || it->second.id != top.new_id) continue;
    Symbol& right = sym[left.next];
    right.alive = false;
    left.id = top.new_id;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    push_pair(left.prev);
    push_pair(top.pos);
  }
  for (const Symbol& s : sym) {
    if (s.alive) ids->push_back(s.id);
  }
  return absl::OkStatus();
}

// ---- WordPiece -------------------------------------------------------------------------------

namespace {

class WordPiece : public Model {
 public:
  WordPiece(Vocabulary vocab, std::string unk, std::string prefix, int64_t max_chars)
      : vocab_(std::move(vocab)),
        unk_(std::move(unk)),
        prefix_(std::move(prefix)),
        max_chars_(max_chars) {}

  absl::Status Tokenize(std::string_view word, std::vector<int32_t>* ids) const override {
    const std::optional<int32_t> unk = vocab_.Find(unk_);
    auto push_unk = [&]() -> absl::Status {
      if (!unk) {
        return absl::FailedPreconditionError(
            Concat("WordPiece unk_token '", unk_, "' is not in the vocab"));
      }
      ids->push_back(*unk);
      return absl::OkStatus();
    };
    if (static_cast<int64_t>(CodePointCount(word)) > max_chars_) return push_unk();
    std::vector<int32_t> pieces;
    size_t start = 0;
    while (start < word.size()) {
      size_t end = word.size();
      std::optional<int32_t> found;
      while (start < end) {
        std::string sub(word.substr(start, end - start));
        if (start > 0) sub.insert(0, prefix_);
        if ((found = vocab_.Find(sub))) break;
        // Drop the last code point.
        do {
          --end;
        } while (end > start && (static_cast<unsigned char>(word[end]) & 0xC0) == 0x80);
      }
      if (!found) return push_unk();
      pieces.push_back(*found);
      start = end;
    }
    ids->insert(ids->end(), pieces.begin(), pieces.end());
    return absl::OkStatus();
  }
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    return vocab_.Find(token);
  }
  std::optional<std::string> IdToToken(int32_t id) const override { return vocab_.Token(id); }
  int64_t VocabSize() const override { return vocab_.IdBound(); }

 private:
  Vocabulary vocab_;
  std::string unk_, prefix_;
  int64_t max_chars_;
};

// ---- WordLevel -------------------------------------------------------------------------------

class WordLevel : public Model {
 public:
  WordLevel(Vocabulary vocab, std::string unk) : vocab_(std::move(vocab)), unk_(std::move(unk)) {}
  absl::Status Tokenize(std::string_view word, std::vector<int32_t>* ids) const override {
    std::optional<int32_t> id = vocab_.Find(word);
    if (!id) id = vocab_.Find(unk_);
    if (!id) {
      return absl::FailedPreconditionError(
          Concat("WordLevel: '", word, "' and the unk_token '", unk_, "' are not in the vocab"));
    }
    ids->push_back(*id);
    return absl::OkStatus();
  }
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    return vocab_.Find(token);
  }
  std::optional<std::string> IdToToken(int32_t id) const override { return vocab_.Token(id); }
  int64_t VocabSize() const override { return vocab_.IdBound(); }

 private:
  Vocabulary vocab_;
  std::string unk_;
};

absl::StatusOr<std::unique_ptr<Model>> ParseBpe(const JsonAt& json) {
  absl::StatusOr<Vocabulary> vocab = ParseVocabulary(json.Field("vocab"));
  if (!vocab.ok()) return vocab.status();
  BpeOptions options;
  if (JsonAt d = json.Field("dropout"); !d.IsNullOrAbsent()) {
    if (!d.value.is_number()) return d.Error("must be a number or null");
    if (d.value.get<double>() != 0.0 && d.value.get<double>() != 1.0) {
      return d.Error("BPE dropout is not supported (inference runs without it)");
    }
  }
  absl::StatusOr<std::optional<std::string>> unk = json.OptionalString("unk_token");
  if (!unk.ok()) return unk.status();
  options.unk_token = *unk;
  absl::StatusOr<std::optional<std::string>> prefix =
      json.OptionalString("continuing_subword_prefix");
  if (!prefix.ok()) return prefix.status();
  options.continuing_subword_prefix = *prefix;
  absl::StatusOr<std::optional<std::string>> suffix = json.OptionalString("end_of_word_suffix");
  if (!suffix.ok()) return suffix.status();
  options.end_of_word_suffix = *suffix;
  absl::StatusOr<bool> fuse = json.BoolOr("fuse_unk", false);
  if (!fuse.ok()) return fuse.status();
  options.fuse_unk = *fuse;
  absl::StatusOr<bool> byte_fallback = json.BoolOr("byte_fallback", false);
  if (!byte_fallback.ok()) return byte_fallback.status();
  options.byte_fallback = *byte_fallback;
  absl::StatusOr<bool> ignore_merges = json.BoolOr("ignore_merges", false);
  if (!ignore_merges.ok()) return ignore_merges.status();
  options.ignore_merges = *ignore_merges;

  auto bpe = std::make_unique<Bpe>(*std::move(vocab), std::move(options));
  JsonAt merges = json.Field("merges");
  if (!merges.IsNullOrAbsent()) {
    if (absl::Status st = merges.ExpectArray(); !st.ok()) return st;
    for (size_t i = 0; i < merges.value.size(); ++i) {
      JsonAt m = merges.Index(i);
      std::string left, right;
      if (m.value.is_string()) {
        // "a b": the first space separates the two tokens.
        const std::string& s = m.value.get_ref<const std::string&>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          return m.Error("must be two tokens separated by one space");
        }
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else if (m.value.is_array() && m.value.size() == 2 && m.value[0].is_string() &&
                 m.value[1].is_string()) {
        left = m.value[0].get<std::string>();
        right = m.value[1].get<std::string>();
      } else {
        return m.Error("must be \"a b\" or [\"a\", \"b\"]");
      }
      if (absl::Status st = bpe->AddMerge(left, right, m); !st.ok()) return st;
    }
  }
  return bpe;
}

}  // namespace

// ---- Unigram ---------------------------------------------------------------------------------

namespace {

// SentencePiece's Unigram model as the tokenizers library runs it: the segmentation of a word
// into pieces whose scores (log probabilities) sum highest (Viterbi over byte positions). A
// code point no piece starts with is unknown, scored as the lowest piece score minus 10;
// adjacent unknowns fuse into one unk token, which byte fallback (when every byte has its
// <0xNN> piece) spells as bytes instead.
class Unigram : public Model {
 public:
  Unigram(Vocabulary vocab, std::vector<double> scores, std::optional<int32_t> unk_id,
          bool byte_fallback)
      : vocab_(std::move(vocab)),
        scores_(std::move(scores)),
        unk_id_(unk_id),
        byte_fallback_(byte_fallback) {
    double lowest = 0;
    for (size_t i = 0; i < scores_.size(); ++i) {
      lowest = i == 0 ? scores_[i] : std::min(lowest, scores_[i]);
      if (std::optional<std::string> t = vocab_.Token(static_cast<int32_t>(i))) {
        longest_piece_ = std::max(longest_piece_, t->size());
      }
    }
    unk_score_ = lowest - kUnkPenalty;
  }

  absl::Status Tokenize(std::string_view word, std::vector<int32_t>* ids) const override {
    if (word.empty()) return absl::OkStatus();
    // best[i]: the best segmentation of word[0, i): its score, where its last piece starts
    // and that piece's id (-1: not reached yet).
    struct Node {
      double score = 0;
      size_t start = 0;
      int32_t id = -1;
      bool reached = false;
    };
    std::vector<Node> best(word.size() + 1);
    best[0].reached = true;
    size_t at = 0;
    while (at < word.size()) {
      size_t next = at;
      NextCodePoint(word, &next);
      const size_t char_len = next - at;
      if (best[at].reached) {
        bool single = false;  // a piece covers exactly this code point
        for (size_t end = next; end <= word.size() && end - at <= longest_piece_;) {
          if (std::optional<int32_t> id = vocab_.Find(word.substr(at, end - at))) {
            const double s = best[at].score + Score(*id);
            if (!best[end].reached || s > best[end].score) best[end] = {s, at, *id, true};
            if (end - at == char_len) single = true;
          }
          if (end == word.size()) break;
          NextCodePoint(word, &end);
        }
        if (!single) {
          const double s = best[at].score + unk_score_;
          const int32_t unk = unk_id_.value_or(-1);
          if (!best[next].reached || s > best[next].score) best[next] = {s, at, unk, true};
        }
      }
      at = next;
    }
    // Back from the end: the pieces in reverse, unknown runs fused.
    std::vector<std::pair<size_t, size_t>> pieces;  // [start, end) byte ranges, reversed
    std::vector<bool> unknown;
    for (size_t end = word.size(); end > 0;) {
      const Node& n = best[end];
      const bool unk = unk_id_.has_value() && n.id == *unk_id_;
      if (unk && !unknown.empty() && unknown.back()) {
        pieces.back().first = n.start;
      } else {
        pieces.push_back({n.start, end});
        unknown.push_back(unk);
      }
      end = n.start;
    }
    for (size_t i = pieces.size(); i-- > 0;) {
      const std::string_view piece =
          word.substr(pieces[i].first, pieces[i].second - pieces[i].first);
      if (std::optional<int32_t> id = vocab_.Find(piece)) {
        ids->push_back(*id);
        continue;
      }
      if (byte_fallback_ && AppendBytes(piece, ids)) continue;
      if (!unk_id_.has_value()) {
        return absl::InvalidArgumentError(
            Concat("Unigram: '", std::string(piece), "' is unknown and the model has no unk_id"));
      }
      ids->push_back(*unk_id_);
    }
    return absl::OkStatus();
  }

  std::optional<int32_t> TokenToId(std::string_view token) const override {
    return vocab_.Find(token);
  }
  std::optional<std::string> IdToToken(int32_t id) const override { return vocab_.Token(id); }
  int64_t VocabSize() const override { return vocab_.IdBound(); }

 private:
  static constexpr double kUnkPenalty = 10.0;

  double Score(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < scores_.size() ? scores_[id] : unk_score_;
  }

  // Appends the <0xNN> pieces of `piece`'s bytes; false (nothing appended) when one is missing.
  bool AppendBytes(std::string_view piece, std::vector<int32_t>* ids) const {
    std::vector<int32_t> bytes;
    for (char c : piece) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<unsigned>(static_cast<uint8_t>(c)));
      std::optional<int32_t> id = vocab_.Find(name);
      if (!id) return false;
      bytes.push_back(*id);
    }
    ids->insert(ids->end(), bytes.begin(), bytes.end());
    return true;
  }

  Vocabulary vocab_;
  std::vector<double> scores_;  // by id
  std::optional<int32_t> unk_id_;
  bool byte_fallback_;
  double unk_score_ = 0;
  size_t longest_piece_ = 0;  // bytes
};

// {"type": "Unigram", "vocab": [[piece, score], ...], "unk_id": int or null, "byte_fallback"}.
absl::StatusOr<std::unique_ptr<Model>> ParseUnigram(const JsonAt& json) {
  JsonAt list = json.Field("vocab");
  if (absl::Status st = list.ExpectArray(); !st.ok()) return st;
  if (list.value.size() > static_cast<size_t>(INT32_MAX)) return list.Error("too many pieces");
  Vocabulary vocab;
  std::vector<double> scores;
  for (size_t i = 0; i < list.value.size(); ++i) {
    JsonAt e = list.Index(i);
    if (!e.value.is_array() || e.value.size() != 2 || !e.value[0].is_string() ||
        !e.value[1].is_number()) {
      return e.Error("must be [piece, score]");
    }
    if (absl::Status st = vocab.Add(e.value[0].get<std::string>(), static_cast<int32_t>(i));
        !st.ok()) {
      return e.Error(std::string(st.message()));
    }
    scores.push_back(e.value[1].get<double>());
  }
  std::optional<int32_t> unk;
  if (JsonAt u = json.Field("unk_id"); !u.IsNullOrAbsent()) {
    absl::StatusOr<int64_t> id = u.Int();
    if (!id.ok()) return id.status();
    if (*id < 0 || static_cast<size_t>(*id) >= scores.size()) {
      return u.Error("is not the id of a piece");
    }
    unk = static_cast<int32_t>(*id);
  }
  absl::StatusOr<bool> byte_fallback = json.BoolOr("byte_fallback", false);
  if (!byte_fallback.ok()) return byte_fallback.status();
  return std::make_unique<Unigram>(std::move(vocab), std::move(scores), unk, *byte_fallback);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> ParseModel(const JsonAt& json) {
  if (absl::Status st = json.ExpectObject(); !st.ok()) return st;
  std::string type;
  if (JsonAt t = json.Field("type"); !t.IsNullOrAbsent()) {
    absl::StatusOr<std::string> s = t.String();
    if (!s.ok()) return s.status();
    type = *s;
  } else if (json.Field("merges").value.is_array()) {
    type = "BPE";  // old files name no type: the fields tell
  } else if (json.Field("continuing_subword_prefix").value.is_string()) {
    type = "WordPiece";
  } else {
    type = "WordLevel";
  }
  if (type == "BPE") return ParseBpe(json);
  if (type == "Unigram") return ParseUnigram(json);
  if (type == "WordPiece") {
    absl::StatusOr<Vocabulary> vocab = ParseVocabulary(json.Field("vocab"));
    if (!vocab.ok()) return vocab.status();
    absl::StatusOr<std::string> unk = json.StringOr("unk_token", "[UNK]");
    if (!unk.ok()) return unk.status();
    absl::StatusOr<std::string> prefix = json.StringOr("continuing_subword_prefix", "##");
    if (!prefix.ok()) return prefix.status();
    absl::StatusOr<int64_t> max_chars = json.IntOr("max_input_chars_per_word", 100);
    if (!max_chars.ok()) return max_chars.status();
    return std::make_unique<WordPiece>(*std::move(vocab), *std::move(unk), *std::move(prefix),
                                       *max_chars);
  }
  if (type == "WordLevel") {
    absl::StatusOr<Vocabulary> vocab = ParseVocabulary(json.Field("vocab"));
    if (!vocab.ok()) return vocab.status();
    absl::StatusOr<std::string> unk = json.StringOr("unk_token", "<unk>");
    if (!unk.ok()) return unk.status();
    return std::make_unique<WordLevel>(*std::move(vocab), *std::move(unk));
  }
  return json.Unsupported(type);
}

}  // namespace cdcca::tokenizer
