// Benchmark metrics, computed as the official evaluation code computes them:
// - VQA accuracy (VQAv2 `vqaEval.py`, 2021 revision): answers stripped, then normalized
//   (punctuation, number words -> digits, articles, contractions) only where the annotators
//   disagree, and the mean over the 10 leave-one-out annotator subsets of min(1, matches / 3);
// - A-OKVQA (`eval_predictions.py`): MC = exact match with the correct choice; DA =
//   min(1, #direct answers equal to the prediction / 3), difficult questions excluded; the
//   percentages are not rounded;
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
//
// The official code followed is GT-Vision-Lab/VQA PythonEvaluationTools/vqaEvaluation/
// vqaEval.py as of its 2021 commit "Fixed processing answers bug" (docs/DATASETS.md).

// vqaEval.processPunctuation: each of  ; / [ ] " { } ( ) = + \ _ - > < @ ` , ? !  is deleted
// when it touches a space somewhere in the input (or the input holds a digit,digit comma
// anywhere) and replaced by a space otherwise; then a '.' not followed by a digit is deleted
// (at most 32 of them: the official code passes re.UNICODE, 32, as the count). The official
// periodStrip pattern "(?!<=\d)(\.)(?!\d)" spells a look-behind as a look-ahead for the
// text "<=digit", which never matches at a '.', so a period after a digit is deleted too
// ("2." -> "2"); only a period before a digit stays ("2.5"). ':' and "'" are kept.
// Digits are ASCII digits (Python's \d also takes other Unicode decimal digits).
std::string VqaProcessPunctuation(std::string_view text);
// vqaEval.processDigitArticle: lower-case, split on whitespace (Python's str.split()), the
// manualMap number words "none", "zero".."ten" -> digits, drop the articles a/an/the,
// replace words found in the official contractions table, join with single spaces.
// Lower-casing covers ASCII and Latin-1 letters (Python lowers every Unicode letter).
std::string VqaProcessDigitArticle(std::string_view text);
// What the official code does to every answer first: newlines and tabs -> spaces, then
// Python's str.strip() (surrounding whitespace, Unicode spaces included).
std::string VqaStripAnswer(std::string_view answer);
// The full normalization (strip, punctuation, digits/articles) that the official code
// applies to the prediction and the ground truth of a question whose annotators disagree.
std::string VqaNormalizeAnswer(std::string_view answer);

// Accuracy in [0, 1] of one predicted answer against the annotators' answers (10 in
// VQAv2), as vqaEval.evaluate computes it: every answer and the prediction are stripped
// (VqaStripAnswer); then, only when the stripped ground-truth answers are not all
// identical, both the ground truth and the prediction are normalized (VqaNormalizeAnswer);
// a unanimous ground truth and its prediction are compared as stripped, so case and
// punctuation count there. The result is the mean over the leave-one-out subsets of
// min(1, exact matches among the other answers / 3). 0 if `gt_answers` is empty.
double VqaAccuracy(std::string_view prediction, const std::vector<std::string>& gt_answers);

// Python's round(x, 2) for the percentages the official code reports (half to even on the
// decimal value; exact ties are rare in practice).
double RoundTo2(double x);

// Accumulates per-question accuracies into the official report (vqaEval.setAccuracy): the
// overall mean and the means per answer type and per question type, each as a percentage
// rounded to 2 decimals after averaging the unrounded per-question accuracies.
class VqaAccumulator {
 public:
  // `question_type` empty: the question counts in no per-question-type mean.
  void Add(double accuracy, const std::string& answer_type,
           const std::string& question_type = "");
  int count() const { return static_cast<int>(all_.size()); }
  // Percentages rounded to 2 decimals; 0 for no questions.
  double Overall() const;
  std::map<std::string, double> PerAnswerType() const;
  std::map<std::string, double> PerQuestionType() const;

 private:
  std::vector<double> all_;
  std::map<std::string, std::vector<double>> by_type_;
  std::map<std::string, std::vector<double>> by_question_type_;
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
