// Pre-tokenizers of tokenizer.json: ByteLevel, Split, Metaspace, Whitespace,
// WhitespaceSplit, BertPreTokenizer, Punctuation, Digits, CharDelimiterSplit, Sequence.
#include <algorithm>
#include <functional>
#include <utility>

#include "model/tokenizer/components.h"
#include "model/tokenizer/unicode.h"

namespace cdcca::tokenizer {
namespace {

// How a split keeps the delimiters it found (SplitDelimiterBehavior).
enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

absl::StatusOr<Behavior> ParseBehavior(const JsonAt& json, std::string_view fallback) {
  std::string name(fallback);
  if (!json.IsNullOrAbsent()) {
    absl::StatusOr<std::string> s = json.String();
    if (!s.ok()) return s.status();
    name = *s;
  }
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  return json.Error(Concat("'", name, "' is not a split behavior"));
}

struct Segment {
  size_t begin, end;
  bool is_match;
};

// Cuts `piece` along `segments` (which cover it in order) the way
// NormalizedString::split does for `behavior`; empty pieces are dropped.
void CutPiece(const Piece& piece, const std::vector<Segment>& segments, Behavior behavior,
              std::vector<Piece>* out) {
  struct Range {
    size_t begin, end;
  };
  std::vector<Range> ranges;
  switch (behavior) {
    case Behavior::kIsolated:
      for (const Segment& s : segments) ranges.push_back({s.begin, s.end});
      break;
    case Behavior::kRemoved:
      for (const Segment& s : segments) {
        if (!s.is_match) ranges.push_back({s.begin, s.end});
      }
      break;
    case Behavior::kContiguous: {
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match == previous_match && !ranges.empty()) {
          ranges.back().end = s.end;
        } else {
          ranges.push_back({s.begin, s.end});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match && !previous_match && !ranges.empty()) {
          ranges.back().end = s.end;
        } else {
          ranges.push_back({s.begin, s.end});
        }
        previous_match = s.is_match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->is_match && !previous_match && !ranges.empty()) {
          ranges.back().begin = it->begin;
        } else {
          ranges.push_back({it->begin, it->end});
        }
        previous_match = it->is_match;
      }
      std::reverse(ranges.begin(), ranges.end());
      break;
    }
  }
  for (const Range& r : ranges) {
    if (r.end <= r.begin) continue;
    Piece p;
    p.text = piece.text.substr(r.begin, r.end - r.begin);
    p.at_start = piece.at_start && r.begin == 0;
    out->push_back(std::move(p));
  }
}

// Segments from match ranges (non-matches fill the gaps); `invert` swaps the two.
std::vector<Segment> SegmentsFromMatches(size_t size,
                                         const std::vector<std::pair<size_t, size_t>>& matches,
                                         bool invert) {
  std::vector<Segment> segments;
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (b > prev) segments.push_back({prev, b, invert});
    segments.push_back({b, e, !invert});
    prev = e;
  }
  if (prev < size) segments.push_back({prev, size, invert});
  return segments;
}

// Segments where every code point satisfying `pred` is a match of its own.
std::vector<Segment> SegmentsFromPredicate(std::string_view text,
                                           const std::function<bool(char32_t)>& pred) {
  std::vector<std::pair<size_t, size_t>> matches;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t at = pos;
    if (pred(NextCodePoint(text, &pos))) matches.emplace_back(at, pos);
  }
  return SegmentsFromMatches(text.size(), matches, false);
}

// Applies `fn` to every piece that is not a known token yet.
absl::Status SplitEach(std::vector<Piece>* pieces,
                       const std::function<absl::Status(const Piece&, std::vector<Piece>*)>& fn) {
  std::vector<Piece> out;
  out.reserve(pieces->size());
  for (Piece& p : *pieces) {
    if (p.id >= 0) {
      out.push_back(std::move(p));
      continue;
    }
    const size_t first = out.size();
    if (absl::Status st = fn(p, &out); !st.ok()) return st;
    // The reference drops every empty split a pre-tokenizer produces.
    out.erase(std::remove_if(out.begin() + first, out.end(),
                             [](const Piece& q) { return q.id < 0 && q.text.empty(); }),
              out.end());
  }
  *pieces = std::move(out);
  return absl::OkStatus();
}

absl::Status SplitByPredicate(std::vector<Piece>* pieces, const std::function<bool(char32_t)>& pred,
                              Behavior behavior) {
  return SplitEach(pieces, [&](const Piece& p, std::vector<Piece>* out) {
    CutPiece(p, SegmentsFromPredicate(p.text, pred), behavior, out);
    return absl::OkStatus();
  });
}

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
      : steps_(std::move(steps)) {}
  absl::Status PreTokenize(std::vector<Piece>* pieces) const override {
    for (const auto& s : steps_) {
      if (absl::Status st = s->PreTokenize(pieces); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::shared_ptr<const Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}
  absl::Status PreTokenize(std::vector<Piece>* pieces) const override {
    absl::Status st =
        SplitEach(pieces, [&](const Piece& in, std::vector<Piece>* out) -> absl::Status {
          Piece p = in;
          if (add_prefix_space_ && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
          if (regex_ == nullptr) {
            out->push_back(std::move(p));
            return absl::OkStatus();
          }
          absl::StatusOr<std::vector<std::pair<size_t, size_t>>> m = regex_->FindAll(p.text);
          if (!m.ok()) return m.status();
          CutPiece(p, SegmentsFromMatches(p.text.size(), *m, false), Behavior::kIsolated, out);
          return absl::OkStatus();
        });
    if (!st.ok()) return st;
    for (Piece& p : *pieces) {
      if (p.id >= 0) continue;
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (char c : p.text) mapped += ByteToUnicode(static_cast<uint8_t>(c));
      p.text = std::move(mapped);
    }
    return absl::OkStatus();
  }

 private:
  bool add_prefix_space_;
  std::shared_ptr<const Regex> regex_;  // null: use_regex false
};

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern pattern, Behavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  absl::Status PreTokenize(std::vector<Piece>* pieces) const override {
    return SplitEach(pieces, [&](const Piece& p, std::vector<Piece>* out) -> absl::Status {
      absl::StatusOr<std::vector<std::pair<size_t, size_t>>> m = pattern_.FindAll(p.text);
      if (!m.ok()) return m.status();
      CutPiece(p, SegmentsFromMatches(p.text.size(), *m, invert_), behavior_, out);
      return absl::OkStatus();
    });
  }

 private:
  Pattern pattern_;
  Behavior behavior_;
  bool invert_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  absl::Status PreTokenize(std::vector<Piece>* pieces) const override {
    return SplitEach(pieces, [&](const Piece& in, std::vector<Piece>* out) -> absl::Status {
      Piece p;
      p.at_start = in.at_start;
      for (char c : in.text) {
        if (c == ' ') {
          p.text += replacement_;
        } else {
          p.text.push_back(c);
        }
      }
      const bool starts = p.text.compare(0, replacement_.size(), replacement_) == 0;
      if (!starts &&
          (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && p.at_start))) {
        p.text.insert(0, replacement_);
      }
      if (!split_) {
        out->push_back(std::move(p));
        return absl::OkStatus();
      }
      std::vector<std::pair<size_t, size_t>> matches;
      for (size_t pos = p.text.find(replacement_); pos != std::string::npos;
           pos = p.text.find(replacement_, pos + replacement_.size())) {
        matches.emplace_back(pos, pos + replacement_.size());
      }
      CutPiece(p, SegmentsFromMatches(p.text.size(), matches, false), Behavior::kMergedWithNext,
               out);
      return absl::OkStatus();
    });
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

// `\w+|[^\w\s]+` (Oniguruma classes), keeping the matches.
class WhitespacePreTokenizer : public PreTokenizer {
 public:
  absl::Status PreTokenize(std::vector<Piece>* pieces) const override {
    return SplitEach(pieces, [](const Piece& p, std::vector<Piece>* out) {
      std::vector<std::pair<size_t, size_t>> matches;
      size_t pos = 0;
      int run_kind = 0;  // 0 none, 1 word, 2 other non-space
      while (pos < p.text.size()) {
        const size_t at = pos;
        const char32_t c = NextCodePoint(p.text, &pos);
        const int kind = IsOnigWordChar(c) ? 1 : IsWhitespace(c) ? 0 : 2;
        if (kind != 0 && kind == run_kind) {
          matches.back().second = pos;
        } else if (kind != 0) {
          matches.emplace_back(at, pos);
        }
        run_kind = kind;
      }
      // Inverted matches with Removed: the runs stay, the whitespace between them goes.
      CutPiece(p, SegmentsFromMatches(p.text.size(), matches, true), Behavior::kRemoved, out);
      return absl::OkStatus();
    });
  }
};

class PredicatePreTokenizer : public PreTokenizer {
 public:
  PredicatePreTokenizer(std::function<bool(char32_t)> pred, Behavior behavior)
      : pred_(std::move(pred)), behavior_(behavior) {}
  absl::Status PreTokenize(std::vector<Piece>* pieces) const override {
    return SplitByPredicate(pieces, pred_, behavior_);
  }

 private:
  std::function<bool(char32_t)> pred_;
  Behavior behavior_;
};

class BertPreTokenizer : public PreTokenizer {
 public:
  absl::Status PreTokenize(std::vector<Piece>* pieces) const override {
    if (absl::Status st = SplitByPredicate(pieces, IsWhitespace, Behavior::kRemoved); !st.ok()) {
      return st;
    }
    return SplitByPredicate(pieces, IsPunctuation, Behavior::kIsolated);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const JsonAt& json) {
  absl::StatusOr<std::string> type = json.Type();
  if (!type.ok()) return type.status();
  if (*type == "Sequence") {
    JsonAt list = json.Field("pretokenizers");
    if (absl::Status st = list.ExpectArray(); !st.ok()) return st;
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (size_t i = 0; i < list.value.size(); ++i) {
      absl::StatusOr<std::unique_ptr<PreTokenizer>> p = ParsePreTokenizer(list.Index(i));
      if (!p.ok()) return p.status();
      steps.push_back(*std::move(p));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  if (*type == "ByteLevel") {
    absl::StatusOr<bool> prefix = json.BoolOr("add_prefix_space", true);
    if (!prefix.ok()) return prefix.status();
    absl::StatusOr<bool> use_regex = json.BoolOr("use_regex", true);
    if (!use_regex.ok()) return use_regex.status();
    std::shared_ptr<const Regex> regex;
    if (*use_regex) {
      static const auto* const kGpt2 =
          new absl::StatusOr<std::shared_ptr<const Regex>>(Regex::Compile(kGpt2Pattern));
      if (!kGpt2->ok()) return kGpt2->status();
      regex = **kGpt2;
    }
    return std::make_unique<ByteLevelPreTokenizer>(*prefix, std::move(regex));
  }
  if (*type == "Split") {
    absl::StatusOr<Pattern> pattern = ParsePattern(json.Field("pattern"));
    if (!pattern.ok()) return pattern.status();
    absl::StatusOr<Behavior> behavior = ParseBehavior(json.Field("behavior"), "");
    if (!behavior.ok()) return behavior.status();
    absl::StatusOr<bool> invert = json.BoolOr("invert", false);
    if (!invert.ok()) return invert.status();
    return std::make_unique<SplitPreTokenizer>(*std::move(pattern), *behavior, *invert);
  }
  if (*type == "Metaspace") {
    absl::StatusOr<std::string> replacement = json.CharOr("replacement", "\xE2\x96\x81");
    if (!replacement.ok()) return replacement.status();
    PrependScheme scheme = PrependScheme::kAlways;
    if (JsonAt s = json.Field("prepend_scheme"); !s.IsNullOrAbsent()) {
      absl::StatusOr<std::string> name = s.String();
      if (!name.ok()) return name.status();
      if (*name == "always") {
        scheme = PrependScheme::kAlways;
      } else if (*name == "first") {
        scheme = PrependScheme::kFirst;
      } else if (*name == "never") {
        scheme = PrependScheme::kNever;
      } else {
        return s.Error(Concat("'", *name, "' is not always, first or never"));
      }
    } else {
      absl::StatusOr<bool> add = json.BoolOr("add_prefix_space", true);
      if (!add.ok()) return add.status();
      scheme = *add ? PrependScheme::kAlways : PrependScheme::kNever;
    }
    absl::StatusOr<bool> split = json.BoolOr("split", true);
    if (!split.ok()) return split.status();
    return std::make_unique<MetaspacePreTokenizer>(*std::move(replacement), scheme, *split);
  }
  if (*type == "Whitespace") return std::make_unique<WhitespacePreTokenizer>();
  if (*type == "WhitespaceSplit") {
    return std::make_unique<PredicatePreTokenizer>(IsWhitespace, Behavior::kRemoved);
  }
  if (*type == "BertPreTokenizer") return std::make_unique<BertPreTokenizer>();
  if (*type == "Punctuation") {
    absl::StatusOr<Behavior> behavior = ParseBehavior(json.Field("behavior"), "Isolated");
    if (!behavior.ok()) return behavior.status();
    return std::make_unique<PredicatePreTokenizer>(IsPunctuation, *behavior);
  }
  if (*type == "Digits") {
    absl::StatusOr<bool> individual = json.BoolOr("individual_digits", false);
    if (!individual.ok()) return individual.status();
    return std::make_unique<PredicatePreTokenizer>(
        IsNumeric, *individual ? Behavior::kIsolated : Behavior::kContiguous);
  }
  if (*type == "CharDelimiterSplit") {
    absl::StatusOr<std::string> delim = json.CharOr("delimiter", "");
    if (!delim.ok()) return delim.status();
    size_t pos = 0;
    const char32_t d = NextCodePoint(*delim, &pos);
    return std::make_unique<PredicatePreTokenizer>([d](char32_t c) { return c == d; },
                                                   Behavior::kRemoved);
  }
  return json.Unsupported(*type);
}

}  // namespace cdcca::tokenizer
