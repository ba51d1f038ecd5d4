// Bounded reading of the small JSON files of a Hugging Face model folder (config.json,
// generation_config.json, model.safetensors.index.json, preprocessor_config.json,
// processor_config.json): files from outside the process, so size and nesting are bounded
// before anything is built from them, and every error names the file.
//
// Torch-free (Abseil and nlohmann_json only): fuzzed under model/fuzz/.
// Thread-safe (no shared state).
#ifndef CDCCA_MODEL_HUB_HF_JSON_H_
#define CDCCA_MODEL_HUB_HF_JSON_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

// The largest settings file read: 16 MiB. Published config.json files are a few KiB, and the
// index of a 400B-parameter checkpoint is ~150 KiB; tokenizer.json has its own reader.
// nlohmann's DOM takes at most ~20 x the text, so a parse allocates at most ~350 MiB.
inline constexpr uint64_t kMaxHfJsonBytes = uint64_t{16} << 20;
// The deepest nesting accepted: 64 arrays/objects (configs nest 3 levels). nlohmann parses
// iteratively but copies, compares and dumps values recursively, so a deeper document could
// exhaust the stack later; it is rejected while parsing, before any deep value exists.
inline constexpr int kMaxHfJsonDepth = 64;

// Parses one JSON value. InvalidArgument naming `file` for text over kMaxHfJsonBytes,
// nesting deeper than kMaxHfJsonDepth, or malformed JSON (with the parser's message).
absl::StatusOr<nlohmann::json> ParseHfJson(absl::string_view text, absl::string_view file);

// The bytes of a settings file: NotFound naming the file when it cannot be opened,
// InvalidArgument when it holds more than kMaxHfJsonBytes (checked before reading).
absl::StatusOr<std::string> ReadHfJsonText(const std::string& path);

// ReadHfJsonText, then ParseHfJson.
absl::StatusOr<nlohmann::json> ReadJsonFile(const std::string& path);

// model.safetensors.index.json's `weight_map`: tensor name (as stored) -> shard file name.
// InvalidArgument naming `file` and the field when the document is not an object, weight_map
// is missing or not an object, a value is not a string, or a shard name is not a plain file
// name of the folder (empty, ".", "..", containing '/' or a NUL byte).
absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(
    const nlohmann::json& index, const std::string& file);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_HF_JSON_H_
