#include "model/tokenizer/json_fields.h"

#include "model/tokenizer/unicode.h"

namespace cdcca::tokenizer {
namespace {

const Json& NullJson() {
  static const Json* const kNull = new Json(nullptr);
  return *kNull;
}

const char* TypeName(const Json& v) { return v.type_name(); }

}  // namespace

JsonAt JsonAt::Field(std::string_view key) const {
  std::string p = path.empty() ? std::string(key) : Concat(path, ".", key);
  if (!value.is_object()) return {NullJson(), file, std::move(p)};
  auto it = value.find(std::string(key));
  if (it == value.end()) return {NullJson(), file, std::move(p)};
  return {*it, file, std::move(p)};
}

JsonAt JsonAt::Index(size_t i) const {
  std::string p = Concat(path, "[", i, "]");
  if (!value.is_array() || i >= value.size()) return {NullJson(), file, std::move(p)};
  return {value[i], file, std::move(p)};
}

absl::Status JsonAt::Error(std::string_view message) const {
  return absl::InvalidArgumentError(
      Concat(file, ": ", path.empty() ? "(top level)" : path, " ", message));
}

absl::Status JsonAt::ExpectObject() const {
  if (value.is_object()) return absl::OkStatus();
  return Error(Concat("must be an object, not ", TypeName(value)));
}

absl::Status JsonAt::ExpectArray() const {
  if (value.is_array()) return absl::OkStatus();
  return Error(Concat("must be an array, not ", TypeName(value)));
}

absl::StatusOr<std::string> JsonAt::String() const {
  if (!value.is_string()) return Error(Concat("must be a string, not ", TypeName(value)));
  return value.get_ref<const std::string&>();
}

absl::StatusOr<bool> JsonAt::Bool() const {
  if (!value.is_boolean()) return Error(Concat("must be a boolean, not ", TypeName(value)));
  return value.get<bool>();
}

absl::StatusOr<int64_t> JsonAt::Int() const {
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u <= static_cast<uint64_t>(INT64_MAX)) return static_cast<int64_t>(u);
  }
  return Error(Concat("must be an integer, not ", TypeName(value)));
}

absl::StatusOr<std::string> JsonAt::StringOr(std::string_view key,
                                             std::string_view fallback) const {
  JsonAt f = Field(key);
  if (f.IsNullOrAbsent()) return std::string(fallback);
  return f.String();
}

absl::StatusOr<bool> JsonAt::BoolOr(std::string_view key, bool fallback) const {
  JsonAt f = Field(key);
  if (f.IsNullOrAbsent()) return fallback;
  return f.Bool();
}

absl::StatusOr<int64_t> JsonAt::IntOr(std::string_view key, int64_t fallback) const {
  JsonAt f = Field(key);
  if (f.IsNullOrAbsent()) return fallback;
  return f.Int();
}

absl::StatusOr<std::optional<std::string>> JsonAt::OptionalString(std::string_view key) const {
  JsonAt f = Field(key);
  if (f.IsNullOrAbsent()) return std::optional<std::string>();
  absl::StatusOr<std::string> s = f.String();
  if (!s.ok()) return s.status();
  return std::optional<std::string>(*std::move(s));
}

absl::StatusOr<std::string> JsonAt::CharOr(std::string_view key, std::string_view fallback) const {
  absl::StatusOr<std::string> s = StringOr(key, fallback);
  if (!s.ok()) return s.status();
  if (!IsValidUtf8(*s) || CodePointCount(*s) != 1) {
    return Field(key).Error("must be a single character");
  }
  return s;
}

absl::StatusOr<std::string> JsonAt::Type() const {
  if (absl::Status st = ExpectObject(); !st.ok()) return st;
  return Field("type").String();
}

absl::Status JsonAt::Unsupported(std::string_view type) const {
  return absl::InvalidArgumentError(
      Concat(file, ": ", path.empty() ? "" : path + ".", "type '", type, "' is not supported"));
}

absl::StatusOr<Json> ParseJson(std::string_view text, std::string_view file, int max_depth) {
  // nlohmann's parser recurses once per nesting level: bound the depth first so hostile
  // input cannot exhaust the stack.
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return absl::InvalidArgumentError(
            Concat(file, ": JSON nests deeper than ", max_depth, " levels"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(Concat(file, ": malformed JSON"));
  return j;
}

}  // namespace cdcca::tokenizer
