// Typed reads of tokenizer.json fields that never throw: a missing or mistyped field is an
// error naming the file and the JSON path ("tokenizer.json: model.vocab must be an object").
#ifndef CDCCA_MODEL_TOKENIZER_JSON_FIELDS_H_
#define CDCCA_MODEL_TOKENIZER_JSON_FIELDS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/tokenizer/concat.h"
#include "nlohmann/json.hpp"

namespace cdcca::tokenizer {

using Json = nlohmann::json;

// A JSON value with where it sits: `file` for messages, `path` the dotted JSON path.
struct JsonAt {
  const Json& value;
  std::string file;
  std::string path;

  // The member `key` of this object (a null value when absent) and its path.
  JsonAt Field(std::string_view key) const;
  JsonAt Index(size_t i) const;
  // An error "FILE: PATH MESSAGE".
  absl::Status Error(std::string_view message) const;

  bool IsNullOrAbsent() const { return value.is_null(); }
  absl::Status ExpectObject() const;
  absl::Status ExpectArray() const;
  absl::StatusOr<std::string> String() const;
  absl::StatusOr<bool> Bool() const;
  absl::StatusOr<int64_t> Int() const;
  // The member `key` read with a default when it is absent or null.
  absl::StatusOr<std::string> StringOr(std::string_view key, std::string_view fallback) const;
  absl::StatusOr<bool> BoolOr(std::string_view key, bool fallback) const;
  absl::StatusOr<int64_t> IntOr(std::string_view key, int64_t fallback) const;
  absl::StatusOr<std::optional<std::string>> OptionalString(std::string_view key) const;
  // A member that must be one code point (Metaspace replacement, Strip content).
  absl::StatusOr<std::string> CharOr(std::string_view key, std::string_view fallback) const;
  // The component's "type" string (an error when missing).
  absl::StatusOr<std::string> Type() const;
  // "FILE: PATH.type 'T' is not supported".
  absl::Status Unsupported(std::string_view type) const;
};

// Parses JSON text without exceptions and without deep recursion: nesting deeper than
// `max_depth` is an error, as is anything that is not one JSON value.
absl::StatusOr<Json> ParseJson(std::string_view text, std::string_view file, int max_depth = 256);

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_JSON_FIELDS_H_
