// Data distributions (domains) and the sample generator.
//
// A DomainSpec says what a stream of samples looks like: split, classes, colours,
// phrasings, image shift and severity, and the teacher's token-mask probability. Named
// presets give the paper's setting: a narrow student source domain, a broader teacher
// domain (all classes, all phrasings, some corruptions, token masking), a list of shifts
// held out from both, target domains per shift, the caption category split and a continual
// schedule over rounds.
//
// SampleGenerator turns (seed, index) into a sample, independently per index, so any
// sample can be regenerated on its own and data loading parallelises trivially.
#ifndef CDCCA_DATASETS_DOMAIN_H_
#define CDCCA_DATASETS_DOMAIN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "datasets/fashion_mnist.h"
#include "datasets/language.h"
#include "datasets/scene.h"
#include "datasets/shifts.h"

namespace cdcca::datasets {

struct ShiftSetting {
  ImageShift shift = ImageShift::kNone;
  int severity = 0;  // 1-5; 0 = drawn uniformly from 1-5 per sample
};

struct DomainSpec {
  std::string name;
  Split split = Split::kTrain;  // scenes use only this split's Fashion-MNIST images
  SceneOptions scene;           // canvas (default 64), item counts, classes, colours
  // Phrasing set(s) of the questions; one drawn per question. Default: base only.
  std::vector<Phrasing> phrasings = {Phrasing::kBase};
  // Question types asked per scene, one question each. Empty = all five.
  std::vector<QuestionType> question_types;
  // Image shifts; a shifted sample draws one uniformly. Empty = always clean.
  std::vector<ShiftSetting> shifts;
  double shift_probability = 1.0;  // chance that a sample is shifted at all, [0, 1]
  // For the teacher's training: the chance that each visual token is masked (the model
  // applies it; the generator only carries it). Default: 0.
  double token_mask_probability = 0.0;
};

// ---- presets ---------------------------------------------------------------------------

// The device student's source domain: in-domain classes (ClassesIn(kIn)), all colours,
// base phrasing, clean images.
DomainSpec StudentSourceDomain(Split split = Split::kTrain);
// The cloud teacher's broader domain: all classes, all phrasings, half the samples
// corrupted by one of TeacherSeenShifts() at severity 1-5, token masking 0.25.
DomainSpec TeacherDomain(Split split = Split::kTrain);
// Shifts the teacher trains on: fog, brightness, contrast, gaussian_noise, motion_blur.
const std::vector<ImageShift>& TeacherSeenShifts();
// Shifts held out from both teacher and student training: rain, snow, jpeg.
const std::vector<ImageShift>& HeldOutShifts();
// Target domains (evaluation/adaptation streams; default split test):
// the student's domain under one image shift (VQAv2-IDS style);
DomainSpec ImageShiftDomain(ImageShift shift, int severity, Split split = Split::kTest);
// all classes with paraphrased and knowledge questions (VQAv2 -> A-OKVQA style);
DomainSpec TextShiftDomain(Split split = Split::kTest);
// both at once;
DomainSpec MultimodalShiftDomain(ImageShift shift, int severity, Split split = Split::kTest);
// scenes whose items come only from one caption category (COCO -> nocaps style).
DomainSpec CategoryShiftDomain(CategoryDomain category, Split split = Split::kTest);
// Continual stream: round r (0-based) of `rounds`. Cycles image shifts (teacher-seen and
// held-out alternating) at severity 3, every third round multimodal, so each round
// differs from the last.
std::vector<DomainSpec> ContinualSchedule(int rounds, Split split = Split::kTest);

// ---- generation ------------------------------------------------------------------------

struct Sample {
  uint64_t index = 0;
  Scene scene;         // scene.image is the clean render
  Image image;         // what the model sees: scene.image after the shift (== clean if none)
  ShiftSetting shift;  // the applied shift; severity 0 when clean
  std::vector<VqaItem> questions;     // one per DomainSpec::question_types entry
  std::vector<std::string> captions;  // 5 references
};

class SampleGenerator {
 public:
  // `images` must hold spec.split's images (checked: test scenes never use train images)
  // and outlive the generator. Errors: INVALID_ARGUMENT for a split mismatch, an unknown
  // class or colour, an allowed class with no images, or a bad severity.
  static absl::StatusOr<SampleGenerator> Create(const ImageSet* images, DomainSpec spec,
                                                uint64_t seed);

  // Sample `index` of this (spec, seed): a pure function of them. Thread-safe (const,
  // no shared mutable state). ~0.2 ms for a clean 64x64 sample (docs/BENCHMARKS.md).
  Sample Generate(uint64_t index) const;

  // Renders only the shifted image and per-item truth (no text): the vision pretraining
  // path. Same scene and image as Generate(index).
  Sample GenerateImageOnly(uint64_t index) const;

  const DomainSpec& spec() const { return spec_; }
  uint64_t seed() const { return seed_; }

 private:
  SampleGenerator(const ImageSet* images, DomainSpec spec, uint64_t seed)
      : images_(images), spec_(std::move(spec)), seed_(seed) {}
  Sample Render(uint64_t index, bool with_text) const;

  const ImageSet* images_;  // not owned
  DomainSpec spec_;
  uint64_t seed_;
};

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_DOMAIN_H_
