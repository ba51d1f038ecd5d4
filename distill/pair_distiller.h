// AKD on Hugging Face teacher-student pairs: the cloud's job, teacher and student being Hub
// folders (BLIP-2, InstructBLIP, LLaVA; a cdcca family's folder is read as its BLIP-2 pair).
//
// The pair shares the vision tower, so the tokens a device uplinks (the tower's output,
// multimodal_model.h VisualTokenPasses::tokens, with the tokens UTS dropped marked absent) are what
// both models read. Their language models may differ in size and tokenizer: a sample's
// prompt travels as text, each side applies its own prompt template and tokenizer, and the
// teacher's greedy answer (the pseudo-label) is decoded to text and tokenized again by the
// student's tokenizer. Per job, once: the teacher answers every sample on the kept tokens and,
// teacher-forced on its answer, gives Q_t (Q-Former outputs / projected image tokens), R_t
// (the LM hidden state at RepresentationLayer() over the answer) and, with the KL term, its
// answer logits. Each step the student, teacher-forced on the pseudo-label, minimises
//   l_ce CE + l_query D(Q_t, phi(Q_s)) + l_repr D(R_t, psi(R_s)) + l_kl T^2 KL
// with D the configured feature term (distill/akd.h: MSE of layer-normed features for AKD,
// Pearson for PKD, channel-wise divergence for CWD, none for PL), phi and psi cloud-only linear
// maps from the student's widths to the teacher's (ridge-fitted at the first job, then kept).
//
// With identical tokenizers (same file bytes) the answer is the same token sequence on both
// sides: R is aligned per answer position and the KL term is available. With different
// tokenizers R is the mean over the answer positions and the KL term is left out whatever its
// weight, and the job says so (PairJobResult::notes).
//
// Thread-safety: one Run at a time per distiller; it trains the student in place. One
// RunTogether at a time per student, and no Run of its distillers meanwhile.
#ifndef CDCCA_DISTILL_HF_AKD_H_
#define CDCCA_DISTILL_HF_AKD_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "compress/named_tensors.h"
#include "compress/uplink_codec.h"
#include "distill/akd.h"
#include "distill/job.h"
#include "model/arch/multimodal_model.h"

namespace cdcca::distill {

// One side of the pair: a loaded model and its text codec. The codec is a pair of functions
// so this module needs no tokenizer library (the GPU build has none); programs bind
// tokenizer::Tokenizer's Encode / Decode (distill/pair_side.h).
struct PairSide {
  model::MultimodalModel* model = nullptr;  // not owned
  // Ids of a text; `special` adds the tokenizer's special tokens (BOS).
  std::function<absl::StatusOr<std::vector<int64_t>>(const std::string& text, bool special)> encode;
  // Text of ids, special tokens skipped.
  std::function<std::string(const std::vector<int64_t>& ids)> decode;
  // InstructBLIP: the Q-Former tokenizer's ids of the prompt (with specials); else empty.
  std::function<absl::StatusOr<std::vector<int64_t>>(const std::string& text)> qformer_encode;
  // Applied to a sample's prompt before tokenizing ({prompt} -> the text); "" = as it is.
  // A template holds the image placeholder where the model needs one (LLaVA's "<image>").
  std::function<absl::StatusOr<std::string>(const std::string& prompt)> format_prompt;
  // Identifies the tokenizer (e.g. a hash of tokenizer.json's bytes): equal ids = identical.
  std::string tokenizer_id;
  // The side runs its own vision tower on a sample's frame (PairSample::pixels) where the
  // sample has one, instead of reading its tokens: a student whose vision side trains
  // (model::AdapterOptions::lora_vision). The teacher reads the tokens.
  bool reads_pixels = false;
};

// A side whose "tokenizer" is the model's ids written as decimal text ("1 32000 450"): for
// programs where both sides share one vocabulary and no tokenizer library is at hand (the GPU
// build), so the KL term applies as for identical tokenizer files. `model` is not owned.
PairSide IdsAsTextSide(model::MultimodalModel* model);

// Whether a job on `device` with `options` multiplies its frozen base in FP8
// (JobOptions::fp8_base: "on", or "native" on a GPU that runs FP8 products natively).
bool UsesFp8Base(const JobOptions& options, const torch::Device& device);

// The LM ids `side` reads `prompt` as: its template, its tokenizer (with specials), the image
// placeholder expanded. Errors of the template or the codec.
absl::StatusOr<std::vector<int64_t>> SidePromptIds(const PairSide& side, const std::string& prompt);
// InstructBLIP's Q-Former ids of `prompt` (InvalidArgument without a Q-Former codec); empty
// for the other models.
absl::StatusOr<std::vector<int64_t>> SideQformerIds(const PairSide& side,
                                                    const std::string& prompt);

// One row of a training batch: a sample's visual input ([1, N, D] tokens and [1, N] present,
// on the model's device) and its ids (not owned; they outlive the call).
struct TextRow {
  torch::Tensor tokens, present;
  torch::Tensor pixels;  // [1, C, H, W] where the side reads the frame (every row or none)
  const std::vector<int64_t>* prompt;   // the expanded LM prompt
  const std::vector<int64_t>* answer;   // the answer, EOS included where the label has one
  const std::vector<int64_t>* qformer;  // InstructBLIP's Q-Former ids, else empty
};

// Rows of prompt + answer, left-padded (the Q-Former's ids right-padded, as the processor
// pads them), for ForwardTokens.
struct TextBatch {
  model::TokenInputs inputs;
  torch::Tensor targets;      // [B, T] int64: the next token where it is an answer token, else -1
  torch::Tensor answer_mask;  // [B, T] bool: positions holding answer tokens
  std::vector<int64_t> answer_lengths;
};
TextBatch CollateHfRows(const std::vector<TextRow>& rows, torch::Device device);

// One uplinked sample as the job reads it.
struct PairSample {
  torch::Tensor tokens;   // [N, D] float: the tower's output tokens (dropped ones: any value)
  torch::Tensor present;  // [N] bool, true = kept by UTS; undefined = all kept
  std::string prompt;     // the user's question, before any template
  // Every row of `tokens` is the frame's real token, the dropped ones too (the cloud
  // recomputed them from an uplinked frame): the teacher labels the sample and gives its
  // targets from all of them; the student trains on `present`. False: rows outside
  // `present` are placeholders and both models read only `present`.
  bool complete = false;
  // [C, H, W] float: the frame as the student's image processor gives it, where the sample
  // came with one; a side that reads pixels (PairSide::reads_pixels) runs its tower on it.
  torch::Tensor pixels;
  // Non-empty: the answer the job trains on instead of the teacher's greedy one (the
  // ground-truth arm of `cdcca adapt-eval`); the teacher's features and logits are
  // teacher-forced on it.
  std::string label;
};

// An uplinked sample (compress/uplink_codec.h) as the job reads it: its kept tokens in their
// rows of an [N, D] grid (the others zero and absent) and its prompt decoded by the student's
// codec (devices uplink the question in the student's ids). InvalidArgument for a sample
// whose features or indices do not match its grid.
absl::StatusOr<PairSample> SampleFromUplink(const compress::UplinkSample& sample,
                                            const PairSide& student);

// A complete sample (PairSample::complete): every token of the grid from `all_features`
// (grid_tokens x feature_dim values, row by row: the tower's output on the sample's frame),
// present = the sample's kept indices (the caller may widen it: the cloud's student reads all).
// InvalidArgument as SampleFromUplink, or for `all_features` of another size.
absl::StatusOr<PairSample> CompleteHfSample(const compress::UplinkSample& sample,
                                            const std::vector<float>& all_features,
                                            const PairSide& student);

struct PairJobResult {
  // The student's trainable set after the job (TrainableParameters order), fp32 CPU clones.
  model::NamedTensors trainable;
  JobStats stats;
  bool kl_used = false;
  std::vector<std::string> pseudo_labels;  // the teacher's answer per sample
  // What the job log should say beyond the numbers, e.g. why the KL term was left out.
  std::vector<std::string> notes;
};

// A job's loss terms, one value per step each, summarised (SummarizeLossTerm) in the order
// the first step gave them.
class LossTermHistory {
 public:
  void Add(const std::vector<std::pair<std::string, torch::Tensor>>& terms);
  std::vector<LossTerm> Summaries() const;

 private:
  std::vector<std::string> names_;
  std::map<std::string, std::vector<double>> values_;
};

class PairDistiller;

// One device's job of PairDistiller::RunTogether: what RunFrom takes, and the distiller that
// keeps the device's learner state. Not owned; they outlive the call.
struct PairJobInput {
  PairDistiller* distiller = nullptr;
  const compress::NamedTensors* mirror = nullptr;
  const std::vector<PairSample>* samples = nullptr;
};

class PairDistiller {
 public:
  // `config`: the learner (feature term and weights); `options`: steps, batch size, lr,
  // weight decay, seed, max_answer_tokens. The student's adapters must exist
  // (MultimodalModel::AddAdapters). InvalidArgument for a side without model or codec, or a
  // student without a trainable set.
  static absl::StatusOr<std::unique_ptr<PairDistiller>> Create(PairSide teacher, PairSide student,
                                                               const DistillConfig& config,
                                                               const JobOptions& options);
  ~PairDistiller();

  // Trains the student's trainable set in place on `samples` (at least one); phi and psi
  // persist to the next job. InvalidArgument for samples that do not fit either model;
  // Internal for a LibTorch error (the student may then hold a partly trained state: callers
  // that must keep it restore it from their mirror).
  absl::StatusOr<PairJobResult> Run(const std::vector<PairSample>& samples);

  // A device's round: the student starts from `mirror` (the device's exact trainable state,
  // fp32 CPU, copied into the student's own dtype), trains as Run does, and the result's
  // `trainable` is the mirror plus what training changed, measured in the student's dtype
  // (so a bf16 student's rounding of the mirror is not mistaken for a change). That is the
  // theta_new DWC encodes against the mirror (compress/delta_encoder.h). InvalidArgument for a
  // mirror that does not name the student's trainable set; errors as Run.
  absl::StatusOr<PairJobResult> RunFrom(const compress::NamedTensors& mirror,
                                        const std::vector<PairSample>& samples);

  // Several devices' rounds over one student base: jobs[i] as
  // jobs[i].distiller->RunFrom(*jobs[i].mirror, *jobs[i].samples), with result i equal to
  // that job's alone up to float rounding. Each job prepares as alone (its teacher pass, its
  // phi and psi), with the student holding its mirror. Then each step takes every running
  // job's batch, drawn as alone, into one forward pass of the shared student, in which each
  // row reads its own job's copy of the trainable set (model::RowSegments: the frozen base
  // runs once over all rows); each job's loss is its own rows' alone, and its optimizer steps
  // on the gradient of that loss alone. A job leaves the steps at its own max_steps or time
  // budget. One job runs as RunFrom does.
  //
  // Every distiller must hold the same student model and appear once (InvalidArgument
  // otherwise, for each job). A job whose samples do not fit fails alone, as its RunFrom
  // would; an error of a shared step fails every job of the group. The student's own
  // trainable set is left as one of the jobs' mirrors (callers copy theirs in, as for
  // RunFrom); its frozen base is untouched. FailedPrecondition for a student that reads a
  // member of its trainable set where rows cannot take their own job's values.
  static std::vector<absl::StatusOr<PairJobResult>> RunTogether(
      const std::vector<PairJobInput>& jobs);

  // Whether the two tokenizers are identical (the KL term and per-position R apply).
  bool same_tokenizer() const;

 private:
  struct State;
  struct Job;
  explicit PairDistiller(std::unique_ptr<State> state);
  // The phases of a job, commented where they are defined.
  absl::Status Prepare(const std::vector<PairSample>& samples, Job* job);
  void StartTraining(model::NamedTensors trainable, Job* job);
  static absl::Status Train(const std::vector<Job*>& jobs, bool segmented);
  void Finish(Job* job);
  absl::StatusOr<compress::NamedTensors> LoadMirror(const compress::NamedTensors& mirror);
  std::unique_ptr<State> state_;
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_HF_AKD_H_
