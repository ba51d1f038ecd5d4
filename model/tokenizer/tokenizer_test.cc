// Unit tests of each tokenizer.json component on hand-made JSON, with expectations taken
// from the behaviour the Hugging Face `tokenizers` library documents for it.
#include "model/tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/tokenizer/components.h"

namespace cdcca::tokenizer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const char kMeta[] = "\xE2\x96\x81";  // ▁

std::string Normalized(const std::string& json, const std::string& text) {
  const Json j = Json::parse(json);
  absl::StatusOr<std::unique_ptr<Normalizer>> n = ParseNormalizer({j, "t.json", "normalizer"});
  EXPECT_TRUE(n.ok()) << n.status();
  if (!n.ok()) return "";
  std::string s = text;
  EXPECT_TRUE((*n)->Normalize(&s).ok());
  return s;
}

std::vector<std::string> PreTokenized(const std::string& json, const std::string& text,
                                      bool at_start = true) {
  const Json j = Json::parse(json);
  absl::StatusOr<std::unique_ptr<PreTokenizer>> p =
      ParsePreTokenizer({j, "t.json", "pre_tokenizer"});
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return {};
  std::vector<Piece> pieces(1);
  pieces[0].text = text;
  pieces[0].at_start = at_start;
  EXPECT_TRUE((*p)->PreTokenize(&pieces).ok());
  std::vector<std::string> out;
  for (const Piece& piece : pieces) out.push_back(piece.text);
  return out;
}

std::vector<std::string> Decoded(const std::string& json, std::vector<std::string> tokens) {
  const Json j = Json::parse(json);
  absl::StatusOr<std::unique_ptr<Decoder>> d = ParseDecoder({j, "t.json", "decoder"});
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return {};
  (*d)->DecodeChain(&tokens);
  return tokens;
}

std::unique_ptr<Tokenizer> Load(const std::string& json) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(json);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

std::vector<int32_t> Ids(const Tokenizer& t, const std::string& text, bool special = true) {
  absl::StatusOr<std::vector<int32_t>> ids = t.Encode(text, special);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

// ---- normalizers -----------------------------------------------------------------------------

TEST(Normalizers, UnicodeForms) {
  EXPECT_EQ(Normalized(R"({"type":"NFC"})", "e\xCC\x81"), "\xC3\xA9");  // e + ◌́ -> é
  EXPECT_EQ(Normalized(R"({"type":"NFD"})", "\xC3\xA9"), "e\xCC\x81");
  EXPECT_EQ(Normalized(R"({"type":"NFKC"})", "\xEF\xAC\x81"), "fi");  // ﬁ ligature
  EXPECT_EQ(Normalized(R"({"type":"NFKD"})", "\xEF\xBC\xA1"), "A");   // fullwidth Ａ
}

TEST(Normalizers, LowercaseIsPerCodePoint) {
  // No final-sigma context, as Rust's char::to_lowercase.
  EXPECT_EQ(Normalized(R"({"type":"Lowercase"})", "HeLLo \xCE\x91\xCE\xA3"),
            "hello \xCE\xB1\xCF\x83");
}

TEST(Normalizers, StripAndStripAccents) {
  EXPECT_EQ(Normalized(R"({"type":"Strip","strip_left":true,"strip_right":false})", " \t a b \n"),
            "a b \n");
  EXPECT_EQ(Normalized(R"({"type":"Strip","strip_left":true,"strip_right":true})", " \t a b \n"),
            "a b");
  EXPECT_EQ(
      Normalized(R"({"type":"Sequence","normalizers":[{"type":"NFD"},{"type":"StripAccents"}]})",
                 "caf\xC3\xA9"),
      "cafe");
}

TEST(Normalizers, ReplacePrependSequence) {
  EXPECT_EQ(Normalized(R"({"type":"Replace","pattern":{"String":" "},"content":"_"})", "a b  c"),
            "a_b__c");
  EXPECT_EQ(Normalized(R"({"type":"Replace","pattern":{"Regex":"\\s+"},"content":" "})", "a \t\nb"),
            "a b");
  EXPECT_EQ(Normalized(R"({"type":"Prepend","prepend":"X"})", "ab"), "Xab");
  EXPECT_EQ(Normalized(R"({"type":"Prepend","prepend":"X"})", ""), "");
  // Llama 2's normalizer: prepend ▁ then spaces become ▁.
  EXPECT_EQ(Normalized(R"({"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},
                        {"type":"Replace","pattern":{"String":" "},"content":"▁"}]})",
                       "Hi you"),
            std::string(kMeta) + "Hi" + kMeta + "you");
}

// A charsmap that is not a trie size and a trie: an error naming the field, never a read
// outside it. (The real charsmap is checked against transformers by the unigram_t5 fixture.)
TEST(Normalizers, PrecompiledCharsmapIsChecked) {
  for (const char* charsmap : {"AAE=",              // 2 bytes
                               "/////wAAAAA=",      // trie size 2^32 - 1
                               "BgAAAAAAAAAAAA==",  // trie size 6, not whole units
                               "not base64!"}) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(
        std::string(R"({"normalizer":{"type":"Precompiled","precompiled_charsmap":")") + charsmap +
        R"("},"model":{"type":"WordLevel","vocab":{}}})");
    ASSERT_FALSE(t.ok()) << charsmap;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("normalizer.precompiled_charsmap"))
        << charsmap;
  }
  // An empty charsmap (SentencePiece's identity rule) changes nothing.
  EXPECT_EQ(Normalized(R"({"type":"Precompiled","precompiled_charsmap":""})", "A\xEF\xAC\x81"),
            "A\xEF\xAC\x81");
}

TEST(Normalizers, BertNormalizer) {
  const std::string bert =
      R"({"type":"BertNormalizer","clean_text":true,"handle_chinese_chars":true,"strip_accents":null,"lowercase":true})";
  // Tab -> space, control char dropped, CJK ideograph padded, accents stripped, lowercased.
  EXPECT_EQ(Normalized(bert,
                       "H\xC3\xA9llo\tW\x01"
                       "\xE4\xB8\x96!"),
            "hello w \xE4\xB8\x96 !");
  const std::string keep_case =
      R"({"type":"BertNormalizer","clean_text":false,"handle_chinese_chars":false,"strip_accents":false,"lowercase":false})";
  EXPECT_EQ(Normalized(keep_case, "H\xC3\xA9llo\t"), "H\xC3\xA9llo\t");
}

// ---- pre-tokenizers --------------------------------------------------------------------------

std::string SplitJson(const std::string& behavior, bool invert = false) {
  return R"({"type":"Split","pattern":{"String":"-"},"behavior":")" + behavior + R"(","invert":)" +
         (invert ? "true" : "false") + "}";
}

TEST(PreTokenizers, SplitBehaviors) {
  // The examples of SplitDelimiterBehavior's documentation on "the-final--countdown".
  const std::string text = "the-final--countdown";
  EXPECT_THAT(PreTokenized(SplitJson("Removed"), text), ElementsAre("the", "final", "countdown"));
  EXPECT_THAT(PreTokenized(SplitJson("Isolated"), text),
              ElementsAre("the", "-", "final", "-", "-", "countdown"));
  EXPECT_THAT(PreTokenized(SplitJson("MergedWithPrevious"), text),
              ElementsAre("the-", "final-", "-", "countdown"));
  EXPECT_THAT(PreTokenized(SplitJson("MergedWithNext"), text),
              ElementsAre("the", "-final", "-", "-countdown"));
  EXPECT_THAT(PreTokenized(SplitJson("Contiguous"), text),
              ElementsAre("the", "-", "final", "--", "countdown"));
  EXPECT_THAT(PreTokenized(SplitJson("Removed", /*invert=*/true), text),
              ElementsAre("-", "-", "-"));
}

TEST(PreTokenizers, SplitRegexWithUnicodeClassesAndLookahead) {
  // Qwen2's pattern: letters with an optional leading non-letter, single digits, trailing
  // whitespace kept apart from the next word by the (?!\S) lookahead.
  const std::string qwen2 =
      R"({"type":"Split","pattern":{"Regex":"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},"behavior":"Isolated","invert":false})";
  EXPECT_THAT(PreTokenized(qwen2,
                           "He's 42  \xC3\xBC"
                           "ber!\n\nx"),
              ElementsAre("He", "'s", " ", "4", "2", " ",
                          " \xC3\xBC"
                          "ber",
                          "!\n\n", "x"));
  EXPECT_THAT(PreTokenized(qwen2, "I'LL"), ElementsAre("I", "'LL"));
}

TEST(PreTokenizers, WhitespaceFamilies) {
  EXPECT_THAT(PreTokenized(R"({"type":"Whitespace"})", "Hey friend!  How are_you?"),
              ElementsAre("Hey", "friend", "!", "How", "are_you", "?"));
  EXPECT_THAT(PreTokenized(R"({"type":"WhitespaceSplit"})", "Hey friend!\t How"),
              ElementsAre("Hey", "friend!", "How"));
  EXPECT_THAT(PreTokenized(R"({"type":"BertPreTokenizer"})", "Hey, friend!"),
              ElementsAre("Hey", ",", "friend", "!"));
  EXPECT_THAT(PreTokenized(R"({"type":"Punctuation"})", "Hey, you!!"),
              ElementsAre("Hey", ",", " you", "!", "!"));
  EXPECT_THAT(PreTokenized(R"({"type":"Punctuation","behavior":"Contiguous"})", "you!!"),
              ElementsAre("you", "!!"));
  EXPECT_THAT(PreTokenized(R"({"type":"CharDelimiterSplit","delimiter":"x"})", "axbxxc"),
              ElementsAre("a", "b", "c"));
}

TEST(PreTokenizers, Digits) {
  EXPECT_THAT(PreTokenized(R"({"type":"Digits","individual_digits":false})", "a123b4"),
              ElementsAre("a", "123", "b", "4"));
  EXPECT_THAT(PreTokenized(R"({"type":"Digits","individual_digits":true})", "a123b4"),
              ElementsAre("a", "1", "2", "3", "b", "4"));
}

TEST(PreTokenizers, Metaspace) {
  const std::string m = kMeta;
  EXPECT_THAT(
      PreTokenized(
          R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true})",
          "Hey  friend"),
      ElementsAre(m + "Hey", m, m + "friend"));
  EXPECT_THAT(
      PreTokenized(
          R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":false})",
          "Hey friend"),
      ElementsAre(m + "Hey" + m + "friend"));
  EXPECT_THAT(PreTokenized(
                  R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"never","split":true})",
                  "Hey friend"),
              ElementsAre("Hey", m + "friend"));
  // "first": only the split at the start of the input gets the prefix.
  const std::string first =
      R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"first","split":false})";
  EXPECT_THAT(PreTokenized(first, "Hey", /*at_start=*/true), ElementsAre(m + "Hey"));
  EXPECT_THAT(PreTokenized(first, "Hey", /*at_start=*/false), ElementsAre("Hey"));
  // Older files: add_prefix_space instead of prepend_scheme.
  EXPECT_THAT(
      PreTokenized(R"({"type":"Metaspace","replacement":"▁","add_prefix_space":false})", "a b"),
      ElementsAre("a", m + "b"));
}

TEST(PreTokenizers, ByteLevel) {
  // Space is U+0120 (Ġ), newline U+010A (Ċ); printable Latin-1 bytes stand for themselves.
  EXPECT_THAT(PreTokenized(R"({"type":"ByteLevel","add_prefix_space":true,"use_regex":true})",
                           "Hello world"),
              ElementsAre("\xC4\xA0Hello", "\xC4\xA0world"));
  EXPECT_THAT(PreTokenized(R"({"type":"ByteLevel","add_prefix_space":false,"use_regex":true})",
                           "Hi\n\xC3\xA9"),
              ElementsAre("Hi", "\xC4\x8A", "\xC3\x83\xC2\xA9"));
  EXPECT_THAT(
      PreTokenized(R"({"type":"ByteLevel","add_prefix_space":false,"use_regex":false})", "a b"),
      ElementsAre("a\xC4\xA0"
                  "b"));
}

TEST(PreTokenizers, SequenceAppliesInOrder) {
  EXPECT_THAT(PreTokenized(R"({"type":"Sequence","pretokenizers":[{"type":"WhitespaceSplit"},
                              {"type":"Digits","individual_digits":true}]})",
                           "ab12 c3"),
              ElementsAre("ab", "1", "2", "c", "3"));
}

// ---- models ----------------------------------------------------------------------------------

std::string WordModelJson(const std::string& model, const std::string& extra = "") {
  return R"({"version":"1.0","normalizer":null,"pre_tokenizer":{"type":"WhitespaceSplit"},)" +
         extra + R"("model":)" + model + "}";
}

TEST(Models, BpeMergesByRankInBothSpellings) {
  // (b, c) ranks before (a, b): "abc" -> a + bc, which has no merge.
  auto t = Load(WordModelJson(
      R"({"type":"BPE","vocab":{"a":0,"b":1,"c":2,"ab":3,"bc":4,"abc":5},"merges":["b c",["a","b"]]})"));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(Ids(*t, "abc"), ElementsAre(0, 4));
  EXPECT_THAT(Ids(*t, "ab cab"), ElementsAre(3, 2, 3));
  // The other order merges a+b first, then ab+c.
  auto u = Load(WordModelJson(
      R"({"type":"BPE","vocab":{"a":0,"b":1,"c":2,"ab":3,"bc":4,"abc":5},"merges":[["a","b"],"b c","ab c"]})"));
  ASSERT_NE(u, nullptr);
  EXPECT_THAT(Ids(*u, "abc"), ElementsAre(5));
  // Equal ranks apply leftmost first: "aaa" -> aa + a.
  auto v = Load(WordModelJson(R"({"type":"BPE","vocab":{"a":0,"aa":1},"merges":["a a"]})"));
  ASSERT_NE(v, nullptr);
  EXPECT_THAT(Ids(*v, "aaa"), ElementsAre(1, 0));
  EXPECT_THAT(Ids(*v, "aaaa"), ElementsAre(1, 1));
}

TEST(Models, BpeIgnoreMergesTakesWholeWords) {
  auto t = Load(WordModelJson(
      R"({"type":"BPE","ignore_merges":true,"vocab":{"a":0,"b":1,"c":2,"abc":3},"merges":[]})"));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(Ids(*t, "abc cab"), ElementsAre(3, 2, 0, 1));
}

TEST(Models, BpeByteFallbackAndUnk) {
  const std::string vocab = R"("vocab":{"<unk>":0,"a":1,"<0xC3>":2,"<0xA9>":3},"merges":[])";
  auto fallback = Load(
      WordModelJson(R"({"type":"BPE","unk_token":"<unk>","byte_fallback":true,)" + vocab + "}"));
  ASSERT_NE(fallback, nullptr);
  EXPECT_THAT(Ids(*fallback, "a\xC3\xA9"), ElementsAre(1, 2, 3));  // é as its two bytes
  EXPECT_THAT(Ids(*fallback, "azz"), ElementsAre(1, 0, 0));        // no <0x7A>: unk per char
  auto fused =
      Load(WordModelJson(R"({"type":"BPE","unk_token":"<unk>","fuse_unk":true,)" + vocab + "}"));
  ASSERT_NE(fused, nullptr);
  EXPECT_THAT(Ids(*fused,
                  "azz\xC3\xA9"
                  "a"),
              ElementsAre(1, 0, 1));  // one unk for "zzé"
  auto no_unk = Load(WordModelJson(R"({"type":"BPE",)" + vocab + "}"));
  ASSERT_NE(no_unk, nullptr);
  EXPECT_THAT(Ids(*no_unk, "aza"), ElementsAre(1, 1));  // unknown chars vanish without unk
}

// Unigram: the segmentation whose piece scores sum highest; an uncovered code point is unk,
// adjacent unknowns fuse, byte fallback spells them as <0xNN> pieces when all exist.
TEST(Models, UnigramViterbiUnknownsAndByteFallback) {
  const std::string vocab =
      R"("vocab":[["<unk>",0],["a",-1],["b",-2],["ab",-2.5],["abb",-6],["<0xC3>",0],["<0xA9>",0]])";
  auto t = Load(WordModelJson(R"({"type":"Unigram","unk_id":0,)" + vocab + "}"));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(Ids(*t, "ab"), ElementsAre(3));          // -2.5 beats a + b at -3
  EXPECT_THAT(Ids(*t, "abb"), ElementsAre(3, 2));      // ab + b (-4.5) beats abb (-6)
  EXPECT_THAT(Ids(*t, "azza"), ElementsAre(1, 0, 1));  // one unk for "zz"
  EXPECT_THAT(Ids(*t, "a\xC3\xA9"), ElementsAre(1, 0));
  auto fallback =
      Load(WordModelJson(R"({"type":"Unigram","unk_id":0,"byte_fallback":true,)" + vocab + "}"));
  ASSERT_NE(fallback, nullptr);
  EXPECT_THAT(Ids(*fallback, "a\xC3\xA9"), ElementsAre(1, 5, 6));  // é as its two bytes
  EXPECT_THAT(Ids(*fallback, "az"), ElementsAre(1, 0));            // no <0x7A>: unk
  auto no_unk = Load(WordModelJson(R"({"type":"Unigram",)" + vocab + "}"));
  ASSERT_NE(no_unk, nullptr);
  EXPECT_FALSE(no_unk->Encode("az").ok());  // tokenizers' MissingUnkId
  EXPECT_FALSE(
      Tokenizer::FromJson(WordModelJson(R"({"type":"Unigram","unk_id":9,)" + vocab + "}")).ok());
  EXPECT_FALSE(
      Tokenizer::FromJson(WordModelJson(R"({"type":"Unigram","vocab":[["a","x"]]})")).ok());
}

TEST(Models, BpeSubwordPrefixAndSuffix) {
  auto t = Load(WordModelJson(
      R"({"type":"BPE","continuing_subword_prefix":"##","end_of_word_suffix":"</w>",
          "vocab":{"a":0,"##b":1,"##c</w>":2,"ab":3,"abc</w>":4},"merges":["a ##b","ab ##c</w>"]})"));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(Ids(*t, "abc"), ElementsAre(4));
}

TEST(Models, WordPieceGreedyLongestMatch) {
  auto t = Load(WordModelJson(
      R"({"type":"WordPiece","unk_token":"[UNK]","continuing_subword_prefix":"##","max_input_chars_per_word":8,
          "vocab":{"[UNK]":0,"un":1,"##aff":2,"##able":3,"a":4,"##a":5}})"));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(Ids(*t, "unaffable"), ElementsAre(0));  // 9 chars > 8: unk
  EXPECT_THAT(Ids(*t, "unaff aa unx"), ElementsAre(1, 2, 4, 5, 0));
}

TEST(Models, WordLevelUnk) {
  auto t =
      Load(WordModelJson(R"({"type":"WordLevel","unk_token":"<unk>","vocab":{"<unk>":0,"hi":1}})"));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(Ids(*t, "hi there hi"), ElementsAre(1, 0, 1));
  auto strict = Load(WordModelJson(R"({"type":"WordLevel","unk_token":"<unk>","vocab":{"hi":1}})"));
  ASSERT_NE(strict, nullptr);
  EXPECT_FALSE(strict->Encode("bye").ok());
}

// ---- post-processors -------------------------------------------------------------------------

TEST(PostProcessors, TemplatesAddSpecialTokens) {
  const std::string model =
      R"({"type":"WordLevel","unk_token":"u","vocab":{"u":0,"hi":1,"[CLS]":2,"[SEP]":3}})";
  auto list_form = Load(WordModelJson(model, R"("post_processor":{"type":"TemplateProcessing",
      "single":[{"SpecialToken":{"id":"[CLS]","type_id":0}},{"Sequence":{"id":"A","type_id":0}},
                {"SpecialToken":{"id":"[SEP]","type_id":0}}],
      "special_tokens":{"[CLS]":{"id":"[CLS]","ids":[2],"tokens":["[CLS]"]},
                        "[SEP]":{"id":"[SEP]","ids":[3],"tokens":["[SEP]"]}}},)"));
  ASSERT_NE(list_form, nullptr);
  EXPECT_THAT(Ids(*list_form, "hi hi"), ElementsAre(2, 1, 1, 3));
  EXPECT_THAT(Ids(*list_form, "hi hi", /*special=*/false), ElementsAre(1, 1));
  EXPECT_THAT(Ids(*list_form, ""), ElementsAre(2, 3));
  auto string_form = Load(WordModelJson(model, R"("post_processor":{"type":"TemplateProcessing",
      "single":"[CLS]:0 $A:0 [SEP]:0",
      "special_tokens":{"[CLS]":{"id":"[CLS]","ids":[2],"tokens":["[CLS]"]},
                        "[SEP]":{"id":"[SEP]","ids":[3],"tokens":["[SEP]"]}}},)"));
  ASSERT_NE(string_form, nullptr);
  EXPECT_THAT(Ids(*string_form, "hi"), ElementsAre(2, 1, 3));
  auto bert = Load(WordModelJson(
      model, R"("post_processor":{"type":"BertProcessing","sep":["[SEP]",3],"cls":["[CLS]",2]},)"));
  ASSERT_NE(bert, nullptr);
  EXPECT_THAT(Ids(*bert, "hi"), ElementsAre(2, 1, 3));
  auto roberta = Load(WordModelJson(model, R"("post_processor":{"type":"Sequence","processors":[
      {"type":"ByteLevel","add_prefix_space":true,"trim_offsets":false,"use_regex":true},
      {"type":"RobertaProcessing","sep":["[SEP]",3],"cls":["[CLS]",2],"trim_offsets":true,"add_prefix_space":true}]},)"));
  ASSERT_NE(roberta, nullptr);
  EXPECT_THAT(Ids(*roberta, "hi"), ElementsAre(2, 1, 3));
}

// ---- decoders --------------------------------------------------------------------------------

TEST(Decoders, ByteLevelAndByteFallbackRepairInvalidUtf8) {
  EXPECT_THAT(Decoded(R"({"type":"ByteLevel"})", {"\xC4\xA0Hello", "\xC4\xA0w\xC3\x83\xC2\xA9"}),
              ElementsAre(" Hello w\xC3\xA9"));
  // A lone lead byte 0xC3 becomes one U+FFFD; a token outside the byte alphabet keeps its text.
  EXPECT_THAT(Decoded(R"({"type":"ByteLevel"})", {"a\xC3\x83", "<|end|>"}),
              ElementsAre("a\xEF\xBF\xBD<|end|>"));
  EXPECT_THAT(Decoded(R"({"type":"ByteFallback"})", {"a", "<0xE2>", "<0x82>", "<0xAC>", "b"}),
              ElementsAre("a", "\xE2\x82\xAC", "b"));
  EXPECT_THAT(Decoded(R"({"type":"ByteFallback"})", {"<0xE2>", "<0x82>", "b"}),
              ElementsAre("\xEF\xBF\xBD", "\xEF\xBF\xBD", "b"));
}

TEST(Decoders, LlamaSequenceAndMetaspace) {
  const std::string llama = R"({"type":"Sequence","decoders":[
      {"type":"Replace","pattern":{"String":"▁"},"content":" "},{"type":"ByteFallback"},
      {"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]})";
  const std::string m = kMeta;
  EXPECT_THAT(Decoded(llama, {m + "Hey", m + "fri", "end", "<0x21>"}), ElementsAre("Hey friend!"));
  EXPECT_THAT(Decoded(llama, {m + m + "x"}), ElementsAre(" x"));  // strips one space only
  EXPECT_THAT(
      Decoded(R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true})",
              {m + "Hey", m + "friend"}),
      ElementsAre("Hey", " friend"));
  EXPECT_THAT(
      Decoded(R"({"type":"Metaspace","replacement":"▁","prepend_scheme":"never","split":true})",
              {m + "Hey"}),
      ElementsAre(" Hey"));
  EXPECT_THAT(Decoded(R"({"type":"Strip","content":"x","start":2,"stop":1})", {"xxxaxx"}),
              ElementsAre("xax"));
}

TEST(Decoders, WordPieceAndBpeSuffix) {
  EXPECT_THAT(Decoded(R"({"type":"WordPiece","prefix":"##","cleanup":true})",
                      {"un", "##aff", "##able", ".", "it", "'", "s", "do", "n't"}),
              ElementsAre("un", "aff", "able", ".", " it", " '", " s", " do", "n't"));
  EXPECT_THAT(
      Decoded(R"({"type":"BPEDecoder","suffix":"</w>"})", {"hel", "lo</w>", "wor", "ld</w>"}),
      ElementsAre("hel", "lo ", "wor", "ld"));
}

// ---- added tokens ----------------------------------------------------------------------------

std::string AddedJson(const std::string& added, const std::string& normalizer = "null") {
  return R"({"normalizer":)" + normalizer +
         R"(,"pre_tokenizer":{"type":"Split","pattern":{"String":" "},
      "behavior":"Isolated","invert":false},"added_tokens":[)" +
         added + R"(],
      "model":{"type":"WordLevel","unk_token":"<unk>","vocab":{"<unk>":0,"hello":1,"world":2," ":5,"xaby":6}}})";
}

TEST(AddedTokens, SplitOutBeforeTheModelWithStripOptions) {
  auto plain = Load(AddedJson(R"({"id":3,"content":"<m>","special":true,"normalized":false})"));
  ASSERT_NE(plain, nullptr);
  EXPECT_THAT(Ids(*plain, "hello <m> world"), ElementsAre(1, 5, 3, 5, 2));
  EXPECT_THAT(Ids(*plain, "hello<m><m>world"), ElementsAre(1, 3, 3, 2));
  auto stripped = Load(AddedJson(
      R"({"id":3,"content":"<m>","special":true,"normalized":false,"lstrip":true,"rstrip":true})"));
  ASSERT_NE(stripped, nullptr);
  EXPECT_THAT(Ids(*stripped, "hello  <m>  world"), ElementsAre(1, 3, 2));
  // Longest match wins at one position.
  auto longest = Load(AddedJson(
      R"({"id":3,"content":"<m>","special":true},{"id":4,"content":"<m>>","special":true})"));
  ASSERT_NE(longest, nullptr);
  EXPECT_THAT(Ids(*longest, "<m>><m>"), ElementsAre(4, 3));
}

TEST(AddedTokens, SingleWordAndNormalized) {
  auto single = Load(AddedJson(R"({"id":7,"content":"ab","single_word":true,"normalized":false})"));
  ASSERT_NE(single, nullptr);
  EXPECT_THAT(Ids(*single, "ab xaby"), ElementsAre(7, 5, 6));
  // normalized: matched in the lowercased text; not normalized: matched in the raw text.
  auto normalized =
      Load(AddedJson(R"({"id":8,"content":"WORLD","normalized":true})", R"({"type":"Lowercase"})"));
  ASSERT_NE(normalized, nullptr);
  EXPECT_THAT(Ids(*normalized, "WoRLD"), ElementsAre(8));
  auto raw = Load(
      AddedJson(R"({"id":8,"content":"WORLD","normalized":false})", R"({"type":"Lowercase"})"));
  ASSERT_NE(raw, nullptr);
  EXPECT_THAT(Ids(*raw, "WoRLD"), ElementsAre(2));
  EXPECT_THAT(Ids(*raw, "WORLD"), ElementsAre(8));
}

TEST(AddedTokens, DecodeSkipsOnlySpecialTokens) {
  auto t = Load(AddedJson(
      R"({"id":3,"content":"<s>","special":true},{"id":4,"content":"<x>","special":false})"));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->Decode({3, 1, 4, 2}, false), "<s> hello <x> world");  // no decoder: joined by " "
  EXPECT_EQ(t->Decode({3, 1, 4, 2}, true), "hello <x> world");
  EXPECT_EQ(t->Decode({1, 999}, false), "hello");  // unknown ids are skipped
  EXPECT_EQ(t->TokenToId("<x>"), 4);
  EXPECT_EQ(t->IdToToken(2), "world");
  EXPECT_EQ(t->VocabSize(), 7);
}

// ---- errors ----------------------------------------------------------------------------------

TEST(Errors, UnsupportedComponentNamesFileAndPath) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(
      R"({"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Whitespace"},{"type":"Foo"}]},
          "model":{"type":"WordLevel","vocab":{}}})");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(),
            "tokenizer.json: pre_tokenizer.pretokenizers[1].type 'Foo' is not supported");
  t = Tokenizer::FromJson(R"({"model":{"type":"CharLevel","vocab":[]}})", "dir/tokenizer.json");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "dir/tokenizer.json: model.type 'CharLevel' is not supported");
}

TEST(Errors, MalformedInputIsAnErrorNotACrash) {
  for (
      const std::string& bad : std::vector<std::string>{
          "", "{", "[]", "null", R"({"model":null})", R"({"model":{"type":"BPE","vocab":[]}})",
          R"({"model":{"type":"BPE","vocab":{"a":"x"}}})",
          R"({"model":{"type":"BPE","vocab":{"a":0},"merges":["a b"]}})",
          R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[1]}})",
          R"({"model":{"type":"WordLevel","vocab":{}},"normalizer":{"type":3}})",
          R"({"model":{"type":"WordLevel","vocab":{}},"pre_tokenizer":{"type":"Split","pattern":{"Regex":"("},"behavior":"Isolated"}})",
          R"({"model":{"type":"WordLevel","vocab":{}},"pre_tokenizer":{"type":"Split","pattern":{"String":"a"},"behavior":"Sideways"}})",
          R"({"model":{"type":"WordLevel","vocab":{}},"added_tokens":[{"id":-1,"content":"x"}]})",
          R"({"model":{"type":"WordLevel","vocab":{}},"post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"X"}}]}})",
          std::string(100000, '['), "{\"model\": \"\xff\"}"}) {
    EXPECT_FALSE(Tokenizer::FromJson(bad).ok()) << bad.substr(0, 80);
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      Tokenizer::FromJson(R"({"model":{"type":"WordLevel","vocab":[]}})");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "tokenizer.json: model.vocab must be an object, not array");
}

TEST(Errors, InvalidUtf8TextIsRejected) {
  auto t = Load(WordModelJson(R"({"type":"WordLevel","unk_token":"<unk>","vocab":{"<unk>":0}})"));
  ASSERT_NE(t, nullptr);
  absl::StatusOr<std::vector<int32_t>> ids = t->Encode("a\xff");
  ASSERT_FALSE(ids.ok());
  EXPECT_THAT(std::string(ids.status().message()), HasSubstr("UTF-8"));
}

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(Folders, TokenizerConfigAddsSpecialTokensAndTemplate) {
  const std::string dir = testing::TempDir() + "/tokenizer_config_folder";
  std::filesystem::create_directories(dir);
  WriteFile(
      dir + "/tokenizer.json",
      WordModelJson(
          R"({"type":"WordLevel","unk_token":"<unk>","vocab":{"<unk>":0,"hi":1,"</s>":2,"<s>":3,".":5}})"));
  // As transformers reads it: named special tokens (a string or an AddedToken object),
  // added_tokens_decoder, add_bos_token / add_eos_token, clean_up_tokenization_spaces.
  WriteFile(dir + "/tokenizer_config.json", R"({
      "add_bos_token": true, "add_eos_token": true, "bos_token": "<s>",
      "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": false, "normalized": false,
                    "rstrip": false, "single_word": false},
      "added_tokens_decoder": {"4": {"content": "<image>", "lstrip": false, "normalized": false,
                                     "rstrip": false, "single_word": false, "special": true}},
      "clean_up_tokenization_spaces": true})");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromFolder(dir);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->bos_id(), 3);
  EXPECT_EQ((*t)->eos_id(), 2);
  EXPECT_EQ((*t)->TokenToId("<image>"), 4);
  EXPECT_THAT(Ids(**t, "hi<image>hi"), ElementsAre(3, 1, 4, 1, 2));
  EXPECT_THAT(Ids(**t, "hi</s>", /*special=*/false), ElementsAre(1, 2));
  EXPECT_EQ((*t)->Decode({3, 1, 5, 4, 2}, true), "hi.");
  EXPECT_EQ((*t)->Decode({3, 1, 5}, false), "<s> hi.");
}

TEST(Folders, MalformedConfigNamesTheFile) {
  const std::string dir = testing::TempDir() + "/bad_config_folder";
  std::filesystem::create_directories(dir);
  WriteFile(dir + "/tokenizer.json", WordModelJson(R"({"type":"WordLevel","vocab":{"a":0}})"));
  WriteFile(dir + "/tokenizer_config.json", R"({"added_tokens_decoder": {"x": {}}})");
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromFolder(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()),
              HasSubstr("tokenizer_config.json: added_tokens_decoder key 'x' is not a token id"));
}

TEST(Folders, MissingFilesAreNotFound) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromFolder("/nonexistent/model");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("/nonexistent/model"));
}

}  // namespace
}  // namespace cdcca::tokenizer
