// Pretraining of a model family (family_model.h) on the scene benchmark (datasets/), in three
// stages:
//   1. vision: the shared ViT on the student's SOURCE domain, its patch tokens supervised per
//      grid cell on the scene ground truth (item class or empty, item colour); then frozen.
//   2. teacher: a BLIP-2 (family_model.h) or, for FamilyConfig::architecture "llava", a LLaVA
//      (llava_family.h) holding that ViT, everything above it trained on the teacher's
//      broader domain (all classes and phrasings, teacher-seen corruptions, random
//      visual-token dropping).
//   3. student: the same on the narrow source domain, from a cache of the ViT's tokens.
// Both end as Hugging Face folders (the student's, with the teacher's in teacher/), which
// every program then reads through LoadModel as it reads a downloaded checkpoint. Each
// stage checkpoints into the output directory (stages/, resume_*) so an interrupted run
// resumes where it stopped; data are index-addressed and every step reseeds, so a resumed run
// follows the same sample order. Runs on CUDA when available, else on all CPU cores.
#ifndef CDCCA_MODEL_FAMILY_PRETRAIN_H_
#define CDCCA_MODEL_FAMILY_PRETRAIN_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/family/config.h"

namespace cdcca::model {

// The "pretrain" section of a family config (configs/models/*.json).
struct StageSchedule {
  int steps = 0;
  int batch = 32;  // images (vision) or scenes (towers; 5 questions each) per step
  float lr = 1e-3f;
  int warmup = 50;  // linear warm-up steps, then cosine decay to lr / 20
  // Towers only: weight of an auxiliary loss in which the query-adapter output predicts
  // each cell's class and colour (heads used only while pretraining); 0 = off.
  float query_aux = 0.0f;
  // Teacher only: the share of steps' scenes whose visual tokens are partly dropped (25-75 %
  // of them) is 2 x token_mask; < 0 = the teacher domain's (datasets::TeacherDomain, 0.25).
  double token_mask = -1.0;
};
struct PretrainSchedule {
  uint64_t seed = 1;
  StageSchedule vision;
  StageSchedule teacher;
  StageSchedule student;
  int student_cache_scenes = 4096;  // scenes whose frozen-encoder tokens stage 3 cycles over
  int checkpoint_every = 200;       // steps between resume checkpoints
  int eval_scenes = 200;            // source-test scenes scored after each tower stage
  int max_answer_tokens = 4;        // generation limit when scoring
  // What the towers learn ("tasks": ["vqa", "caption"]): the scenes' VQA questions and/or
  // one caption per scene (prompt datasets::CaptionPrompt()). Default: VQA only.
  bool questions = true;
  bool captions = false;
};
absl::StatusOr<PretrainSchedule> ParsePretrainSchedule(const std::string& json_text);

struct PretrainOptions {
  std::string config_path;  // family config JSON
  std::string out_dir;      // checkpoint directory (created)
  std::string fashion_mnist_dir;
  int threads = 0;  // torch intra-op threads; 0 = automatic (model::IntraOpThreads)
  bool force_cpu = false;
  float scale_steps = 1.0f;  // multiplies every stage's steps (quick smoke runs)
  // > 0: train at most this many steps in this run (all stages together), then write the
  // stage's resume checkpoint and return ABORTED; a later run continues from there. For
  // splitting a long pretraining into sessions, and for testing the resume path.
  int stop_after_steps = 0;
};

// Runs (or resumes) the three stages and writes the family: the student's Hugging Face folder
// in options.out_dir, the teacher's in out_dir/teacher (SaveFamilyFolder), with the family
// config and a training record in the student's config.json ("cdcca" -> "family"). stages/ keeps
// the stage files (not part of the model). Progress goes to stderr.
absl::Status Pretrain(const PretrainOptions& options);

// How a training step pads its questions: lengths[i] = (prompt tokens, answer tokens) of
// question i, sorted by prompt length (ties by answer length). Splits them into at most
// max_groups consecutive groups, each padded to its own longest prompt and answer, so that
// the padded positions are fewest (the fewest groups among equals). Returns each group's
// first index, ascending, starting at 0; empty for no questions.
std::vector<size_t> PaddingGroups(const std::vector<std::pair<size_t, size_t>>& lengths,
                                  int max_groups);

// Source-domain and shifted VQA accuracy (DA, the official VQA metric against 10 direct
// answers) of a family checkpoint, as a markdown table: rows = source test, each image
// shift at severities 1/3/5, the text shift; columns = teacher fp32 and student
// fp32/int8/int4.
struct AccuracyOptions {
  std::string checkpoint_dir;
  std::string fashion_mnist_dir;
  int scenes = 200;  // per domain, 5 questions each
  int threads = 0;
  bool force_cpu = false;
  uint64_t seed = 7;
  // Each cell also gives, in parentheses, the accuracy estimated without answers from the
  // model's confidence (AtcEstimate at the AtcThreshold of its source-test row).
  bool estimates = false;
};
absl::StatusOr<std::string> AccuracyTable(const AccuracyOptions& options);

// Average thresholded confidence (Garg et al., 2022): the confidence threshold at which the
// share of `confidences` (in [0, 1], one per question) at or above it equals `accuracy` (in
// [0, 1]) on labelled data: the value below which round((1 - accuracy) n) of them lie.
double AtcThreshold(std::vector<double> confidences, double accuracy);
// The accuracy ATC estimates on unlabelled data: the share of `confidences` at or above
// `threshold`. 0 for none.
double AtcEstimate(const std::vector<double>& confidences, double threshold);

// Captioning scores of a family checkpoint trained with captions: BLEU-4 and CIDEr-D per
// caption category (datasets::CategoryShiftDomain: in-domain, near-domain, out-domain) and
// over all three, as a markdown table with the same columns as AccuracyTable.
absl::StatusOr<std::string> CaptionTable(const AccuracyOptions& options);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_PRETRAIN_H_
