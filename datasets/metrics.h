// Benchmark metrics, computed as the official evaluation code computes them:
// - VQA accuracy (VQAv2 `vqaEval.py`): answer normalization (punctuation, number words ->
//   digits, articles, contractions) and the mean over the 10 leave-one-out annotator subsets
//   of min(1, matches / 3);
// - A-OKVQA (`eval_predictions.py`): MC = exact match with the correct choice; DA =
//   min(1, #direct answers equal to the prediction / 3), difficult questions excluded;
// - COCO caption evaluation (`pycocoevalcap`): PTB-style tokenization, corpus BLEU-1..4
//   with the closest reference length and brevity penalty, CIDEr-D (sigma 6, clipped
//   candidate counts, IDF over the evaluated references, x10).
// All functions are pure and thread-safe.
#ifndef CDCCA_DATASETS_METRICS_H_
#define CDCCA_DATASETS_METRICS_H_

#include <array>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace cdcca::datasets {

// ---- VQA -------------------------------------------------------------------------------

// vqaEval.processPunctuation: each of ; : / ' [ ] " ( ) = + \ _ > < @ ` , ? is deleted when
// it touches a space in the input (or the input has a digit,digit comma) and replaced by a
// space otherwise; then a '.' not followed by a digit is deleted (at most 32 of them, as the
// official code passes re.UNICODE as the count).
std::string VqaProcessPunctuation(std::string_view text);
// vqaEval.processDigitArticle: lower-case, split on whitespace, number words "none".."ten"
// -> digits, drop a/an/the, expand the official contractions table, join with spaces.
std::string VqaProcessDigitArticle(std::string_view text);
// What the official code does to a predicted answer: newlines/tabs -> spaces, trim,
// punctuation, digits/articles.
std::string VqaNormalizeAnswer(std::string_view answer);

// Accuracy in [0, 1] of one predicted answer against the annotators' answers (10 in
// VQAv2): the prediction is normalized; the ground truth gets punctuation processing only,
// and only when the annotators disagree, as in the official code (so an all-identical
// ground truth is compared verbatim). Mean over the leave-one-out subsets of
// min(1, matches / 3). 0 if `gt_answers` is empty.
double VqaAccuracy(std::string_view prediction, const std::vector<std::string>& gt_answers);

// Python's round(x, 2) for the percentages the official code reports (half to even on the
// decimal value; exact ties are rare in practice).
double RoundTo2(double x);

// Accumulates per-question accuracies into the official report.
class VqaAccumulator {
 public:
  void Add(double accuracy, const std::string& answer_type);
  int count() const { return static_cast<int>(all_.size()); }
  // Percentages rounded to 2 decimals; 0 for no questions.
  double Overall() const;
  std::map<std::string, double> PerAnswerType() const;

 private:
  std::vector<double> all_;
  std::map<std::string, std::vector<double>> by_type_;
};

// ---- A-OKVQA ---------------------------------------------------------------------------

// 1 if `prediction` equals choices[correct_choice_idx], else 0 (exact string match).
double AokvqaMcAccuracy(std::string_view prediction, const std::vector<std::string>& choices,
                        int correct_choice_idx);
// min(1, #{direct answers == prediction} / 3), exact string match, no normalization.
double AokvqaDaAccuracy(std::string_view prediction,
                        const std::vector<std::string>& direct_answers);

// ---- captions --------------------------------------------------------------------------

// PTB-style tokenization as the COCO caption code applies it (Stanford PTBTokenizer, then
// lower-casing and removal of punctuation tokens): splits punctuation off words, splits
// clitics ("don't" -> "do", "n't"; "dog's" -> "dog", "'s"), drops the tokens
// '' ' `` ` . ? ! , : - -- ... ; and brackets. A faithful re-implementation of the rules
// that matter for caption text, not of all of CoreNLP.
std::vector<std::string> PtbTokenize(std::string_view caption);

struct CaptionScores {
  std::array<double, 4> bleu{};        // BLEU-1..4 in [0, 1]
  double cider = 0;                    // CIDEr-D (already x10, as COCO reports it)
  std::vector<double> cider_per_item;  // per candidate
};

// Scores candidates[i] against references[i] (each >= 1 reference). Inputs are raw
// strings; both sides go through PtbTokenize. Empty input gives all zeros.
CaptionScores ScoreCaptions(const std::vector<std::string>& candidates,
                            const std::vector<std::vector<std::string>>& references);

// The same on already tokenized text (tokens joined by single spaces).
std::array<double, 4> CorpusBleu(const std::vector<std::vector<std::string>>& candidates,
                                 const std::vector<std::vector<std::vector<std::string>>>& refs);
std::vector<double> CiderD(const std::vector<std::vector<std::string>>& candidates,
                           const std::vector<std::vector<std::vector<std::string>>>& refs);

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_METRICS_H_
