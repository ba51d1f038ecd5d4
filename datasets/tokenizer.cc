#include "datasets/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "datasets/language.h"
#include "nlohmann/json.hpp"

namespace cdcca::datasets {
namespace {

constexpr char kFormat[] = "cdcca-word-tokenizer";
const char* const kSpecials[Tokenizer::kNumSpecial] = {"<pad>", "<bos>", "<eos>", "<unk>"};

bool IsWordChar(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '\'' || c == '<' ||
         c == '>' || c == '_';
}

bool IsPunct(std::string_view w) {
  return w.size() == 1 && !std::isalnum(static_cast<unsigned char>(w[0]));
}

}  // namespace

Tokenizer::Tokenizer(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {
  for (size_t i = 0; i < tokens_.size(); ++i) ids_.emplace(tokens_[i], static_cast<int>(i));
}

Tokenizer Tokenizer::FromTexts(const std::vector<std::string>& texts) {
  std::set<std::string> words;
  for (const std::string& t : texts) {
    for (std::string& w : Split(t)) {
      if (w.front() == '{') continue;  // a template placeholder, not a word
      words.insert(std::move(w));
    }
  }
  std::vector<std::string> tokens(kSpecials, kSpecials + kNumSpecial);
  for (const std::string& w : words) {
    if (std::find(tokens.begin(), tokens.begin() + kNumSpecial, w) == tokens.begin() + kNumSpecial)
      tokens.push_back(w);
  }
  return Tokenizer(std::move(tokens));
}

Tokenizer Tokenizer::SceneLanguage() { return FromTexts(LanguageCorpus()); }

std::vector<std::string> Tokenizer::Split(std::string_view text) {
  std::vector<std::string> out;
  std::string cur;
  auto flush = [&] {
    // Trim '-' / '\'' at word edges ("-left" is not a word, "top-left" is).
    while (!cur.empty() && (cur.back() == '-' || cur.back() == '\'')) cur.pop_back();
    size_t start = 0;
    while (start < cur.size() && (cur[start] == '-' || cur[start] == '\'')) ++start;
    if (start < cur.size()) out.push_back(cur.substr(start));
    cur.clear();
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
    if (c == '{') {  // keep "{pos}" placeholders whole so they can be skipped
      flush();
      const size_t end = text.find('}', i);
      if (end != std::string_view::npos) {
        out.emplace_back(text.substr(i, end - i + 1));
        i = end;
        continue;
      }
    }
    if (IsWordChar(c)) {
      cur.push_back(c);
    } else {
      flush();
      if (!std::isspace(static_cast<unsigned char>(c))) out.emplace_back(1, c);
    }
  }
  flush();
  return out;
}

std::vector<int> Tokenizer::Encode(std::string_view text, bool add_bos, bool add_eos) const {
  std::vector<int> ids;
  if (add_bos) ids.push_back(kBos);
  for (const std::string& w : Split(text)) ids.push_back(Id(w));
  if (add_eos) ids.push_back(kEos);
  return ids;
}

std::string Tokenizer::Decode(const std::vector<int>& ids) const {
  std::string out;
  for (int id : ids) {
    if (id == kEos) break;
    if (id == kPad || id == kBos) continue;
    const std::string& w = Word(id);
    if (!out.empty() && !IsPunct(w)) out.push_back(' ');
    out += w;
  }
  return out;
}

int Tokenizer::Id(std::string_view word) const {
  auto it = ids_.find(std::string(word));
  return it == ids_.end() ? kUnk : it->second;
}

const std::string& Tokenizer::Word(int id) const {
  return id >= 0 && id < size() ? tokens_[id] : tokens_[kUnk];
}

std::string Tokenizer::ToJson() const {
  nlohmann::json j;
  j["format"] = kFormat;
  j["version"] = 1;
  j["tokens"] = tokens_;
  return j.dump(1);
}

absl::StatusOr<Tokenizer> Tokenizer::FromJson(std::string_view json) {
  nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("tokenizer JSON: not a JSON object");
  }
  nlohmann::json listed = nlohmann::json::array();
  if (j.contains("model") && !j.contains("format")) {
    // A Hugging Face tokenizer.json with a WordLevel model (a family's model folder): the
    // words by id, up to the first "<unused_N>" or "<image>" entry.
    const nlohmann::json& m = j["model"];
    if (!m.is_object() || !m.contains("type") || m["type"] != "WordLevel" || !m.contains("vocab") ||
        !m["vocab"].is_object()) {
      return absl::InvalidArgumentError(
          "tokenizer JSON: a Hugging Face tokenizer.json must have a WordLevel model with a vocab");
    }
    const size_t n = m["vocab"].size();
    std::vector<const std::string*> by_id(n, nullptr);
    for (const auto& item : m["vocab"].items()) {
      if (!item.value().is_number_integer() || item.value().get<int64_t>() < 0 ||
          item.value().get<int64_t>() >= static_cast<int64_t>(n) ||
          by_id[item.value().get<size_t>()] != nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("tokenizer JSON: model.vocab[\"", item.key(),
                                                       "\"] is not a distinct id in 0-", n - 1));
      }
      by_id[item.value().get<size_t>()] = &item.key();
    }
    for (const std::string* w : by_id) {
      if (w->rfind("<unused_", 0) == 0 || *w == "<image>") break;
      listed.push_back(*w);
    }
  } else {
    if (!j.contains("format") || j["format"] != kFormat) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer JSON: field 'format' must be \"", kFormat, "\""));
    }
    if (!j.contains("tokens") || !j["tokens"].is_array()) {
      return absl::InvalidArgumentError("tokenizer JSON: field 'tokens' must be an array");
    }
    listed = j["tokens"];
  }
  std::vector<std::string> tokens;
  std::set<std::string> seen;
  for (const nlohmann::json& t : listed) {
    if (!t.is_string()) {
      return absl::InvalidArgumentError("tokenizer JSON: field 'tokens' holds a non-string");
    }
    if (!seen.insert(t.get<std::string>()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer JSON: duplicate token '", t.get<std::string>(), "'"));
    }
    tokens.push_back(t.get<std::string>());
  }
  if (tokens.size() < kNumSpecial) {
    return absl::InvalidArgumentError("tokenizer JSON: fewer tokens than the 4 specials");
  }
  for (int i = 0; i < kNumSpecial; ++i) {
    if (tokens[i] != kSpecials[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer JSON: token ", i, " must be ", kSpecials[i]));
    }
  }
  return Tokenizer(std::move(tokens));
}

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open tokenizer file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<Tokenizer> t = FromJson(ss.str());
  if (!t.ok())
    return absl::Status(t.status().code(), absl::StrCat(path, ": ", t.status().message()));
  return t;
}

absl::Status Tokenizer::Save(const std::string& path) const {
  std::ofstream out(path, std::ios::trunc);
  out << ToJson();
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write tokenizer file ", path));
  return absl::OkStatus();
}

}  // namespace cdcca::datasets
