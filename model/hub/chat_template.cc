#include "model/hub/chat_template.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "model/hub/folder_json.h"

namespace cdcca::model {
namespace {

using json = nlohmann::json;

// ---- Loading --------------------------------------------------------------------------

// A "chat_template" value: the text, or the "default" of a list of named templates.
absl::StatusOr<std::string> TemplateText(const json& v, const std::string& file) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    for (const json& t : v) {
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
          t["template"].is_string()) {
        return t["template"].get<std::string>();
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": chat_template: a list without a template named \"default\""));
  }
  return absl::InvalidArgumentError(absl::StrCat(file, ": chat_template: not a string"));
}

// tokenizer_config.json's special tokens: a string or an AddedToken object {"content": ...}.
std::map<std::string, std::string> SpecialTokens(const json& config) {
  std::map<std::string, std::string> out;
  if (!config.is_object()) return out;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                          "cls_token", "mask_token"}) {
    auto it = config.find(key);
    if (it == config.end()) continue;
    if (it->is_string()) out[key] = it->get<std::string>();
    if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      out[key] = (*it)["content"].get<std::string>();
    }
  }
  return out;
}

// ---- Values ---------------------------------------------------------------------------

// A template value: JSON, or Jinja's undefined (a missing variable, key or attribute).
struct Value {
  json v;
  bool undefined = false;
};
Value Undefined() { return Value{json(), true}; }
Value Of(json v) { return Value{std::move(v), false}; }

bool Truthy(const Value& x) {
  if (x.undefined || x.v.is_null()) return false;
  if (x.v.is_boolean()) return x.v.get<bool>();
  if (x.v.is_number_integer()) return x.v.get<int64_t>() != 0;
  if (x.v.is_number()) return x.v.get<double>() != 0;
  if (x.v.is_string()) return !x.v.get_ref<const std::string&>().empty();
  return !x.v.empty();
}

// Python's str() of a value, as {{ }} and ~ print it.
absl::StatusOr<std::string> Str(const Value& x) {
  if (x.undefined) return std::string();
  const json& v = x.v;
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return std::string(v.get<bool>() ? "True" : "False");
  if (v.is_null()) return std::string("None");
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number()) return v.dump();
  return absl::InvalidArgumentError("printing a list or mapping is not supported");
}

// ---- Template structure ---------------------------------------------------------------

struct Expr;
using ExprP = std::shared_ptr<Expr>;
struct Expr {
  enum Kind {
    kLiteral,  // lit
    kName,     // name
    kAttr,     // args[0].name
    kIndex,    // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]] (null = omitted)
    kCall,     // name(args...) or args[0].name(args[1...]) when method
    kFilter,   // args[0] | name(args[1...])
    kTest,     // args[0] is [not] name(args[1...])
    kNot,
    kNeg,
    kBinary,  // args[0] name args[1]
    kAnd,
    kOr,
    kCond,  // args[0] if args[1] else args[2] (args[2] null = undefined)
    kList,
  } kind;
  std::string name;
  json lit;
  bool method = false;   // kCall
  bool negated = false;  // kTest
  std::vector<ExprP> args;
};

struct Node {
  enum Kind { kText, kOutput, kIf, kFor, kSet, kBody } kind;
  std::string text;  // kText
  ExprP expr;        // kOutput, kSet (value), kFor (iterable)
  std::string var;   // kSet, kFor
  ExprP filter;      // kFor's `if`
  // kIf: (condition, body) per if / elif; a null condition is the else.
  std::vector<std::pair<ExprP, std::vector<Node>>> branches;
  std::vector<Node> body, else_body;  // kFor, kBody
};

// ---- Expression parsing ---------------------------------------------------------------

struct Token {
  enum Kind { kName, kString, kInt, kFloat, kOp, kEnd } kind;
  std::string text;
};

absl::StatusOr<std::vector<Token>> Lex(const std::string& s) {
  std::vector<Token> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      out.push_back({Token::kName, s.substr(i, j - i)});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      bool is_float = false;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) ||
                              (s[j] == '.' && !is_float && j + 1 < s.size() &&
                               std::isdigit(static_cast<unsigned char>(s[j + 1]))))) {
        is_float |= s[j] == '.';
        ++j;
      }
      out.push_back({is_float ? Token::kFloat : Token::kInt, s.substr(i, j - i)});
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string text;
      size_t j = i + 1;
      for (; j < s.size() && s[j] != c; ++j) {
        if (s[j] != '\\' || j + 1 == s.size()) {
          text += s[j];
          continue;
        }
        const char e = s[++j];
        switch (e) {
          case 'n':
            text += '\n';
            break;
          case 't':
            text += '\t';
            break;
          case 'r':
            text += '\r';
            break;
          case '\\':
          case '\'':
          case '"':
            text += e;
            break;
          default:
            text += '\\';
            text += e;
        }
      }
      if (j >= s.size()) return absl::InvalidArgumentError("a string literal is not closed");
      out.push_back({Token::kString, std::move(text)});
      i = j + 1;
    } else {
      static const char* const kOps[] = {"//", "==", "!=", "<=", ">=", "(", ")", "[",
                                         "]",  "{",  "}",  ".",  ",",  ":", "|", "~",
                                         "+",  "-",  "*",  "/",  "%",  "<", ">", "="};
      bool found = false;
      for (const char* op : kOps) {
        if (s.compare(i, std::strlen(op), op) == 0) {
          out.push_back({Token::kOp, op});
          i += std::strlen(op);
          found = true;
          break;
        }
      }
      if (!found)
        return absl::InvalidArgumentError(absl::StrCat("unexpected '", s.substr(i, 1), "'"));
    }
  }
  out.push_back({Token::kEnd, ""});
  return out;
}

class ExprParser {
 public:
  explicit ExprParser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  absl::StatusOr<ExprP> Parse() { return Conditional(); }
  bool AtEnd() const { return t_[i_].kind == Token::kEnd; }
  bool IsName(const char* n) const { return t_[i_].kind == Token::kName && t_[i_].text == n; }
  bool IsOp(const char* o) const { return t_[i_].kind == Token::kOp && t_[i_].text == o; }
  const Token& Next() { return t_[i_++]; }
  absl::Status Expect(const char* op) {
    if (!IsOp(op)) return Error(absl::StrCat("expected '", op, "'"));
    ++i_;
    return absl::OkStatus();
  }
  absl::Status Error(const std::string& what) const {
    const std::string near = t_[i_].kind == Token::kEnd ? "the end" : "'" + t_[i_].text + "'";
    return absl::InvalidArgumentError(absl::StrCat(what, " near ", near));
  }

 private:
  static ExprP Make(Expr::Kind kind, std::vector<ExprP> args = {}, std::string name = "") {
    auto e = std::make_shared<Expr>();
    e->kind = kind;
    e->args = std::move(args);
    e->name = std::move(name);
    return e;
  }

  absl::StatusOr<ExprP> Conditional() {
    absl::StatusOr<ExprP> value = Or();
    if (!value.ok() || !IsName("if")) return value;
    ++i_;
    absl::StatusOr<ExprP> cond = Or();
    if (!cond.ok()) return cond;
    ExprP otherwise;
    if (IsName("else")) {
      ++i_;
      absl::StatusOr<ExprP> e = Conditional();
      if (!e.ok()) return e;
      otherwise = *e;
    }
    return Make(Expr::kCond, {*value, *cond, otherwise});
  }
  absl::StatusOr<ExprP> Or() {
    absl::StatusOr<ExprP> left = And();
    while (left.ok() && IsName("or")) {
      ++i_;
      absl::StatusOr<ExprP> right = And();
      if (!right.ok()) return right;
      left = Make(Expr::kOr, {*left, *right});
    }
    return left;
  }
  absl::StatusOr<ExprP> And() {
    absl::StatusOr<ExprP> left = Not();
    while (left.ok() && IsName("and")) {
      ++i_;
      absl::StatusOr<ExprP> right = Not();
      if (!right.ok()) return right;
      left = Make(Expr::kAnd, {*left, *right});
    }
    return left;
  }
  absl::StatusOr<ExprP> Not() {
    if (IsName("not")) {
      ++i_;
      absl::StatusOr<ExprP> e = Not();
      if (!e.ok()) return e;
      return Make(Expr::kNot, {*e});
    }
    return Compare();
  }
  absl::StatusOr<ExprP> Compare() {
    absl::StatusOr<ExprP> left = Concat();
    while (left.ok()) {
      std::string op;
      if (IsOp("==") || IsOp("!=") || IsOp("<") || IsOp(">") || IsOp("<=") || IsOp(">=")) {
        op = Next().text;
      } else if (IsName("in")) {
        ++i_;
        op = "in";
      } else if (IsName("not") && t_[i_ + 1].kind == Token::kName && t_[i_ + 1].text == "in") {
        i_ += 2;
        op = "not in";
      } else if (IsName("is")) {
        ++i_;
        auto test = Make(Expr::kTest, {*left});
        if (IsName("not")) {
          ++i_;
          test->negated = true;
        }
        if (t_[i_].kind != Token::kName) return Error("expected a test name after 'is'");
        test->name = Next().text;
        if (IsOp("(")) {
          if (absl::Status s = Arguments(test.get()); !s.ok()) return s;
        } else if (t_[i_].kind == Token::kString || t_[i_].kind == Token::kInt) {
          absl::StatusOr<ExprP> arg = Primary();  // `is equalto 'x'`
          if (!arg.ok()) return arg;
          test->args.push_back(*arg);
        }
        left = test;
        continue;
      } else {
        break;
      }
      absl::StatusOr<ExprP> right = Concat();
      if (!right.ok()) return right;
      left = Make(Expr::kBinary, {*left, *right}, op);
    }
    return left;
  }
  absl::StatusOr<ExprP> Concat() {
    absl::StatusOr<ExprP> left = Sum();
    while (left.ok() && IsOp("~")) {
      ++i_;
      absl::StatusOr<ExprP> right = Sum();
      if (!right.ok()) return right;
      left = Make(Expr::kBinary, {*left, *right}, "~");
    }
    return left;
  }
  absl::StatusOr<ExprP> Sum() {
    absl::StatusOr<ExprP> left = Product();
    while (left.ok() && (IsOp("+") || IsOp("-"))) {
      const std::string op = Next().text;
      absl::StatusOr<ExprP> right = Product();
      if (!right.ok()) return right;
      left = Make(Expr::kBinary, {*left, *right}, op);
    }
    return left;
  }
  absl::StatusOr<ExprP> Product() {
    absl::StatusOr<ExprP> left = Unary();
    while (left.ok() && (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%"))) {
      const std::string op = Next().text;
      absl::StatusOr<ExprP> right = Unary();
      if (!right.ok()) return right;
      left = Make(Expr::kBinary, {*left, *right}, op);
    }
    return left;
  }
  absl::StatusOr<ExprP> Unary() {
    if (IsOp("-")) {
      ++i_;
      absl::StatusOr<ExprP> e = Unary();
      if (!e.ok()) return e;
      return Make(Expr::kNeg, {*e});
    }
    absl::StatusOr<ExprP> e = Postfix();
    while (e.ok() && IsOp("|")) {
      ++i_;
      if (t_[i_].kind != Token::kName) return Error("expected a filter name after '|'");
      auto f = Make(Expr::kFilter, {*e}, Next().text);
      if (IsOp("(")) {
        if (absl::Status s = Arguments(f.get()); !s.ok()) return s;
      }
      e = f;
    }
    return e;
  }
  // `( a, b, ... )` appended to e->args.
  absl::Status Arguments(Expr* e) {
    if (absl::Status s = Expect("("); !s.ok()) return s;
    while (!IsOp(")")) {
      if (t_[i_].kind == Token::kName && t_[i_ + 1].kind == Token::kOp && t_[i_ + 1].text == "=") {
        return Error("keyword arguments are not supported");
      }
      absl::StatusOr<ExprP> a = Conditional();
      if (!a.ok()) return a.status();
      e->args.push_back(*a);
      if (!IsOp(",")) break;
      ++i_;
    }
    return Expect(")");
  }
  absl::StatusOr<ExprP> Postfix() {
    absl::StatusOr<ExprP> e = Primary();
    while (e.ok()) {
      if (IsOp(".")) {
        ++i_;
        if (t_[i_].kind != Token::kName) return Error("expected a name after '.'");
        const std::string name = Next().text;
        if (IsOp("(")) {
          auto call = Make(Expr::kCall, {*e}, name);
          call->method = true;
          if (absl::Status s = Arguments(call.get()); !s.ok()) return s;
          e = call;
        } else {
          e = Make(Expr::kAttr, {*e}, name);
        }
      } else if (IsOp("[")) {
        ++i_;
        std::vector<ExprP> parts(1);
        while (true) {
          if (!IsOp(":") && !IsOp("]")) {
            absl::StatusOr<ExprP> a = Conditional();
            if (!a.ok()) return a;
            parts.back() = *a;
          }
          if (!IsOp(":")) break;
          ++i_;
          parts.emplace_back();
        }
        if (absl::Status s = Expect("]"); !s.ok()) return s;
        if (parts.size() == 1) {
          if (parts[0] == nullptr) return Error("an empty subscript");
          e = Make(Expr::kIndex, {*e, parts[0]});
        } else {
          parts.resize(3);
          e = Make(Expr::kSlice, {*e, parts[0], parts[1], parts[2]});
        }
      } else if (IsOp("(")) {
        if ((*e)->kind != Expr::kName) return Error("only named functions can be called");
        auto call = Make(Expr::kCall, {}, (*e)->name);
        if (absl::Status s = Arguments(call.get()); !s.ok()) return s;
        e = call;
      } else {
        break;
      }
    }
    return e;
  }
  absl::StatusOr<ExprP> Primary() {
    const Token& t = t_[i_];
    auto lit = [&](json v) {
      ++i_;
      auto e = Make(Expr::kLiteral);
      e->lit = std::move(v);
      return e;
    };
    switch (t.kind) {
      case Token::kString: {
        std::string s = t.text;
        ++i_;
        while (t_[i_].kind == Token::kString) s += Next().text;  // adjacent literals join
        auto e = Make(Expr::kLiteral);
        e->lit = s;
        return e;
      }
      case Token::kInt: {
        int64_t v = 0;
        if (!absl::SimpleAtoi(t.text, &v)) return Error("an integer out of range");
        return lit(v);
      }
      case Token::kFloat: {
        double v = 0;
        if (!absl::SimpleAtod(t.text, &v)) return Error("a bad number");
        return lit(v);
      }
      case Token::kName:
        if (t.text == "true" || t.text == "True") return lit(true);
        if (t.text == "false" || t.text == "False") return lit(false);
        if (t.text == "none" || t.text == "None") return lit(nullptr);
        ++i_;
        return Make(Expr::kName, {}, t.text);
      case Token::kOp:
        if (t.text == "(") {
          ++i_;
          absl::StatusOr<ExprP> e = Conditional();
          if (!e.ok()) return e;
          if (absl::Status s = Expect(")"); !s.ok()) return s;
          return e;
        }
        if (t.text == "[") {
          ++i_;
          auto list = Make(Expr::kList);
          while (!IsOp("]")) {
            absl::StatusOr<ExprP> a = Conditional();
            if (!a.ok()) return a;
            list->args.push_back(*a);
            if (!IsOp(",")) break;
            ++i_;
          }
          if (absl::Status s = Expect("]"); !s.ok()) return s;
          return list;
        }
        if (t.text == "{") return Error("mapping literals are not supported");
        break;
      case Token::kEnd:
        break;
    }
    return Error("expected a value");
  }

  std::vector<Token> t_;
  size_t i_ = 0;
};

absl::StatusOr<ExprP> ParseExpr(const std::string& text) {
  absl::StatusOr<std::vector<Token>> tokens = Lex(text);
  if (!tokens.ok()) return tokens.status();
  ExprParser p(*std::move(tokens));
  absl::StatusOr<ExprP> e = p.Parse();
  if (e.ok() && !p.AtEnd()) return p.Error("unexpected text after the expression");
  return e;
}

// ---- Template parsing -----------------------------------------------------------------

struct Tag {
  enum Kind { kText, kOutput, kStatement } kind;
  std::string text;
};

bool IsBlank(char c) { return c == ' ' || c == '\t'; }

// Splits the template into text, {{ }} and {% %} (comments dropped), applying the whitespace
// control marks and jinja2's trim_blocks and lstrip_blocks as transformers sets them.
absl::StatusOr<std::vector<Tag>> SplitTags(const std::string& s) {
  std::vector<Tag> out;
  size_t pos = 0;
  bool strip_next = false;    // the previous tag ended with '-'
  bool trim_newline = false;  // the previous tag was a block or comment (trim_blocks)
  while (pos <= s.size()) {
    size_t open = std::string::npos;
    for (const char* o : {"{{", "{%", "{#"}) open = std::min(open, s.find(o, pos));
    const std::string raw =
        s.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    // lstrip_blocks: the blanks from the start of a line up to a block or comment tag.
    size_t lstrip = 0;
    if (open != std::string::npos && s[open + 1] != '{' && open + 2 < s.size() &&
        s[open + 2] != '+' && s[open + 2] != '-') {
      const size_t line = raw.find_last_of('\n');
      const size_t from = line == std::string::npos ? 0 : line + 1;
      const bool line_start = line != std::string::npos || pos == 0 || s[pos - 1] == '\n';
      if (line_start && std::all_of(raw.begin() + from, raw.end(), IsBlank)) {
        lstrip = raw.size() - from;
      }
    }
    std::string text = raw;
    if (strip_next) {
      text.erase(0, text.find_first_not_of(" \t\r\n"));
    } else if (trim_newline && !text.empty() && text[0] == '\n') {
      text.erase(0, 1);
    }
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({Tag::kText, std::move(text)});
      break;
    }
    const char kind = s[open + 1];
    size_t body = open + 2;
    if (body < s.size() && s[body] == '-') {
      const size_t keep = text.find_last_not_of(" \t\r\n");
      text.erase(keep == std::string::npos ? 0 : keep + 1);
      ++body;
    } else if (body < s.size() && s[body] == '+') {
      ++body;
    } else {
      text.erase(text.size() - std::min(lstrip, text.size()));
    }
    if (!text.empty()) out.push_back({Tag::kText, std::move(text)});
    const std::string close = kind == '{' ? "}}" : (kind == '%' ? "%}" : "#}");
    size_t end = body;
    if (kind == '#') {
      end = s.find(close, body);
    } else {
      char quote = 0;
      for (; end < s.size(); ++end) {
        if (quote != 0) {
          if (s[end] == '\\')
            ++end;
          else if (s[end] == quote)
            quote = 0;
        } else if (s[end] == '\'' || s[end] == '"') {
          quote = s[end];
        } else if (s.compare(end, 2, close) == 0) {
          break;
        }
      }
      if (end >= s.size()) end = std::string::npos;
    }
    if (end == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("a tag opened at offset ", open, " is not closed with ", close));
    }
    std::string inner = s.substr(body, end - body);
    strip_next = !inner.empty() && inner.back() == '-';
    const bool keep_newline = !inner.empty() && inner.back() == '+';
    if (strip_next || keep_newline) inner.pop_back();
    trim_newline = kind != '{' && !keep_newline;
    if (kind == '{') out.push_back({Tag::kOutput, std::move(inner)});
    if (kind == '%') out.push_back({Tag::kStatement, std::move(inner)});
    pos = end + 2;
  }
  return out;
}

// The first word of a statement and the rest.
std::pair<std::string, std::string> Keyword(const std::string& statement) {
  const std::string s(absl::StripAsciiWhitespace(statement));
  size_t i = 0;
  while (i < s.size() && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '_')) ++i;
  return {s.substr(0, i), std::string(absl::StripAsciiWhitespace(s.substr(i)))};
}

class TemplateParser {
 public:
  explicit TemplateParser(std::vector<Tag> tags) : tags_(std::move(tags)) {}

  // Parses nodes until a statement whose keyword is in `ends` (returned in *end; "" at the end
  // of the template, which only the top level accepts).
  absl::Status Block(std::vector<Node>* out, std::initializer_list<const char*> ends,
                     std::string* end, std::string* end_rest) {
    while (i_ < tags_.size()) {
      const Tag& tag = tags_[i_++];
      if (tag.kind == Tag::kText) {
        out->push_back(Node{Node::kText, tag.text});
        continue;
      }
      if (tag.kind == Tag::kOutput) {
        absl::StatusOr<ExprP> e = ParseExpr(tag.text);
        if (!e.ok()) return Context(e.status(), "{{" + tag.text + "}}");
        Node n{Node::kOutput};
        n.expr = *e;
        out->push_back(std::move(n));
        continue;
      }
      auto [word, rest] = Keyword(tag.text);
      for (const char* e : ends) {
        if (word == e) {
          *end = word;
          *end_rest = rest;
          return absl::OkStatus();
        }
      }
      absl::Status s = Statement(word, rest, tag.text, out);
      if (!s.ok()) return s;
    }
    if (ends.size() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a block is not closed (expected {% ", *ends.begin(), " %})"));
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status Context(const absl::Status& s, const std::string& where) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", s.message()));
  }

  absl::Status Statement(const std::string& word, const std::string& rest, const std::string& text,
                         std::vector<Node>* out) {
    std::string end, end_rest;
    const std::string where = "{%" + text + "%}";
    if (word == "if") {
      Node n{Node::kIf};
      std::string cond_text = rest;
      bool has_cond = true;
      while (true) {
        ExprP cond;
        if (has_cond) {
          absl::StatusOr<ExprP> c = ParseExpr(cond_text);
          if (!c.ok()) return Context(c.status(), where);
          cond = *c;
        }
        std::vector<Node> body;
        if (absl::Status s = Block(&body, {"endif", "elif", "else"}, &end, &end_rest); !s.ok()) {
          return s;
        }
        n.branches.emplace_back(cond, std::move(body));
        if (end == "endif") break;
        if (!has_cond) return Context(absl::InvalidArgumentError("a branch after else"), where);
        has_cond = end == "elif";
        cond_text = end_rest;
      }
      out->push_back(std::move(n));
      return absl::OkStatus();
    }
    if (word == "for") {
      const size_t in = rest.find(" in ");
      if (in == std::string::npos) return Context(absl::InvalidArgumentError("no 'in'"), where);
      Node n{Node::kFor};
      n.var = std::string(absl::StripAsciiWhitespace(rest.substr(0, in)));
      if (n.var.find(',') != std::string::npos || n.var.empty()) {
        return Context(absl::InvalidArgumentError("unpacking loop variables is not supported"),
                       where);
      }
      absl::StatusOr<std::vector<Token>> tokens = Lex(rest.substr(in + 4));
      if (!tokens.ok()) return Context(tokens.status(), where);
      ExprParser p(*std::move(tokens));
      absl::StatusOr<ExprP> iterable = p.Parse();
      if (!iterable.ok()) return Context(iterable.status(), where);
      n.expr = *iterable;
      // `x if c` inside the parse above would read as a conditional without else: a filter.
      if (n.expr->kind == Expr::kCond && n.expr->args[2] == nullptr) {
        n.filter = n.expr->args[1];
        n.expr = n.expr->args[0];
      }
      if (p.IsName("recursive")) {
        return Context(absl::InvalidArgumentError("recursive loops are not supported"), where);
      }
      if (!p.AtEnd()) return Context(p.Error("unexpected text"), where);
      if (absl::Status s = Block(&n.body, {"endfor", "else"}, &end, &end_rest); !s.ok()) return s;
      if (end == "else") {
        if (absl::Status s = Block(&n.else_body, {"endfor"}, &end, &end_rest); !s.ok()) return s;
      }
      out->push_back(std::move(n));
      return absl::OkStatus();
    }
    if (word == "set") {
      const size_t eq = rest.find('=');
      Node n{Node::kSet};
      n.var = std::string(absl::StripAsciiWhitespace(rest.substr(0, eq)));
      if (eq == std::string::npos || n.var.empty() ||
          !std::all_of(n.var.begin(), n.var.end(), [](char c) {
            return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
          })) {
        return Context(
            absl::InvalidArgumentError("only {% set name = value %} is supported (no block set, no "
                                       "namespace attributes, no unpacking)"),
            where);
      }
      absl::StatusOr<ExprP> e = ParseExpr(rest.substr(eq + 1));
      if (!e.ok()) return Context(e.status(), where);
      n.expr = *e;
      out->push_back(std::move(n));
      return absl::OkStatus();
    }
    if (word == "generation") {
      Node n{Node::kBody};
      if (absl::Status s = Block(&n.body, {"endgeneration"}, &end, &end_rest); !s.ok()) return s;
      out->push_back(std::move(n));
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": ", word.empty() ? "an empty statement" : "'" + word + "'", " is not supported"));
  }

  std::vector<Tag> tags_;
  size_t i_ = 0;
};

// ---- Rendering ------------------------------------------------------------------------

absl::Status Unsupported(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(what, " is not supported"));
}

class Renderer {
 public:
  explicit Renderer(std::map<std::string, Value> globals) { scopes_.push_back(std::move(globals)); }

  absl::Status Render(const std::vector<Node>& nodes, std::string* out) {
    for (const Node& n : nodes) {
      switch (n.kind) {
        case Node::kText:
          *out += n.text;
          break;
        case Node::kOutput: {
          absl::StatusOr<Value> v = Eval(*n.expr);
          if (!v.ok()) return v.status();
          absl::StatusOr<std::string> s = Str(*v);
          if (!s.ok()) return s.status();
          *out += *s;
          break;
        }
        case Node::kSet: {
          absl::StatusOr<Value> v = Eval(*n.expr);
          if (!v.ok()) return v.status();
          scopes_.back()[n.var] = *std::move(v);
          break;
        }
        case Node::kIf:
          for (const auto& [cond, body] : n.branches) {
            bool take = cond == nullptr;
            if (!take) {
              absl::StatusOr<Value> c = Eval(*cond);
              if (!c.ok()) return c.status();
              take = Truthy(*c);
            }
            if (take) {
              if (absl::Status s = Render(body, out); !s.ok()) return s;
              break;
            }
          }
          break;
        case Node::kFor:
          if (absl::Status s = For(n, out); !s.ok()) return s;
          break;
        case Node::kBody:
          if (absl::Status s = Render(n.body, out); !s.ok()) return s;
          break;
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status For(const Node& n, std::string* out) {
    absl::StatusOr<Value> it = Eval(*n.expr);
    if (!it.ok()) return it.status();
    json items = json::array();
    if (it->v.is_array()) {
      items = it->v;
    } else if (it->v.is_object()) {
      for (auto kv = it->v.begin(); kv != it->v.end(); ++kv) items.push_back(kv.key());
    } else if (it->v.is_string()) {
      for (char c : it->v.get<std::string>()) items.push_back(std::string(1, c));
    } else if (!it->undefined) {
      return absl::InvalidArgumentError("for: the value is not iterable");
    }
    if (n.filter != nullptr) {
      json kept = json::array();
      for (const json& x : items) {
        scopes_.push_back({{n.var, Of(x)}});
        absl::StatusOr<Value> c = Eval(*n.filter);
        scopes_.pop_back();
        if (!c.ok()) return c.status();
        if (Truthy(*c)) kept.push_back(x);
      }
      items = std::move(kept);
    }
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < count; ++i) {
      json loop = {{"index", i + 1},
                   {"index0", i},
                   {"first", i == 0},
                   {"last", i + 1 == count},
                   {"length", count},
                   {"revindex", count - i},
                   {"revindex0", count - i - 1}};
      scopes_.push_back({{n.var, Of(items[i])}, {"loop", Of(std::move(loop))}});
      absl::Status s = Render(n.body, out);
      scopes_.pop_back();
      if (!s.ok()) return s;
    }
    if (count == 0) return Render(n.else_body, out);
    return absl::OkStatus();
  }

  Value Lookup(const std::string& name) const {
    for (auto s = scopes_.rbegin(); s != scopes_.rend(); ++s) {
      auto it = s->find(name);
      if (it != s->end()) return it->second;
    }
    return Undefined();
  }

  absl::StatusOr<std::vector<Value>> EvalArgs(const Expr& e, size_t from) {
    std::vector<Value> out;
    for (size_t i = from; i < e.args.size(); ++i) {
      absl::StatusOr<Value> v = Eval(*e.args[i]);
      if (!v.ok()) return v.status();
      out.push_back(*std::move(v));
    }
    return out;
  }

  static Value Member(const Value& x, const json& key) {
    if (x.v.is_object() && key.is_string()) {
      auto it = x.v.find(key.get<std::string>());
      if (it != x.v.end()) return Of(*it);
    }
    if ((x.v.is_array() || x.v.is_string()) && key.is_number_integer()) {
      const int64_t n = x.v.is_array()
                            ? static_cast<int64_t>(x.v.size())
                            : static_cast<int64_t>(x.v.get_ref<const std::string&>().size());
      int64_t i = key.get<int64_t>();
      if (i < 0) i += n;
      if (i >= 0 && i < n) {
        return x.v.is_array() ? Of(x.v[i]) : Of(x.v.get<std::string>().substr(i, 1));
      }
    }
    return Undefined();
  }

  static absl::StatusOr<Value> Slice(const Value& x, const Value& a, const Value& b,
                                     const Value& c) {
    if (!x.v.is_array() && !x.v.is_string()) return Unsupported("slicing this value");
    const int64_t n = x.v.is_array()
                          ? static_cast<int64_t>(x.v.size())
                          : static_cast<int64_t>(x.v.get_ref<const std::string&>().size());
    for (const Value* v : {&a, &b, &c}) {
      if (!v->undefined && !v->v.is_null() && !v->v.is_number_integer()) {
        return Unsupported("a slice bound that is not an integer");
      }
    }
    const bool has_step = !c.undefined && !c.v.is_null();
    const int64_t step = has_step ? c.v.get<int64_t>() : 1;
    if (step == 0) return absl::InvalidArgumentError("slice step cannot be zero");
    // Python's slice.indices.
    auto bound = [&](const Value& v, int64_t dflt) {
      if (v.undefined || v.v.is_null()) return dflt;
      int64_t i = v.v.get<int64_t>();
      if (i < 0) i += n;
      return step > 0 ? std::clamp<int64_t>(i, 0, n) : std::clamp<int64_t>(i, -1, n - 1);
    };
    const int64_t start = bound(a, step > 0 ? 0 : n - 1), stop = bound(b, step > 0 ? n : -1);
    json arr = json::array();
    std::string str;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (x.v.is_array())
        arr.push_back(x.v[i]);
      else
        str += x.v.get_ref<const std::string&>()[i];
    }
    return x.v.is_array() ? Of(std::move(arr)) : Of(std::move(str));
  }

  static absl::StatusOr<bool> Test(const std::string& name, const Value& x,
                                   const std::vector<Value>& args) {
    if (name == "defined") return !x.undefined;
    if (name == "undefined") return x.undefined;
    if (name == "none") return !x.undefined && x.v.is_null();
    if (name == "string") return x.v.is_string();
    if (name == "number") return x.v.is_number();
    if (name == "integer") return x.v.is_number_integer();
    if (name == "boolean") return x.v.is_boolean();
    if (name == "mapping") return x.v.is_object();
    if (name == "sequence" || name == "iterable") {
      return x.v.is_array() || x.v.is_string() || x.v.is_object();
    }
    if (name == "true") return x.v.is_boolean() && x.v.get<bool>();
    if (name == "false") return x.v.is_boolean() && !x.v.get<bool>();
    if (name == "equalto" || name == "eq" || name == "==" || name == "ne" || name == "!=") {
      if (args.size() != 1) return absl::InvalidArgumentError(name + " takes one argument");
      const bool equal = x.undefined == args[0].undefined && x.v == args[0].v;
      return (name == "ne" || name == "!=") ? !equal : equal;
    }
    return Unsupported(absl::StrCat("the test '", name, "'"));
  }

  absl::StatusOr<Value> Filter(const std::string& name, const Value& x,
                               const std::vector<Value>& args) {
    auto need_string = [&]() -> absl::Status {
      if (!x.v.is_string()) return absl::InvalidArgumentError(name + ": not a string");
      return absl::OkStatus();
    };
    if (name == "trim" || name == "upper" || name == "lower" || name == "capitalize" ||
        name == "title") {
      if (absl::Status s = need_string(); !s.ok()) return s;
      return StringMethod(name == "trim" ? "strip" : name, x.v.get<std::string>(), args);
    }
    if (name == "length" || name == "count") {
      if (x.v.is_string())
        return Of(static_cast<int64_t>(x.v.get_ref<const std::string&>().size()));
      if (x.v.is_array() || x.v.is_object()) return Of(static_cast<int64_t>(x.v.size()));
      if (x.undefined) return Of(0);
      return absl::InvalidArgumentError(name + ": no length");
    }
    if (name == "first" || name == "last") {
      if (!x.v.is_array() && !x.v.is_string())
        return absl::InvalidArgumentError(name + ": not a list");
      return Member(x, json(name == "first" ? 0 : -1));
    }
    if (name == "string") {
      absl::StatusOr<std::string> s = Str(x);
      if (!s.ok()) return s.status();
      return Of(*s);
    }
    if (name == "list") {
      if (x.v.is_array()) return x;
      return Unsupported("list of anything but a list");
    }
    if (name == "default" || name == "d") {
      if (args.empty() || args.size() > 1)
        return Unsupported("default without exactly one argument");
      return x.undefined ? args[0] : x;
    }
    if (name == "join") {
      if (!x.v.is_array()) return absl::InvalidArgumentError("join: not a list");
      std::string sep;
      if (!args.empty()) {
        absl::StatusOr<std::string> s = Str(args[0]);
        if (!s.ok()) return s.status();
        sep = *s;
      }
      std::string out;
      for (size_t i = 0; i < x.v.size(); ++i) {
        absl::StatusOr<std::string> s = Str(Of(x.v[i]));
        if (!s.ok()) return s.status();
        absl::StrAppend(&out, i == 0 ? "" : sep, *s);
      }
      return Of(out);
    }
    if (name == "selectattr" || name == "rejectattr") {
      if (args.empty() || !args[0].v.is_string()) {
        return absl::InvalidArgumentError(name + ": the first argument names an attribute");
      }
      if (!x.v.is_array() && !x.undefined) return absl::InvalidArgumentError(name + ": not a list");
      std::string test = "truthy";
      if (args.size() >= 2) {
        if (!args[1].v.is_string())
          return absl::InvalidArgumentError(name + ": the test is a name");
        test = args[1].v.get<std::string>();
      }
      const std::vector<Value> test_args(args.begin() + std::min<size_t>(2, args.size()),
                                         args.end());
      json out = json::array();
      for (const json& item : x.v.is_array() ? x.v : json::array()) {
        const Value attr = Member(Of(item), args[0].v);
        bool pass = false;
        if (test == "truthy") {
          pass = Truthy(attr);
        } else {
          absl::StatusOr<bool> t = Test(test, attr, test_args);
          if (!t.ok()) return t.status();
          pass = *t;
        }
        if (pass == (name == "selectattr")) out.push_back(item);
      }
      return Of(std::move(out));
    }
    return Unsupported(absl::StrCat("the filter '", name, "'"));
  }

  static absl::StatusOr<Value> StringMethod(const std::string& name, const std::string& s,
                                            const std::vector<Value>& args) {
    auto arg = [&](size_t i) -> absl::StatusOr<std::string> {
      if (i >= args.size() || !args[i].v.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": argument ", i + 1, " is not a string"));
      }
      return args[i].v.get<std::string>();
    };
    if (name == "upper") return Of(absl::AsciiStrToUpper(s));
    if (name == "lower") return Of(absl::AsciiStrToLower(s));
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      std::string chars = " \t\n\r\f\v";
      if (!args.empty()) {
        absl::StatusOr<std::string> c = arg(0);
        if (!c.ok()) return c.status();
        chars = *c;
      }
      size_t b = 0, e = s.size();
      if (name != "rstrip") b = std::min(s.find_first_not_of(chars), s.size());
      if (name != "lstrip") {
        const size_t last = s.find_last_not_of(chars);
        e = last == std::string::npos ? 0 : last + 1;
      }
      return Of(b < e ? s.substr(b, e - b) : std::string());
    }
    if (name == "capitalize" || name == "title") {
      std::string out = absl::AsciiStrToLower(s);
      bool start = true;
      for (char& c : out) {
        if (start && std::isalpha(static_cast<unsigned char>(c))) {
          c = absl::ascii_toupper(c);
          if (name == "capitalize") break;
        }
        start = name == "title" ? !std::isalnum(static_cast<unsigned char>(c)) : false;
      }
      return Of(out);
    }
    if (name == "startswith" || name == "endswith") {
      absl::StatusOr<std::string> p = arg(0);
      if (!p.ok()) return p.status();
      return Of(name == "startswith" ? absl::StartsWith(s, *p) : absl::EndsWith(s, *p));
    }
    if (name == "replace") {
      absl::StatusOr<std::string> from = arg(0), to = arg(1);
      if (!from.ok()) return from.status();
      if (!to.ok()) return to.status();
      return Of(absl::StrReplaceAll(s, {{*from, *to}}));
    }
    if (name == "split") {
      json out = json::array();
      if (args.empty()) {
        for (absl::string_view w :
             absl::StrSplit(s, absl::ByAnyChar(" \t\n\r"), absl::SkipEmpty())) {
          out.push_back(std::string(w));
        }
      } else {
        absl::StatusOr<std::string> sep = arg(0);
        if (!sep.ok()) return sep.status();
        if (sep->empty()) return absl::InvalidArgumentError("split: empty separator");
        for (absl::string_view w : absl::StrSplit(s, *sep)) out.push_back(std::string(w));
      }
      return Of(std::move(out));
    }
    return Unsupported(absl::StrCat("the string method '", name, "'"));
  }

  absl::StatusOr<Value> Call(const Expr& e) {
    if (!e.method) {
      absl::StatusOr<std::vector<Value>> args = EvalArgs(e, 0);
      if (!args.ok()) return args.status();
      if (e.name == "raise_exception") {
        absl::StatusOr<std::string> msg = args->empty() ? std::string() : Str((*args)[0]);
        return absl::InvalidArgumentError(
            absl::StrCat("the template raised: ", msg.ok() ? *msg : "(unprintable)"));
      }
      return Unsupported(absl::StrCat("the function '", e.name, "'"));
    }
    absl::StatusOr<Value> self = Eval(*e.args[0]);
    if (!self.ok()) return self.status();
    absl::StatusOr<std::vector<Value>> args = EvalArgs(e, 1);
    if (!args.ok()) return args.status();
    if (self->v.is_string()) return StringMethod(e.name, self->v.get<std::string>(), *args);
    if (self->v.is_object()) {
      if (e.name == "get" && !args->empty()) {
        const Value v = Member(*self, (*args)[0].v);
        return v.undefined ? (args->size() > 1 ? (*args)[1] : Of(nullptr)) : v;
      }
      if (e.name == "keys" || e.name == "values") {
        json out = json::array();
        for (auto it = self->v.begin(); it != self->v.end(); ++it) {
          out.push_back(e.name == "keys" ? json(it.key()) : it.value());
        }
        return Of(std::move(out));
      }
    }
    return Unsupported(absl::StrCat("the method '", e.name, "'"));
  }

  absl::StatusOr<Value> Binary(const std::string& op, const Value& a, const Value& b) {
    if (op == "~") {
      absl::StatusOr<std::string> x = Str(a), y = Str(b);
      if (!x.ok()) return x.status();
      if (!y.ok()) return y.status();
      return Of(*x + *y);
    }
    if (op == "==" || op == "!=") {
      const bool equal = a.undefined == b.undefined && a.v == b.v;
      return Of(op == "==" ? equal : !equal);
    }
    if (op == "in" || op == "not in") {
      bool found = false;
      if (b.v.is_string() && a.v.is_string()) {
        found = absl::StrContains(b.v.get<std::string>(), a.v.get<std::string>());
      } else if (b.v.is_array()) {
        found = std::find(b.v.begin(), b.v.end(), a.v) != b.v.end();
      } else if (b.v.is_object() && a.v.is_string()) {
        found = b.v.contains(a.v.get<std::string>());
      } else {
        return absl::InvalidArgumentError(absl::StrCat("'", op, "' on values that do not hold"));
      }
      return Of(op == "in" ? found : !found);
    }
    if (op == "+" && a.v.is_string() && b.v.is_string()) {
      return Of(a.v.get<std::string>() + b.v.get<std::string>());
    }
    if (op == "+" && a.v.is_array() && b.v.is_array()) {
      json out = a.v;
      out.insert(out.end(), b.v.begin(), b.v.end());
      return Of(std::move(out));
    }
    if ((op == "<" || op == ">" || op == "<=" || op == ">=") && a.v.is_string() &&
        b.v.is_string()) {
      const int c = a.v.get<std::string>().compare(b.v.get<std::string>());
      return Of(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (!a.v.is_number() || !b.v.is_number() || a.v.is_boolean() || b.v.is_boolean()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", op, "' on ", a.undefined ? "an undefined value" : a.v.type_name(),
                       " and ", b.undefined ? "an undefined value" : b.v.type_name()));
    }
    const bool ints = a.v.is_number_integer() && b.v.is_number_integer();
    const double x = a.v.get<double>(), y = b.v.get<double>();
    if (op == "<") return Of(x < y);
    if (op == ">") return Of(x > y);
    if (op == "<=") return Of(x <= y);
    if (op == ">=") return Of(x >= y);
    if (ints && op != "/") {
      const int64_t i = a.v.get<int64_t>(), j = b.v.get<int64_t>();
      if ((op == "//" || op == "%") && j == 0)
        return absl::InvalidArgumentError("division by zero");
      if (op == "+") return Of(i + j);
      if (op == "-") return Of(i - j);
      if (op == "*") return Of(i * j);
      // Python floors.
      const int64_t q = i / j - ((i % j != 0) && ((i < 0) != (j < 0)) ? 1 : 0);
      if (op == "//") return Of(q);
      if (op == "%") return Of(i - q * j);
    }
    if (op == "+") return Of(x + y);
    if (op == "-") return Of(x - y);
    if (op == "*") return Of(x * y);
    if (op == "/") {
      if (y == 0) return absl::InvalidArgumentError("division by zero");
      return Of(x / y);
    }
    return Unsupported(absl::StrCat("'", op, "' on floats"));
  }

  absl::StatusOr<Value> Eval(const Expr& e) {
    switch (e.kind) {
      case Expr::kLiteral:
        return Of(e.lit);
      case Expr::kName:
        return Lookup(e.name);
      case Expr::kList: {
        absl::StatusOr<std::vector<Value>> items = EvalArgs(e, 0);
        if (!items.ok()) return items.status();
        json out = json::array();
        for (Value& v : *items) out.push_back(std::move(v.v));
        return Of(std::move(out));
      }
      case Expr::kAttr:
      case Expr::kIndex: {
        absl::StatusOr<Value> x = Eval(*e.args[0]);
        if (!x.ok()) return x.status();
        if (x->undefined) {
          return absl::InvalidArgumentError("an attribute or item of an undefined value");
        }
        if (e.kind == Expr::kAttr) return Member(*x, json(e.name));
        absl::StatusOr<Value> key = Eval(*e.args[1]);
        if (!key.ok()) return key.status();
        return Member(*x, key->v);
      }
      case Expr::kSlice: {
        std::vector<Value> parts;
        for (const ExprP& p : e.args) {
          if (p == nullptr) {
            parts.push_back(Undefined());
            continue;
          }
          absl::StatusOr<Value> v = Eval(*p);
          if (!v.ok()) return v.status();
          parts.push_back(*std::move(v));
        }
        return Slice(parts[0], parts[1], parts[2], parts[3]);
      }
      case Expr::kCall:
        return Call(e);
      case Expr::kFilter: {
        absl::StatusOr<Value> x = Eval(*e.args[0]);
        if (!x.ok()) return x.status();
        absl::StatusOr<std::vector<Value>> args = EvalArgs(e, 1);
        if (!args.ok()) return args.status();
        return Filter(e.name, *x, *args);
      }
      case Expr::kTest: {
        absl::StatusOr<Value> x = Eval(*e.args[0]);
        if (!x.ok()) return x.status();
        absl::StatusOr<std::vector<Value>> args = EvalArgs(e, 1);
        if (!args.ok()) return args.status();
        absl::StatusOr<bool> t = Test(e.name, *x, *args);
        if (!t.ok()) return t.status();
        return Of(*t != e.negated);
      }
      case Expr::kNot: {
        absl::StatusOr<Value> x = Eval(*e.args[0]);
        if (!x.ok()) return x.status();
        return Of(!Truthy(*x));
      }
      case Expr::kNeg: {
        absl::StatusOr<Value> x = Eval(*e.args[0]);
        if (!x.ok()) return x.status();
        return Binary("-", Of(0), *x);
      }
      case Expr::kAnd:
      case Expr::kOr: {
        absl::StatusOr<Value> a = Eval(*e.args[0]);
        if (!a.ok()) return a.status();
        if (Truthy(*a) == (e.kind == Expr::kOr)) return a;
        return Eval(*e.args[1]);
      }
      case Expr::kCond: {
        absl::StatusOr<Value> c = Eval(*e.args[1]);
        if (!c.ok()) return c.status();
        if (Truthy(*c)) return Eval(*e.args[0]);
        return e.args[2] == nullptr ? Undefined() : Eval(*e.args[2]);
      }
      case Expr::kBinary: {
        absl::StatusOr<Value> a = Eval(*e.args[0]);
        if (!a.ok()) return a.status();
        absl::StatusOr<Value> b = Eval(*e.args[1]);
        if (!b.ok()) return b.status();
        return Binary(e.name, *a, *b);
      }
    }
    return absl::InternalError("unknown expression");
  }

  std::vector<std::map<std::string, Value>> scopes_;
};

}  // namespace

absl::StatusOr<std::optional<ChatTemplate>> LoadChatTemplate(const std::string& dir) {
  namespace fs = std::filesystem;
  std::optional<ChatTemplate> out;
  const std::string jinja = dir + "/chat_template.jinja";
  if (fs::is_regular_file(jinja)) {
    // The same bound as the folder's other settings files.
    absl::StatusOr<std::string> text = ReadHfJsonText(jinja);
    if (!text.ok()) return text.status();
    out = ChatTemplate{jinja, *std::move(text), {}};
  }
  for (const char* name :
       {"chat_template.json", "processor_config.json", "tokenizer_config.json"}) {
    if (out.has_value()) break;
    const std::string path = dir + "/" + name;
    if (!fs::is_regular_file(path)) continue;
    absl::StatusOr<json> j = ReadJsonFile(path);
    if (!j.ok()) return j.status();
    if (!j->is_object() || !j->contains("chat_template") || (*j)["chat_template"].is_null()) {
      continue;
    }
    absl::StatusOr<std::string> text = TemplateText((*j)["chat_template"], path);
    if (!text.ok()) return text.status();
    out = ChatTemplate{path, *std::move(text), {}};
  }
  if (!out.has_value()) return out;
  const std::string tokenizer_config = dir + "/tokenizer_config.json";
  if (fs::is_regular_file(tokenizer_config)) {
    absl::StatusOr<json> j = ReadJsonFile(tokenizer_config);
    if (!j.ok()) return j.status();
    out->special_tokens = SpecialTokens(*j);
  }
  return out;
}

absl::StatusOr<std::string> RenderChatTemplate(const ChatTemplate& tmpl, const json& messages,
                                               bool add_generation_prompt) {
  auto fail = [&](const absl::Status& s) {
    return absl::InvalidArgumentError(absl::StrCat(tmpl.source, ": chat template: ", s.message()));
  };
  // jinja2 drops the template's one trailing newline (keep_trailing_newline is off).
  std::string text = tmpl.text;
  if (absl::EndsWith(text, "\r\n")) {
    text.resize(text.size() - 2);
  } else if (absl::EndsWith(text, "\n") || absl::EndsWith(text, "\r")) {
    text.pop_back();
  }
  absl::StatusOr<std::vector<Tag>> tags = SplitTags(text);
  if (!tags.ok()) return fail(tags.status());
  TemplateParser parser(*std::move(tags));
  std::vector<Node> nodes;
  std::string end, end_rest;
  if (absl::Status s = parser.Block(&nodes, {}, &end, &end_rest); !s.ok()) return fail(s);
  if (!end.empty()) return fail(absl::InvalidArgumentError("{% " + end + " %} without its block"));
  std::map<std::string, Value> globals = {{"messages", Of(messages)},
                                          {"add_generation_prompt", Of(add_generation_prompt)}};
  for (const auto& [name, token] : tmpl.special_tokens) globals[name] = Of(token);
  Renderer r(std::move(globals));
  std::string out;
  if (absl::Status s = r.Render(nodes, &out); !s.ok()) return fail(s);
  return out;
}

json OneImageUserTurn(const std::string& text) {
  return json::array(
      {{{"role", "user"},
        {"content", json::array({{{"type", "image"}}, {{"type", "text"}, {"text", text}}})}}});
}

}  // namespace cdcca::model
