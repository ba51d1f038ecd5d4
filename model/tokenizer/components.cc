#include "model/tokenizer/components.h"

#include <array>

#include "absl/strings/str_replace.h"
#include "model/tokenizer/unicode.h"

namespace cdcca::tokenizer {

absl::StatusOr<Pattern> ParsePattern(const JsonAt& json) {
  if (absl::Status st = json.ExpectObject(); !st.ok()) return st;
  Pattern p;
  if (JsonAt s = json.Field("String"); !s.IsNullOrAbsent()) {
    absl::StatusOr<std::string> lit = s.String();
    if (!lit.ok()) return lit.status();
    p.literal = *std::move(lit);
    return p;
  }
  if (JsonAt r = json.Field("Regex"); !r.IsNullOrAbsent()) {
    absl::StatusOr<std::string> src = r.String();
    if (!src.ok()) return src.status();
    absl::StatusOr<std::shared_ptr<const Regex>> re = Regex::Compile(*src);
    if (!re.ok()) return r.Error(std::string(re.status().message()));
    p.regex = *std::move(re);
    return p;
  }
  return json.Error("must hold \"String\" or \"Regex\"");
}

absl::StatusOr<std::vector<std::pair<size_t, size_t>>> Pattern::FindAll(
    std::string_view text) const {
  if (regex != nullptr) return regex->FindAll(text);
  std::vector<std::pair<size_t, size_t>> out;
  if (literal.empty()) return out;
  for (size_t pos = text.find(literal); pos != std::string_view::npos;
       pos = text.find(literal, pos + literal.size())) {
    out.emplace_back(pos, pos + literal.size());
  }
  return out;
}

absl::StatusOr<std::string> Pattern::ReplaceAll(std::string_view text,
                                                std::string_view content) const {
  absl::StatusOr<std::vector<std::pair<size_t, size_t>>> matches = FindAll(text);
  if (!matches.ok()) return matches.status();
  std::string out;
  size_t prev = 0;
  for (const auto& [b, e] : *matches) {
    out.append(text.substr(prev, b - prev));
    out.append(content);
    prev = e;
  }
  out.append(text.substr(prev));
  return out;
}

namespace {

struct ByteTable {
  std::array<std::string, 256> to_unicode;
  std::array<char32_t, 256> code_point{};
};

const ByteTable& Table() {
  static const ByteTable* const kTable = [] {
    auto* t = new ByteTable;
    // Printable Latin-1 bytes stand for themselves; the rest take 256, 257, ... in order.
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t->code_point[b] = printable ? static_cast<char32_t>(b) : next++;
      t->to_unicode[b] = Utf8(t->code_point[b]);
    }
    return t;
  }();
  return *kTable;
}

}  // namespace

const std::string& ByteToUnicode(uint8_t byte) { return Table().to_unicode[byte]; }

int UnicodeToByte(char32_t cp) {
  if (cp < 256) {
    const bool printable = (cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || cp >= 0xAE;
    return printable ? static_cast<int>(cp) : -1;
  }
  if (cp < 256 + 68) {
    const ByteTable& t = Table();
    for (int b = 0; b < 256; ++b) {
      if (t.code_point[b] == cp) return b;
    }
  }
  return -1;
}

std::string CleanUpTokenization(std::string text, bool wordpiece_variant) {
  // Applied one after the other, as the chained str.replace / String::replace calls are;
  // the WordPiece decoder's list also rewrites " do not".
  const std::pair<const char*, const char*> kRules[] = {
      {" .", "."},   {" ?", "?"},     {" !", "!"},    {" ,", ","},
      {" ' ", "'"},  {" n't", "n't"}, {" 'm", "'m"},  {" do not", " don't"},
      {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kRules) {
    if (!wordpiece_variant && std::string_view(from) == " do not") continue;
    text = absl::StrReplaceAll(text, {{from, to}});
  }
  return text;
}

}  // namespace cdcca::tokenizer
