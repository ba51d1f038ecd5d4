#include "model/hub/folder_json.h"

#include <fstream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace cdcca::model {

using nlohmann::json;

absl::StatusOr<json> ParseHfJson(absl::string_view text, absl::string_view file) {
  if (text.size() > kMaxHfJsonBytes) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", text.size(),
                                                   " bytes, more than the ", kMaxHfJsonBytes,
                                                   " a settings file may have"));
  }
  // The callback sees every array/object start with the number of enclosing containers;
  // refusing one past the bound discards it unbuilt (the parser itself keeps its state in
  // vectors, not on the stack), and the flag turns the result into an error.
  bool too_deep = false;
  const json::parser_callback_t bound_depth = [&too_deep](int depth, json::parse_event_t event,
                                                          json&) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxHfJsonDepth) {
      too_deep = true;
      return false;
    }
    return true;
  };
  json out;
  try {
    out = json::parse(text.begin(), text.end(), bound_depth);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": bad JSON: ", e.what()));
  }
  if (too_deep) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": JSON nests deeper than ", kMaxHfJsonDepth, " levels"));
  }
  return out;
}

absl::StatusOr<std::string> ReadHfJsonText(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  if (static_cast<uint64_t>(size) > kMaxHfJsonBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", size, " bytes, more than the ",
                                                   kMaxHfJsonBytes, " a settings file may have"));
  }
  std::string text(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (!in.read(text.data(), size)) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  return text;
}

absl::StatusOr<json> ReadJsonFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadHfJsonText(path);
  if (!text.ok()) return text.status();
  return ParseHfJson(*text, path);
}

absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(const json& index,
                                                                         const std::string& file) {
  if (!index.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": not a JSON object"));
  }
  auto map = index.find("weight_map");
  if (map == index.end() || !map->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": field weight_map missing"));
  }
  std::map<std::string, std::string> out;
  for (const auto& item : map->items()) {
    if (!item.value().is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": weight_map[", item.key(), "] is not a file name"));
    }
    std::string shard = item.value().get<std::string>();
    // The folder's own files only: the shard is opened as <dir>/<shard>.
    if (shard.empty() || shard == "." || shard == ".." || absl::StrContains(shard, "/") ||
        absl::StrContains(shard, absl::string_view("\0", 1))) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": weight_map[", item.key(), "]: shard name ", json(shard).dump()));
    }
    out.emplace(item.key(), std::move(shard));
  }
  return out;
}

}  // namespace cdcca::model
