#include "distill/pair_distiller.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "distill/adamw.h"
#include "distill/greedy_answers.h"
#include "distill/losses.h"
#include "model/arch/decoder_lm.h"
#include "model/arch/layers.h"
#include "model/arch/row_segments.h"
#include "model/runtime/fp8_product.h"
#include "model/runtime/gpu_memory.h"

namespace cdcca::distill {

absl::StatusOr<std::vector<int64_t>> SidePromptIds(const PairSide& side,
                                                   const std::string& prompt) {
  std::string text = prompt;
  if (side.format_prompt) {
    absl::StatusOr<std::string> f = side.format_prompt(prompt);
    if (!f.ok()) return f.status();
    text = *f;
  }
  absl::StatusOr<std::vector<int64_t>> ids = side.encode(text, /*special=*/true);
  if (!ids.ok()) return ids.status();
  return side.model->ExpandImageTokens(*ids);
}

absl::StatusOr<std::vector<int64_t>> SideQformerIds(const PairSide& side,
                                                    const std::string& prompt) {
  if (side.model->model_type() != "instructblip") return std::vector<int64_t>{};
  if (!side.qformer_encode) {
    return absl::InvalidArgumentError("an InstructBLIP side needs its Q-Former tokenizer");
  }
  return side.qformer_encode(prompt);
}

TextBatch CollateHfRows(const std::vector<TextRow>& rows, torch::Device device) {
  int64_t width = 0, q_width = 0;
  for (const TextRow& r : rows) {
    width = std::max<int64_t>(width, r.prompt->size() + r.answer->size());
    q_width = std::max<int64_t>(q_width, r.qformer->size());
  }
  const int64_t b = static_cast<int64_t>(rows.size());
  torch::Tensor ids = torch::zeros({b, width}, torch::kLong);
  torch::Tensor mask = torch::zeros({b, width}, torch::kLong);
  torch::Tensor targets = torch::full({b, width}, -1, torch::kLong);
  torch::Tensor answer_mask = torch::zeros({b, width}, torch::kBool);
  torch::Tensor q_ids = torch::zeros({b, q_width}, torch::kLong);
  torch::Tensor q_mask = torch::zeros({b, q_width}, torch::kLong);
  TextBatch batch;
  std::vector<torch::Tensor> tokens, present;
  std::vector<int64_t> prompt_lengths;
  for (int64_t r = 0; r < b; ++r) {
    const TextRow& x = rows[static_cast<size_t>(r)];
    std::vector<int64_t> row = *x.prompt;
    row.insert(row.end(), x.answer->begin(), x.answer->end());
    const int64_t n = static_cast<int64_t>(row.size());
    const int64_t pad = width - n;
    const int64_t a = static_cast<int64_t>(x.answer->size());
    ids[r].narrow(0, pad, n).copy_(torch::tensor(row, torch::kLong));
    mask[r].narrow(0, pad, n).fill_(1);
    // logits at position t predict token t + 1: the answer's predictors are the a positions
    // before the last.
    targets[r].narrow(0, width - a - 1, a).copy_(torch::tensor(*x.answer, torch::kLong));
    answer_mask[r].narrow(0, width - a, a).fill_(true);
    if (!x.qformer->empty()) {
      const int64_t qn = static_cast<int64_t>(x.qformer->size());
      // The Q-Former reads its instruction right-padded, as the processor pads it.
      q_ids[r].narrow(0, 0, qn).copy_(torch::tensor(*x.qformer, torch::kLong));
      q_mask[r].narrow(0, 0, qn).fill_(1);
    }
    tokens.push_back(x.tokens);
    present.push_back(x.present);
    prompt_lengths.push_back(static_cast<int64_t>(x.prompt->size()));
    batch.answer_lengths.push_back(a);
  }
  batch.inputs.visual_tokens = torch::cat(tokens);
  batch.inputs.visual_present = torch::cat(present);
  if (rows[0].pixels.defined()) {
    std::vector<torch::Tensor> pixels;
    for (const TextRow& x : rows) pixels.push_back(x.pixels);
    batch.inputs.pixel_values = torch::cat(pixels);
  }
  batch.inputs.input_ids = ids.to(device);
  batch.inputs.attention_mask = mask.to(device);
  batch.inputs.prompt_lengths = torch::tensor(prompt_lengths, torch::kLong).to(device);
  if (q_width > 0) {
    batch.inputs.qformer_input_ids = q_ids.to(device);
    batch.inputs.qformer_attention_mask = q_mask.to(device);
  }
  batch.targets = targets.to(device);
  batch.answer_mask = answer_mask.to(device);
  return batch;
}

void LossTermHistory::Add(const std::vector<std::pair<std::string, torch::Tensor>>& terms) {
  if (names_.empty()) {
    for (const auto& [name, t] : terms) names_.push_back(name);
  }
  for (const auto& [name, t] : terms) values_[name].push_back(t.item<double>());
}

std::vector<LossTerm> LossTermHistory::Summaries() const {
  std::vector<LossTerm> out;
  for (const std::string& name : names_) out.push_back(SummarizeLossTerm(name, values_.at(name)));
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;

// What the job keeps per sample: the student's text and the teacher's targets.
struct PreparedSample {
  torch::Tensor tokens;                   // [1, N, D] on the job device
  torch::Tensor present;                  // [1, N] bool
  torch::Tensor pixels;                   // [1, C, H, W] where the student reads the frame
  std::vector<int64_t> student_prompt;    // expanded LM ids
  std::vector<int64_t> student_answer;    // pseudo-label ids + eos
  std::vector<int64_t> student_qformer;   // InstructBLIP students
  torch::Tensor teacher_queries;          // [L, Hq_t]
  torch::Tensor teacher_queries_present;  // [L] bool
  torch::Tensor teacher_repr;             // [P, H_t] (P = answer length, or 1 when pooled)
  torch::Tensor teacher_logits;           // [P, V] when the KL term runs
  // Geometric mean of the teacher's probabilities of its answer's tokens (teacher-forced).
  double teacher_confidence = 1.0;
};

int64_t FirstEos(const model::MultimodalModel& m) {
  const std::vector<int64_t> eos = m.eos_token_ids();
  return eos.empty() ? -1 : eos[0];
}

torch::Tensor Row(const torch::Tensor& t) { return t.unsqueeze(0); }

// `batch` with its logits asked for at the answers' predictors alone (TokenInputs::
// logits_tail): the last A + 1 positions of its left-padded rows, A its longest answer. The
// losses read no other position, and the LM head's product and the logits' memory shrink
// from every position to those.
TextBatch AtAnswers(TextBatch batch) {
  int64_t longest = 0;
  for (int64_t a : batch.answer_lengths) longest = std::max(longest, a);
  batch.inputs.logits_tail = longest + 1;
  return batch;
}

// A sample's present mask as a [1, N] bool row on `device` (all present when undefined).
torch::Tensor PresentRow(const PairSample& sample, torch::Device device) {
  return sample.present.defined()
             ? Row(sample.present.to(device, torch::kBool))
             : torch::ones({1, sample.tokens.size(0)},
                           torch::TensorOptions().dtype(torch::kBool).device(device));
}

// A sample's LM prompt ids in `side` (its template and tokenizer) and InstructBLIP's Q-Former
// ids (empty for the other models): what a side's batches read (CollateSide).
struct SidePrompt {
  std::vector<int64_t> lm, qformer;
};
absl::StatusOr<SidePrompt> SidePromptOf(const PairSide& side, const std::string& prompt) {
  absl::StatusOr<std::vector<int64_t>> lm = SidePromptIds(side, prompt);
  if (!lm.ok()) return lm.status();
  absl::StatusOr<std::vector<int64_t>> qformer = SideQformerIds(side, prompt);
  if (!qformer.ok()) return qformer.status();
  return SidePrompt{*std::move(lm), *std::move(qformer)};
}

// `samples` as one left-padded batch of `side` (CollateHfRows): each row the sample's prompt
// in the side's template and tokenizer, its present tokens, its frame where the side reads
// pixels, then answers[i] (`answers` null: the prompts alone, as generation takes them).
// Errors name a sample "sample <names[i]>" (`names` null: "sample <i>").
struct SideBatch {
  std::vector<SidePrompt> prompts;
  TextBatch batch;
};
absl::StatusOr<SideBatch> CollateSide(const PairSide& side,
                                      const std::vector<const PairSample*>& samples,
                                      const std::vector<std::vector<int64_t>>* answers,
                                      const std::vector<size_t>* names = nullptr) {
  const torch::Device device = side.model->device();
  auto name = [names](size_t i) { return names != nullptr ? (*names)[i] : i; };
  SideBatch out;
  out.prompts.reserve(samples.size());  // the rows point into it
  const bool pixels = side.reads_pixels && samples[0]->pixels.defined();
  const std::vector<int64_t> none;
  std::vector<TextRow> rows;
  for (size_t i = 0; i < samples.size(); ++i) {
    const PairSample& s = *samples[i];
    absl::StatusOr<SidePrompt> prompt = SidePromptOf(side, s.prompt);
    if (!prompt.ok()) {
      return absl::Status(prompt.status().code(),
                          absl::StrCat("sample ", name(i), ": ", prompt.status().message()));
    }
    if (side.reads_pixels && s.pixels.defined() != pixels) {
      return absl::InvalidArgumentError(
          absl::StrCat("sample ", name(i),
                       ": a side that reads frames reads every sample's frame "
                       "or none"));
    }
    out.prompts.push_back(*std::move(prompt));
    rows.push_back({Row(s.tokens.to(device, torch::kFloat)), PresentRow(s, device),
                    pixels ? Row(s.pixels.to(device, torch::kFloat)) : torch::Tensor(),
                    &out.prompts.back().lm, answers != nullptr ? &(*answers)[i] : &none,
                    &out.prompts.back().qformer});
  }
  out.batch = CollateHfRows(rows, device);
  if (answers == nullptr) out.batch.inputs.prompt_lengths = torch::Tensor();
  return out;
}

// Where `side` reads frames, `samples`' indices with a frame and those without (a batch feeds
// frames to every row or to none); else all of them, one group.
std::vector<std::vector<size_t>> FrameGroups(const PairSide& side,
                                             const std::vector<const PairSample*>& samples) {
  std::vector<size_t> with, without;
  for (size_t i = 0; i < samples.size(); ++i) {
    (side.reads_pixels && samples[i]->pixels.defined() ? with : without).push_back(i);
  }
  std::vector<std::vector<size_t>> groups;
  for (std::vector<size_t>* g : {&with, &without}) {
    if (!g->empty()) groups.push_back(std::move(*g));
  }
  return groups;
}

// A step's (or the preparation's) phases timed where `on` (JobOptions::phase_steps): Mark(name)
// synchronizes the device and adds the time since the previous mark (or Start) to the phase `name`.
class PhaseClock {
 public:
  PhaseClock(torch::Device device, bool on) : device_(device), on_(on) {}
  void Start() {
    if (!on_) return;
    Sync();
    last_ = Clock::now();
  }
  void Mark(const char* name) {
    if (!on_) return;
    Sync();
    const Clock::time_point now = Clock::now();
    phases_.emplace_back(name, std::chrono::duration<double>(now - last_).count());
    if (device_.is_cuda()) {
      allocated_.emplace_back(name, model::PeakGpuMemory(device_).allocated_now_bytes);
    }
    last_ = now;
  }
  // Adds the phases' seconds to `into`'s, phase by phase.
  void AddSeconds(std::vector<std::pair<std::string, double>>& into) const {
    for (const auto& [name, seconds] : phases_) {
      Merge(into, name, seconds, [](double a, double b) { return a + b; });
    }
  }
  // Adds this step's phases to `stats` (a timed step only): seconds summed, memory the most.
  void AddTo(JobStats& stats) const {
    if (!on_) return;
    AddSeconds(stats.phases);
    stats.phase_timed_steps += 1;
    for (const auto& [name, bytes] : allocated_) {
      Merge(stats.phase_allocated_bytes, name, bytes,
            [](int64_t a, int64_t b) { return std::max(a, b); });
    }
  }

 private:
  // `name`'s entry of `into` combined with `value` (appended where it has none yet).
  template <typename T, typename Combine>
  static void Merge(std::vector<std::pair<std::string, T>>& into, const std::string& name, T value,
                    Combine combine) {
    auto it =
        std::find_if(into.begin(), into.end(), [&](const auto& p) { return p.first == name; });
    if (it == into.end()) {
      into.emplace_back(name, value);
    } else {
      it->second = combine(it->second, value);
    }
  }
  void Sync() const {
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
  }
  torch::Device device_;
  bool on_;
  std::vector<std::pair<std::string, int64_t>> allocated_;
  Clock::time_point last_;
  std::vector<std::pair<std::string, double>> phases_;
};

// GreedyAnswers with sample i named "sample <names[i]>" in its errors (defined below).
absl::StatusOr<std::vector<std::string>> GreedyAnswersNamed(
    const PairSide& side, const std::vector<const PairSample*>& samples,
    const std::vector<size_t>& names, int max_new_tokens, std::vector<std::vector<int64_t>>* ids,
    std::vector<double>* entropies);

}  // namespace

struct PairDistiller::State {
  PairSide teacher, student;
  DistillConfig config;
  JobOptions options;
  bool same_tokenizer = false;
  bool use_kl = false;
  bool fp8_base = false;  // UsesFp8Base(options, device)
  torch::Device device = torch::kCPU;
  torch::nn::Linear phi{nullptr}, psi{nullptr};
  bool fitted = false;
  int64_t jobs = 0;

  bool UsesFeatures() const {
    return config.feature_loss != FeatureLoss::kNone && (config.l_query > 0 || config.l_repr > 0);
  }

  // Teacher work for a chunk of samples, in one batch: pseudo-labels (one greedy pass over
  // the samples without a given label), then Q_t, R_t and the answer logits teacher-forced
  // on them (one forward pass). Each sample's results are what a chunk of one gives, up to
  // the rounding of the batch's products: the rows are left-padded and masked. The teacher
  // reads every token of a complete sample, the student its present ones. Errors name the
  // samples by their index in the job (`first` is the chunk's first).
  // `clock` marks "greedy" after the greedy pass and "forced" after the forced one.
  absl::Status PrepareChunk(const std::vector<const PairSample*>& samples,
                            const std::vector<PreparedSample*>& out, size_t first,
                            std::vector<std::string>* labels, PhaseClock& clock) {
    torch::NoGradGuard no_grad;
    const size_t n = samples.size();
    std::vector<std::vector<int64_t>> answer(n);
    labels->assign(n, std::string());
    auto at = [first](size_t i, const absl::Status& st) {
      return absl::Status(st.code(), absl::StrCat("sample ", first + i, ": ", st.message()));
    };
    // A pass over several samples: its error names them all, unless it names its sample.
    auto over = [first](const std::vector<size_t>& which, const absl::Status& st) {
      if (absl::StartsWith(st.message(), "sample ")) return st;
      const std::string who = which.size() == 1 ? absl::StrCat("sample ", first + which[0])
                                                : absl::StrCat("samples ", first + which.front(),
                                                               "-", first + which.back());
      return absl::Status(st.code(), absl::StrCat(who, ": ", st.message()));
    };
    // What the teacher reads: every token of a complete sample.
    std::vector<PairSample> views(n);
    std::vector<const PairSample*> view_of(n), unlabelled_views;
    std::vector<size_t> unlabelled;
    for (size_t i = 0; i < n; ++i) {
      const PairSample& sample = *samples[i];
      views[i] = sample;
      if (sample.complete) views[i].present = torch::Tensor();
      view_of[i] = &views[i];
      if (!sample.label.empty()) {
        // A given label (the ground-truth arm): the teacher is forced on it.
        absl::StatusOr<std::vector<int64_t>> ids = teacher.encode(sample.label, /*special=*/false);
        if (!ids.ok()) return at(i, ids.status());
        answer[i] = *std::move(ids);
        (*labels)[i] = sample.label;
      } else {
        unlabelled.push_back(i);
        unlabelled_views.push_back(&views[i]);
      }
    }
    if (!unlabelled.empty()) {
      std::vector<std::vector<int64_t>> ids;
      std::vector<size_t> names;
      for (size_t i : unlabelled) names.push_back(first + i);
      absl::StatusOr<std::vector<std::string>> texts = GreedyAnswersNamed(
          teacher, unlabelled_views, names, options.max_answer_tokens, &ids, nullptr);
      if (!texts.ok()) return over(unlabelled, texts.status());
      for (size_t r = 0; r < unlabelled.size(); ++r) {
        (*labels)[unlabelled[r]] = std::move((*texts)[r]);
        answer[unlabelled[r]] = std::move(ids[r]);
      }
    }
    clock.Mark("greedy");
    const int64_t t_eos_id = FirstEos(*teacher.model);
    for (size_t i = 0; i < n; ++i) {
      const PairSample& sample = *samples[i];
      PreparedSample* o = out[i];
      if (t_eos_id >= 0) answer[i].push_back(t_eos_id);
      // The student's answer: the same ids with an identical tokenizer, else the label's text.
      if (same_tokenizer) {
        o->student_answer = answer[i];
      } else {
        absl::StatusOr<std::vector<int64_t>> ids = student.encode((*labels)[i], /*special=*/false);
        if (!ids.ok()) return at(i, ids.status());
        o->student_answer = *ids;
        const int64_t s_eos = FirstEos(*student.model);
        if (s_eos >= 0) o->student_answer.push_back(s_eos);
      }
      absl::StatusOr<SidePrompt> s_prompt = SidePromptOf(student, sample.prompt);
      if (!s_prompt.ok()) return at(i, s_prompt.status());
      o->student_prompt = std::move(s_prompt->lm);
      o->student_qformer = std::move(s_prompt->qformer);
      o->tokens = Row(sample.tokens.to(device, torch::kFloat));
      o->present = PresentRow(sample, device);  // what the student trains on
      if (student.reads_pixels && sample.pixels.defined()) {
        o->pixels = Row(sample.pixels.to(device, torch::kFloat));
      }
    }

    // Teacher-forced on the answers, one row per sample.
    std::vector<size_t> all(n), names(n);
    for (size_t i = 0; i < n; ++i) {
      all[i] = i;
      names[i] = first + i;
    }
    absl::StatusOr<SideBatch> side_batch = CollateSide(teacher, view_of, &answer, &names);
    if (!side_batch.ok()) return side_batch.status();
    TextBatch forced = AtAnswers(std::move(side_batch->batch));
    // No gradient, and nothing pins its digits: on CUDA it attends through the fused kernel,
    // as the training steps do (0.6 s less for 64 samples at the 13B shape on an H100,
    // docs/BENCHMARKS.md). The greedy pass above keeps the eager product, which measured
    // faster there.
    absl::StatusOr<model::TokenForward> f = [&] {
      model::FusedAttentionScope fused_attention;
      return teacher.model->ForwardTokens(forced.inputs);
    }();
    if (!f.ok()) return over(all, f.status());
    const int64_t width = forced.inputs.input_ids.size(1);
    const int64_t tail = f->logits.size(1);  // the logits' last `tail` positions of `width`
    for (size_t i = 0; i < n; ++i) {
      PreparedSample* o = out[i];
      const int64_t r = static_cast<int64_t>(i);
      const int64_t a = static_cast<int64_t>(answer[i].size());
      o->teacher_queries = f->queries[r].to(device);
      o->teacher_queries_present = f->queries_present[r].to(device);
      torch::Tensor rep = f->representation[r].narrow(0, width - a, a).to(device);
      o->teacher_repr = same_tokenizer ? rep : rep.mean(0, /*keepdim=*/true);
      // logits[t] predict id t + 1: the answer's ids are predicted from the position before.
      const torch::Tensor answer_logits = f->logits[r].narrow(0, tail - a - 1, a);
      if (use_kl) o->teacher_logits = answer_logits.to(device);
      if (config.confidence_power > 0) {  // a read back from the device per sample: only if used
        const torch::Tensor ids = torch::tensor(answer[i], torch::kLong).to(answer_logits.device());
        const torch::Tensor logp = torch::log_softmax(answer_logits.to(torch::kFloat), -1)
                                       .gather(-1, ids.unsqueeze(-1))
                                       .squeeze(-1);
        o->teacher_confidence = std::exp(logp.mean().item<double>());
      }
    }
    clock.Mark("forced");
    return absl::OkStatus();
  }

  TextBatch Collate(const std::vector<PreparedSample>& pool,
                    const std::vector<int64_t>& rows) const {
    std::vector<TextRow> text;
    for (int64_t i : rows) {
      const PreparedSample& x = pool[static_cast<size_t>(i)];
      text.push_back({x.tokens, x.present, x.pixels, &x.student_prompt, &x.student_answer,
                      &x.student_qformer});
    }
    return AtAnswers(CollateHfRows(text, device));
  }

  // The student's R as the teacher's is kept: per answer position [B, P, H] with mask [B, P],
  // or the answer mean [B, 1, H].
  std::pair<torch::Tensor, torch::Tensor> StudentRepr(const TextBatch& batch,
                                                      const torch::Tensor& representation) const {
    const int64_t b = representation.size(0), width = representation.size(1);
    if (!same_tokenizer) {
      torch::Tensor m = batch.answer_mask.unsqueeze(-1).to(representation.scalar_type());
      torch::Tensor mean = (representation * m).sum(1, true) / m.sum(1, true).clamp_min(1.0);
      return {mean, torch::ones({b, 1}, batch.answer_mask.options())};
    }
    const int64_t p = *std::max_element(batch.answer_lengths.begin(), batch.answer_lengths.end());
    std::vector<torch::Tensor> rows;
    torch::Tensor mask = torch::zeros({b, p}, torch::TensorOptions().dtype(torch::kBool));
    for (int64_t r = 0; r < b; ++r) {
      const int64_t a = batch.answer_lengths[r];
      torch::Tensor x = representation[r].narrow(0, width - a, a);
      if (a < p) x = torch::cat({x, torch::zeros({p - a, x.size(1)}, x.options())});
      rows.push_back(x);
      mask[r].narrow(0, 0, a).fill_(true);
    }
    return {torch::stack(rows), mask.to(representation.device())};
  }

  // The teacher's side of a batch, padded as StudentRepr pads: [B, P, H_t].
  static torch::Tensor Stack(const std::vector<PreparedSample>& pool,
                             const std::vector<int64_t>& rows,
                             torch::Tensor PreparedSample::*field) {
    int64_t p = 0;
    for (int64_t i : rows) p = std::max<int64_t>(p, (pool[i].*field).size(0));
    std::vector<torch::Tensor> out;
    for (int64_t i : rows) {
      torch::Tensor x = pool[i].*field;
      if (x.size(0) < p) {
        std::vector<int64_t> shape = x.sizes().vec();
        shape[0] = p - x.size(0);
        x = torch::cat({x, torch::zeros(shape, x.options())});
      }
      out.push_back(x);
    }
    return torch::stack(out);
  }

  void FitProjections(const std::vector<PreparedSample>& pool) {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> qs, qt, rs, rt;
    const int64_t chunk = std::max(1, options.batch_size);
    for (int64_t begin = 0; begin < static_cast<int64_t>(pool.size()); begin += chunk) {
      std::vector<int64_t> rows;
      for (int64_t i = begin; i < std::min<int64_t>(pool.size(), begin + chunk); ++i) {
        rows.push_back(i);
      }
      TextBatch batch = Collate(pool, rows);
      absl::StatusOr<model::TokenForward> f = student.model->ForwardTokens(batch.inputs);
      if (!f.ok()) return;  // Run's first step reports the same error
      torch::Tensor present = f->queries_present.to(device);
      qs.push_back(f->queries.to(device).index({present}));
      qt.push_back(Stack(pool, rows, &PreparedSample::teacher_queries).index({present}));
      auto [r, mask] = StudentRepr(batch, f->representation.to(device));
      rs.push_back(r.index({mask}));
      rt.push_back(Stack(pool, rows, &PreparedSample::teacher_repr).index({mask}));
    }
    auto target = [&](const torch::Tensor& y) {
      return config.normalize && config.feature_loss == FeatureLoss::kMse ? LayerNormFeatures(y)
                                                                          : y;
    };
    RidgeFit(torch::cat(qs), target(torch::cat(qt)), config.ridge_lambda, phi);
    RidgeFit(torch::cat(rs), target(torch::cat(rt)), config.ridge_lambda, psi);
  }
};

PairDistiller::PairDistiller(std::unique_ptr<State> state) : state_(std::move(state)) {}
PairDistiller::~PairDistiller() = default;

bool PairDistiller::same_tokenizer() const { return state_->same_tokenizer; }

absl::StatusOr<std::unique_ptr<PairDistiller>> PairDistiller::Create(PairSide teacher,
                                                                     PairSide student,
                                                                     const DistillConfig& config,
                                                                     const JobOptions& options) {
  for (const PairSide* side : {&teacher, &student}) {
    if (side->model == nullptr || !side->encode || !side->decode) {
      return absl::InvalidArgumentError(
          absl::StrCat(side == &teacher ? "teacher" : "student", ": model or text codec missing"));
    }
  }
  if (options.max_steps <= 0 || options.batch_size <= 0 || !(options.lr > 0) ||
      options.max_answer_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_steps, batch_size, lr and max_answer_tokens must be > 0 (got ", options.max_steps,
        ", ", options.batch_size, ", ", options.lr, ", ", options.max_answer_tokens, ")"));
  }
  if (student.model->TrainableParameters().empty()) {
    return absl::InvalidArgumentError("the student has no trainable set");
  }
  if (absl::Status s = CheckFp8BaseMode(options.fp8_base, "fp8_base"); !s.ok()) return s;
  if (const torch::Device device = student.model->device();
      options.fp8_base == "on" && device.is_cuda() && !model::NativeFp8Available(device)) {
    // Emulated on a GPU the products would run slower than bf16's with twice its weight
    // memory: nothing a user asking for FP8 on a GPU wants. The CPU emulates on purpose.
    return absl::InvalidArgumentError(
        "fp8_base on: this GPU has no native FP8 products (compute capability 8.9+ and LibTorch "
        ">= 2.5 are needed); run with fp8_base native or off");
  }
  auto state = std::make_unique<State>();
  state->teacher = std::move(teacher);
  state->student = std::move(student);
  state->config = config;
  state->options = options;
  state->device = state->student.model->device();
  // On CUDA a step would dequantize every frozen weight of a quantized student in the
  // forward and again in the backward pass: held dequantized once (the same values, the
  // float weights' memory more), the products multiply directly. The CPU keeps the packed
  // kernels and the memory.
  // With FP8 products the FP8 copies take the float copy's place (the same bytes as bf16).
  state->fp8_base = UsesFp8Base(options, state->device);
  if (state->device.is_cuda()) {
    if (state->fp8_base) {
      model::HoldFp8Weights(state->student.model->module());
    } else {
      model::HoldDequantizedWeights(state->student.model->module());
    }
  }
  state->same_tokenizer = !state->teacher.tokenizer_id.empty() &&
                          state->teacher.tokenizer_id == state->student.tokenizer_id;
  state->use_kl = config.l_kl > 0 && state->same_tokenizer;
  return std::unique_ptr<PairDistiller>(new PairDistiller(std::move(state)));
}

// A job between its phases: what it prepared, what it trains and how far it got.
struct PairDistiller::Job {
  PairDistiller* distiller = nullptr;
  PairJobResult result;
  std::vector<PreparedSample> pool;
  // What the optimizer trains: the student's own trainable set (a job alone) or this job's
  // copy of it (jobs together).
  model::NamedTensors trainable;
  std::unique_ptr<MultiTensorAdamW> optimizer;
  std::mt19937_64 rng;
  std::vector<int64_t> order;
  size_t cursor = 0;
  LossTermHistory history;
  bool done = false;

  // The next batch's samples: the pool reshuffled at each pass.
  std::vector<int64_t> NextRows() {
    const State& s = *distiller->state_;
    std::vector<int64_t> rows;
    while (static_cast<int>(rows.size()) < std::min<int>(s.options.batch_size, pool.size())) {
      if (cursor == order.size()) {
        std::shuffle(order.begin(), order.end(), rng);
        cursor = 0;
      }
      rows.push_back(order[cursor++]);
    }
    return rows;
  }

  // The loss terms of this job's rows of a step ("total" first): `batch` and `f` hold only
  // them, so every mean is over this job's rows as alone.
  std::vector<std::pair<std::string, torch::Tensor>> Losses(const TextBatch& batch,
                                                            const model::TokenForward& f,
                                                            const std::vector<int64_t>& rows) {
    State& s = *distiller->state_;
    std::vector<std::pair<std::string, torch::Tensor>> terms;
    // CE and KL read the answer's predictor positions alone (row-major, as the teacher's
    // answer logits are stacked): the same means as over the whole masked [B, T, V]. The
    // logits cover the rows' last positions (AtAnswers), where every predictor is.
    const int64_t tail = f.logits.size(1);
    const torch::Tensor targets = batch.targets.narrow(1, batch.targets.size(1) - tail, tail);
    const torch::Tensor predictors = targets >= 0;
    const torch::Tensor logits = f.logits.index({predictors});  // [K, V]
    // With confidence_power: each predictor position weighs its row's teacher confidence
    // raised to it (rows' positions are contiguous, row-major).
    torch::Tensor weights;
    if (s.config.confidence_power > 0) {
      std::vector<double> row_weights;
      for (int64_t r : rows) {
        row_weights.push_back(std::pow(pool[r].teacher_confidence, s.config.confidence_power));
      }
      weights = torch::repeat_interleave(
          torch::tensor(row_weights, torch::kDouble).to(s.device, torch::kFloat),
          predictors.sum(1));
    }
    torch::Tensor ce = weights.defined()
                           ? WeightedTokenCrossEntropy(logits, targets.index({predictors}), weights)
                           : TokenCrossEntropy(logits, targets.index({predictors}));
    torch::Tensor total = s.config.l_ce * ce;
    terms.emplace_back("ce", ce);
    if (s.UsesFeatures() && s.config.l_query > 0) {
      torch::Tensor qt = State::Stack(pool, rows, &PreparedSample::teacher_queries);
      torch::Tensor q = FeatureDistance(s.config, qt, s.phi->forward(f.queries.to(s.device)),
                                        f.queries_present.to(s.device));
      total = total + s.config.l_query * q;
      terms.emplace_back("query", q);
    }
    if (s.UsesFeatures() && s.config.l_repr > 0) {
      auto [r, mask] = s.StudentRepr(batch, f.representation.to(s.device));
      torch::Tensor rt = State::Stack(pool, rows, &PreparedSample::teacher_repr);
      torch::Tensor rep = FeatureDistance(s.config, rt, s.psi->forward(r), mask);
      total = total + s.config.l_repr * rep;
      terms.emplace_back("repr", rep);
    }
    if (s.use_kl) {
      std::vector<torch::Tensor> teacher_logits;
      for (int64_t r : rows) teacher_logits.push_back(pool[r].teacher_logits);
      torch::Tensor kl = weights.defined()
                             ? WeightedTemperatureKl(torch::cat(teacher_logits), logits, weights,
                                                     s.config.temperature)
                             : TemperatureKl(torch::cat(teacher_logits), logits, torch::Tensor(),
                                             s.config.temperature);
      total = total + s.config.l_kl * kl;
      terms.emplace_back("kl", kl);
    }
    terms.insert(terms.begin(), {"total", total});
    return terms;
  }
};

namespace {

// Rows [offset, offset + n) of a step's batch and of its forward pass.
TextBatch BatchRows(const TextBatch& batch, int64_t offset, int64_t n) {
  TextBatch out;
  out.targets = batch.targets.narrow(0, offset, n);
  out.answer_mask = batch.answer_mask.narrow(0, offset, n);
  out.answer_lengths.assign(batch.answer_lengths.begin() + offset,
                            batch.answer_lengths.begin() + offset + n);
  return out;
}

model::TokenForward ForwardRows(const model::TokenForward& f, int64_t offset, int64_t n) {
  model::TokenForward out;
  out.logits = f.logits.narrow(0, offset, n);
  out.representation = f.representation.narrow(0, offset, n);
  out.queries = f.queries.narrow(0, offset, n);
  out.queries_present = f.queries_present.narrow(0, offset, n);
  return out;
}

}  // namespace

// The job's teacher work and learner set-up: pseudo-labels and targets per sample, phi and psi
// at the first job (fitted with the student as it is now). Fills job->pool and the result's
// labels, notes and prepare time.
absl::Status PairDistiller::Prepare(const std::vector<PairSample>& samples, Job* job) {
  State& s = *state_;
  job->distiller = this;
  if (samples.empty()) return absl::InvalidArgumentError("a job needs at least one sample");
  PairJobResult& result = job->result;
  result.kl_used = s.use_kl;
  if (!s.same_tokenizer) {
    // Said whatever the KL weight: a pair with different tokenizers never gets the term.
    result.notes.push_back(absl::StrCat(
        "kl_off: the teacher's and the student's tokenizers differ, so the logit KL (weight ",
        s.config.l_kl,
        ") is left out, pseudo-labels are re-tokenized by the student and R is "
        "aligned on the answer mean"));
  }
  const Clock::time_point prepare_start = Clock::now();
  std::vector<PreparedSample>& pool = job->pool;
  pool.assign(samples.size(), PreparedSample());
  model::MultimodalModel& student = *s.student.model;
  // A batch feeds the student either frames or tokens, not both.
  if (s.student.reads_pixels) {
    for (size_t i = 1; i < samples.size(); ++i) {
      if (samples[i].pixels.defined() != samples[0].pixels.defined()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sample ", i, (samples[i].pixels.defined() ? " has" : " has no"), " frame and sample 0",
            (samples[0].pixels.defined() ? " has" : " has none"),
            ": a student that trains its vision side reads every sample's frame or none"));
      }
    }
  }
  try {
    s.teacher.model->module().eval();
    student.module().eval();
    for (size_t i = 0; i < samples.size(); ++i) {
      const PairSample& x = samples[i];
      if (!x.tokens.defined() || x.tokens.dim() != 2 ||
          (x.present.defined() &&
           (x.present.dim() != 1 || x.present.size(0) != x.tokens.size(0)))) {
        return absl::InvalidArgumentError(
            absl::StrCat("sample ", i, ": tokens must be [N, D] and present [N]"));
      }
    }
    // The teacher labels the samples a chunk at a time: one greedy pass and one teacher-forced
    // pass per chunk instead of per sample.
    const size_t chunk = static_cast<size_t>(PrepareBatch(s.options));
    PhaseClock clock(s.device, s.options.phase_steps > 0);
    clock.Start();
    for (size_t begin = 0; begin < samples.size(); begin += chunk) {
      const size_t end = std::min(samples.size(), begin + chunk);
      std::vector<const PairSample*> part;
      std::vector<PreparedSample*> out;
      for (size_t i = begin; i < end; ++i) {
        part.push_back(&samples[i]);
        out.push_back(&pool[i]);
      }
      std::vector<std::string> labels;
      if (absl::Status st = s.PrepareChunk(part, out, begin, &labels, clock); !st.ok()) return st;
      for (std::string& label : labels) result.pseudo_labels.push_back(std::move(label));
    }
    if (s.UsesFeatures() && !s.phi) {
      // Widths from one student pass (no grad) and the teacher's kept features; the fit's
      // passes keep no gradient either (fused on CUDA, as the forced pass).
      torch::NoGradGuard no_grad;
      model::FusedAttentionScope fused_attention;
      TextBatch one = s.Collate(pool, {0});
      absl::StatusOr<model::TokenForward> f = student.ForwardTokens(one.inputs);
      if (!f.ok()) return f.status();
      s.phi = torch::nn::Linear(f->queries.size(-1), pool[0].teacher_queries.size(-1));
      s.psi = torch::nn::Linear(f->representation.size(-1), pool[0].teacher_repr.size(-1));
      s.phi->to(s.device);
      s.psi->to(s.device);
      if (s.config.ridge_init) s.FitProjections(pool);
    }
    clock.Mark("fit");
    clock.AddSeconds(result.stats.prepare_phases);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("preparing the job: ", e.what_without_backtrace()));
  }
  result.stats.prepare_seconds =
      std::chrono::duration<double>(Clock::now() - prepare_start).count();
  return absl::OkStatus();
}

// The job's optimizer over `trainable` (and phi, psi) and its batch order. Only these get
// gradients: the student's own parameters are frozen.
void PairDistiller::StartTraining(model::NamedTensors trainable, Job* job) {
  State& s = *state_;
  for (auto& p : s.student.model->module().parameters()) p.set_requires_grad(false);
  std::vector<torch::Tensor> params;
  for (auto& [name, t] : trainable) {
    t.set_requires_grad(true);
    params.push_back(t);
  }
  if (s.UsesFeatures()) {
    for (auto& p : s.phi->parameters()) params.push_back(p);
    for (auto& p : s.psi->parameters()) params.push_back(p);
  }
  job->trainable = std::move(trainable);
  AdamWOptions adamw;
  adamw.lr = s.options.lr;
  adamw.weight_decay = s.options.weight_decay;
  job->optimizer = std::make_unique<MultiTensorAdamW>(std::move(params), adamw);
  job->rng.seed(s.options.seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(s.jobs));
  job->order.resize(job->pool.size());
  for (size_t i = 0; i < job->order.size(); ++i) job->order[i] = static_cast<int64_t>(i);
  job->cursor = job->order.size();
}

// The training steps of `jobs` (over one student), each step one forward pass over every
// running job's batch. `segmented`: each job trains its own copy, which its rows read through
// model::RowSegments; else the one job trains the student's own set.
absl::Status PairDistiller::Train(const std::vector<Job*>& jobs, bool segmented) {
  model::MultimodalModel& student = *jobs[0]->distiller->state_->student.model;
  const torch::Device device = jobs[0]->distiller->state_->device;
  const model::NamedTensors shared =
      segmented ? student.TrainableParameters() : model::NamedTensors();
  // Holding FP8 costs a pass over the base's weights: before the clock, as the load's holding is.
  const model::Fp8BaseScope fp8(student.module(), jobs[0]->distiller->state_->fp8_base);
  const Clock::time_point train_start = Clock::now();
  Clock::time_point step_start = train_start;
  std::vector<Job*> running = jobs;
  try {
    for (bool first = true; !running.empty(); first = false) {
      // Names the step for a profiler's trace (akd_bench --trace); nothing where none runs.
      RECORD_USER_SCOPE("cdcca::train_step");
      const JobOptions& lead = running[0]->distiller->state_->options;
      PhaseClock clock(device, lead.phase_steps > 0 && running[0]->result.stats.steps >=
                                                           lead.max_steps - lead.phase_steps);
      clock.Start();
      std::vector<std::vector<int64_t>> rows;
      std::vector<TextRow> text;
      std::vector<int64_t> job_of_row;
      for (size_t k = 0; k < running.size(); ++k) {
        rows.push_back(running[k]->NextRows());
        for (int64_t i : rows.back()) {
          const PreparedSample& x = running[k]->pool[static_cast<size_t>(i)];
          text.push_back({x.tokens, x.present, x.pixels, &x.student_prompt, &x.student_answer,
                          &x.student_qformer});
          job_of_row.push_back(static_cast<int64_t>(k));
        }
      }
      TextBatch batch = AtAnswers(CollateHfRows(text, device));
      clock.Mark("batch");
      absl::StatusOr<model::TokenForward> f;
      if (segmented) {
        std::vector<model::NamedTensors> copies;
        for (Job* job : running) copies.push_back(job->trainable);
        absl::StatusOr<model::RowSegments> segments = model::RowSegments::Create(
            shared, std::move(copies), torch::tensor(job_of_row, torch::kLong).to(device));
        if (!segments.ok()) return segments.status();
        model::RowSegmentsScope scope(&*segments);
        f = student.ForwardTokens(batch.inputs);
        if (f.ok() && first) {
          if (std::vector<std::string> unused = segments->Unused(); !unused.empty()) {
            return absl::FailedPreconditionError(absl::StrCat(
                "the student reads ", unused[0],
                " of its trainable set where rows cannot take their own job's values; its jobs "
                "cannot run together"));
          }
        }
      } else {
        f = student.ForwardTokens(batch.inputs);
      }
      if (!f.ok()) return f.status();
      clock.Mark("forward");
      // Each job's loss depends on its own copy alone: the gradient of the sum is, for each
      // copy, that of its job's loss.
      torch::Tensor sum;
      std::vector<std::vector<std::pair<std::string, torch::Tensor>>> terms(running.size());
      int64_t offset = 0;
      for (size_t k = 0; k < running.size(); ++k) {
        const auto n = static_cast<int64_t>(rows[k].size());
        terms[k] =
            running[k]->Losses(BatchRows(batch, offset, n), ForwardRows(*f, offset, n), rows[k]);
        sum = k == 0 ? terms[k][0].second : sum + terms[k][0].second;
        offset += n;
      }
      clock.Mark("losses");
      for (Job* job : running) job->optimizer->zero_grad();
      sum.backward();
      clock.Mark("backward");
      for (Job* job : running) job->optimizer->step();
      clock.Mark("optimizer");
      std::vector<Job*> still;
      for (size_t k = 0; k < running.size(); ++k) {
        Job& job = *running[k];
        const State& s = *job.distiller->state_;
        clock.AddTo(job.result.stats);
        job.history.Add(terms[k]);
        JobStats& stats = job.result.stats;
        const Clock::time_point now = Clock::now();
        stats.step_seconds.push_back(std::chrono::duration<double>(now - step_start).count());
        stats.steps += 1;
        stats.samples_seen += static_cast<int64_t>(rows[k].size());
        if (PastBudget(s.options, train_start) && stats.steps < s.options.max_steps) {
          stats.stopped_by_budget = true;
          job.done = true;
        }
        if (stats.steps >= s.options.max_steps) job.done = true;
        if (job.done) {
          stats.train_seconds = std::chrono::duration<double>(Clock::now() - train_start).count();
        } else {
          still.push_back(&job);
        }
      }
      running = std::move(still);
      step_start = Clock::now();
    }
  } catch (const c10::Error& e) {
    for (Job* job : jobs) {
      for (auto& [name, t] : job->trainable) t.set_requires_grad(false);
    }
    return absl::InternalError(absl::StrCat("training step: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

// The result's statistics and trained set (fp32 CPU clones); the job counts for the next
// job's batch order.
void PairDistiller::Finish(Job* job) {
  State& s = *state_;
  PairJobResult& result = job->result;
  result.stats.samples_per_second =
      result.stats.train_seconds > 0 ? result.stats.samples_seen / result.stats.train_seconds : 0;
  result.stats.current_samples = static_cast<int64_t>(job->pool.size());
  result.stats.device = s.device.str();
  result.stats.terms = job->history.Summaries();
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : job->trainable) {
    t.set_requires_grad(false);
    result.trainable.emplace_back(name,
                                  t.detach().to(torch::kCPU, torch::kFloat).contiguous().clone());
  }
  ++s.jobs;
}

absl::StatusOr<PairJobResult> PairDistiller::Run(const std::vector<PairSample>& samples) {
  Job job;
  if (absl::Status st = Prepare(samples, &job); !st.ok()) return st;
  StartTraining(state_->student.model->TrainableParameters(), &job);
  if (absl::Status st = Train({&job}, /*segmented=*/false); !st.ok()) return st;
  Finish(&job);
  return std::move(job.result);
}

// Copies `mirror` into the student's trainable set; returns that set as it then is, fp32
// clones (what training changes are measured from).
absl::StatusOr<compress::NamedTensors> PairDistiller::LoadMirror(
    const compress::NamedTensors& mirror) {
  model::MultimodalModel& student = *state_->student.model;
  const model::NamedTensors params = student.TrainableParameters();
  if (params.size() != mirror.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the mirror has ", mirror.size(), " tensors, the student's trainable set ", params.size()));
  }
  if (absl::Status s = compress::CopyInto(mirror, params); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("the mirror: ", s.message()));
  }
  return compress::Fp32Clones(params);
}

namespace {

// `result`'s trained set as the mirror plus what training changed from `at_start`.
void OntoMirror(const compress::NamedTensors& mirror, const compress::NamedTensors& at_start,
                PairJobResult* result) {
  absl::flat_hash_map<std::string, const torch::Tensor*> start;
  for (const auto& [name, t] : at_start) start[name] = &t;
  absl::flat_hash_map<std::string, const torch::Tensor*> base;
  for (const auto& [name, t] : mirror) base[name] = &t;
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : result->trainable) {
    t = (*base.at(name) + (t - *start.at(name))).contiguous();
  }
}

}  // namespace

absl::StatusOr<PairJobResult> PairDistiller::RunFrom(const compress::NamedTensors& mirror,
                                                     const std::vector<PairSample>& samples) {
  absl::StatusOr<compress::NamedTensors> before = LoadMirror(mirror);
  if (!before.ok()) return before.status();
  absl::StatusOr<PairJobResult> result = Run(samples);
  if (!result.ok()) return result.status();
  OntoMirror(mirror, *before, &*result);
  return result;
}

std::vector<absl::StatusOr<PairJobResult>> PairDistiller::RunTogether(
    const std::vector<PairJobInput>& jobs) {
  std::vector<absl::StatusOr<PairJobResult>> out(
      jobs.size(), absl::StatusOr<PairJobResult>(absl::UnknownError("not run")));
  std::vector<size_t> valid;
  absl::flat_hash_map<const PairDistiller*, int> uses;
  for (const PairJobInput& in : jobs) ++uses[in.distiller];
  for (size_t i = 0; i < jobs.size(); ++i) {
    const PairJobInput& in = jobs[i];
    if (in.distiller == nullptr || in.mirror == nullptr || in.samples == nullptr) {
      out[i] = absl::InvalidArgumentError("a job needs its distiller, mirror and samples");
    } else if (uses[in.distiller] > 1) {
      out[i] = absl::InvalidArgumentError("a distiller runs one job at a time");
    } else if (in.distiller->state_->student.model != jobs[0].distiller->state_->student.model) {
      out[i] = absl::InvalidArgumentError("jobs run together must share one student model");
    } else {
      valid.push_back(i);
    }
  }
  if (valid.size() == 1) {
    const PairJobInput& in = jobs[valid[0]];
    out[valid[0]] = in.distiller->RunFrom(*in.mirror, *in.samples);
  }
  if (valid.size() <= 1) return out;

  // Each job prepares with the student holding its mirror, then trains a copy of it.
  std::vector<std::unique_ptr<Job>> flights(jobs.size());
  std::vector<compress::NamedTensors> at_start(jobs.size());
  std::vector<Job*> ready;
  for (size_t i : valid) {
    const PairJobInput& in = jobs[i];
    PairDistiller& d = *in.distiller;
    absl::StatusOr<compress::NamedTensors> before = d.LoadMirror(*in.mirror);
    if (!before.ok()) {
      out[i] = before.status();
      continue;
    }
    at_start[i] = *std::move(before);
    flights[i] = std::make_unique<Job>();
    if (absl::Status st = d.Prepare(*in.samples, flights[i].get()); !st.ok()) {
      out[i] = st;
      continue;
    }
    model::NamedTensors copy;
    {
      torch::NoGradGuard no_grad;
      for (const auto& [name, t] : d.state_->student.model->TrainableParameters()) {
        copy.emplace_back(name, t.detach().clone());
      }
    }
    d.StartTraining(std::move(copy), flights[i].get());
    ready.push_back(flights[i].get());
  }
  if (ready.empty()) return out;
  // Segmented even where one job is left: each trains its copy, not the student's own set.
  const absl::Status trained = Train(ready, /*segmented=*/true);
  for (size_t i : valid) {
    if (flights[i] == nullptr || flights[i]->optimizer == nullptr) continue;  // failed alone
    if (!trained.ok()) {
      out[i] = trained;
      continue;
    }
    PairDistiller& d = *jobs[i].distiller;
    d.Finish(flights[i].get());
    OntoMirror(*jobs[i].mirror, at_start[i], &flights[i]->result);
    out[i] = std::move(flights[i]->result);
  }
  return out;
}

namespace {

absl::StatusOr<std::vector<std::string>> GreedyAnswersNamed(
    const PairSide& side, const std::vector<const PairSample*>& samples,
    const std::vector<size_t>& names, int max_new_tokens, std::vector<std::vector<int64_t>>* ids,
    std::vector<double>* entropies) {
  torch::NoGradGuard no_grad;
  std::vector<std::string> texts;
  if (ids != nullptr) ids->clear();
  if (entropies != nullptr) entropies->clear();
  if (samples.empty()) return texts;
  if (std::vector<std::vector<size_t>> groups = FrameGroups(side, samples); groups.size() > 1) {
    texts.resize(samples.size());
    if (ids != nullptr) ids->resize(samples.size());
    if (entropies != nullptr) entropies->resize(samples.size());
    for (const std::vector<size_t>& group : groups) {
      std::vector<const PairSample*> part;
      std::vector<size_t> part_names;
      for (size_t i : group) {
        part.push_back(samples[i]);
        part_names.push_back(names[i]);
      }
      std::vector<std::vector<int64_t>> part_ids;
      std::vector<double> part_entropies;
      absl::StatusOr<std::vector<std::string>> part_texts =
          GreedyAnswersNamed(side, part, part_names, max_new_tokens, &part_ids, &part_entropies);
      if (!part_texts.ok()) return part_texts.status();
      for (size_t r = 0; r < group.size(); ++r) {
        texts[group[r]] = std::move((*part_texts)[r]);
        if (ids != nullptr) (*ids)[group[r]] = std::move(part_ids[r]);
        if (entropies != nullptr) (*entropies)[group[r]] = part_entropies[r];
      }
    }
    return texts;
  }
  absl::StatusOr<SideBatch> batch = CollateSide(side, samples, /*answers=*/nullptr, &names);
  if (!batch.ok()) return batch.status();
  model::GreedyOptions g;
  g.max_new_tokens = max_new_tokens;
  g.eos_token_ids = side.model->eos_token_ids();
  g.keep_step_logits = entropies != nullptr;
  absl::StatusOr<model::GreedyResult> gen = side.model->GenerateFromTokens(batch->batch.inputs, g);
  if (!gen.ok()) return gen.status();
  const int64_t image = side.model->image_token_id();
  for (size_t r = 0; r < samples.size(); ++r) {
    if (entropies != nullptr) entropies->push_back(model::MeanStepEntropy(*gen, r));
    std::vector<int64_t> answer = model::AnswerIds(gen->tokens[r], g.eos_token_ids);
    // The image placeholder cannot be part of an answer that is read back (it would stand for
    // an image position): the answer ends before it, as at an EOS.
    answer.erase(std::find(answer.begin(), answer.end(), image), answer.end());
    texts.emplace_back(absl::StripAsciiWhitespace(side.decode(answer)));
    if (ids != nullptr) ids->push_back(std::move(answer));
  }
  return texts;
}

// Names 0 .. n - 1: a sample is named by its index in the caller's list.
std::vector<size_t> Positions(size_t n) {
  std::vector<size_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = i;
  return out;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> GreedyAnswers(
    const PairSide& side, const std::vector<const PairSample*>& samples, int max_new_tokens,
    std::vector<std::vector<int64_t>>* ids, std::vector<double>* entropies) {
  return GreedyAnswersNamed(side, samples, Positions(samples.size()), max_new_tokens, ids,
                            entropies);
}

absl::StatusOr<std::string> GreedyAnswer(const PairSide& side, const PairSample& sample,
                                         int max_new_tokens, std::vector<int64_t>* ids,
                                         double* entropy) {
  std::vector<std::vector<int64_t>> all_ids;
  std::vector<double> entropies;
  absl::StatusOr<std::vector<std::string>> texts = GreedyAnswers(
      side, {&sample}, max_new_tokens, &all_ids, entropy != nullptr ? &entropies : nullptr);
  if (!texts.ok()) return texts.status();
  if (ids != nullptr) *ids = std::move(all_ids[0]);
  if (entropy != nullptr) *entropy = entropies[0];
  return std::move((*texts)[0]);
}

namespace {

// AnswerIdsProbabilities with sample i named "sample <names[i]>" in its errors.
absl::StatusOr<std::vector<double>> AnswerIdsProbabilitiesNamed(
    const PairSide& side, const std::vector<const PairSample*>& samples,
    const std::vector<std::vector<int64_t>>& ids, const std::vector<size_t>& names) {
  if (ids.size() != samples.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ids.size(), " answers for ", samples.size(), " samples"));
  }
  // An empty answer has probability 1: only the others take a row.
  std::vector<double> out(samples.size(), 1.0);
  std::vector<size_t> which, part_names;
  std::vector<const PairSample*> part;
  std::vector<std::vector<int64_t>> part_ids;
  for (size_t i = 0; i < samples.size(); ++i) {
    if (ids[i].empty()) continue;
    which.push_back(i);
    part_names.push_back(names[i]);
    part.push_back(samples[i]);
    part_ids.push_back(ids[i]);
  }
  if (part.empty()) return out;
  if (std::vector<std::vector<size_t>> groups = FrameGroups(side, part); groups.size() > 1) {
    for (const std::vector<size_t>& group : groups) {
      std::vector<const PairSample*> group_samples;
      std::vector<std::vector<int64_t>> group_ids;
      std::vector<size_t> group_names;
      for (size_t r : group) {
        group_samples.push_back(part[r]);
        group_ids.push_back(part_ids[r]);
        group_names.push_back(part_names[r]);
      }
      absl::StatusOr<std::vector<double>> p =
          AnswerIdsProbabilitiesNamed(side, group_samples, group_ids, group_names);
      if (!p.ok()) return p.status();
      for (size_t k = 0; k < group.size(); ++k) out[which[group[k]]] = (*p)[k];
    }
    return out;
  }
  torch::NoGradGuard no_grad;
  absl::StatusOr<SideBatch> batch = CollateSide(side, part, &part_ids, &part_names);
  if (!batch.ok()) return batch.status();
  const TextBatch forced = AtAnswers(std::move(batch->batch));
  absl::StatusOr<model::TokenForward> f = side.model->ForwardTokens(forced.inputs);
  if (!f.ok()) return f.status();
  const int64_t tail = f->logits.size(1);
  for (size_t r = 0; r < part.size(); ++r) {
    const int64_t a = static_cast<int64_t>(part_ids[r].size());
    // logits[t] predicts id t + 1: a row's answer ids are predicted from the position before
    // its first, which the tail's last a + 1 positions hold.
    const torch::Tensor logp = torch::log_softmax(f->logits[static_cast<int64_t>(r)]
                                                      .narrow(0, tail - a - 1, a)
                                                      .to(torch::kCPU, torch::kDouble),
                                                  -1);
    const torch::Tensor chosen =
        logp.gather(1, torch::tensor(part_ids[r], torch::kLong).unsqueeze(1));
    out[which[r]] = std::exp(chosen.sum().item<double>());
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<double>> AnswerIdsProbabilities(
    const PairSide& side, const std::vector<const PairSample*>& samples,
    const std::vector<std::vector<int64_t>>& ids) {
  return AnswerIdsProbabilitiesNamed(side, samples, ids, Positions(samples.size()));
}

absl::StatusOr<double> AnswerIdsProbability(const PairSide& side, const PairSample& sample,
                                            const std::vector<int64_t>& ids) {
  absl::StatusOr<std::vector<double>> p = AnswerIdsProbabilities(side, {&sample}, {ids});
  if (!p.ok()) return p.status();
  return (*p)[0];
}

absl::StatusOr<std::vector<double>> AnswerProbabilities(
    const PairSide& side, const std::vector<const PairSample*>& samples,
    const std::vector<std::string>& answers) {
  if (answers.size() != samples.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(answers.size(), " answers for ", samples.size(), " samples"));
  }
  const int64_t eos = FirstEos(*side.model);
  std::vector<std::vector<int64_t>> ids(answers.size());
  for (size_t i = 0; i < answers.size(); ++i) {
    if (!answers[i].empty()) {
      absl::StatusOr<std::vector<int64_t>> encoded = side.encode(answers[i], /*special=*/false);
      if (!encoded.ok()) return encoded.status();
      ids[i] = *std::move(encoded);
    }
    if (eos >= 0) ids[i].push_back(eos);
  }
  return AnswerIdsProbabilities(side, samples, ids);
}

absl::StatusOr<double> AnswerProbability(const PairSide& side, const PairSample& sample,
                                         const std::string& answer) {
  absl::StatusOr<std::vector<double>> p = AnswerProbabilities(side, {&sample}, {answer});
  if (!p.ok()) return p.status();
  return (*p)[0];
}

bool UsesFp8Base(const JobOptions& options, const torch::Device& device) {
  return options.fp8_base == "on" ||
         (options.fp8_base == "native" && device.is_cuda() && model::NativeFp8Available(device));
}

PairSide IdsAsTextSide(model::MultimodalModel* model) {
  PairSide side;
  side.model = model;
  side.encode = [](const std::string& text, bool) -> absl::StatusOr<std::vector<int64_t>> {
    std::vector<int64_t> ids;
    for (absl::string_view w : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
      int64_t id = 0;
      if (!absl::SimpleAtoi(w, &id)) {
        return absl::InvalidArgumentError(absl::StrCat("not an id: '", w, "'"));
      }
      ids.push_back(id);
    }
    return ids;
  };
  side.decode = [](const std::vector<int64_t>& ids) { return absl::StrJoin(ids, " "); };
  side.tokenizer_id = "ids-as-text";
  return side;
}

absl::StatusOr<PairSample> SampleFromUplink(const compress::UplinkSample& sample,
                                            const PairSide& student) {
  const int64_t n = sample.grid_tokens;
  const int64_t d = sample.feature_dim;
  const size_t kept = sample.kept_indices.size();
  if (n <= 0 || d <= 0 || sample.features.size() != kept * static_cast<size_t>(d)) {
    return absl::InvalidArgumentError(absl::StrCat("sample ", sample.sample_id, ": ",
                                                   sample.features.size(), " feature values for ",
                                                   kept, " kept tokens of width ", d));
  }
  PairSample h;
  h.tokens = torch::zeros({n, d}, torch::kFloat);
  h.present = torch::zeros({n}, torch::kBool);
  if (kept > 0) {
    std::vector<int64_t> rows(sample.kept_indices.begin(), sample.kept_indices.end());
    for (int64_t r : rows) {
      if (r >= n) {
        return absl::InvalidArgumentError(absl::StrCat("sample ", sample.sample_id, ": kept token ",
                                                       r, " outside its grid of ", n));
      }
    }
    const torch::Tensor index = torch::tensor(rows, torch::kLong);
    const torch::Tensor values = torch::from_blob(const_cast<float*>(sample.features.data()),
                                                  {static_cast<int64_t>(kept), d}, torch::kFloat);
    h.tokens.index_copy_(0, index, values);  // copies: `values` does not outlive the sample
    h.present.index_fill_(0, index, true);
  }
  h.prompt = student.decode(
      std::vector<int64_t>(sample.prompt_tokens.begin(), sample.prompt_tokens.end()));
  return h;
}

absl::StatusOr<PairSample> CompleteHfSample(const compress::UplinkSample& sample,
                                            const std::vector<float>& all_features,
                                            const PairSide& student) {
  // The kept indices and the prompt are checked as an uplinked sample's, the grid from the
  // sample with every row kept.
  absl::StatusOr<PairSample> kept = SampleFromUplink(sample, student);
  if (!kept.ok()) return kept.status();
  const size_t want = static_cast<size_t>(sample.grid_tokens) * sample.feature_dim;
  if (all_features.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sample ", sample.sample_id, ": ", all_features.size(), " feature values for a grid of ",
        sample.grid_tokens, "x", sample.feature_dim));
  }
  kept->tokens = torch::tensor(all_features, torch::kFloat)
                     .reshape({static_cast<int64_t>(sample.grid_tokens),
                               static_cast<int64_t>(sample.feature_dim)});
  kept->complete = true;
  return kept;
}

}  // namespace cdcca::distill
