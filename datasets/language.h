// The closed scene language: VQA questions from templates (what / color / count / where /
// exists) in three phrasing sets, multiple-choice options and ten direct answers per
// question (A-OKVQA style), several differently-worded reference captions per scene, and
// the in/near/out-domain class split used for the captioning category shift.
//
// Answers are short (1-2 words) and drawn from a small closed vocabulary
// (AnswerVocabulary()): class names, colour names, cell names, digits 0-4, yes, no.
#ifndef CDCCA_DATASETS_LANGUAGE_H_
#define CDCCA_DATASETS_LANGUAGE_H_

#include <string>
#include <string_view>
#include <vector>

#include "datasets/random.h"
#include "datasets/scene.h"

namespace cdcca::datasets {

enum class QuestionType { kWhat, kColor, kCount, kWhere, kExists };
inline constexpr int kNumQuestionTypes = 5;
std::string_view QuestionTypeName(QuestionType t);  // "what", "color", "count", ...

// Phrasing sets = the text shift. kBase is the student's source phrasing; kParaphrase
// rewords it; kKnowledge asks through world knowledge ("which item would you wear on your
// feet?"), like VQAv2 -> A-OKVQA.
enum class Phrasing { kBase, kParaphrase, kKnowledge };
std::string_view PhrasingName(Phrasing p);  // "base", "paraphrase", "knowledge"

// VQA answer types, named as the official VQA evaluation reports them.
enum class AnswerType { kYesNo, kNumber, kOther };
std::string_view AnswerTypeName(AnswerType t);  // "yes/no", "number", "other"

struct VqaItem {
  std::string question;  // lower-case, ends with '?' (or '.' for imperatives)
  std::string answer;    // canonical answer, in AnswerVocabulary()
  QuestionType type = QuestionType::kWhat;
  Phrasing phrasing = Phrasing::kBase;
  AnswerType answer_type = AnswerType::kOther;
  std::vector<std::string> choices;  // 4 multiple-choice options, `answer` among them
  int correct_choice = 0;            // index of `answer` in `choices`
  // 10 annotator answers (A-OKVQA / VQAv2 style): mostly `answer`, plus realistic variants
  // ("sneakers", "two", "upper left") and the odd disagreement.
  std::vector<std::string> direct_answers;
};

// One question of `type` about `scene` in `phrasing`. When the knowledge phrasing cannot
// single out an item (e.g. two coats), it falls back to the paraphrase set; `phrasing` of
// the result says which was used. Deterministic given `rng`.
// `classes` / `colors` restrict the names a question may mention that are not in the
// scene (exists/count distractors); empty = all.
VqaItem MakeQuestion(const Scene& scene, QuestionType type, Phrasing phrasing, Rng& rng,
                     const std::vector<int>& classes = {}, const std::vector<int>& colors = {});

// Five reference captions, each worded differently, e.g. "a red coat in the top left and
// a blue sandal in the bottom right." Deterministic given `rng`.
std::vector<std::string> MakeCaptions(const Scene& scene, Rng& rng);

// The prompt that asks a model for a caption: "what is in the picture?". Its words are in
// LanguageCorpus(), so checkpoints trained before captioning existed keep their vocabulary.
std::string_view CaptionPrompt();
// Tokens of the longest caption MakeCaptions can write, <eos> included (four items, the
// longest template): the generation limit that never cuts a caption short.
inline constexpr int kMaxCaptionTokens = 48;

// Category split for captioning (like COCO -> nocaps): in-domain classes the student's
// source domain contains, near-domain classes that resemble them (tops: shirt, coat), and
// out-of-domain classes it never sees (sandal, ankle boot).
enum class CategoryDomain { kIn, kNear, kOut };
std::string_view CategoryDomainName(CategoryDomain d);  // "in-domain", "near-domain", ...
CategoryDomain ClassCategory(int label);
std::vector<int> ClassesIn(CategoryDomain d);

// Every canonical answer, sorted.
const std::vector<std::string>& AnswerVocabulary();

// Every string the generator can emit words from (templates with their placeholders
// removed, fill-ins, variants, captions' connectives). The tokenizer's vocabulary is
// built from it, so any generated text tokenizes without <unk>.
std::vector<std::string> LanguageCorpus();

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_LANGUAGE_H_
