#include "model/tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/status/status.h"
#include "model/tokenizer/concat.h"

namespace cdcca::tokenizer {

absl::StatusOr<std::shared_ptr<const Regex>> Regex::Compile(std::string_view pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return absl::InvalidArgumentError(Concat("regex '", pattern, "' does not compile at offset ",
                                             offset, ": ", reinterpret_cast<char*>(message)));
  }
  // JIT is a speed-up only: without it pcre2_match interprets.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return std::shared_ptr<const Regex>(new Regex(code));
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

absl::StatusOr<std::vector<std::pair<size_t, size_t>>> Regex::FindAll(std::string_view text) const {
  auto* code = static_cast<pcre2_code*>(code_);
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
      pcre2_match_data_create_from_pattern(code, nullptr), &pcre2_match_data_free);
  if (data == nullptr) return absl::ResourceExhaustedError("pcre2 match data");
  std::vector<std::pair<size_t, size_t>> matches;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    // The input is valid UTF-8 (checked once at the API), so skip PCRE2's re-check.
    const int rc =
        pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      return absl::ResourceExhaustedError(
          Concat("regex match failed: ", reinterpret_cast<char*>(message)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.get());
    const size_t b = ov[0], e = ov[1];
    matches.emplace_back(b, e);
    if (e > b) {
      start = e;
    } else {
      // Empty match: move on by one code point.
      if (e >= text.size()) break;
      start = e + 1;
      while (start < text.size() && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80)
        ++start;
    }
  }
  return matches;
}

}  // namespace cdcca::tokenizer
