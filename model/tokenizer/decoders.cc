// Decoders of tokenizer.json: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace,
// WordPiece, BPEDecoder, Sequence.
#include <utility>

#include "absl/strings/str_join.h"
#include "model/tokenizer/components.h"
#include "model/tokenizer/unicode.h"

namespace cdcca::tokenizer {
namespace {

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps)
      : steps_(std::move(steps)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& s : steps_) s->DecodeChain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

// Byte-level code points back to bytes; a token with any other code point keeps its own
// UTF-8 bytes. All tokens become one string.
class ByteLevelDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (const std::string& t : *tokens) {
      std::string mapped;
      size_t pos = 0;
      bool ok = true;
      while (pos < t.size()) {
        const int b = UnicodeToByte(NextCodePoint(t, &pos));
        if (b < 0) {
          ok = false;
          break;
        }
        mapped.push_back(static_cast<char>(b));
      }
      bytes += ok ? mapped : t;
    }
    *tokens = {Utf8Lossy(bytes)};
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool prepend)
      : replacement_(std::move(replacement)), prepend_(prepend) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& t = (*tokens)[i];
      std::string out;
      size_t pos = 0;
      while (pos < t.size()) {
        if (t.compare(pos, replacement_.size(), replacement_) == 0) {
          if (!(i == 0 && prepend_)) out.push_back(' ');
          pos += replacement_.size();
        } else {
          out.push_back(t[pos++]);
        }
      }
      t = std::move(out);
    }
  }

 private:
  std::string replacement_;
  bool prepend_;  // prepend_scheme != never: the first token's replacements vanish
};

// "<0xAB>" runs become their bytes when they form UTF-8, else one U+FFFD per byte.
class ByteFallbackDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (IsValidUtf8(pending)) {
        out.push_back(pending);
      } else {
        for (size_t i = 0; i < pending.size(); ++i) out.push_back("\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (std::string& t : *tokens) {
      int byte = -1;
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
        auto hex = [](char c) {
          if (c >= '0' && c <= '9') return c - '0';
          if (c >= 'A' && c <= 'F') return c - 'A' + 10;
          if (c >= 'a' && c <= 'f') return c - 'a' + 10;
          return -1;
        };
        const int hi = hex(t[3]), lo = hex(t[4]);
        if (hi >= 0 && lo >= 0) byte = hi * 16 + lo;
      }
      if (byte >= 0) {
        pending.push_back(static_cast<char>(byte));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    *tokens = std::move(out);
  }
};

class FuseDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    *tokens = {absl::StrJoin(*tokens, "")};
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, int64_t start, int64_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) {
      size_t begin = 0, end = t.size();
      for (int64_t i = 0; i < start_ && t.compare(begin, content_.size(), content_) == 0 &&
                          begin + content_.size() <= t.size();
           ++i) {
        begin += content_.size();
      }
      for (int64_t i = 0; i < stop_ && end >= begin + content_.size() &&
                          t.compare(end - content_.size(), content_.size(), content_) == 0;
           ++i) {
        end -= content_.size();
      }
      t = t.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  int64_t start_, stop_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) {
      absl::StatusOr<std::string> r = pattern_.ReplaceAll(t, content_);
      if (r.ok()) t = *std::move(r);
    }
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class WordPieceDecoder : public Decoder {
 public:
  WordPieceDecoder(std::string prefix, bool cleanup)
      : prefix_(std::move(prefix)), cleanup_(cleanup) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& t = (*tokens)[i];
      if (i != 0) {
        if (!prefix_.empty() && t.compare(0, prefix_.size(), prefix_) == 0) {
          t.erase(0, prefix_.size());
        } else {
          t.insert(0, " ");
        }
      }
      if (cleanup_) t = CleanUpTokenization(std::move(t), /*wordpiece_variant=*/true);
    }
  }

 private:
  std::string prefix_;
  bool cleanup_;
};

class BpeSuffixDecoder : public Decoder {
 public:
  explicit BpeSuffixDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& t = (*tokens)[i];
      const std::string with = i + 1 == tokens->size() ? "" : " ";
      std::string out;
      size_t pos = 0;
      while (!suffix_.empty() && pos < t.size()) {
        const size_t hit = t.find(suffix_, pos);
        if (hit == std::string::npos) break;
        out.append(t, pos, hit - pos);
        out += with;
        pos = hit + suffix_.size();
      }
      out.append(t, pos, std::string::npos);
      t = std::move(out);
    }
  }

 private:
  std::string suffix_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(const JsonAt& json) {
  absl::StatusOr<std::string> type = json.Type();
  if (!type.ok()) return type.status();
  if (*type == "Sequence") {
    JsonAt list = json.Field("decoders");
    if (absl::Status st = list.ExpectArray(); !st.ok()) return st;
    std::vector<std::unique_ptr<Decoder>> steps;
    for (size_t i = 0; i < list.value.size(); ++i) {
      absl::StatusOr<std::unique_ptr<Decoder>> d = ParseDecoder(list.Index(i));
      if (!d.ok()) return d.status();
      steps.push_back(*std::move(d));
    }
    return std::make_unique<SequenceDecoder>(std::move(steps));
  }
  if (*type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (*type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (*type == "Fuse") return std::make_unique<FuseDecoder>();
  if (*type == "Metaspace") {
    absl::StatusOr<std::string> replacement = json.CharOr("replacement", "\xE2\x96\x81");
    if (!replacement.ok()) return replacement.status();
    bool prepend = true;
    if (JsonAt s = json.Field("prepend_scheme"); !s.IsNullOrAbsent()) {
      absl::StatusOr<std::string> name = s.String();
      if (!name.ok()) return name.status();
      if (*name != "always" && *name != "first" && *name != "never") {
        return s.Error(Concat("'", *name, "' is not always, first or never"));
      }
      prepend = *name != "never";
    } else {
      absl::StatusOr<bool> add = json.BoolOr("add_prefix_space", true);
      if (!add.ok()) return add.status();
      prepend = *add;
    }
    return std::make_unique<MetaspaceDecoder>(*std::move(replacement), prepend);
  }
  if (*type == "Strip") {
    absl::StatusOr<std::string> content = json.CharOr("content", " ");
    if (!content.ok()) return content.status();
    absl::StatusOr<int64_t> start = json.IntOr("start", 0);
    if (!start.ok()) return start.status();
    absl::StatusOr<int64_t> stop = json.IntOr("stop", 0);
    if (!stop.ok()) return stop.status();
    return std::make_unique<StripDecoder>(*std::move(content), *start, *stop);
  }
  if (*type == "Replace") {
    absl::StatusOr<Pattern> pattern = ParsePattern(json.Field("pattern"));
    if (!pattern.ok()) return pattern.status();
    absl::StatusOr<std::string> content = json.Field("content").String();
    if (!content.ok()) return content.status();
    return std::make_unique<ReplaceDecoder>(*std::move(pattern), *std::move(content));
  }
  if (*type == "WordPiece") {
    absl::StatusOr<std::string> prefix = json.StringOr("prefix", "##");
    if (!prefix.ok()) return prefix.status();
    absl::StatusOr<bool> cleanup = json.BoolOr("cleanup", true);
    if (!cleanup.ok()) return cleanup.status();
    return std::make_unique<WordPieceDecoder>(*std::move(prefix), *cleanup);
  }
  if (*type == "BPEDecoder") {
    absl::StatusOr<std::string> suffix = json.StringOr("suffix", "</w>");
    if (!suffix.ok()) return suffix.status();
    return std::make_unique<BpeSuffixDecoder>(*std::move(suffix));
  }
  return json.Unsupported(*type);
}

}  // namespace cdcca::tokenizer
