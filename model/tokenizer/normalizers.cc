// Normalizers of tokenizer.json: Sequence, NFC/NFD/NFKC/NFKD, Lowercase, Strip,
// StripAccents, Replace, Prepend, BertNormalizer, ByteLevel, Precompiled.
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "model/tokenizer/components.h"
#include "model/tokenizer/unicode.h"

namespace cdcca::tokenizer {
namespace {

// SentencePiece's precompiled normalization rules (the Precompiled normalizer, T5's and other
// Unigram models'). The charsmap is a little-endian uint32 byte count of a trie, the trie (a
// Darts-clone double array of uint32 units mapping a UTF-8 key to an offset), then the
// replacements, NUL-terminated, that the offsets point into.
//
// Applied as the tokenizers library does: per extended grapheme cluster, a cluster shorter
// than 6 bytes whose bytes begin with a key is replaced as a whole by the replacement of the
// shortest such key; otherwise each code point that begins with a key is replaced by it and
// the others are kept.
class PrecompiledNormalizer : public Normalizer {
 public:
  // InvalidArgument when `charsmap` is not laid out as above.
  static absl::StatusOr<std::unique_ptr<PrecompiledNormalizer>> Create(std::string_view charsmap) {
    if (charsmap.size() < 4) return absl::InvalidArgumentError("charsmap shorter than 4 bytes");
    const auto* b = reinterpret_cast<const uint8_t*>(charsmap.data());
    const uint64_t trie_bytes = static_cast<uint64_t>(b[0]) | static_cast<uint64_t>(b[1]) << 8 |
                                static_cast<uint64_t>(b[2]) << 16 |
                                static_cast<uint64_t>(b[3]) << 24;
    if (trie_bytes % 4 != 0 || trie_bytes == 0 || trie_bytes > charsmap.size() - 4) {
      return absl::InvalidArgumentError("charsmap trie size does not fit the charsmap");
    }
    auto n = std::unique_ptr<PrecompiledNormalizer>(new PrecompiledNormalizer());
    n->units_.resize(trie_bytes / 4);
    for (size_t i = 0; i < n->units_.size(); ++i) {
      const uint8_t* u = b + 4 + 4 * i;
      n->units_[i] = static_cast<uint32_t>(u[0]) | static_cast<uint32_t>(u[1]) << 8 |
                     static_cast<uint32_t>(u[2]) << 16 | static_cast<uint32_t>(u[3]) << 24;
    }
    n->replacements_ = std::string(charsmap.substr(4 + trie_bytes));
    return n;
  }

  absl::Status Normalize(std::string* text) const override {
    absl::StatusOr<std::vector<size_t>> bounds = GraphemeBoundaries(*text);
    if (!bounds.ok()) return bounds.status();
    const std::string_view s = *text;
    std::string out;
    out.reserve(s.size());
    for (size_t g = 0; g + 1 < bounds->size(); ++g) {
      const std::string_view cluster = s.substr((*bounds)[g], (*bounds)[g + 1] - (*bounds)[g]);
      if (cluster.size() < 6) {
        if (std::optional<std::string_view> r = Replacement(cluster)) {
          out.append(*r);
          continue;
        }
      }
      size_t pos = 0;
      while (pos < cluster.size()) {
        const size_t start = pos;
        NextCodePoint(cluster, &pos);
        const std::string_view cp = cluster.substr(start, pos - start);
        std::optional<std::string_view> r = Replacement(cp);
        out.append(r ? *r : cp);
      }
    }
    *text = std::move(out);
    return absl::OkStatus();
  }

 private:
  PrecompiledNormalizer() = default;

  // Darts-clone unit fields.
  static bool HasLeaf(uint32_t u) { return ((u >> 8) & 1) == 1; }
  static uint32_t Value(uint32_t u) { return u & ((1u << 31) - 1); }
  static uint32_t Label(uint32_t u) { return u & ((1u << 31) | 0xFF); }
  static uint32_t Offset(uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); }

  // The replacement of the shortest key `key` begins with; nullopt when none (or when the
  // trie points outside itself or the replacements: a damaged charsmap changes nothing).
  std::optional<std::string_view> Replacement(std::string_view key) const {
    size_t node = Offset(units_[0]);
    for (char ch : key) {
      const auto c = static_cast<uint8_t>(ch);
      if (c == 0) break;
      node ^= c;
      if (node >= units_.size()) return std::nullopt;
      const uint32_t unit = units_[node];
      if (Label(unit) != c) return std::nullopt;
      node ^= Offset(unit);
      if (node >= units_.size()) return std::nullopt;
      if (HasLeaf(unit)) {
        const size_t at = Value(units_[node]);
        if (at >= replacements_.size()) return std::nullopt;
        const size_t end = replacements_.find('\0', at);
        return std::string_view(replacements_)
            .substr(at, (end == std::string::npos ? replacements_.size() : end) - at);
      }
    }
    return std::nullopt;
  }

  std::vector<uint32_t> units_;
  std::string replacements_;
};

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps)
      : steps_(std::move(steps)) {}
  absl::Status Normalize(std::string* text) const override {
    for (const auto& s : steps_) {
      if (absl::Status st = s->Normalize(text); !st.ok()) return st;
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalizationForm form) : form_(form) {}
  absl::Status Normalize(std::string* text) const override {
    absl::StatusOr<std::string> out = tokenizer::Normalize(form_, *text);
    if (!out.ok()) return out.status();
    *text = *std::move(out);
    return absl::OkStatus();
  }

 private:
  NormalizationForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  absl::Status Normalize(std::string* text) const override {
    *text = Lowercase(*text);
    return absl::OkStatus();
  }
};

// Removes leading/trailing White_Space code points.
std::string StripWhitespace(std::string_view s, bool left, bool right) {
  size_t begin = 0, end = s.size();
  if (left) {
    size_t pos = 0;
    while (pos < s.size()) {
      const size_t at = pos;
      if (!IsWhitespace(NextCodePoint(s, &pos))) {
        begin = at;
        break;
      }
      begin = pos;
    }
  }
  if (right) {
    size_t pos = begin, last_non_space_end = begin;
    while (pos < s.size()) {
      const char32_t c = NextCodePoint(s, &pos);
      if (!IsWhitespace(c)) last_non_space_end = pos;
    }
    end = last_non_space_end;
  }
  return std::string(s.substr(begin, end - begin));
}

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  absl::Status Normalize(std::string* text) const override {
    *text = StripWhitespace(*text, left_, right_);
    return absl::OkStatus();
  }

 private:
  bool left_, right_;
};

std::string DropNonspacingMarks(std::string_view s) {
  std::string out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t at = pos;
    if (!IsNonspacingMark(NextCodePoint(s, &pos))) out.append(s.substr(at, pos - at));
  }
  return out;
}

class StripAccentsNormalizer : public Normalizer {
 public:
  absl::Status Normalize(std::string* text) const override {
    *text = DropNonspacingMarks(*text);
    return absl::OkStatus();
  }
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  absl::Status Normalize(std::string* text) const override {
    absl::StatusOr<std::string> out = pattern_.ReplaceAll(*text, content_);
    if (!out.ok()) return out.status();
    *text = *std::move(out);
    return absl::OkStatus();
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  absl::Status Normalize(std::string* text) const override {
    if (!text->empty()) text->insert(0, prefix_);
    return absl::OkStatus();
  }

 private:
  std::string prefix_;
};

class BertNormalizer : public Normalizer {
 public:
  BertNormalizer(bool clean_text, bool chinese, bool strip_accents, bool lowercase)
      : clean_text_(clean_text),
        chinese_(chinese),
        strip_accents_(strip_accents),
        lowercase_(lowercase) {}
  absl::Status Normalize(std::string* text) const override {
    std::string out;
    size_t pos = 0;
    const std::string_view s = *text;
    while (pos < s.size()) {
      const size_t at = pos;
      const char32_t c = NextCodePoint(s, &pos);
      if (clean_text_) {
        if (c == 0 || c == 0xFFFD || IsBertControl(c)) continue;
        if (IsBertWhitespace(c)) {
          out.push_back(' ');
          continue;
        }
      }
      if (chinese_ && IsChineseChar(c)) {
        out.push_back(' ');
        out.append(s.substr(at, pos - at));
        out.push_back(' ');
        continue;
      }
      out.append(s.substr(at, pos - at));
    }
    if (strip_accents_) {
      absl::StatusOr<std::string> nfd = tokenizer::Normalize(NormalizationForm::kNfd, out);
      if (!nfd.ok()) return nfd.status();
      out = DropNonspacingMarks(*nfd);
    }
    if (lowercase_) out = Lowercase(out);
    *text = std::move(out);
    return absl::OkStatus();
  }

 private:
  bool clean_text_, chinese_, strip_accents_, lowercase_;
};

// Rewrites every byte as its byte-level code point (the ByteLevel normalizer).
class ByteLevelNormalizer : public Normalizer {
 public:
  absl::Status Normalize(std::string* text) const override {
    std::string out;
    for (char c : *text) out += ByteToUnicode(static_cast<uint8_t>(c));
    *text = std::move(out);
    return absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(const JsonAt& json) {
  absl::StatusOr<std::string> type = json.Type();
  if (!type.ok()) return type.status();
  if (*type == "Sequence") {
    JsonAt list = json.Field("normalizers");
    if (absl::Status st = list.ExpectArray(); !st.ok()) return st;
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (size_t i = 0; i < list.value.size(); ++i) {
      absl::StatusOr<std::unique_ptr<Normalizer>> n = ParseNormalizer(list.Index(i));
      if (!n.ok()) return n.status();
      steps.push_back(*std::move(n));
    }
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  if (*type == "NFC") return std::make_unique<UnicodeNormalizer>(NormalizationForm::kNfc);
  if (*type == "NFD") return std::make_unique<UnicodeNormalizer>(NormalizationForm::kNfd);
  if (*type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormalizationForm::kNfkc);
  if (*type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormalizationForm::kNfkd);
  if (*type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (*type == "StripAccents") return std::make_unique<StripAccentsNormalizer>();
  if (*type == "ByteLevel") return std::make_unique<ByteLevelNormalizer>();
  if (*type == "Strip") {
    absl::StatusOr<bool> left = json.BoolOr("strip_left", true);
    if (!left.ok()) return left.status();
    absl::StatusOr<bool> right = json.BoolOr("strip_right", true);
    if (!right.ok()) return right.status();
    return std::make_unique<StripNormalizer>(*left, *right);
  }
  if (*type == "Replace") {
    absl::StatusOr<Pattern> pattern = ParsePattern(json.Field("pattern"));
    if (!pattern.ok()) return pattern.status();
    absl::StatusOr<std::string> content = json.Field("content").String();
    if (!content.ok()) return content.status();
    return std::make_unique<ReplaceNormalizer>(*std::move(pattern), *std::move(content));
  }
  if (*type == "Precompiled") {
    absl::StatusOr<std::string> encoded = json.Field("precompiled_charsmap").String();
    if (!encoded.ok()) return encoded.status();
    std::string charsmap;
    if (!absl::Base64Unescape(*encoded, &charsmap)) {
      return json.Field("precompiled_charsmap").Error("is not base64");
    }
    // An empty charsmap normalizes nothing (SentencePiece's "identity" rule).
    if (charsmap.empty())
      return std::make_unique<SequenceNormalizer>(std::vector<std::unique_ptr<Normalizer>>());
    absl::StatusOr<std::unique_ptr<PrecompiledNormalizer>> p =
        PrecompiledNormalizer::Create(charsmap);
    if (!p.ok()) return json.Field("precompiled_charsmap").Error(std::string(p.status().message()));
    return *std::move(p);
  }
  if (*type == "Prepend") {
    absl::StatusOr<std::string> prefix = json.Field("prepend").String();
    if (!prefix.ok()) return prefix.status();
    return std::make_unique<PrependNormalizer>(*std::move(prefix));
  }
  if (*type == "BertNormalizer") {
    absl::StatusOr<bool> clean = json.BoolOr("clean_text", true);
    if (!clean.ok()) return clean.status();
    absl::StatusOr<bool> chinese = json.BoolOr("handle_chinese_chars", true);
    if (!chinese.ok()) return chinese.status();
    absl::StatusOr<bool> lower = json.BoolOr("lowercase", true);
    if (!lower.ok()) return lower.status();
    // strip_accents: null means "as lowercase".
    absl::StatusOr<bool> strip = json.BoolOr("strip_accents", *lower);
    if (!strip.ok()) return strip.status();
    return std::make_unique<BertNormalizer>(*clean, *chinese, *strip, *lower);
  }
  return json.Unsupported(*type);
}

}  // namespace cdcca::tokenizer
