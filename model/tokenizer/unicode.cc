#include "model/tokenizer/unicode.h"

#include <unicode/brkiter.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>
#include <unicode/utext.h>

#include <memory>

#include "absl/status/status.h"
#include "model/tokenizer/concat.h"

namespace cdcca::tokenizer {

char32_t NextCodePoint(std::string_view s, size_t* pos) {
  const auto b0 = static_cast<unsigned char>(s[*pos]);
  int len = 1;
  char32_t cp = b0;
  if (b0 >= 0xF0) {
    len = 4;
    cp = b0 & 0x07;
  } else if (b0 >= 0xE0) {
    len = 3;
    cp = b0 & 0x0F;
  } else if (b0 >= 0xC0) {
    len = 2;
    cp = b0 & 0x1F;
  }
  for (int i = 1; i < len && *pos + i < s.size(); ++i) {
    cp = (cp << 6) | (static_cast<unsigned char>(s[*pos + i]) & 0x3F);
  }
  *pos += len;
  if (*pos > s.size()) *pos = s.size();
  return cp;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string Utf8(char32_t cp) {
  std::string s;
  AppendUtf8(cp, &s);
  return s;
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

namespace {

// Length of the well-formed UTF-8 sequence at s[pos], or 0 if ill-formed; *subpart gets the
// length of the maximal ill-formed prefix (>= 1) when it is.
size_t WellFormedLength(std::string_view s, size_t pos, size_t* subpart) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  *subpart = 1;
  if (b0 < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t i = 1; i < len; ++i) {
    if (pos + i >= s.size()) return 0;
    const auto b = static_cast<unsigned char>(s[pos + i]);
    const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) return 0;
    *subpart = i + 1;
  }
  return len;
}

}  // namespace

bool IsValidUtf8(std::string_view s) {
  size_t pos = 0, subpart = 0;
  while (pos < s.size()) {
    const size_t n = WellFormedLength(s, pos, &subpart);
    if (n == 0) return false;
    pos += n;
  }
  return true;
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0, subpart = 0;
  while (pos < bytes.size()) {
    const size_t n = WellFormedLength(bytes, pos, &subpart);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      pos += subpart;
    } else {
      out.append(bytes.substr(pos, n));
      pos += n;
    }
  }
  return out;
}

bool IsWhitespace(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE);
}

bool IsNumeric(char32_t c) {
  const int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

bool IsAlphanumeric(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_ALPHABETIC) || IsNumeric(c);
}

bool IsOnigWordChar(char32_t c) {
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) &
          (U_GC_L_MASK | U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

bool IsRegexWordChar(char32_t c) {
  const auto u = static_cast<UChar32>(c);
  const int8_t t = u_charType(u);
  return u_hasBinaryProperty(u, UCHAR_ALPHABETIC) || t == U_NON_SPACING_MARK ||
         t == U_ENCLOSING_MARK || t == U_COMBINING_SPACING_MARK || t == U_DECIMAL_DIGIT_NUMBER ||
         t == U_CONNECTOR_PUNCTUATION || u_hasBinaryProperty(u, UCHAR_JOIN_CONTROL);
}

bool IsPunctuation(char32_t c) {
  if (c < 0x80) {
    return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
           (c >= 0x7B && c <= 0x7E);
  }
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_P_MASK) != 0;
}

bool IsNonspacingMark(char32_t c) {
  return u_charType(static_cast<UChar32>(c)) == U_NON_SPACING_MARK;
}

bool IsBertControl(char32_t c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_C_MASK) != 0;
}

bool IsBertWhitespace(char32_t c) { return c == '\t' || c == '\n' || c == '\r' || IsWhitespace(c); }

bool IsChineseChar(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

std::string Lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = NextCodePoint(s, &pos);
    if (c < 0x80) {
      out.push_back(static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c));
      continue;
    }
    // Full case mapping of one code point alone (no neighbours: no final-sigma context).
    UChar src[2];
    int32_t src_len = 0;
    U16_APPEND_UNSAFE(src, src_len, static_cast<UChar32>(c));
    UChar dst[8];
    UErrorCode err = U_ZERO_ERROR;
    const int32_t n = u_strToLower(dst, 8, src, src_len, "", &err);
    if (U_FAILURE(err)) {
      AppendUtf8(c, &out);
      continue;
    }
    icu::UnicodeString(dst, n).toUTF8String(out);
  }
  return out;
}

absl::StatusOr<std::vector<size_t>> GraphemeBoundaries(std::string_view s) {
  std::vector<size_t> out{0};
  if (s.empty()) return out;
  UErrorCode err = U_ZERO_ERROR;
  std::unique_ptr<icu::BreakIterator> it(
      icu::BreakIterator::createCharacterInstance(icu::Locale::getRoot(), err));
  if (U_FAILURE(err) || it == nullptr) {
    return absl::InternalError(Concat("ICU grapheme iterator unavailable: ", u_errorName(err)));
  }
  // A UText over the UTF-8 bytes: the iterator's offsets are byte offsets.
  UText* text = utext_openUTF8(nullptr, s.data(), static_cast<int64_t>(s.size()), &err);
  if (U_FAILURE(err)) {
    return absl::InternalError(Concat("ICU cannot read the text: ", u_errorName(err)));
  }
  it->setText(text, err);
  if (U_FAILURE(err)) {
    utext_close(text);
    return absl::InternalError(Concat("ICU cannot segment the text: ", u_errorName(err)));
  }
  for (int32_t b = it->next(); b != icu::BreakIterator::DONE; b = it->next()) {
    out.push_back(static_cast<size_t>(b));
  }
  utext_close(text);
  if (out.back() != s.size()) out.push_back(s.size());
  return out;
}

absl::StatusOr<std::string> Normalize(NormalizationForm form, std::string_view s) {
  UErrorCode err = U_ZERO_ERROR;
  // ICU's "nfc" data composes or decomposes canonically, "nfkc" compatibly.
  const bool compatibility = form == NormalizationForm::kNfkc || form == NormalizationForm::kNfkd;
  const bool compose = form == NormalizationForm::kNfc || form == NormalizationForm::kNfkc;
  const icu::Normalizer2* n = icu::Normalizer2::getInstance(
      nullptr, compatibility ? "nfkc" : "nfc", compose ? UNORM2_COMPOSE : UNORM2_DECOMPOSE, err);
  if (U_FAILURE(err) || n == nullptr) {
    return absl::InternalError(Concat("ICU normalizer unavailable: ", u_errorName(err)));
  }
  const icu::UnicodeString in =
      icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  icu::UnicodeString normalized = n->normalize(in, err);
  if (U_FAILURE(err)) {
    return absl::InvalidArgumentError(Concat("Unicode normalization failed: ", u_errorName(err)));
  }
  std::string out;
  normalized.toUTF8String(out);
  return out;
}

}  // namespace cdcca::tokenizer
