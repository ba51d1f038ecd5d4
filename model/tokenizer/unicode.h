// UTF-8 and Unicode character classes as the Hugging Face `tokenizers` library (Rust) sees
// them, backed by ICU. Internal to cdcca_tokenizers; torch-free.
#ifndef CDCCA_MODEL_TOKENIZER_UNICODE_H_
#define CDCCA_MODEL_TOKENIZER_UNICODE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace cdcca::tokenizer {

// Decodes the code point at s[*pos] and advances *pos past it. `s` must be valid UTF-8
// (callers validate input once with IsValidUtf8).
char32_t NextCodePoint(std::string_view s, size_t* pos);
// Appends the UTF-8 encoding of `cp`.
void AppendUtf8(char32_t cp, std::string* out);
std::string Utf8(char32_t cp);
// Number of code points of valid UTF-8 text.
size_t CodePointCount(std::string_view s);

bool IsValidUtf8(std::string_view s);
// Bytes to text the way Rust's String::from_utf8_lossy (and Python's errors="replace") do:
// every maximal ill-formed subsequence becomes one U+FFFD.
std::string Utf8Lossy(std::string_view bytes);

// Rust char::is_whitespace: the Unicode White_Space property.
bool IsWhitespace(char32_t c);
// Rust char::is_numeric: general categories Nd, Nl, No.
bool IsNumeric(char32_t c);
// Rust char::is_alphanumeric: Alphabetic or numeric.
bool IsAlphanumeric(char32_t c);
// Rust regex `\w` (UTS #18): Alphabetic, marks, Nd, Pc, Join_Control (added tokens'
// single_word test).
bool IsRegexWordChar(char32_t c);
// Oniguruma's Unicode `\w`: letters, marks, Nd, Pc (the Whitespace pre-tokenizer).
bool IsOnigWordChar(char32_t c);
// The tokenizers library's punctuation test (BertPreTokenizer, Punctuation): ASCII
// punctuation or a Unicode P* category.
bool IsPunctuation(char32_t c);
// Unicode general category Mn (what StripAccents and BertNormalizer drop after NFD).
bool IsNonspacingMark(char32_t c);
// BertNormalizer's control test: category C* except \t \n \r.
bool IsBertControl(char32_t c);
// BertNormalizer's whitespace test: \t \n \r or White_Space.
bool IsBertWhitespace(char32_t c);
// BertNormalizer's CJK ideograph blocks.
bool IsChineseChar(char32_t c);

// Per-code-point full lowercase mapping (Rust char::to_lowercase: no context, so a final
// capital sigma maps to σ).
std::string Lowercase(std::string_view s);

// Byte offsets where the extended grapheme clusters (UAX #29, as Rust's unicode-segmentation
// `graphemes(true)`) of valid UTF-8 text begin, followed by s.size(); {0} for empty text.
absl::StatusOr<std::vector<size_t>> GraphemeBoundaries(std::string_view s);

enum class NormalizationForm { kNfc, kNfd, kNfkc, kNfkd };
absl::StatusOr<std::string> Normalize(NormalizationForm form, std::string_view s);

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_UNICODE_H_
