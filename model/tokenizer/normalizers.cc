// Normalizers of tokenizer.json: Sequence, NFC/NFD/NFKC/NFKD, Lowercase, Strip,
// StripAccents, Replace, Prepend, BertNormalizer, ByteLevel.
#include <utility>

#include "model/tokenizer/components.h"
#include "model/tokenizer/unicode.h"

namespace cdcca::tokenizer {
namespace {

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
