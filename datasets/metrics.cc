#include "datasets/metrics.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <unordered_map>

namespace cdcca::datasets {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// vqaEval.commaStrip: a digit, a comma, a digit.
bool HasDigitCommaDigit(std::string_view s) {
  for (size_t i = 1; i + 1 < s.size(); ++i) {
    if (s[i] == ',' && IsDigit(s[i - 1]) && IsDigit(s[i + 1])) return true;
  }
  return false;
}

void ReplaceAll(std::string& s, char from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == from) {
      out.append(to);
    } else {
      out.push_back(c);
    }
  }
  s.swap(out);
}

// vqaEval.contractions as the 2021 revision has it (straight apostrophes; the keys that
// start with a capital can never match, as the official code lower-cases first).
const std::unordered_map<std::string, std::string>& Contractions() {
  static const std::unordered_map<std::string, std::string> kTable = {
      {"aint", "ain't"},
      {"arent", "aren't"},
      {"cant", "can't"},
      {"couldve", "could've"},
      {"couldnt", "couldn't"},
      {"couldn'tve", "couldn't've"},
      {"couldnt've", "couldn't've"},
      {"didnt", "didn't"},
      {"doesnt", "doesn't"},
      {"dont", "don't"},
      {"hadnt", "hadn't"},
      {"hadnt've", "hadn't've"},
      {"hadn'tve", "hadn't've"},
      {"hasnt", "hasn't"},
      {"havent", "haven't"},
      {"hed", "he'd"},
      {"hed've", "he'd've"},
      {"he'dve", "he'd've"},
      {"hes", "he's"},
      {"howd", "how'd"},
      {"howll", "how'll"},
      {"hows", "how's"},
      {"Id've", "I'd've"},
      {"I'dve", "I'd've"},
      {"Im", "I'm"},
      {"Ive", "I've"},
      {"isnt", "isn't"},
      {"itd", "it'd"},
      {"itd've", "it'd've"},
      {"it'dve", "it'd've"},
      {"itll", "it'll"},
      {"let's", "let's"},
      {"maam", "ma'am"},
      {"mightnt", "mightn't"},
      {"mightnt've", "mightn't've"},
      {"mightn'tve", "mightn't've"},
      {"mightve", "might've"},
      {"mustnt", "mustn't"},
      {"mustve", "must've"},
      {"neednt", "needn't"},
      {"notve", "not've"},
      {"oclock", "o'clock"},
      {"oughtnt", "oughtn't"},
      {"ow's'at", "'ow's'at"},
      {"'ows'at", "'ow's'at"},
      {"'ow'sat", "'ow's'at"},
      {"shant", "shan't"},
      {"shed've", "she'd've"},
      {"she'dve", "she'd've"},
      {"she's", "she's"},
      {"shouldve", "should've"},
      {"shouldnt", "shouldn't"},
      {"shouldnt've", "shouldn't've"},
      {"shouldn'tve", "shouldn't've"},
      {"somebody'd", "somebodyd"},
      {"somebodyd've", "somebody'd've"},
      {"somebody'dve", "somebody'd've"},
      {"somebodyll", "somebody'll"},
      {"somebodys", "somebody's"},
      {"someoned", "someone'd"},
      {"someoned've", "someone'd've"},
      {"someone'dve", "someone'd've"},
      {"someonell", "someone'll"},
      {"someones", "someone's"},
      {"somethingd", "something'd"},
      {"somethingd've", "something'd've"},
      {"something'dve", "something'd've"},
      {"somethingll", "something'll"},
      {"thats", "that's"},
      {"thered", "there'd"},
      {"thered've", "there'd've"},
      {"there'dve", "there'd've"},
      {"therere", "there're"},
      {"theres", "there's"},
      {"theyd", "they'd"},
      {"theyd've", "they'd've"},
      {"they'dve", "they'd've"},
      {"theyll", "they'll"},
      {"theyre", "they're"},
      {"theyve", "they've"},
      {"twas", "'twas"},
      {"wasnt", "wasn't"},
      {"wed've", "we'd've"},
      {"we'dve", "we'd've"},
      {"weve", "we've"},
      {"werent", "weren't"},
      {"whatll", "what'll"},
      {"whatre", "what're"},
      {"whats", "what's"},
      {"whatve", "what've"},
      {"whens", "when's"},
      {"whered", "where'd"},
      {"wheres", "where's"},
      {"whereve", "where've"},
      {"whod", "who'd"},
      {"whod've", "who'd've"},
      {"who'dve", "who'd've"},
      {"wholl", "who'll"},
      {"whos", "who's"},
      {"whove", "who've"},
      {"whyll", "why'll"},
      {"whyre", "why're"},
      {"whys", "why's"},
      {"wont", "won't"},
      {"wouldve", "would've"},
      {"wouldnt", "wouldn't"},
      {"wouldnt've", "wouldn't've"},
      {"wouldn'tve", "wouldn't've"},
      {"yall", "y'all"},
      {"yall'll", "y'all'll"},
      {"y'allll", "y'all'll"},
      {"yall'd've", "y'all'd've"},
      {"y'alld've", "y'all'd've"},
      {"y'all'dve", "y'all'd've"},
      {"youd", "you'd"},
      {"youd've", "you'd've"},
      {"you'dve", "you'd've"},
      {"youll", "you'll"},
      {"youre", "you're"},
      {"youve", "you've"}};
  return kTable;
}

// ---- Python string semantics the VQA code relies on -----------------------------------

// Length of the UTF-8 sequence at s[i] that Python's str.isspace() accepts, 0 if none:
// \t \n \v \f \r, \x1c-\x1f, space, U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029,
// U+202F, U+205F, U+3000.
size_t PySpaceAt(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if ((c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20)) return 1;
  if (c == 0xc2 && i + 1 < s.size() && (b(i + 1) == 0x85 || b(i + 1) == 0xa0)) return 2;
  if (i + 2 >= s.size()) return 0;
  const unsigned cp = ((c & 0x0fu) << 12) | ((b(i + 1) & 0x3fu) << 6) | (b(i + 2) & 0x3fu);
  if ((c & 0xf0) != 0xe0 || (b(i + 1) & 0xc0) != 0x80 || (b(i + 2) & 0xc0) != 0x80) return 0;
  const bool space = cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 ||
                     cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
  return space ? 3 : 0;
}

// str.strip() with no argument.
std::string PyStrip(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    const size_t n = PySpaceAt(s, b);
    if (n == 0) break;
    b += n;
  }
  // The last non-space code point ends the result: scan forwards, as UTF-8 is.
  size_t e = b;
  for (size_t i = b; i < s.size();) {
    const size_t n = PySpaceAt(s, i);
    if (n > 0) {
      i += n;
    } else {
      ++i;
      while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xc0) == 0x80) ++i;
      e = i;
    }
  }
  return std::string(s.substr(b, e - b));
}

// str.split() with no argument: runs of whitespace separate, no empty words.
std::vector<std::string> PySplit(std::string_view s) {
  std::vector<std::string> words;
  std::string cur;
  for (size_t i = 0; i < s.size();) {
    if (const size_t n = PySpaceAt(s, i); n > 0) {
      if (!cur.empty()) words.push_back(std::move(cur));
      cur.clear();
      i += n;
    } else {
      cur.push_back(s[i++]);
    }
  }
  if (!cur.empty()) words.push_back(std::move(cur));
  return words;
}

// str.lower() for ASCII and the Latin-1 capitals U+00C0-U+00DE (not U+00D7, the
// multiplication sign); other code points are left as they are.
std::string PyLower(std::string_view s) {
  std::string out(s);
  for (size_t i = 0; i < out.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(out[i]);
    if (c >= 'A' && c <= 'Z') {
      out[i] = static_cast<char>(c - 'A' + 'a');
    } else if (c == 0xc3 && i + 1 < out.size()) {
      const unsigned char d = static_cast<unsigned char>(out[i + 1]);
      if (d >= 0x80 && d <= 0x9e && d != 0x97) out[i + 1] = static_cast<char>(d + 0x20);
      ++i;
    }
  }
  return out;
}

std::map<std::string, double> RoundedMeans(
    const std::map<std::string, std::vector<double>>& groups) {
  std::map<std::string, double> out;
  for (const auto& [key, accs] : groups) {
    double s = 0;
    for (double a : accs) s += a;
    out[key] = RoundTo2(100.0 * s / static_cast<double>(accs.size()));
  }
  return out;
}

// ---- PTB tokenization ----------------------------------------------------------------

bool IsDroppedToken(std::string_view t) {
  static const std::set<std::string_view> kDrop = {
      "''", "'", "``", "`",   "-lrb-", "-rrb-", "-lcb-", "-rcb-", ".", "?", "!", ",",
      ":",  "-", "--", "...", ";",     "(",     ")",     "[",     "]", "{", "}", "\""};
  return kDrop.count(t) > 0;
}

// Splits the clitics PTB separates: n't, 's, 're, 've, 'll, 'd, 'm.
void EmitWord(std::string word, std::vector<std::string>& out) {
  if (word.empty()) return;
  static const char* const kClitics[] = {"n't", "'s", "'re", "'ve", "'ll", "'d", "'m"};
  for (const char* c : kClitics) {
    const size_t n = std::char_traits<char>::length(c);
    if (word.size() > n && word.compare(word.size() - n, n, c) == 0) {
      out.push_back(word.substr(0, word.size() - n));
      out.emplace_back(c);
      return;
    }
  }
  out.push_back(std::move(word));
}

// ---- n-gram helpers -------------------------------------------------------------------

using NGramCounts = std::map<std::vector<std::string>, int>;

NGramCounts CountNGrams(const std::vector<std::string>& words, int max_n) {
  NGramCounts counts;
  for (int k = 1; k <= max_n; ++k) {
    for (size_t i = 0; i + k <= words.size(); ++i) {
      ++counts[std::vector<std::string>(words.begin() + i, words.begin() + i + k)];
    }
  }
  return counts;
}

}  // namespace

// ---- VQA --------------------------------------------------------------------------------

std::string VqaProcessPunctuation(std::string_view text) {
  // vqaEval.punct (2021). The decision for each mark looks at the input, not at the text as
  // the earlier marks left it; so the order of the list does not matter.
  static constexpr char kPunct[] = {';', '/', '[', ']', '"', '{', '}', '(', ')', '=', '+',
                                    '\\', '_', '-', '>', '<', '@', '`', ',', '?', '!'};
  const bool digit_comma = HasDigitCommaDigit(text);
  std::string out(text);
  for (char p : kPunct) {
    const std::string p_space = std::string(1, p) + " ", space_p = " " + std::string(1, p);
    const bool touches_space = text.find(p_space) != std::string_view::npos ||
                               text.find(space_p) != std::string_view::npos;
    ReplaceAll(out, p, touches_space || digit_comma ? "" : " ");
  }
  // periodStrip "(?!<=\d)(\.)(?!\d)" with count = re.UNICODE (32): delete the first 32
  // periods that are not followed by a digit, whatever precedes them (see the header).
  std::string result;
  int removed = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == '.' && removed < 32 && !(i + 1 < out.size() && IsDigit(out[i + 1]))) {
      ++removed;
      continue;
    }
    result.push_back(out[i]);
  }
  return result;
}

std::string VqaProcessDigitArticle(std::string_view text) {
  static const std::unordered_map<std::string, std::string> kNumbers = {
      {"none", "0"}, {"zero", "0"}, {"one", "1"},   {"two", "2"},   {"three", "3"}, {"four", "4"},
      {"five", "5"}, {"six", "6"},  {"seven", "7"}, {"eight", "8"}, {"nine", "9"},  {"ten", "10"}};
  std::string out;
  for (std::string word : PySplit(PyLower(text))) {
    auto number = kNumbers.find(word);
    if (number != kNumbers.end()) word = number->second;
    if (word == "a" || word == "an" || word == "the") continue;
    // The official code replaces contractions after dropping the articles; a word is
    // looked up once, so the order of these two steps does not change the result.
    auto c = Contractions().find(word);
    if (c != Contractions().end()) word = c->second;
    if (!out.empty()) out.push_back(' ');
    out += word;
  }
  return out;
}

std::string VqaStripAnswer(std::string_view answer) {
  std::string a(answer);
  for (char& c : a) {
    if (c == '\n' || c == '\t') c = ' ';
  }
  return PyStrip(a);
}

std::string VqaNormalizeAnswer(std::string_view answer) {
  return VqaProcessDigitArticle(VqaProcessPunctuation(VqaStripAnswer(answer)));
}

double VqaAccuracy(std::string_view prediction, const std::vector<std::string>& gt_answers) {
  if (gt_answers.empty()) return 0;
  std::string pred = VqaStripAnswer(prediction);
  std::vector<std::string> gts;
  gts.reserve(gt_answers.size());
  for (const std::string& g : gt_answers) gts.push_back(VqaStripAnswer(g));
  // Unanimity is judged on the stripped answers, before any other processing.
  if (std::set<std::string>(gts.begin(), gts.end()).size() > 1) {
    for (std::string& g : gts) g = VqaProcessDigitArticle(VqaProcessPunctuation(g));
    pred = VqaProcessDigitArticle(VqaProcessPunctuation(pred));
  }
  const int total = static_cast<int>(std::count(gts.begin(), gts.end(), pred));
  double sum = 0;
  for (const std::string& g : gts) {
    // Leave this annotator out: the official code drops exactly this answer record (the
    // records differ in answer_id), so a match among the others loses one if g matches.
    const int others = total - (g == pred ? 1 : 0);
    sum += std::min(1.0, static_cast<double>(others) / 3.0);
  }
  return sum / static_cast<double>(gts.size());
}

double RoundTo2(double x) {
  // Python's round() is half to even; nearbyint in the default rounding mode is too. (Python
  // rounds the exact binary value; x * 100 may differ from it in the last bit.)
  return std::nearbyint(x * 100.0) / 100.0;
}

void VqaAccumulator::Add(double accuracy, const std::string& answer_type,
                         const std::string& question_type) {
  all_.push_back(accuracy);
  by_type_[answer_type].push_back(accuracy);
  if (!question_type.empty()) by_question_type_[question_type].push_back(accuracy);
}

double VqaAccumulator::Overall() const {
  if (all_.empty()) return 0;
  double s = 0;
  for (double a : all_) s += a;
  return RoundTo2(100.0 * s / static_cast<double>(all_.size()));
}

std::map<std::string, double> VqaAccumulator::PerAnswerType() const {
  return RoundedMeans(by_type_);
}

std::map<std::string, double> VqaAccumulator::PerQuestionType() const {
  return RoundedMeans(by_question_type_);
}

// ---- A-OKVQA ----------------------------------------------------------------------------

double AokvqaMcAccuracy(std::string_view prediction, const std::vector<std::string>& choices,
                        int correct_choice_idx) {
  if (correct_choice_idx < 0 || correct_choice_idx >= static_cast<int>(choices.size())) return 0;
  return prediction == choices[correct_choice_idx] ? 1.0 : 0.0;
}

double AokvqaDaAccuracy(std::string_view prediction,
                        const std::vector<std::string>& direct_answers) {
  const auto matches = std::count(direct_answers.begin(), direct_answers.end(), prediction);
  return std::min(1.0, matches / 3.0);
}

// ---- captions ---------------------------------------------------------------------------

std::vector<std::string> PtbTokenize(std::string_view caption) {
  // Lower-case, and make the always-separate punctuation its own chunk.
  std::string text;
  for (size_t i = 0; i < caption.size(); ++i) {
    const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(caption[i])));
    const bool between_digits =
        i > 0 && i + 1 < caption.size() && IsDigit(caption[i - 1]) && IsDigit(caption[i + 1]);
    if (std::string_view(";!?\"()[]{}").find(c) != std::string_view::npos ||
        ((c == ',' || c == ':') && !between_digits)) {
      text += ' ';
      text += c;
      text += ' ';
    } else if (c == '\n' || c == '\t' || c == '\r') {
      text += ' ';
    } else {
      text += c;
    }
  }
  std::vector<std::string> raw;
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && text[i] == ' ') ++i;
    size_t j = i;
    while (j < text.size() && text[j] != ' ') ++j;
    std::string chunk = text.substr(i, j - i);
    i = j;
    if (chunk.empty()) continue;
    // Leading quotes, trailing periods and quotes come off as their own tokens.
    size_t b = 0;
    while (b < chunk.size() && (chunk[b] == '\'' || chunk[b] == '`')) ++b;
    if (b > 0) raw.push_back(chunk.substr(0, b));
    size_t e = chunk.size();
    while (e > b && (chunk[e - 1] == '.' || chunk[e - 1] == '\'' || chunk[e - 1] == '`')) --e;
    EmitWord(chunk.substr(b, e - b), raw);
    if (e < chunk.size()) raw.push_back(chunk.substr(e));
  }
  std::vector<std::string> out;
  for (std::string& t : raw) {
    if (!t.empty() && !IsDroppedToken(t)) out.push_back(std::move(t));
  }
  return out;
}

std::array<double, 4> CorpusBleu(const std::vector<std::vector<std::string>>& candidates,
                                 const std::vector<std::vector<std::vector<std::string>>>& refs) {
  // pycocoevalcap BleuScorer with option "closest".
  double test_len = 0, ref_len = 0;
  std::array<double, 4> guess{}, correct{};
  for (size_t i = 0; i < candidates.size() && i < refs.size(); ++i) {
    const std::vector<std::string>& cand = candidates[i];
    NGramCounts max_ref;
    int best_len = -1;
    for (const std::vector<std::string>& r : refs[i]) {
      for (const auto& [ng, c] : CountNGrams(r, 4)) max_ref[ng] = std::max(max_ref[ng], c);
      const int len = static_cast<int>(r.size());
      const int tl = static_cast<int>(cand.size());
      // min over (|len - testlen|, len): ties go to the shorter reference.
      if (best_len < 0 || std::abs(len - tl) < std::abs(best_len - tl) ||
          (std::abs(len - tl) == std::abs(best_len - tl) && len < best_len)) {
        best_len = len;
      }
    }
    test_len += cand.size();
    ref_len += std::max(best_len, 0);
    for (int k = 0; k < 4; ++k) guess[k] += std::max<int>(static_cast<int>(cand.size()) - k, 0);
    for (const auto& [ng, c] : CountNGrams(cand, 4)) {
      auto it = max_ref.find(ng);
      if (it != max_ref.end()) correct[ng.size() - 1] += std::min(c, it->second);
    }
  }
  constexpr double kTiny = 1e-15, kSmall = 1e-9;
  std::array<double, 4> bleu{};
  double prod = 1;
  for (int k = 0; k < 4; ++k) {
    prod *= (correct[k] + kTiny) / (guess[k] + kSmall);
    bleu[k] = std::pow(prod, 1.0 / (k + 1));
  }
  const double ratio = (test_len + kTiny) / (ref_len + kSmall);
  if (ratio < 1) {
    for (double& b : bleu) b *= std::exp(1 - 1 / ratio);
  }
  return bleu;
}

std::vector<double> CiderD(const std::vector<std::vector<std::string>>& candidates,
                           const std::vector<std::vector<std::vector<std::string>>>& refs) {
  // pycocoevalcap CiderScorer (which is CIDEr-D): n = 4, sigma = 6.
  constexpr int kN = 4;
  constexpr double kSigma = 6.0;
  const size_t n_items = std::min(candidates.size(), refs.size());
  std::vector<NGramCounts> cand_counts(n_items);
  std::vector<std::vector<NGramCounts>> ref_counts(n_items);
  std::map<std::vector<std::string>, int> doc_freq;
  for (size_t i = 0; i < n_items; ++i) {
    cand_counts[i] = CountNGrams(candidates[i], kN);
    std::set<std::vector<std::string>> seen;
    for (const auto& r : refs[i]) {
      ref_counts[i].push_back(CountNGrams(r, kN));
      for (const auto& [ng, c] : ref_counts[i].back()) seen.insert(ng);
    }
    for (const auto& ng : seen) ++doc_freq[ng];
  }
  const double log_ref_len = std::log(static_cast<double>(std::max<size_t>(n_items, 1)));

  struct Vec {
    std::array<std::map<std::vector<std::string>, double>, kN> v;
    std::array<double, kN> norm{};
    double length = 0;
  };
  auto to_vec = [&](const NGramCounts& counts) {
    Vec out;
    for (const auto& [ng, tf] : counts) {
      auto it = doc_freq.find(ng);
      const double df = std::log(std::max(1.0, it == doc_freq.end() ? 0.0 : it->second));
      const int n = static_cast<int>(ng.size()) - 1;
      const double w = tf * (log_ref_len - df);
      out.v[n][ng] = w;
      out.norm[n] += w * w;
      // The official code measures length in bigrams (its `if n == 1`); kept for fidelity.
      if (n == 1) out.length += tf;
    }
    for (double& x : out.norm) x = std::sqrt(x);
    return out;
  };

  std::vector<double> scores;
  for (size_t i = 0; i < n_items; ++i) {
    const Vec hyp = to_vec(cand_counts[i]);
    std::array<double, kN> total{};
    for (const NGramCounts& rc : ref_counts[i]) {
      const Vec ref = to_vec(rc);
      const double delta = hyp.length - ref.length;
      for (int n = 0; n < kN; ++n) {
        double val = 0;
        for (const auto& [ng, w] : hyp.v[n]) {
          auto it = ref.v[n].find(ng);
          if (it != ref.v[n].end()) val += std::min(w, it->second) * it->second;
        }
        if (hyp.norm[n] != 0 && ref.norm[n] != 0) val /= hyp.norm[n] * ref.norm[n];
        val *= std::exp(-(delta * delta) / (2 * kSigma * kSigma));
        total[n] += val;
      }
    }
    double mean = 0;
    for (double t : total) mean += t / kN;
    mean /= std::max<size_t>(ref_counts[i].size(), 1);
    scores.push_back(mean * 10.0);
  }
  return scores;
}

CaptionScores ScoreCaptions(const std::vector<std::string>& candidates,
                            const std::vector<std::vector<std::string>>& references) {
  CaptionScores out;
  if (candidates.empty()) return out;
  std::vector<std::vector<std::string>> cand;
  std::vector<std::vector<std::vector<std::string>>> refs;
  for (size_t i = 0; i < candidates.size() && i < references.size(); ++i) {
    cand.push_back(PtbTokenize(candidates[i]));
    refs.emplace_back();
    for (const std::string& r : references[i]) refs.back().push_back(PtbTokenize(r));
  }
  out.bleu = CorpusBleu(cand, refs);
  out.cider_per_item = CiderD(cand, refs);
  double s = 0;
  for (double c : out.cider_per_item) s += c;
  out.cider = out.cider_per_item.empty() ? 0 : s / out.cider_per_item.size();
  return out;
}

}  // namespace cdcca::datasets
