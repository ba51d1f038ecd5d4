#include "model/tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "model/tokenizer/components.h"
#include "model/tokenizer/json_fields.h"
#include "model/tokenizer/sentencepiece_reader.h"
#include "model/tokenizer/unicode.h"

namespace cdcca::tokenizer {
namespace {

absl::StatusOr<AddedToken> ParseAddedToken(const JsonAt& json, std::optional<int32_t> id) {
  if (absl::Status st = json.ExpectObject(); !st.ok()) return st;
  AddedToken t;
  if (id) {
    t.id = *id;
  } else {
    absl::StatusOr<int64_t> v = json.Field("id").Int();
    if (!v.ok()) return v.status();
    if (*v < 0 || *v > INT32_MAX) return json.Field("id").Error("is out of range");
    t.id = static_cast<int32_t>(*v);
  }
  absl::StatusOr<std::string> content = json.Field("content").String();
  if (!content.ok()) return content.status();
  t.content = *std::move(content);
  if (!IsValidUtf8(t.content)) return json.Field("content").Error("is not valid UTF-8");
  absl::StatusOr<bool> b = json.BoolOr("single_word", false);
  if (!b.ok()) return b.status();
  t.single_word = *b;
  if (b = json.BoolOr("lstrip", false); !b.ok()) return b.status();
  t.lstrip = *b;
  if (b = json.BoolOr("rstrip", false); !b.ok()) return b.status();
  t.rstrip = *b;
  if (b = json.BoolOr("special", false); !b.ok()) return b.status();
  t.special = *b;
  // AddedToken::from(content, special) defaults normalized to !special.
  if (b = json.BoolOr("normalized", !t.special); !b.ok()) return b.status();
  t.normalized = *b;
  return t;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(Concat(path, ": cannot be opened"));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(Concat(path, ": read failed"));
  return ss.str();
}

bool FileExists(const std::string& path) { return std::ifstream(path).good(); }

// Start of the whitespace run ending s (Rust regex `\s*$`).
size_t TrailingSpaceStart(std::string_view s) {
  size_t pos = 0, start = 0;
  while (pos < s.size()) {
    const char32_t c = NextCodePoint(s, &pos);
    if (!IsWhitespace(c)) start = pos;
  }
  return start;
}

// Length of the whitespace run starting s (Rust regex `^\s*`).
size_t LeadingSpaceLength(std::string_view s) {
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t at = pos;
    if (!IsWhitespace(NextCodePoint(s, &pos))) return at;
  }
  return s.size();
}

char32_t LastCodePoint(std::string_view s) {
  size_t at = s.size() - 1;
  while (at > 0 && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80) --at;
  return NextCodePoint(s, &at);
}

char32_t FirstCodePoint(std::string_view s) {
  size_t pos = 0;
  return NextCodePoint(s, &pos);
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json_text,
                                                               std::string_view file) {
  absl::StatusOr<Json> parsed = ParseJson(json_text, file);
  if (!parsed.ok()) return parsed.status();
  const JsonAt root{*parsed, std::string(file), ""};
  if (absl::Status st = root.ExpectObject(); !st.ok()) return st;
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  try {
    if (JsonAt n = root.Field("normalizer"); !n.IsNullOrAbsent()) {
      absl::StatusOr<std::unique_ptr<Normalizer>> v = ParseNormalizer(n);
      if (!v.ok()) return v.status();
      t->normalizer_ = *std::move(v);
    }
    if (JsonAt p = root.Field("pre_tokenizer"); !p.IsNullOrAbsent()) {
      absl::StatusOr<std::unique_ptr<PreTokenizer>> v = ParsePreTokenizer(p);
      if (!v.ok()) return v.status();
      t->pre_tokenizer_ = *std::move(v);
    }
    JsonAt m = root.Field("model");
    if (m.IsNullOrAbsent()) return m.Error("is missing");
    absl::StatusOr<std::unique_ptr<Model>> model = ParseModel(m);
    if (!model.ok()) return model.status();
    t->model_ = *std::move(model);
    if (JsonAt p = root.Field("post_processor"); !p.IsNullOrAbsent()) {
      absl::StatusOr<std::unique_ptr<PostProcessor>> v = ParsePostProcessor(p);
      if (!v.ok()) return v.status();
      t->post_processor_ = *std::move(v);
    }
    if (JsonAt d = root.Field("decoder"); !d.IsNullOrAbsent()) {
      absl::StatusOr<std::unique_ptr<Decoder>> v = ParseDecoder(d);
      if (!v.ok()) return v.status();
      t->decoder_ = *std::move(v);
    }
    if (JsonAt added = root.Field("added_tokens"); !added.IsNullOrAbsent()) {
      if (absl::Status st = added.ExpectArray(); !st.ok()) return st;
      for (size_t i = 0; i < added.value.size(); ++i) {
        absl::StatusOr<AddedToken> tok = ParseAddedToken(added.Index(i), std::nullopt);
        if (!tok.ok()) return tok.status();
        if (absl::Status st = t->AddToken(*std::move(tok)); !st.ok()) return st;
      }
    }
  } catch (const std::exception& e) {
    // The readers check types before every access; this only guards against a gap.
    return absl::InvalidArgumentError(Concat(file, ": unreadable: ", e.what()));
  }
  return t;
}

absl::Status Tokenizer::AddToken(AddedToken token) {
  if (token.content.empty()) return absl::OkStatus();  // the reference ignores empty tokens
  std::string pattern = token.content;
  if (token.normalized && normalizer_ != nullptr) {
    if (absl::Status st = normalizer_->Normalize(&pattern); !st.ok()) return st;
  }
  if (auto it = added_by_content_.find(token.content); it != added_by_content_.end()) {
    const size_t index = added_by_id_[it->second];
    added_by_id_.erase(it->second);
    added_[index] = token;
    added_pattern_[index] = std::move(pattern);
    added_by_id_[token.id] = index;
    it->second = token.id;
    return absl::OkStatus();
  }
  added_by_content_[token.content] = token.id;
  added_by_id_[token.id] = added_.size();
  added_.push_back(std::move(token));
  added_pattern_.push_back(std::move(pattern));
  return absl::OkStatus();
}

absl::Status Tokenizer::SplitOnAddedTokens(std::vector<Piece>* pieces, bool normalized) const {
  // Candidates by first byte, longest first (leftmost-longest matching).
  std::vector<size_t> by_first[256];
  bool any = false;
  for (size_t i = 0; i < added_.size(); ++i) {
    if (added_[i].normalized != normalized || added_pattern_[i].empty()) continue;
    by_first[static_cast<unsigned char>(added_pattern_[i][0])].push_back(i);
    any = true;
  }
  if (!any) {
    // Nothing to match: only the reference's dropping of empty splits applies.
    pieces->erase(std::remove_if(pieces->begin(), pieces->end(),
                                 [](const Piece& p) { return p.id < 0 && p.text.empty(); }),
                  pieces->end());
    return absl::OkStatus();
  }
  for (auto& list : by_first) {
    std::stable_sort(list.begin(), list.end(), [&](size_t a, size_t b) {
      return added_pattern_[a].size() > added_pattern_[b].size();
    });
  }
  std::vector<Piece> out;
  for (Piece& piece : *pieces) {
    if (piece.id >= 0) {
      out.push_back(std::move(piece));
      continue;
    }
    const std::string_view s = piece.text;
    size_t start_offset = 0, search = 0;
    auto emit = [&](size_t b, size_t e, int32_t id) {
      Piece p;
      p.text = std::string(s.substr(b, e - b));
      p.id = id;
      p.at_start = piece.at_start && b == 0;
      out.push_back(std::move(p));
    };
    while (search < s.size()) {
      // Leftmost position with a match, and the longest token there.
      size_t begin = s.size(), which = 0;
      for (size_t i = search; i < s.size() && begin == s.size(); ++i) {
        for (size_t cand : by_first[static_cast<unsigned char>(s[i])]) {
          const std::string& pat = added_pattern_[cand];
          if (s.compare(i, pat.size(), pat) == 0) {
            begin = i;
            which = cand;
            break;
          }
        }
      }
      if (begin == s.size()) break;
      const AddedToken& tok = added_[which];
      size_t stop = begin + added_pattern_[which].size();
      search = stop;
      size_t start = begin;
      if (tok.single_word) {
        const bool word_before = start > 0 && IsRegexWordChar(LastCodePoint(s.substr(0, start)));
        const bool word_after = stop < s.size() && IsRegexWordChar(FirstCodePoint(s.substr(stop)));
        if (word_before || word_after) continue;
      }
      if (tok.lstrip) start = std::max(TrailingSpaceStart(s.substr(0, start)), start_offset);
      if (tok.rstrip) stop += LeadingSpaceLength(s.substr(stop));
      search = stop;
      if (start_offset < start) emit(start_offset, start, -1);
      emit(start, stop, tok.id);
      start_offset = stop;
    }
    // Empty splits are dropped, as the reference does.
    if (start_offset < s.size()) emit(start_offset, s.size(), -1);
  }
  *pieces = std::move(out);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       bool add_special_tokens) const {
  if (!IsValidUtf8(text)) return absl::InvalidArgumentError("text is not valid UTF-8");
  std::vector<Piece> pieces(1);
  pieces[0].text = std::string(text);
  pieces[0].at_start = true;
  // Added tokens that match the raw text, then normalization of what is left and the added
  // tokens that match normalized text, as AddedVocabulary::extract_and_normalize does.
  if (absl::Status st = SplitOnAddedTokens(&pieces, /*normalized=*/false); !st.ok()) return st;
  if (normalizer_ != nullptr) {
    for (Piece& p : pieces) {
      if (p.id >= 0) continue;
      if (absl::Status st = normalizer_->Normalize(&p.text); !st.ok()) return st;
    }
  }
  if (absl::Status st = SplitOnAddedTokens(&pieces, /*normalized=*/true); !st.ok()) return st;
  if (pre_tokenizer_ != nullptr) {
    if (absl::Status st = pre_tokenizer_->PreTokenize(&pieces); !st.ok()) return st;
  }
  std::vector<int32_t> ids;
  for (const Piece& p : pieces) {
    if (p.id >= 0) {
      ids.push_back(p.id);
    } else if (absl::Status st = model_->Tokenize(p.text, &ids); !st.ok()) {
      return st;
    }
  }
  if (add_special_tokens && post_processor_ != nullptr) post_processor_->Process(&ids);
  return ids;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (auto it = added_by_id_.find(id); it != added_by_id_.end()) {
      const AddedToken& t = added_[it->second];
      if (skip_special_tokens && t.special) continue;
      tokens.push_back(t.content);
    } else if (std::optional<std::string> tok = model_->IdToToken(id)) {
      // A model token spelled like a special added token is skipped too (by content).
      if (skip_special_tokens) {
        auto c = added_by_content_.find(*tok);
        if (c != added_by_content_.end() && added_[added_by_id_.at(c->second)].special) continue;
      }
      tokens.push_back(*std::move(tok));
    }
  }
  std::string text;
  if (decoder_ != nullptr) {
    decoder_->DecodeChain(&tokens);
    text = absl::StrJoin(tokens, "");
  } else {
    text = absl::StrJoin(tokens, " ");
  }
  if (clean_up_tokenization_spaces_) text = CleanUpTokenization(std::move(text), false);
  return text;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  if (auto it = added_by_content_.find(absl::string_view(token.data(), token.size()));
      it != added_by_content_.end()) {
    return it->second;
  }
  return model_->TokenToId(token);
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (auto it = added_by_id_.find(id); it != added_by_id_.end()) return added_[it->second].content;
  return model_->IdToToken(id);
}

int64_t Tokenizer::VocabSize() const {
  int64_t n = model_->VocabSize();
  for (const AddedToken& t : added_) n = std::max<int64_t>(n, int64_t{t.id} + 1);
  return n;
}

// ---- folders ---------------------------------------------------------------------------------

namespace {

// A token named in tokenizer_config.json: a string or an AddedToken object.
absl::StatusOr<std::optional<AddedToken>> ConfigToken(const JsonAt& json) {
  if (json.IsNullOrAbsent()) return std::optional<AddedToken>();
  AddedToken t;
  t.special = true;
  t.normalized = false;
  if (json.value.is_string()) {
    t.content = json.value.get<std::string>();
  } else if (json.value.is_object()) {
    absl::StatusOr<AddedToken> parsed = ParseAddedToken(json, 0);
    if (!parsed.ok()) return parsed.status();
    t = *std::move(parsed);
    t.special = true;
  } else {
    return json.Error("must be a token string or an AddedToken object");
  }
  if (!IsValidUtf8(t.content)) return json.Error("is not valid UTF-8");
  return std::optional<AddedToken>(std::move(t));
}

// tokenizer.json's "added_tokens" for a SentencePiece model: its unknown and control pieces,
// special and unnormalized, at their piece ids.
Json SpecialPiecesJson(const std::vector<SentencePiecePiece>& pieces) {
  Json added = Json::array();
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (!pieces[i].unknown && !pieces[i].control) continue;
    added.push_back({{"id", i},
                     {"content", pieces[i].piece},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  return added;
}

}  // namespace

absl::Status Tokenizer::ApplyConfig(const std::string& dir, bool from_sentencepiece) {
  // special_tokens_map.json first: tokenizer_config.json's entries win.
  for (const char* name : {"special_tokens_map.json", "tokenizer_config.json"}) {
    const std::string path = Concat(dir, "/", name);
    if (!FileExists(path)) continue;
    absl::StatusOr<std::string> text = ReadFile(path);
    if (!text.ok()) return text.status();
    absl::StatusOr<Json> parsed = ParseJson(*text, path);
    if (!parsed.ok()) return parsed.status();
    const JsonAt root{*parsed, path, ""};
    if (absl::Status st = root.ExpectObject(); !st.ok()) return st;

    // added_tokens_decoder: {"32000": {"content": "<image>", ...}}
    if (JsonAt dec = root.Field("added_tokens_decoder"); !dec.IsNullOrAbsent()) {
      if (absl::Status st = dec.ExpectObject(); !st.ok()) return st;
      for (auto it = dec.value.begin(); it != dec.value.end(); ++it) {
        int32_t id = 0;
        if (!absl::SimpleAtoi(it.key(), &id) || id < 0) {
          return dec.Error(Concat("key '", it.key(), "' is not a token id"));
        }
        absl::StatusOr<AddedToken> tok = ParseAddedToken(dec.Field(it.key()), id);
        if (!tok.ok()) return tok.status();
        if (auto known = added_by_content_.find(tok->content);
            known != added_by_content_.end() && known->second == tok->id) {
          continue;  // tokenizer.json already has it, with its own flags
        }
        if (absl::Status st = AddToken(*std::move(tok)); !st.ok()) return st;
      }
    }
    // Named special tokens become special added tokens (transformers adds them so).
    struct Named {
      const char* key;
      std::optional<int32_t>* id;
    };
    const Named kNamed[] = {{"bos_token", &bos_id_}, {"eos_token", &eos_id_},
                            {"unk_token", &unk_id_}, {"pad_token", &pad_id_},
                            {"cls_token", nullptr},  {"sep_token", nullptr},
                            {"mask_token", nullptr}};
    auto add_named = [&](const JsonAt& at, std::optional<int32_t>* slot) -> absl::Status {
      absl::StatusOr<std::optional<AddedToken>> tok = ConfigToken(at);
      if (!tok.ok()) return tok.status();
      if (!tok->has_value()) return absl::OkStatus();
      AddedToken t = **std::move(tok);
      const std::optional<int32_t> id = TokenToId(t.content);
      if (!id) return absl::OkStatus();  // not in the vocabulary: nothing it can change
      t.id = *id;
      if (slot != nullptr) *slot = *id;
      if (added_by_content_.count(t.content) == 0) return AddToken(std::move(t));
      return absl::OkStatus();
    };
    for (const Named& n : kNamed) {
      if (absl::Status st = add_named(root.Field(n.key), n.id); !st.ok()) return st;
    }
    for (const char* list_key : {"additional_special_tokens", "extra_special_tokens"}) {
      JsonAt list = root.Field(list_key);
      if (list.value.is_array()) {
        for (size_t i = 0; i < list.value.size(); ++i) {
          if (absl::Status st = add_named(list.Index(i), nullptr); !st.ok()) return st;
        }
      } else if (list.value.is_object()) {  // {"image_token": "<image>"}
        for (auto it = list.value.begin(); it != list.value.end(); ++it) {
          if (absl::Status st = add_named(list.Field(it.key()), nullptr); !st.ok()) return st;
        }
      }
    }
    if (std::string_view(name) != "tokenizer_config.json") continue;
    absl::StatusOr<bool> cleanup =
        root.BoolOr("clean_up_tokenization_spaces", clean_up_tokenization_spaces_);
    if (!cleanup.ok()) return cleanup.status();
    clean_up_tokenization_spaces_ = *cleanup;
    // add_bos_token / add_eos_token decide the template of Llama-style tokenizers, as
    // transformers' update_post_processor does (a SentencePiece folder: bos by default).
    const bool has_flags = !root.Field("add_bos_token").IsNullOrAbsent() ||
                           !root.Field("add_eos_token").IsNullOrAbsent();
    if (has_flags || from_sentencepiece) {
      absl::StatusOr<bool> add_bos = root.BoolOr("add_bos_token", true);
      if (!add_bos.ok()) return add_bos.status();
      absl::StatusOr<bool> add_eos = root.BoolOr("add_eos_token", false);
      if (!add_eos.ok()) return add_eos.status();
      std::vector<int32_t> before, after;
      if (*add_bos && bos_id_) before.push_back(*bos_id_);
      if (*add_eos && eos_id_) after.push_back(*eos_id_);
      post_processor_ = MakeWrapProcessor(std::move(before), std::move(after));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFolder(const std::string& dir) {
  const std::string json_path = Concat(dir, "/tokenizer.json");
  const std::string spm_path = Concat(dir, "/tokenizer.model");
  std::unique_ptr<Tokenizer> t;
  bool from_sentencepiece = false;
  if (FileExists(json_path)) {
    absl::StatusOr<std::string> text = ReadFile(json_path);
    if (!text.ok()) return text.status();
    absl::StatusOr<std::unique_ptr<Tokenizer>> parsed = FromJson(*text, json_path);
    if (!parsed.ok()) return parsed.status();
    t = *std::move(parsed);
  } else if (FileExists(spm_path)) {
    // legacy (tokenizer_config.json) picks Metaspace's prepend scheme: "first" when false.
    bool legacy = true;
    const std::string config_path = Concat(dir, "/tokenizer_config.json");
    if (FileExists(config_path)) {
      absl::StatusOr<std::string> text = ReadFile(config_path);
      if (!text.ok()) return text.status();
      absl::StatusOr<Json> config = ParseJson(*text, config_path);
      if (!config.ok()) return config.status();
      const JsonAt root{*config, config_path, ""};
      absl::StatusOr<bool> l = root.BoolOr("legacy", true);
      if (!l.ok()) return l.status();
      legacy = *l;
      absl::StatusOr<std::string> cls = root.StringOr("tokenizer_class", "LlamaTokenizer");
      if (!cls.ok()) return cls.status();
      if (cls->rfind("LlamaTokenizer", 0) != 0 && cls->rfind("CodeLlamaTokenizer", 0) != 0) {
        return root.Field("tokenizer_class")
            .Error(Concat(
                "'", *cls,
                "' with tokenizer.model is not supported (only LlamaTokenizer's conversion)"));
      }
    }
    absl::StatusOr<std::unique_ptr<Tokenizer>> parsed = FromSentencePiece(spm_path, legacy);
    if (!parsed.ok()) return parsed.status();
    t = *std::move(parsed);
    from_sentencepiece = true;
  } else if (const std::string spiece_path = Concat(dir, "/spiece.model");
             FileExists(spiece_path)) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> parsed = FromSentencePieceUnigram(spiece_path);
    if (!parsed.ok()) return parsed.status();
    t = *std::move(parsed);
  } else {
    return absl::NotFoundError(Concat(dir, ": no tokenizer.json, tokenizer.model or spiece.model"));
  }
  if (absl::Status st = t->ApplyConfig(dir, from_sentencepiece); !st.ok()) return st;
  return t;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromSentencePieceUnigram(
    const std::string& model_path) {
  absl::StatusOr<std::string> bytes = ReadFile(model_path);
  if (!bytes.ok()) return bytes.status();
  std::vector<SentencePiecePiece> pieces;
  SentencePieceSpec spec;
  std::string error;
  if (!ReadSentencePieceModel(*bytes, &pieces, &error, &spec)) {
    return absl::InvalidArgumentError(Concat(model_path, ": not a SentencePiece model: ", error));
  }
  if (spec.model_type != 1) {
    return absl::InvalidArgumentError(
        Concat(model_path, ": trainer_spec.model_type = ", spec.model_type,
               " is not supported here (only a Unigram model, 1, converts as T5's)"));
  }
  if (spec.unk_id < 0 || static_cast<size_t>(spec.unk_id) >= pieces.size()) {
    return absl::InvalidArgumentError(
        Concat(model_path, ": trainer_spec.unk_id = ", spec.unk_id, " is not a piece"));
  }
  // The pipeline transformers' conversion of T5's spiece.model gives: the model's
  // precompiled normalization and runs of spaces folded, Metaspace with the dummy prefix,
  // </s> appended.
  Json vocab = Json::array();
  for (const SentencePiecePiece& p : pieces) vocab.push_back(Json::array({p.piece, p.score}));
  const Json added = SpecialPiecesJson(pieces);
  Json normalizers = Json::array();
  if (!spec.precompiled_charsmap.empty()) {
    normalizers.push_back(
        {{"type", "Precompiled"},
         {"precompiled_charsmap", absl::Base64Escape(spec.precompiled_charsmap)}});
  }
  if (spec.remove_extra_whitespaces) {
    normalizers.push_back(
        {{"type", "Replace"}, {"pattern", {{"Regex", " {2,}"}}}, {"content", " "}});
  }
  const std::string meta = "\xE2\x96\x81";
  const Json metaspace = {{"type", "Metaspace"},
                          {"replacement", meta},
                          {"prepend_scheme", spec.add_dummy_prefix ? "always" : "never"},
                          {"split", true}};
  Json decoder = metaspace;
  if (spec.byte_fallback) {
    decoder = {
        {"type", "Sequence"},
        {"decoders",
         Json::array({{{"type", "Replace"}, {"pattern", {{"String", meta}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  }
  Json post = nullptr;
  if (spec.eos_id >= 0 && static_cast<size_t>(spec.eos_id) < pieces.size()) {
    const std::string& eos = pieces[spec.eos_id].piece;
    post = {{"type", "TemplateProcessing"},
            {"single", Json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                    {{"SpecialToken", {{"id", eos}, {"type_id", 0}}}}})},
            {"pair", Json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                  {{"SpecialToken", {{"id", eos}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "B"}, {"type_id", 1}}}},
                                  {{"SpecialToken", {{"id", eos}, {"type_id", 1}}}}})},
            {"special_tokens",
             {{eos, {{"id", eos}, {"ids", Json::array({spec.eos_id})}, {"tokens", {eos}}}}}}};
  }
  Json json = {{"added_tokens", added},
               {"normalizer", {{"type", "Sequence"}, {"normalizers", normalizers}}},
               {"pre_tokenizer", metaspace},
               {"post_processor", post},
               {"decoder", decoder},
               {"model",
                {{"type", "Unigram"},
                 {"unk_id", spec.unk_id},
                 {"byte_fallback", spec.byte_fallback},
                 {"vocab", vocab}}}};
  return FromJson(json.dump(-1, ' ', false, Json::error_handler_t::replace), model_path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromSentencePiece(
    const std::string& model_path, bool legacy) {
  absl::StatusOr<std::string> bytes = ReadFile(model_path);
  if (!bytes.ok()) return bytes.status();
  std::vector<SentencePiecePiece> pieces;
  std::string error;
  if (!ReadSentencePieceModel(*bytes, &pieces, &error)) {
    return absl::InvalidArgumentError(Concat(model_path, ": not a SentencePiece model: ", error));
  }
  // The BPE transformers' LlamaTokenizer builds from the pieces: the vocabulary as is, and
  // merges for every split of a piece into two pieces, ranked by the piece's score
  // (higher first), then the longer left part, then the longer right part.
  Json vocab = Json::object();
  absl::flat_hash_map<std::string, int32_t> ids;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (ids.count(pieces[i].piece) == 0) ids[pieces[i].piece] = static_cast<int32_t>(i);
    vocab[pieces[i].piece] = i;
  }
  struct Merge {
    std::string left, right;
    float score;
    size_t left_len, right_len;
  };
  std::vector<Merge> merges;
  std::string unk = "<unk>";
  for (size_t i = 0; i < pieces.size(); ++i) {
    const SentencePiecePiece& p = pieces[i];
    if (p.unknown) unk = p.piece;
    if (ids[p.piece] != static_cast<int32_t>(i)) continue;
    std::vector<Merge> local;
    size_t pos = 0, count = 0;
    std::vector<size_t> cuts;
    while (pos < p.piece.size()) {
      NextCodePoint(p.piece, &pos);
      ++count;
      if (pos < p.piece.size()) cuts.push_back(pos);
    }
    for (size_t c = 0; c < cuts.size(); ++c) {
      std::string l = p.piece.substr(0, cuts[c]), r = p.piece.substr(cuts[c]);
      if (ids.count(l) && ids.count(r)) local.push_back({l, r, p.score, c + 1, count - c - 1});
    }
    std::sort(local.begin(), local.end(), [&](const Merge& a, const Merge& b) {
      return std::make_pair(ids[a.left], ids[a.right]) < std::make_pair(ids[b.left], ids[b.right]);
    });
    merges.insert(merges.end(), local.begin(), local.end());
  }
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.left_len != b.left_len) return a.left_len > b.left_len;
    return a.right_len > b.right_len;
  });
  Json merge_list = Json::array();
  for (const Merge& m : merges) merge_list.push_back(Json::array({m.left, m.right}));
  const Json added = SpecialPiecesJson(pieces);
  const std::string meta = "\xE2\x96\x81";
  Json spec = {
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Metaspace"},
        {"replacement", meta},
        {"prepend_scheme", legacy ? "always" : "first"},
        {"split", false}}},
      {"post_processor", nullptr},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         Json::array({{{"type", "Replace"}, {"pattern", {{"String", meta}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}}},
      {"model",
       {{"type", "BPE"},
        {"unk_token", unk},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", merge_list}}}};
  return FromJson(spec.dump(-1, ' ', false, Json::error_handler_t::replace), model_path);
}

}  // namespace cdcca::tokenizer
