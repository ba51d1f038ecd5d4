// A compiled PCRE2 pattern in UTF + UCP mode: the Unicode classes (\p{L}, \s, \w) and
// lookahead that tokenizer.json patterns (Oniguruma syntax in the Rust library) use.
#ifndef CDCCA_MODEL_TOKENIZER_REGEX_H_
#define CDCCA_MODEL_TOKENIZER_REGEX_H_

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace cdcca::tokenizer {

class Regex {
 public:
  // Compiles `pattern`; an error carries PCRE2's message and offset.
  static absl::StatusOr<std::shared_ptr<const Regex>> Compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Byte ranges [start, end) of the successive non-overlapping matches in `text` (valid
  // UTF-8). After an empty match the search resumes one code point further. Thread-safe.
  absl::StatusOr<std::vector<std::pair<size_t, size_t>>> FindAll(std::string_view text) const;

 private:
  explicit Regex(void* code) : code_(code) {}
  void* code_;  // pcre2_code_8*
};

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_REGEX_H_
