#include "datasets/language.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace cdcca::datasets {
namespace {

// absl::string_view is not std::string_view in every Abseil build (Debian's is not).
absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A piece of world knowledge: "would you <phrase>?" holds for exactly these classes.
// Every class has at least one fact of its own, so a knowledge question can nearly always
// single out an item.
struct Fact {
  std::string_view phrase;
  std::vector<int> classes;
};

const std::vector<Fact>& Facts() {
  // 0 t-shirt, 1 trouser, 2 pullover, 3 dress, 4 coat, 5 sandal, 6 shirt, 7 sneaker,
  // 8 bag, 9 ankle boot.
  static const std::vector<Fact> kFacts = {
      {"wear on your feet", {5, 7, 9}},
      {"wear on your legs", {1}},
      {"carry your things in", {8}},
      {"wear over other clothes when it is cold", {4}},
      {"wear to the beach", {5}},
      {"wear for running", {7}},
      {"wear on your upper body", {0, 2, 4, 6}},
      {"wear as a one-piece outfit", {3}},
      {"wear in the snow", {4, 9}},
      {"wear to cover your ankles", {9}},
      {"wear buttoned up to the collar", {6}},
      {"wear as a short-sleeved top", {0}},
      {"wear as a warm knitted top", {2}},
      {"pull over your head", {0, 2}},
  };
  return kFacts;
}

bool FactHolds(const Fact& f, int label) {
  return std::find(f.classes.begin(), f.classes.end(), label) != f.classes.end();
}

struct TemplateSet {
  std::vector<std::string_view> base, paraphrase, knowledge;
};

const TemplateSet& Templates(QuestionType t) {
  static const TemplateSet kWhat = {
      {"what is in the {pos}?"},
      {"which item is in the {pos} of the picture?", "what can you see in the {pos} corner?",
       "what is the object at the {pos}?"},
      {"which item would you {fact}?", "what in the picture would you {fact}?"}};
  static const TemplateSet kColor = {
      {"what color is the {ref}?"},
      {"what is the color of the {ref}?", "which color does the {ref} have?",
       "tell me the color of the {ref}."},
      {"what color is the item you would {fact}?", "which color has the thing you would {fact}?"}};
  static const TemplateSet kCount = {
      {"how many items are there?", "how many {color} items are there?"},
      {"what is the number of items in the picture?", "how many things can you see?",
       "count the {color} items.", "how many objects are {color}?"},
      {"how many items would you {fact}?", "how many of the things shown would you {fact}?"}};
  static const TemplateSet kWhere = {
      {"where is the {color} {class}?"},
      {"in which part of the picture is the {color} {class}?",
       "where can you find the {color} {class}?", "at which corner is the {color} {class}?"},
      {"where is the item you would {fact}?"}};
  static const TemplateSet kExists = {
      {"is there a {class}?", "is there a {color} {class}?"},
      {"does the picture contain a {class}?", "can you see a {color} {class}?",
       "is any {class} visible?"},
      {"is there anything you would {fact}?", "does the picture show something you would {fact}?"}};
  switch (t) {
    case QuestionType::kWhat:
      return kWhat;
    case QuestionType::kColor:
      return kColor;
    case QuestionType::kCount:
      return kCount;
    case QuestionType::kWhere:
      return kWhere;
    case QuestionType::kExists:
      return kExists;
  }
  return kWhat;
}

constexpr std::string_view kColorRefByCell = "item in the {pos}";

// Caption templates; {list} items are "a {color} {class}", {list_in} adds "in the {pos}",
// {list_at} adds "at the {pos}".
constexpr std::string_view kCaptionTemplates[] = {
    "{list_in}.",
    "{n} {items}: {list}.",
    "a picture of {list}.",
    "{list} on a {bg} background.",
    "there {be} {n} {items} on a {bg} background: {list_at}.",
};

constexpr std::string_view kCaptionPrompt = "what is in the picture?";

constexpr std::string_view kNumberWords[] = {"zero", "one", "two", "three", "four", "five"};
constexpr std::string_view kYesNoFillers[] = {"maybe", "cannot tell"};

const std::vector<std::string_view>& ClassVariants(int label) {
  static const std::vector<std::string_view> kVariants[kNumClasses] = {
      {"t shirt", "tshirt", "tee shirt", "shirt"},
      {"trousers", "pants", "jeans"},
      {"sweater", "jumper"},
      {"dresses", "gown"},
      {"jacket", "coats"},
      {"sandals", "flip flop"},
      {"blouse", "shirts", "button shirt"},
      {"sneakers", "shoe", "trainer"},
      {"handbag", "purse"},
      {"boot", "boots", "ankle boots"}};
  return kVariants[label];
}
const std::vector<std::string_view>& ColorVariants(int color) {
  static const std::vector<std::string_view> kVariants[kNumColors] = {
      {"crimson", "scarlet"}, {"amber", "dark orange"},    {"gold", "golden"},
      {"lime", "dark green"}, {"turquoise", "light blue"}, {"dark blue", "navy"},
      {"violet", "magenta"},  {"light gray", "silver"}};
  return kVariants[color];
}
const std::vector<std::string_view>& CellVariants(int cell) {
  static const std::vector<std::string_view> kVariants[kNumCells] = {
      {"upper left", "top-left", "left"},
      {"upper right", "top-right", "right"},
      {"lower left", "bottom-left", "left"},
      {"lower right", "bottom-right", "right"}};
  return kVariants[cell];
}

template <typename T>
const T& Pick(const std::vector<T>& v, Rng& rng) {
  return v[rng.UniformInt(0, static_cast<int>(v.size()) - 1)];
}

// "a" -> "an" before a vowel sound (the closed language has no "a one"-type exceptions
// other than "one-piece").
std::string FixArticles(const std::string& text) {
  std::vector<std::string> words = absl::StrSplit(text, ' ');
  for (size_t i = 0; i + 1 < words.size(); ++i) {
    const std::string& next = words[i + 1];
    if (words[i] == "a" && !next.empty() &&
        std::string_view("aeiou").find(next[0]) != std::string_view::npos &&
        next.rfind("one", 0) != 0) {
      words[i] = "an";
    }
  }
  return absl::StrJoin(words, " ");
}

std::string JoinList(const std::vector<std::string>& parts) {
  if (parts.size() <= 1) return parts.empty() ? "" : parts[0];
  return absl::StrCat(absl::StrJoin(parts.begin(), parts.end() - 1, ", "), " and ", parts.back());
}

std::vector<int> OrAll(const std::vector<int>& v, int n) {
  if (!v.empty()) return v;
  std::vector<int> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;
  return all;
}

int CountClass(const Scene& s, int label) {
  return static_cast<int>(std::count_if(s.items.begin(), s.items.end(),
                                        [&](const SceneItem& it) { return it.label == label; }));
}

// Draws the 4 MC choices: the answer, then distractors of the same kind, preferring values
// from the scene (the plausible confusions), without repeats.
void FillChoices(VqaItem& q, std::vector<std::string> preferred, std::vector<std::string> pool,
                 Rng& rng) {
  Shuffle(preferred.begin(), preferred.end(), rng);
  Shuffle(pool.begin(), pool.end(), rng);
  std::vector<std::string> choices = {q.answer};
  for (const auto* list : {&preferred, &pool}) {
    for (const std::string& c : *list) {
      if (choices.size() == 4) break;
      if (std::find(choices.begin(), choices.end(), c) == choices.end()) choices.push_back(c);
    }
  }
  Shuffle(choices.begin(), choices.end(), rng);
  q.correct_choice =
      static_cast<int>(std::find(choices.begin(), choices.end(), q.answer) - choices.begin());
  q.choices = std::move(choices);
}

// Ten annotator answers: 5-9 canonical, the rest realistic variants.
void FillDirectAnswers(VqaItem& q, const std::vector<std::string_view>& variants, Rng& rng) {
  const int canonical = rng.UniformInt(5, 9);
  q.direct_answers.assign(canonical, q.answer);
  while (q.direct_answers.size() < 10) {
    q.direct_answers.emplace_back(variants.empty() ? std::string_view(q.answer)
                                                   : Pick(variants, rng));
  }
  Shuffle(q.direct_answers.begin(), q.direct_answers.end(), rng);
}

std::vector<std::string> Names(const std::vector<int>& ids, std::string_view (*name)(int)) {
  std::vector<std::string> out;
  for (int i : ids) out.emplace_back(name(i));
  return out;
}

}  // namespace

std::string_view QuestionTypeName(QuestionType t) {
  constexpr std::string_view kNames[] = {"what", "color", "count", "where", "exists"};
  return kNames[static_cast<int>(t)];
}
std::string_view PhrasingName(Phrasing p) {
  constexpr std::string_view kNames[] = {"base", "paraphrase", "knowledge"};
  return kNames[static_cast<int>(p)];
}
std::string_view AnswerTypeName(AnswerType t) {
  constexpr std::string_view kNames[] = {"yes/no", "number", "other"};
  return kNames[static_cast<int>(t)];
}
std::string_view CategoryDomainName(CategoryDomain d) {
  constexpr std::string_view kNames[] = {"in-domain", "near-domain", "out-domain"};
  return kNames[static_cast<int>(d)];
}

CategoryDomain ClassCategory(int label) {
  switch (label) {
    case 4:  // coat
    case 6:  // shirt
      return CategoryDomain::kNear;
    case 5:  // sandal
    case 9:  // ankle boot
      return CategoryDomain::kOut;
    default:
      return CategoryDomain::kIn;
  }
}

std::vector<int> ClassesIn(CategoryDomain d) {
  std::vector<int> out;
  for (int i = 0; i < kNumClasses; ++i) {
    if (ClassCategory(i) == d) out.push_back(i);
  }
  return out;
}

VqaItem MakeQuestion(const Scene& scene, QuestionType type, Phrasing phrasing, Rng& rng,
                     const std::vector<int>& classes_in, const std::vector<int>& colors_in) {
  const std::vector<int> classes = OrAll(classes_in, kNumClasses);
  const std::vector<int> colors = OrAll(colors_in, kNumColors);
  VqaItem q;
  q.type = type;

  // Knowledge phrasing for what/color/where needs a fact true of exactly one item.
  const Fact* fact = nullptr;
  const SceneItem* target = nullptr;
  if (phrasing == Phrasing::kKnowledge &&
      (type == QuestionType::kWhat || type == QuestionType::kColor ||
       type == QuestionType::kWhere)) {
    std::vector<std::pair<const Fact*, const SceneItem*>> unique;
    for (const Fact& f : Facts()) {
      const SceneItem* match = nullptr;
      int matches = 0;
      for (const SceneItem& it : scene.items) {
        if (FactHolds(f, it.label)) {
          ++matches;
          match = &it;
        }
      }
      if (matches == 1) unique.emplace_back(&f, match);
    }
    if (unique.empty()) {
      phrasing = Phrasing::kParaphrase;
    } else {
      std::tie(fact, target) = Pick(unique, rng);
    }
  }
  q.phrasing = phrasing;
  const TemplateSet& set = Templates(type);
  const std::vector<std::string_view>& templates = phrasing == Phrasing::kBase ? set.base
                                                   : phrasing == Phrasing::kParaphrase
                                                       ? set.paraphrase
                                                       : set.knowledge;
  std::string text(Pick(templates, rng));
  if (target == nullptr && !scene.items.empty()) target = &Pick(scene.items, rng);
  if (scene.items.empty()) {
    static const SceneItem kNone;
    target = &kNone;
  }
  const bool unique_class = CountClass(scene, target->label) == 1;
  text = absl::StrReplaceAll(
      text, {{"{ref}", unique_class ? AV(ClassName(target->label)) : AV(kColorRefByCell)}});

  std::string cls(ClassName(target->label)), color(ColorName(target->color));
  std::vector<std::string_view> variants;
  std::vector<std::string> preferred, pool;
  switch (type) {
    case QuestionType::kWhat:
      q.answer = cls;
      variants = ClassVariants(target->label);
      for (const SceneItem& it : scene.items) preferred.emplace_back(ClassName(it.label));
      pool = Names(classes, ClassName);
      break;
    case QuestionType::kColor:
      q.answer = color;
      variants = ColorVariants(target->color);
      for (const SceneItem& it : scene.items) preferred.emplace_back(ColorName(it.color));
      pool = Names(colors, ColorName);
      break;
    case QuestionType::kWhere:
      q.answer = std::string(CellName(target->cell));
      variants = CellVariants(target->cell);
      pool = {"top left", "top right", "bottom left", "bottom right"};
      break;
    case QuestionType::kCount: {
      int count = static_cast<int>(scene.items.size());
      if (phrasing == Phrasing::kKnowledge) {
        fact = &Pick(Facts(), rng);
        count = static_cast<int>(
            std::count_if(scene.items.begin(), scene.items.end(),
                          [&](const SceneItem& it) { return FactHolds(*fact, it.label); }));
      } else if (text.find("{color}") != std::string::npos) {
        const int c = rng.Bernoulli(0.6) ? target->color : Pick(colors, rng);
        color = std::string(ColorName(c));
        count = static_cast<int>(std::count_if(scene.items.begin(), scene.items.end(),
                                               [&](const SceneItem& it) { return it.color == c; }));
      }
      q.answer = absl::StrCat(count);
      variants = {kNumberWords[count], kNumberWords[count],
                  kNumberWords[count + 1 <= 4 ? count + 1 : count - 1]};
      pool = {"0", "1", "2", "3", "4"};
      break;
    }
    case QuestionType::kExists: {
      bool yes = rng.Bernoulli(0.5);
      const bool with_color = text.find("{color}") != std::string::npos;
      if (phrasing == Phrasing::kKnowledge) {
        std::vector<const Fact*> hold, fail;
        for (const Fact& f : Facts()) {
          const bool any = std::any_of(scene.items.begin(), scene.items.end(),
                                       [&](const SceneItem& it) { return FactHolds(f, it.label); });
          (any ? hold : fail).push_back(&f);
        }
        if (fail.empty()) yes = true;
        if (hold.empty()) yes = false;
        fact = yes ? Pick(hold, rng) : Pick(fail, rng);
      } else if (!yes) {
        // An absent class (or colour-class pair) from the domain's names; if every one is
        // present, the answer is yes after all.
        std::vector<std::pair<int, int>> absent;
        for (int c : classes) {
          if (!with_color) {
            if (CountClass(scene, c) == 0) absent.emplace_back(c, target->color);
            continue;
          }
          for (int k : colors) {
            if (std::none_of(scene.items.begin(), scene.items.end(),
                             [&](const SceneItem& it) { return it.label == c && it.color == k; })) {
              absent.emplace_back(c, k);
            }
          }
        }
        if (absent.empty()) {
          yes = true;
        } else {
          const auto [c, k] = Pick(absent, rng);
          cls = std::string(ClassName(c));
          color = std::string(ColorName(k));
        }
      }
      q.answer = yes ? "yes" : "no";
      variants = {yes ? "no" : "yes"};
      pool = {"yes", "no", std::string(kYesNoFillers[0]), std::string(kYesNoFillers[1])};
      break;
    }
  }
  q.answer_type = type == QuestionType::kExists  ? AnswerType::kYesNo
                  : type == QuestionType::kCount ? AnswerType::kNumber
                                                 : AnswerType::kOther;
  text = absl::StrReplaceAll(text, {{"{class}", cls},
                                    {"{color}", color},
                                    {"{pos}", AV(CellName(target->cell))},
                                    {"{fact}", fact ? AV(fact->phrase) : absl::string_view()}});
  q.question = FixArticles(text);
  FillChoices(q, std::move(preferred), std::move(pool), rng);
  // Disagreeing annotators are rarer on yes/no: keep at most 2 of the 10.
  if (q.answer_type == AnswerType::kYesNo) {
    q.direct_answers.assign(10, q.answer);
    const int flips = rng.UniformInt(0, 2);
    for (int i = 0; i < flips; ++i) q.direct_answers[rng.UniformInt(0, 9)] = variants[0];
  } else {
    FillDirectAnswers(q, variants, rng);
  }
  return q;
}

std::vector<std::string> MakeCaptions(const Scene& scene, Rng& rng) {
  std::vector<std::string> plain, in, at;
  for (const SceneItem& it : scene.items) {
    const std::string base =
        absl::StrCat("a ", AV(ColorName(it.color)), " ", AV(ClassName(it.label)));
    plain.push_back(base);
    in.push_back(absl::StrCat(base, " in the ", AV(CellName(it.cell))));
    at.push_back(absl::StrCat(base, " at the ", AV(CellName(it.cell))));
  }
  // Random listing order per caption, so references differ in word order too.
  auto shuffled = [&](std::vector<std::string> v) {
    Shuffle(v.begin(), v.end(), rng);
    return JoinList(v);
  };
  const size_t n = scene.items.size();
  std::vector<std::string> captions;
  for (std::string_view t : kCaptionTemplates) {
    const std::string list_in = shuffled(in), list_at = shuffled(at), list = shuffled(plain);
    std::string c = absl::StrReplaceAll(AV(t), {{"{list_in}", list_in},
                                                {"{list_at}", list_at},
                                                {"{list}", list},
                                                {"{n}", AV(kNumberWords[std::min<size_t>(n, 5)])},
                                                {"{items}", n == 1 ? "item" : "items"},
                                                {"{be}", n == 1 ? "is" : "are"},
                                                {"{bg}", AV(BackgroundName(scene.background))}});
    captions.push_back(FixArticles(c));
  }
  return captions;
}

std::string_view CaptionPrompt() { return kCaptionPrompt; }

const std::vector<std::string>& AnswerVocabulary() {
  static const std::vector<std::string> kVocab = [] {
    std::set<std::string> s = {"yes", "no", "0", "1", "2", "3", "4"};
    for (int i = 0; i < kNumClasses; ++i) s.emplace(ClassName(i));
    for (int i = 0; i < kNumColors; ++i) s.emplace(ColorName(i));
    for (int i = 0; i < kNumCells; ++i) s.emplace(CellName(i));
    return std::vector<std::string>(s.begin(), s.end());
  }();
  return kVocab;
}

std::vector<std::string> LanguageCorpus() {
  std::vector<std::string> out = AnswerVocabulary();
  for (int t = 0; t < kNumQuestionTypes; ++t) {
    const TemplateSet& set = Templates(static_cast<QuestionType>(t));
    for (const auto* list : {&set.base, &set.paraphrase, &set.knowledge}) {
      for (std::string_view s : *list) out.emplace_back(s);
    }
  }
  out.emplace_back(kColorRefByCell);
  for (std::string_view s : kCaptionTemplates) out.emplace_back(s);
  for (const Fact& f : Facts()) out.emplace_back(f.phrase);
  for (std::string_view s : kNumberWords) out.emplace_back(s);
  for (std::string_view s : kYesNoFillers) out.emplace_back(s);
  for (int i = 0; i < kNumBackgrounds; ++i) out.emplace_back(BackgroundName(Background(i)));
  for (int i = 0; i < kNumClasses; ++i) {
    for (std::string_view v : ClassVariants(i)) out.emplace_back(v);
  }
  for (int i = 0; i < kNumColors; ++i) {
    for (std::string_view v : ColorVariants(i)) out.emplace_back(v);
  }
  for (int i = 0; i < kNumCells; ++i) {
    for (std::string_view v : CellVariants(i)) out.emplace_back(v);
  }
  // Connectives the code adds outside the templates.
  for (std::string_view s :
       {"a", "an", "and", ",", "in the", "at the", "item", "items", "is", "are"}) {
    out.emplace_back(s);
  }
  return out;
}

}  // namespace cdcca::datasets
