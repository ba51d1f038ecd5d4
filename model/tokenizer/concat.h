// Concat(): string concatenation that takes std::string_view. Debian's Abseil keeps its own
// absl::string_view type, so absl::StrCat does not accept std::string_view there.
#ifndef CDCCA_MODEL_TOKENIZER_CONCAT_H_
#define CDCCA_MODEL_TOKENIZER_CONCAT_H_

#include <string>
#include <string_view>
#include <type_traits>

#include "absl/strings/string_view.h"

namespace cdcca::tokenizer {

inline void AppendPiece(std::string* out, std::string_view s) { out->append(s); }
inline void AppendPiece(std::string* out, const char* s) { out->append(s); }
inline void AppendPiece(std::string* out, const std::string& s) { out->append(s); }
#ifndef ABSL_USES_STD_STRING_VIEW
inline void AppendPiece(std::string* out, absl::string_view s) { out->append(s.data(), s.size()); }
#endif
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void AppendPiece(std::string* out, T v) {
  out->append(std::to_string(v));
}
template <typename... Args>
std::string Concat(const Args&... args) {
  std::string out;
  (AppendPiece(&out, args), ...);
  return out;
}

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_CONCAT_H_
