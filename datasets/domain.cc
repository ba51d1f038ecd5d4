#include "datasets/domain.h"

#include "absl/strings/str_cat.h"
#include "datasets/random.h"

namespace cdcca::datasets {
namespace {

// absl::string_view is not std::string_view in every Abseil build (Debian's is not).
absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Sub-stream tags: scene layout, shift, text are drawn from independent streams so that,
// e.g., changing the phrasing does not move the items.
constexpr uint64_t kSceneStream = 1, kShiftStream = 2, kTextStream = 3;

std::vector<QuestionType> AllQuestionTypes() {
  return {QuestionType::kWhat, QuestionType::kColor, QuestionType::kCount, QuestionType::kWhere,
          QuestionType::kExists};
}

}  // namespace

const std::vector<ImageShift>& TeacherSeenShifts() {
  static const std::vector<ImageShift> kSeen = {ImageShift::kFog, ImageShift::kBrightness,
                                                ImageShift::kContrast, ImageShift::kGaussianNoise,
                                                ImageShift::kMotionBlur};
  return kSeen;
}

const std::vector<ImageShift>& HeldOutShifts() {
  static const std::vector<ImageShift> kHeldOut = {ImageShift::kRain, ImageShift::kSnow,
                                                   ImageShift::kJpeg};
  return kHeldOut;
}

DomainSpec StudentSourceDomain(Split split) {
  DomainSpec d;
  d.name = "student-source";
  d.split = split;
  d.scene.classes = ClassesIn(CategoryDomain::kIn);
  return d;
}

DomainSpec TeacherDomain(Split split) {
  DomainSpec d;
  d.name = "teacher";
  d.split = split;
  d.phrasings = {Phrasing::kBase, Phrasing::kParaphrase, Phrasing::kKnowledge};
  for (ImageShift s : TeacherSeenShifts()) d.shifts.push_back({s, 0});
  d.shift_probability = 0.5;
  d.token_mask_probability = 0.25;
  return d;
}

DomainSpec ImageShiftDomain(ImageShift shift, int severity, Split split) {
  DomainSpec d = StudentSourceDomain(split);
  d.name = absl::StrCat("image-", AV(ImageShiftName(shift)), "-", severity);
  d.shifts = {{shift, severity}};
  return d;
}

DomainSpec TextShiftDomain(Split split) {
  DomainSpec d = StudentSourceDomain(split);
  d.name = "text-knowledge";
  d.scene.classes.clear();
  d.phrasings = {Phrasing::kParaphrase, Phrasing::kKnowledge};
  return d;
}

DomainSpec MultimodalShiftDomain(ImageShift shift, int severity, Split split) {
  DomainSpec d = TextShiftDomain(split);
  d.name = absl::StrCat("multimodal-", AV(ImageShiftName(shift)), "-", severity);
  d.shifts = {{shift, severity}};
  return d;
}

DomainSpec CategoryShiftDomain(CategoryDomain category, Split split) {
  DomainSpec d = StudentSourceDomain(split);
  d.name = absl::StrCat("category-", AV(CategoryDomainName(category)));
  d.scene.classes = ClassesIn(category);
  return d;
}

std::vector<DomainSpec> ContinualSchedule(int rounds, Split split) {
  // Interleave teacher-seen and held-out shifts so both kinds recur over the stream.
  std::vector<ImageShift> order;
  const auto& seen = TeacherSeenShifts();
  const auto& held = HeldOutShifts();
  for (size_t i = 0; i < seen.size() || i < held.size(); ++i) {
    if (i < seen.size()) order.push_back(seen[i]);
    if (i < held.size()) order.push_back(held[i]);
  }
  std::vector<DomainSpec> out;
  for (int r = 0; r < rounds; ++r) {
    const ImageShift s = order[r % order.size()];
    DomainSpec d = r % 3 == 2 ? MultimodalShiftDomain(s, 3, split) : ImageShiftDomain(s, 3, split);
    d.name = absl::StrCat("round", r, "-", d.name);
    out.push_back(std::move(d));
  }
  return out;
}

absl::StatusOr<SampleGenerator> SampleGenerator::Create(const ImageSet* images, DomainSpec spec,
                                                        uint64_t seed) {
  if (images == nullptr) return absl::InvalidArgumentError("no image set");
  if (images->split != spec.split) {
    return absl::InvalidArgumentError(
        absl::StrCat("domain '", spec.name, "' wants the ", AV(SplitName(spec.split)),
                     " split but was given ", AV(SplitName(images->split)), " images"));
  }
  if (spec.scene.canvas < 16) {
    return absl::InvalidArgumentError(absl::StrCat("canvas ", spec.scene.canvas, " < 16"));
  }
  std::vector<int> classes = spec.scene.classes;
  if (classes.empty()) {
    for (int i = 0; i < kNumClasses; ++i) classes.push_back(i);
  }
  for (int c : classes) {
    if (c < 0 || c >= kNumClasses) {
      return absl::InvalidArgumentError(absl::StrCat("unknown class ", c));
    }
    if (images->by_class[c].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("class '", AV(ClassName(c)),
                                                     "' has no images in the ",
                                                     AV(SplitName(images->split)), " split"));
    }
  }
  for (int c : spec.scene.colors) {
    if (c < 0 || c >= kNumColors) {
      return absl::InvalidArgumentError(absl::StrCat("unknown colour ", c));
    }
  }
  for (const ShiftSetting& s : spec.shifts) {
    if (s.severity < 0 || s.severity > kMaxSeverity) {
      return absl::InvalidArgumentError(absl::StrCat("severity ", s.severity, " outside [0, 5]"));
    }
  }
  if (spec.phrasings.empty()) spec.phrasings = {Phrasing::kBase};
  if (spec.question_types.empty()) spec.question_types = AllQuestionTypes();
  return SampleGenerator(images, std::move(spec), seed);
}

Sample SampleGenerator::Render(uint64_t index, bool with_text) const {
  const uint64_t sample_seed = MixSeed(seed_, index);
  Sample s;
  s.index = index;
  Rng scene_rng(MixSeed(sample_seed, kSceneStream));
  s.scene = RenderScene(*images_, spec_.scene, scene_rng);
  s.image = s.scene.image;
  Rng shift_rng(MixSeed(sample_seed, kShiftStream));
  if (!spec_.shifts.empty() && shift_rng.Bernoulli(spec_.shift_probability)) {
    s.shift = spec_.shifts[shift_rng.UniformInt(0, static_cast<int>(spec_.shifts.size()) - 1)];
    if (s.shift.severity == 0) s.shift.severity = shift_rng.UniformInt(1, kMaxSeverity);
    // Severity was validated in Create, so this cannot fail.
    ApplyShift(s.shift.shift, s.shift.severity, shift_rng.Next(), s.image).IgnoreError();
  }
  if (!with_text) return s;
  Rng text_rng(MixSeed(sample_seed, kTextStream));
  for (QuestionType t : spec_.question_types) {
    const Phrasing p =
        spec_.phrasings[text_rng.UniformInt(0, static_cast<int>(spec_.phrasings.size()) - 1)];
    s.questions.push_back(
        MakeQuestion(s.scene, t, p, text_rng, spec_.scene.classes, spec_.scene.colors));
  }
  s.captions = MakeCaptions(s.scene, text_rng);
  return s;
}

Sample SampleGenerator::Generate(uint64_t index) const { return Render(index, true); }
Sample SampleGenerator::GenerateImageOnly(uint64_t index) const { return Render(index, false); }

}  // namespace cdcca::datasets
