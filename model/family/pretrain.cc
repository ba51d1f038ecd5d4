#include "model/family/pretrain.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "datasets/domain.h"
#include "datasets/fashion_mnist.h"
#include "datasets/metrics.h"
#include "datasets/tokenizer.h"
#include "model/arch/blip2.h"
#include "model/arch/multimodal_model.h"
#include "model/family/family_model.h"
#include "model/family/llava_family.h"
#include "model/hub/model_folder.h"
#include "model/hub/safetensors.h"
#include "model/runtime/threads.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {
namespace {

namespace ds = ::cdcca::datasets;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

torch::Device PickDevice(bool force_cpu) {
  if (!force_cpu && torch::cuda::is_available()) return torch::Device(torch::kCUDA, 0);
  return torch::Device(torch::kCPU);
}

int AllCores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

void SetThreads(int threads) {
  torch::set_num_threads(threads > 0 ? threads : AllCores());
  FlushDenormals();
}

// Intra-op threads of the pretraining stages and evaluations: on the CPU the automatic count
// of threads.h (their time is in matrix products, which the BLAS threads itself; a second
// intra-op thread spins against them: the vision stage runs 652 images/s with two, 1,272
// with one, on the 2-core machine).
int TowerThreads(int threads, torch::Device device) {
  return device.is_cpu() ? IntraOpThreads(threads) : (threads > 0 ? threads : AllCores());
}

// One stderr line, rewritten in place at most 5 times a second.
class ProgressBar {
 public:
  ProgressBar(std::string name, int total, int first)
      : name_(std::move(name)), total_(total), first_(first), start_(Clock::now()) {}
  void Update(int done, double loss, int64_t samples) {
    samples_ += samples;
    loss_ = loss_ < 0 ? loss : 0.9 * loss_ + 0.1 * loss;
    if (done < total_ && Seconds(last_) < 0.2) return;
    last_ = Clock::now();
    const double t = Seconds(start_);
    const double rate = samples_ / std::max(t, 1e-9);
    const double eta = (done > first_) ? t / (done - first_) * (total_ - done) : 0.0;
    const int width = 24;
    const int fill = total_ > 0 ? width * done / total_ : width;
    std::fprintf(stderr, "\r[%-8s] %5d/%-5d [%s%s] loss %.4f  %.0f samples/s  %.0fs eta %.0fs ",
                 name_.c_str(), done, total_, std::string(fill, '=').c_str(),
                 std::string(width - fill, ' ').c_str(), loss_, rate, t, eta);
    if (done >= total_) std::fprintf(stderr, "\n");
  }
  double seconds() const { return Seconds(start_); }
  double loss() const { return loss_; }

 private:
  std::string name_;
  int total_, first_;
  Clock::time_point start_, last_{};
  int64_t samples_ = 0;
  double loss_ = -1;
};

// ---- the architecture ----------------------------------------------------------------------
// What the stages need of a family's architecture (FamilyConfig::architecture), as the BLIP-2
// (family_model.h) or the LLaVA (llava_family.h) implementation provides it.

// The shared ViT: stage 1 trains `module` with the cell heads on `patches`; the towers read
// `tokens` (pixel values -> [B, N, D], gradients flowing).
struct FamilyVit {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> tokens;
  std::function<torch::Tensor(const torch::Tensor&)> patches;  // [B, grid^2, D], row-major
};

FamilyVit MakeVit(const FamilyConfig& f) {
  if (f.architecture == "llava") {
    ClipVisionTower vit = MakeLlavaFamilyVit(f.vision);
    auto tokens = [p = vit.ptr(), v = f.vision](const torch::Tensor& px) {
      return LlavaFamilyVisualTokens(*p, v, px);
    };
    return {vit.ptr(), tokens, tokens};
  }
  std::shared_ptr<Blip2VisionModelImpl> vit = MakeFamilyVit(f.vision).ptr();
  const int64_t patches = f.vision.NumPatches();
  return {
      vit, [vit](const torch::Tensor& px) { return vit->forward(px); },
      [vit, patches](const torch::Tensor& px) { return vit->forward(px).narrow(1, 1, patches); }};
}

// One tower and what the stages do with it.
struct FamilyTower {
  std::shared_ptr<torch::nn::Module> module;
  std::string vit_prefix;                  // where the shared ViT's parameters sit among module's
  int64_t query_count = 0, query_dim = 0;  // FamilyGroupOutput::queries' [Q, count, dim]
  double dropout = 0;                      // TowerConfig::dropout, while training
  std::function<std::vector<FamilyGroupOutput>(const torch::Tensor&, const torch::Tensor&,
                                               const std::vector<FamilyQuestionGroup>&, double)>
      forward_groups;
  std::function<std::unique_ptr<MultimodalModel>(torch::Device)> wrap;
  std::function<absl::Status(const std::string&, const json&)> save;  // the Hugging Face folder
};

FamilyTower TowerOf(Blip2ForConditionalGeneration m, const FamilyConfig& f, const TowerConfig& t,
                    const std::vector<std::string>& vocabulary) {
  FamilyTower tower;
  tower.module = m.ptr();
  tower.vit_prefix = "vision_model.";
  tower.query_count = t.num_queries;
  tower.query_dim = t.qa_dim;
  tower.dropout = t.dropout;
  tower.forward_groups = [p = m.ptr()](const torch::Tensor& vis, const torch::Tensor& mask,
                                       const std::vector<FamilyQuestionGroup>& groups,
                                       double dropout) {
    return ForwardQuestionGroups(*p, vis, mask, groups, dropout);
  };
  tower.wrap = [m](torch::Device device) { return FamilyMultimodalModel(m, device); };
  tower.save = [m, vision = f.vision, t, vocabulary](const std::string& dir, const json& extra) {
    return SaveFamilyFolder(dir, *m.ptr(), vision, t, vocabulary, extra);
  };
  return tower;
}

FamilyTower TowerOf(Llava m, const FamilyConfig& f, const TowerConfig& t,
                    const std::vector<std::string>& vocabulary) {
  FamilyTower tower;
  tower.module = m.ptr();
  tower.vit_prefix = "model.vision_tower.";
  tower.query_count = f.vision.NumPatches();
  tower.query_dim = t.d_model;
  tower.dropout = t.dropout;
  tower.forward_groups = [p = m.ptr()](const torch::Tensor& vis, const torch::Tensor& mask,
                                       const std::vector<FamilyQuestionGroup>& groups,
                                       double dropout) {
    return ForwardQuestionGroups(*p, vis, mask, groups, dropout);
  };
  tower.wrap = [m](torch::Device device) { return LlavaFamilyMultimodalModel(m, device); };
  tower.save = [m, vision = f.vision, t, vocabulary](const std::string& dir, const json& extra) {
    return SaveLlavaFamilyFolder(dir, *m.ptr(), vision, t, vocabulary, extra);
  };
  return tower;
}

// A fresh tower of the family's architecture (seed torch first).
absl::StatusOr<FamilyTower> NewTower(const FamilyConfig& f, const TowerConfig& t,
                                     const std::vector<std::string>& vocabulary) {
  if (f.architecture == "llava") {
    absl::StatusOr<Llava> m = NewLlavaFamilyModel(f.vision, t);
    if (!m.ok()) return m.status();
    return TowerOf(*m, f, t, vocabulary);
  }
  absl::StatusOr<Blip2ForConditionalGeneration> m = NewFamilyModel(f.vision, t);
  if (!m.ok()) return m.status();
  return TowerOf(*m, f, t, vocabulary);
}

// The tower a stage folder holds (written by FamilyTower::save).
absl::StatusOr<FamilyTower> LoadTower(const std::string& folder, const FamilyConfig& f,
                                      const TowerConfig& t,
                                      const std::vector<std::string>& vocabulary,
                                      torch::Device device) {
  if (f.architecture == "llava") {
    absl::StatusOr<Llava> m = LoadLlavaFamilyModel(folder, device);
    if (!m.ok()) return m.status();
    return TowerOf(*m, f, t, vocabulary);
  }
  absl::StatusOr<ModelFolder> hf = ModelFolder::Open(folder);
  if (!hf.ok()) return hf.status();
  absl::StatusOr<std::shared_ptr<Blip2ForConditionalGenerationImpl>> loaded =
      Blip2ForConditionalGenerationImpl::FromFolder(*hf, WeightPrecision{}, device);
  if (!loaded.ok()) return loaded.status();
  return TowerOf(Blip2ForConditionalGeneration(*loaded), f, t, vocabulary);
}

torch::Tensor ImagesToTensor(const std::vector<ds::Sample>& samples) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t h = samples.front().image.height;
  const int64_t w = samples.front().image.width;
  torch::Tensor out = torch::empty({n, h, w, 3}, torch::kByte);
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(out[i].data_ptr(), samples[i].image.pixels.data(), h * w * 3);
  }
  return out.permute({0, 3, 1, 2}).to(torch::kFloat).div_(255.0);
}

std::vector<ds::Sample> Generate(const ds::SampleGenerator& gen, uint64_t first, int64_t n,
                                 bool image_only) {
  std::vector<ds::Sample> out(n);
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      out[i] = image_only ? gen.GenerateImageOnly(first + i) : gen.Generate(first + i);
    }
  });
  return out;
}

// Every question of every scene, tokenized: prompt = <bos> question (left-padded), answer =
// answer words + <eos> (right-padded). labels[t] is the token logits[t] must predict.
struct QaBatch {
  torch::Tensor scene;                 // [Q] int64: which scene each question is about
  torch::Tensor text, valid;           // [Q, Tp + Ta]
  torch::Tensor labels;                // [Q, Tp + Ta], -100 = no loss
  torch::Tensor prompt, prompt_valid;  // [Q, Tp]
  std::vector<const ds::VqaItem*> items;
};

struct TokenizedQuestion {
  int64_t scene;
  const ds::VqaItem* item;
  std::vector<int> prompt, answer;
};

// Every question of every scene, tokenized, and with `captions` one caption row per scene:
// prompt datasets::CaptionPrompt(), answer one of its reference captions, a different one
// for each `salt` (the training step), so every reference is trained on.
std::vector<TokenizedQuestion> TokenizeQuestions(const std::vector<ds::Sample>& samples,
                                                 const ds::Tokenizer& tok, bool questions = true,
                                                 bool captions = false, uint64_t salt = 0) {
  std::vector<TokenizedQuestion> out;
  const std::vector<int> caption_prompt = tok.Encode(ds::CaptionPrompt(), /*add_bos=*/true);
  for (size_t s = 0; s < samples.size(); ++s) {
    if (questions) {
      for (const ds::VqaItem& q : samples[s].questions) {
        out.push_back({static_cast<int64_t>(s), &q,
                       tok.Encode(q.question, /*add_bos=*/true, /*add_eos=*/false),
                       tok.Encode(q.answer, false, /*add_eos=*/true)});
      }
    }
    const std::vector<std::string>& refs = samples[s].captions;
    if (captions && !refs.empty()) {
      const std::string& ref = refs[(samples[s].index + salt) % refs.size()];
      out.push_back({static_cast<int64_t>(s), nullptr, caption_prompt,
                     tok.Encode(ref, false, /*add_eos=*/true)});
    }
  }
  return out;
}

// Pads questions [begin, end) among themselves.
QaBatch PackQuestions(const std::vector<TokenizedQuestion>& qs, size_t begin, size_t end) {
  QaBatch b;
  const int64_t n = static_cast<int64_t>(end - begin);
  size_t tp = 0, ta = 0;
  for (size_t i = begin; i < end; ++i) {
    tp = std::max(tp, qs[i].prompt.size());
    ta = std::max(ta, qs[i].answer.size());
  }
  const int64_t t = static_cast<int64_t>(tp + ta);
  b.text = torch::zeros({n, t}, torch::kLong);
  b.valid = torch::zeros({n, t}, torch::kBool);
  b.labels = torch::full({n, t}, -100, torch::kLong);
  auto text = b.text.accessor<int64_t, 2>();
  auto valid = b.valid.accessor<bool, 2>();
  auto labels = b.labels.accessor<int64_t, 2>();
  std::vector<int64_t> scene;
  for (int64_t i = 0; i < n; ++i) {
    const TokenizedQuestion& q = qs[begin + i];
    const int64_t off = static_cast<int64_t>(tp - q.prompt.size());
    for (size_t j = 0; j < q.prompt.size(); ++j) {
      text[i][off + j] = q.prompt[j];
      valid[i][off + j] = true;
    }
    for (size_t j = 0; j < q.answer.size(); ++j) {
      text[i][tp + j] = q.answer[j];
      valid[i][tp + j] = true;
      labels[i][tp + j - 1] = q.answer[j];  // predicted from the previous position
    }
    scene.push_back(q.scene);
    b.items.push_back(q.item);
  }
  b.scene = torch::tensor(scene, torch::kLong);
  b.prompt = b.text.narrow(1, 0, static_cast<int64_t>(tp));
  b.prompt_valid = b.valid.narrow(1, 0, static_cast<int64_t>(tp));
  return b;
}

QaBatch BuildQa(const std::vector<ds::Sample>& samples, const ds::Tokenizer& tok) {
  std::vector<TokenizedQuestion> qs = TokenizeQuestions(samples, tok);
  return PackQuestions(qs, 0, qs.size());
}

// The questions of a training step in groups of similar length (PaddingGroups).
std::vector<QaBatch> BuildQaGroups(const std::vector<ds::Sample>& samples, const ds::Tokenizer& tok,
                                   int max_groups, const PretrainSchedule& sched, uint64_t salt) {
  std::vector<TokenizedQuestion> qs =
      TokenizeQuestions(samples, tok, sched.questions, sched.captions, salt);
  std::stable_sort(qs.begin(), qs.end(),
                   [](const TokenizedQuestion& a, const TokenizedQuestion& b) {
                     return std::make_pair(a.prompt.size(), a.answer.size()) <
                            std::make_pair(b.prompt.size(), b.answer.size());
                   });
  std::vector<std::pair<size_t, size_t>> lengths;
  for (const TokenizedQuestion& q : qs) lengths.emplace_back(q.prompt.size(), q.answer.size());
  std::vector<size_t> starts = PaddingGroups(lengths, max_groups);
  std::vector<QaBatch> out;
  for (size_t g = 0; g < starts.size(); ++g) {
    out.push_back(PackQuestions(qs, starts[g], g + 1 < starts.size() ? starts[g + 1] : qs.size()));
  }
  return out;
}

// Question groups per training step (BuildQaGroups): the prefix is shared, so on the CPU a
// group costs one more small LM call and saves its padding (3 groups: teacher +33 %
// questions/s). On a GPU, where a step's time is kernel launches, one group is faster.
int QuestionGroups(torch::Device device) { return device.is_cpu() ? 3 : 1; }

double LearningRate(const StageSchedule& s, int step) {
  const double warm = std::min(1.0, (step + 1.0) / std::max(1, s.warmup));
  const double progress = static_cast<double>(step) / std::max(1, s.steps);
  return s.lr * warm * (0.05 + 0.95 * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

void SetLr(torch::optim::AdamW& opt, double lr) {
  for (auto& g : opt.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
  }
}

// Per-cell supervision of the encoder: mean+max pool the tokens of each 2x2 grid cell,
// predict the cell's item class (or "empty") and colour.
class CellHeadsImpl : public torch::nn::Module {
 public:
  CellHeadsImpl(int64_t d, int64_t grid) : grid_(grid) {
    hidden_ = register_module("hidden", torch::nn::Linear(2 * d, 256));
    cls_ = register_module("cls", torch::nn::Linear(256, ds::kNumClasses + 1));
    color_ = register_module("color", torch::nn::Linear(256, ds::kNumColors));
  }
  // patch tokens [B, g*g, d] -> (class logits [B, 4, 11], colour logits [B, 4, 8])
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& tokens) {
    const int64_t b = tokens.size(0), d = tokens.size(2), h = grid_ / 2;
    torch::Tensor x =
        tokens.view({b, 2, h, 2, h, d}).permute({0, 1, 3, 2, 4, 5}).reshape({b, 4, h * h, d});
    torch::Tensor pooled = torch::cat({x.mean(2), std::get<0>(x.max(2))}, -1);
    torch::Tensor z = torch::relu(hidden_->forward(pooled));
    return {cls_->forward(z), color_->forward(z)};
  }

 private:
  int64_t grid_;
  torch::nn::Linear hidden_{nullptr}, cls_{nullptr}, color_{nullptr};
};
TORCH_MODULE(CellHeads);

// Auxiliary heads on a tower's query-adapter output (StageSchedule::query_aux): the L
// queries of a scene, flattened, predict each 2x2 cell's class (or empty) and colour. They
// make the prefix carry what the questions ask about from the first steps, rather than
// leaving the LM to discover that a colour is there to be read (without them a student
// often never does: BENCHMARKS, "Pretraining cost"). Used only while pretraining.
class QueryHeadsImpl : public torch::nn::Module {
 public:
  QueryHeadsImpl(int64_t queries, int64_t dim) {
    hidden_ = register_module("hidden", torch::nn::Linear(queries * dim, 256));
    cls_ = register_module("cls", torch::nn::Linear(256, ds::kNumCells * (ds::kNumClasses + 1)));
    color_ = register_module("color", torch::nn::Linear(256, ds::kNumCells * ds::kNumColors));
  }
  // queries [S, L, dim] -> (class logits [S, 4, 11], colour logits [S, 4, 8])
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& queries) {
    const int64_t s = queries.size(0);
    torch::Tensor z = torch::relu(hidden_->forward(queries.reshape({s, -1})));
    return {cls_->forward(z).view({s, ds::kNumCells, ds::kNumClasses + 1}),
            color_->forward(z).view({s, ds::kNumCells, ds::kNumColors})};
  }

 private:
  torch::nn::Linear hidden_{nullptr}, cls_{nullptr}, color_{nullptr};
};
TORCH_MODULE(QueryHeads);

// Targets of the cell heads: class (kNumClasses = empty) and colour (-100 when empty).
std::pair<torch::Tensor, torch::Tensor> CellTargets(const std::vector<ds::Sample>& samples) {
  const int64_t n = static_cast<int64_t>(samples.size());
  torch::Tensor cls = torch::full({n, ds::kNumCells}, ds::kNumClasses, torch::kLong);
  torch::Tensor color = torch::full({n, ds::kNumCells}, -100, torch::kLong);
  auto c = cls.accessor<int64_t, 2>();  // every step of three stages: no per-element ops
  auto k = color.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    for (const ds::SceneItem& it : samples[i].scene.items) {
      c[i][it.cell] = it.label;
      k[i][it.cell] = it.color;
    }
  }
  return {cls, color};
}

// Summed class and colour cross-entropy of cell-head logits against CellTargets' targets.
torch::Tensor CellLoss(const torch::Tensor& cls, const torch::Tensor& color,
                       const torch::Tensor& cls_t, const torch::Tensor& color_t) {
  namespace F = torch::nn::functional;
  return F::cross_entropy(cls.reshape({-1, cls.size(-1)}), cls_t.to(cls.device()).reshape(-1)) +
         F::cross_entropy(color.reshape({-1, color.size(-1)}),
                          color_t.to(color.device()).reshape(-1));
}

// Resume state of one stage: modules + optimizer + step, written atomically enough (the
// step file is renamed into place last, and names which files belong to it).
struct ResumePaths {
  std::string model, extra, optim, step;
};
ResumePaths ResumeFor(const std::string& dir, const std::string& stage) {
  const std::string p = dir + "/resume_" + stage;
  return {p + "_model.pt", p + "_extra.pt", p + "_optim.pt", p + "_step.txt"};
}

int ReadResumeStep(const ResumePaths& r) {
  std::ifstream in(r.step);
  int step = 0;
  if (in >> step) return step;
  return 0;
}

template <typename M, typename E>
void WriteResume(const ResumePaths& r, M& model, E* extra, torch::optim::AdamW& opt, int step) {
  torch::save(model, r.model);
  if (extra != nullptr) torch::save(*extra, r.extra);
  torch::save(opt, r.optim);
  {
    std::ofstream out(r.step + ".tmp");
    out << step << "\n";
  }
  std::rename((r.step + ".tmp").c_str(), r.step.c_str());
}

void RemoveResume(const ResumePaths& r) {
  for (const std::string& p : {r.model, r.extra, r.optim, r.step}) std::filesystem::remove(p);
}

// PretrainOptions::stop_after_steps across the stages of one run.
class StepBudget {
 public:
  explicit StepBudget(int steps) : left_(steps > 0 ? steps : -1), total_(steps) {}
  bool Exhausted() const { return left_ == 0; }  // never for an unlimited budget
  void Spend() {
    if (left_ > 0) --left_;
  }
  absl::Status Stopped(const std::string& stage, int step) const {
    return absl::AbortedError(absl::StrCat("stopped after ", total_, " steps of this run (", stage,
                                           " at step ", step,
                                           "); run the same command again to continue"));
  }

 private:
  int left_;
  int total_;
};

}  // namespace

std::vector<size_t> PaddingGroups(const std::vector<std::pair<size_t, size_t>>& lengths,
                                  int max_groups) {
  const size_t n = lengths.size();
  if (n == 0) return {};
  const size_t inf = std::numeric_limits<size_t>::max();
  const size_t groups = std::max<size_t>(1, std::min<size_t>(std::max(1, max_groups), n));
  // best[g][j]: fewest positions for the first j questions in g groups; cut[g][j]: where the
  // last of those groups starts.
  std::vector<std::vector<size_t>> best(groups + 1, std::vector<size_t>(n + 1, inf));
  std::vector<std::vector<size_t>> cut(groups + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t g = 1; g <= groups; ++g) {
    for (size_t j = 1; j <= n; ++j) {
      // Group [i, j), i falling: prompts are sorted, so its longest prompt is question j-1's;
      // its longest answer is kept as i falls. On ties the smallest i wins (<=).
      size_t ta = 0;
      for (size_t i = j; i-- > g - 1;) {
        ta = std::max(ta, lengths[i].second);
        if (best[g - 1][i] == inf) continue;
        const size_t c = best[g - 1][i] + (j - i) * (lengths[j - 1].first + ta);
        if (c <= best[g][j]) {
          best[g][j] = c;
          cut[g][j] = i;
        }
      }
    }
  }
  size_t g = 1;  // the fewest groups that reach the fewest positions
  for (size_t k = 2; k <= groups; ++k) {
    if (best[k][n] < best[g][n]) g = k;
  }
  std::vector<size_t> starts(g);
  for (size_t j = n; g > 0; --g) {
    starts[g - 1] = cut[g][j];
    j = cut[g][j];
  }
  return starts;
}

namespace {

struct EvalResult {
  double accuracy = 0;  // percent, DA (official VQA metric against the 10 direct answers)
  int questions = 0;
  std::string by_type;  // "what 91.0  color 88.2 ..." (percent per question type)
  // Per question, the model's probability of the first token of its answer.
  std::vector<double> first_token_confidence;
};

struct CaptionEval {
  double bleu4 = 0;  // percent: corpus BLEU-4 against each scene's 5 references
  double cider = 0;  // percent: CIDEr-D x 100 (1.0 in COCO's units = 100)
  int images = 0;
  std::vector<std::string> captions;  // the generated caption of each sample
};

// Greedy answers of `model` (the one interface every program uses) to rows of a QaBatch:
// the LM ids as LoadModel's processor lays them out (left padding, the image tokens, the
// prompt) over each row's scene's visual tokens (tokens [S, N, D], CPU), at most max_tokens.
// `confidence`, where given, receives per row the probability of the first answer token.
absl::StatusOr<std::vector<std::vector<int>>> AnswerRows(
    MultimodalModel& model, const torch::Tensor& tokens, const QaBatch& qa, int max_tokens,
    std::vector<double>* confidence = nullptr) {
  const int64_t rows = qa.prompt.size(0), tp = qa.prompt.size(1);
  // The image tokens in front of the prompt: BLIP-2 adds its query tokens to any prompt, LLaVA
  // expands the one placeholder it is given (llava_family.h's layout).
  std::vector<int64_t> prefix = model.ExpandImageTokens({});
  if (prefix.empty()) prefix = model.ExpandImageTokens({model.image_token_id()});
  const int64_t l = static_cast<int64_t>(prefix.size());
  torch::Tensor ids = torch::full({rows, l + tp}, ds::Tokenizer::kPad, torch::kLong);
  torch::Tensor mask = torch::zeros({rows, l + tp}, torch::kLong);
  auto prompt = qa.prompt.accessor<int64_t, 2>();
  auto valid = qa.prompt_valid.accessor<bool, 2>();
  auto id = ids.accessor<int64_t, 2>();
  auto m = mask.accessor<int64_t, 2>();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t pads = 0;
    while (pads < tp && !valid[r][pads]) ++pads;
    for (int64_t k = 0; k < l; ++k) {
      id[r][pads + k] = prefix[k];
      m[r][pads + k] = 1;
    }
    for (int64_t k = pads; k < tp; ++k) {
      id[r][l + k] = prompt[r][k];
      m[r][l + k] = 1;
    }
  }
  TokenInputs in;
  in.visual_tokens = tokens.index_select(0, qa.scene);
  in.input_ids = ids;
  in.attention_mask = mask;
  GreedyOptions options;
  options.max_new_tokens = max_tokens;
  options.eos_token_ids = model.eos_token_ids();
  absl::StatusOr<GreedyResult> g = model.GenerateFromTokens(in, options);
  if (!g.ok()) return g.status();
  if (confidence != nullptr) {
    const torch::Tensor top =
        std::get<0>(torch::softmax(g->first_logits.to(torch::kDouble), -1).max(-1)).contiguous();
    const double* p = top.data_ptr<double>();
    confidence->insert(confidence->end(), p, p + top.numel());
  }
  std::vector<std::vector<int>> out;
  for (const std::vector<int64_t>& row : g->tokens) {
    const std::vector<int64_t> answer = AnswerIds(row, options.eos_token_ids);
    out.emplace_back(answer.begin(), answer.end());
  }
  return out;
}

// DA accuracy of `model`'s greedy answers (at most max_answer_tokens) to every question of
// `samples`, given their visual tokens [S, N, D] (CPU). Puts the model in eval() mode.
absl::StatusOr<EvalResult> ScoreAnswers(MultimodalModel& model, const torch::Tensor& tokens,
                                        const std::vector<ds::Sample>& samples,
                                        const ds::Tokenizer& tok, int max_answer_tokens) {
  torch::NoGradGuard no_grad;
  model.module().eval();
  ds::VqaAccumulator acc;
  std::vector<double> confidence;
  std::map<std::string, std::pair<double, int>> by_type;  // question type -> (sum, count)
  const int64_t chunk = 64;                               // scenes per generation batch
  for (int64_t s0 = 0; s0 < static_cast<int64_t>(samples.size()); s0 += chunk) {
    const int64_t n = std::min<int64_t>(chunk, samples.size() - s0);
    std::vector<ds::Sample> part(samples.begin() + s0, samples.begin() + s0 + n);
    QaBatch qa = BuildQa(part, tok);
    absl::StatusOr<std::vector<std::vector<int>>> answers =
        AnswerRows(model, tokens.narrow(0, s0, n), qa, max_answer_tokens, &confidence);
    if (!answers.ok()) return answers.status();
    for (size_t i = 0; i < answers->size(); ++i) {
      const std::string pred = tok.Decode((*answers)[i]);
      const double a = ds::VqaAccuracy(pred, qa.items[i]->direct_answers);
      acc.Add(a, std::string(ds::AnswerTypeName(qa.items[i]->answer_type)));
      auto& t = by_type[std::string(ds::QuestionTypeName(qa.items[i]->type))];
      t.first += a;
      t.second += 1;
    }
  }
  EvalResult r{acc.Overall(), acc.count(), "", std::move(confidence)};
  for (const auto& [type, t] : by_type) {
    absl::StrAppend(&r.by_type, type, " ", absl::StrFormat("%.1f", 100.0 * t.first / t.second),
                    "  ");
  }
  return r;
}

// Greedy captions (prompt datasets::CaptionPrompt(), at most max_tokens tokens) of every
// sample, scored with the COCO caption metrics. Puts the model in eval() mode.
absl::StatusOr<CaptionEval> ScoreCaptionsOf(MultimodalModel& model, const torch::Tensor& tokens,
                                            const std::vector<ds::Sample>& samples,
                                            const ds::Tokenizer& tok, int max_tokens) {
  torch::NoGradGuard no_grad;
  model.module().eval();
  CaptionEval out;
  std::vector<std::vector<std::string>> refs;
  const int64_t chunk = 64;
  for (int64_t s0 = 0; s0 < static_cast<int64_t>(samples.size()); s0 += chunk) {
    const int64_t n = std::min<int64_t>(chunk, samples.size() - s0);
    std::vector<ds::Sample> part(samples.begin() + s0, samples.begin() + s0 + n);
    std::vector<TokenizedQuestion> rows = TokenizeQuestions(part, tok, false, true);
    QaBatch qa = PackQuestions(rows, 0, rows.size());
    absl::StatusOr<std::vector<std::vector<int>>> captions =
        AnswerRows(model, tokens.narrow(0, s0, n), qa, max_tokens);
    if (!captions.ok()) return captions.status();
    for (size_t i = 0; i < captions->size(); ++i) {
      out.captions.push_back(tok.Decode((*captions)[i]));
      refs.push_back(part[qa.scene[i].item<int64_t>()].captions);
    }
  }
  const ds::CaptionScores s = ds::ScoreCaptions(out.captions, refs);
  out.bleu4 = 100 * s.bleu[3];
  out.cider = 100 * s.cider;
  out.images = static_cast<int>(out.captions.size());
  return out;
}

// The pixel values of every sample's (shifted) image, [S, 3, H, W] on the CPU.
torch::Tensor PixelValuesOf(const std::vector<ds::Sample>& samples) {
  return FamilyPixelValues(ImagesToTensor(samples));
}

// The ViT's tokens [S, N, d_vis] of every sample's image on `device`, in chunks of 256
// images. No gradients.
torch::Tensor EncodeAll(const FamilyVit& vit, const std::vector<ds::Sample>& samples,
                        torch::Device device) {
  torch::NoGradGuard no_grad;
  vit.module->eval();
  std::vector<torch::Tensor> parts;
  const size_t chunk = 256;
  for (size_t s0 = 0; s0 < samples.size(); s0 += chunk) {
    std::vector<ds::Sample> part(samples.begin() + s0,
                                 samples.begin() + std::min(samples.size(), s0 + chunk));
    parts.push_back(vit.tokens(PixelValuesOf(part).to(device)));
  }
  return torch::cat(parts, 0);
}

// A model's own tokens of every sample (MultimodalModel::EncodeImages: a quantized model's
// tower computes quantized), [S, N, D] on the CPU, in chunks of 256 images.
absl::StatusOr<torch::Tensor> EncodeWith(MultimodalModel& model,
                                         const std::vector<ds::Sample>& samples) {
  std::vector<torch::Tensor> parts;
  const size_t chunk = 256;
  for (size_t s0 = 0; s0 < samples.size(); s0 += chunk) {
    std::vector<ds::Sample> part(samples.begin() + s0,
                                 samples.begin() + std::min(samples.size(), s0 + chunk));
    MultimodalInputs in;
    in.pixel_values = PixelValuesOf(part);
    absl::StatusOr<torch::Tensor> t = model.EncodeImages(in);
    if (!t.ok()) return t.status();
    parts.push_back(*t);
  }
  return torch::cat(parts, 0);
}

}  // namespace

namespace {

absl::StatusOr<ds::SampleGenerator> MakeGenerator(const ds::ImageSet* images, ds::DomainSpec spec,
                                                  uint64_t seed) {
  return ds::SampleGenerator::Create(images, std::move(spec), seed);
}

// ---- stages -------------------------------------------------------------------------------

absl::Status TrainVision(const PretrainSchedule& sched, const PretrainOptions& opt,
                         const ds::ImageSet& train, const VisionConfig& vision,
                         const FamilyVit& vit, torch::Device device, StepBudget* budget,
                         json* record) {
  // Clean source-domain scenes, but items of every class: like the paper's CLIP, the encoder
  // knows the categories and has never seen the target corruptions. (Trained on the six
  // source classes only, it maps shirt/coat onto t-shirt/pullover and the teacher, which
  // must name all ten, cannot tell them apart.)
  ds::DomainSpec domain = ds::StudentSourceDomain(ds::Split::kTrain);
  domain.scene.classes.clear();
  absl::StatusOr<ds::SampleGenerator> gen = MakeGenerator(&train, domain, sched.seed * 31 + 1);
  if (!gen.ok()) return gen.status();
  const StageSchedule& s = sched.vision;
  CellHeads heads(vision.d_vis, vision.GridSide());
  heads->to(device);
  const std::shared_ptr<torch::nn::Module>& enc = vit.module;
  std::vector<torch::Tensor> params = enc->parameters();
  for (const auto& p : heads->parameters()) params.push_back(p);
  torch::optim::AdamW optim(params, torch::optim::AdamWOptions(s.lr).weight_decay(1e-4));
  const ResumePaths rp = ResumeFor(opt.out_dir, "vision");
  int step = ReadResumeStep(rp);
  if (step > 0) {
    torch::load(enc, rp.model, device);
    torch::load(heads, rp.extra, device);
    torch::load(optim, rp.optim, device);
  }
  enc->train();
  ProgressBar bar("vision", s.steps, step);
  double cls_acc = 0;
  for (; step < s.steps; ++step) {
    if (budget->Exhausted()) {
      if (step > 0) WriteResume(rp, enc, &heads, optim, step);
      return budget->Stopped("vision", step);
    }
    torch::manual_seed(sched.seed * 1000003 + 1000000 + step);
    std::vector<ds::Sample> batch =
        Generate(*gen, static_cast<uint64_t>(step) * s.batch, s.batch, true);
    torch::Tensor pixels = PixelValuesOf(batch).to(device);
    auto [cls, color] = heads->forward(vit.patches(pixels));
    auto [cls_t, color_t] = CellTargets(batch);
    cls_t = cls_t.to(device);
    color_t = color_t.to(device);
    torch::Tensor loss = CellLoss(cls, color, cls_t, color_t);
    SetLr(optim, LearningRate(s, step));
    optim.zero_grad();
    loss.backward();
    optim.step();
    cls_acc =
        0.95 * cls_acc + 0.05 * (cls.argmax(-1) == cls_t).to(torch::kFloat).mean().item<double>();
    bar.Update(step + 1, loss.item<double>(), s.batch);
    if ((step + 1) % sched.checkpoint_every == 0 && step + 1 < s.steps) {
      WriteResume(rp, enc, &heads, optim, step + 1);
    }
    budget->Spend();
  }
  enc->eval();
  (*record)["vision"] = {{"steps", s.steps},
                         {"seconds", bar.seconds()},
                         {"final_loss", bar.loss()},
                         {"train_cell_class_accuracy", cls_acc}};
  RemoveResume(rp);
  return absl::OkStatus();
}

// Draws a visual-token mask per scene: unmasked with probability 1 - 2p, else a drop ratio
// uniform in [0.25, 0.75] (the range UTS keeps); mean drop ~ p for p = 0.25.
torch::Tensor RandomTokenMask(int64_t scenes, int64_t tokens, double p) {
  if (p <= 0) return torch::Tensor();
  torch::Tensor masked = torch::rand({scenes, 1}) < std::min(1.0, 2 * p);
  torch::Tensor ratio = torch::rand({scenes, 1}) * 0.5 + 0.25;
  torch::Tensor drop = (torch::rand({scenes, tokens}) < ratio) & masked;
  return drop.logical_not();
}

absl::Status TrainTower(const std::string& name, const StageSchedule& s,
                        const PretrainSchedule& sched, const PretrainOptions& opt,
                        const ds::SampleGenerator& gen, const ds::Tokenizer& tok,
                        const FamilyVit& vit, const FamilyTower& tower,
                        const torch::Tensor& token_cache,
                        const std::vector<ds::Sample>* cache_samples, double token_mask_p,
                        torch::Device device, StepBudget* budget, json* record) {
  // Everything above the frozen ViT (which the model's own copy of it stays equal to).
  std::vector<torch::Tensor> params;
  const std::shared_ptr<torch::nn::Module>& model = tower.module;
  for (auto& p : model->named_parameters()) {
    const bool frozen = absl::StartsWith(p.key(), tower.vit_prefix);
    p.value().set_requires_grad(!frozen);
    if (!frozen) params.push_back(p.value());
  }
  QueryHeads heads{nullptr};
  if (s.query_aux > 0) {
    heads = QueryHeads(tower.query_count, tower.query_dim);
    heads->to(device);
    for (const auto& p : heads->parameters()) params.push_back(p);
  }
  torch::optim::AdamW optim(params, torch::optim::AdamWOptions(s.lr).weight_decay(0.01));
  const ResumePaths rp = ResumeFor(opt.out_dir, name);
  int step = ReadResumeStep(rp);
  if (step > 0) {
    torch::load(model, rp.model, device);
    if (heads) torch::load(heads, rp.extra, device);
    torch::load(optim, rp.optim, device);
  }
  model->train();
  ProgressBar bar(name, s.steps, step);
  const uint64_t stage_salt = name == "teacher" ? 2000000 : 3000000;
  for (; step < s.steps; ++step) {
    if (budget->Exhausted()) {
      if (step > 0) WriteResume(rp, model, heads ? &heads : nullptr, optim, step);
      return budget->Stopped(name, step);
    }
    torch::manual_seed(sched.seed * 1000003 + stage_salt + step);
    std::vector<ds::Sample> batch;
    torch::Tensor vis;
    if (cache_samples != nullptr) {
      const int64_t n = static_cast<int64_t>(cache_samples->size());
      torch::Tensor idx =
          (torch::arange(s.batch, torch::kLong) + static_cast<int64_t>(step) * s.batch) % n;
      for (int64_t i = 0; i < s.batch; ++i)
        batch.push_back((*cache_samples)[idx[i].item<int64_t>()]);
      vis = token_cache.index_select(0, idx.to(device));
    } else {
      batch = Generate(gen, static_cast<uint64_t>(step) * s.batch, s.batch, false);
      torch::NoGradGuard no_grad;
      vis = vit.tokens(PixelValuesOf(batch).to(device));
    }
    std::vector<QaBatch> qa =
        BuildQaGroups(batch, tok, QuestionGroups(device), sched, static_cast<uint64_t>(step));
    std::vector<FamilyQuestionGroup> groups;
    int64_t questions = 0;
    for (const QaBatch& g : qa) {
      // Only the columns that predict an answer token carry a loss (PackQuestions).
      groups.push_back({g.text.to(device), g.valid.to(device), g.scene.to(device),
                        g.prompt.size(1) - 1, g.text.size(1) - g.prompt.size(1)});
      questions += static_cast<int64_t>(g.items.size());
    }
    torch::Tensor mask = RandomTokenMask(s.batch, vis.size(1), token_mask_p);
    // One query-adapter and prefix pass per scene, shared by its questions.
    std::vector<FamilyGroupOutput> outs =
        tower.forward_groups(vis, mask.defined() ? mask.to(device) : mask, groups, tower.dropout);
    torch::Tensor loss_sum = torch::zeros({}, vis.options());
    int64_t labelled = 0;
    for (size_t g = 0; g < outs.size(); ++g) {
      torch::Tensor labels = qa[g]
                                 .labels.narrow(1, groups[g].logit_first, groups[g].logit_count)
                                 .to(device)
                                 .reshape(-1);
      loss_sum = loss_sum +
                 torch::nn::functional::cross_entropy(
                     outs[g].logits.reshape({-1, outs[g].logits.size(-1)}), labels,
                     torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).reduction(
                         torch::kSum));
      labelled += (qa[g].labels != -100).sum().item<int64_t>();
    }
    torch::Tensor loss = loss_sum / static_cast<double>(std::max<int64_t>(1, labelled));
    if (heads) {  // per question row: each scene counts once for each of its questions
      std::vector<torch::Tensor> queries, rows;
      for (size_t g = 0; g < outs.size(); ++g) {
        queries.push_back(outs[g].queries);
        rows.push_back(groups[g].scene_index);
      }
      auto [cls, color] = heads->forward(torch::cat(queries));
      auto [cls_t, color_t] = CellTargets(batch);
      const torch::Tensor r = torch::cat(rows).cpu();
      loss = loss + s.query_aux *
                        CellLoss(cls, color, cls_t.index_select(0, r), color_t.index_select(0, r));
    }
    SetLr(optim, LearningRate(s, step));
    optim.zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(params, 1.0);
    optim.step();
    bar.Update(step + 1, loss.item<double>(), questions);
    if ((step + 1) % sched.checkpoint_every == 0 && step + 1 < s.steps) {
      WriteResume(rp, model, heads ? &heads : nullptr, optim, step + 1);
    }
    budget->Spend();
  }
  model->eval();
  (*record)[name] = {{"steps", s.steps},
                     {"scenes_per_step", s.batch},
                     {"seconds", bar.seconds()},
                     {"final_loss", bar.loss()},
                     {"query_aux", s.query_aux}};
  RemoveResume(rp);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PretrainSchedule> ParsePretrainSchedule(const std::string& json_text) {
  PretrainSchedule p;
  if (json_text.empty()) return absl::InvalidArgumentError("config has no pretrain section");
  try {
    json j = json::parse(json_text);
    auto stage = [&](const char* key, StageSchedule* s) {
      if (!j.contains(key)) return;
      const json& o = j.at(key);
      s->steps = o.value("steps", s->steps);
      s->batch = o.value("batch", s->batch);
      s->lr = o.value("lr", s->lr);
      s->warmup = o.value("warmup", s->warmup);
      s->query_aux = o.value("query_aux", s->query_aux);
      s->token_mask = o.value("token_mask", s->token_mask);
    };
    p.seed = j.value("seed", p.seed);
    stage("vision", &p.vision);
    stage("teacher", &p.teacher);
    stage("student", &p.student);
    p.student_cache_scenes = j.value("student_cache_scenes", p.student_cache_scenes);
    p.checkpoint_every = j.value("checkpoint_every", p.checkpoint_every);
    p.eval_scenes = j.value("eval_scenes", p.eval_scenes);
    p.max_answer_tokens = j.value("max_answer_tokens", p.max_answer_tokens);
    if (j.contains("tasks")) {
      const std::vector<std::string> tasks = j.at("tasks").get<std::vector<std::string>>();
      p.questions = p.captions = false;
      for (const std::string& t : tasks) {
        if (t == "vqa") {
          p.questions = true;
        } else if (t == "caption") {
          p.captions = true;
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("pretrain.tasks: unknown task \"", t, "\" (vqa, caption)"));
        }
      }
      if (!p.questions && !p.captions) {
        return absl::InvalidArgumentError("pretrain.tasks must name vqa and/or caption");
      }
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("pretrain section: ", e.what()));
  }
  for (const auto& [key, s] : {std::pair{"teacher", &p.teacher}, {"student", &p.student}}) {
    if (!(s->query_aux >= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("pretrain.", key, ".query_aux must be >= 0, got ", s->query_aux));
    }
  }
  if (p.teacher.token_mask > 0.5) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pretrain.teacher.token_mask must be at most 0.5, got ", p.teacher.token_mask));
  }
  return p;
}

absl::Status Pretrain(const PretrainOptions& opt) {
  const auto t0 = Clock::now();
  absl::StatusOr<FamilyConfig> family = LoadFamilyConfig(opt.config_path);
  if (!family.ok()) return family.status();
  absl::StatusOr<PretrainSchedule> parsed = ParsePretrainSchedule(family->pretrain_json);
  if (!parsed.ok()) return parsed.status();
  PretrainSchedule sched = *parsed;
  for (StageSchedule* s : {&sched.vision, &sched.teacher, &sched.student}) {
    s->steps = std::max(1, static_cast<int>(std::lround(s->steps * opt.scale_steps)));
    s->warmup = std::min(s->warmup, std::max(1, s->steps / 5));
  }
  sched.checkpoint_every = std::max(1, sched.checkpoint_every);
  ds::Tokenizer tok = ds::Tokenizer::SceneLanguage();
  if (tok.size() > family->vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer has ", tok.size(), " words, config vocab_size is only ", family->vocab_size));
  }
  if (sched.captions) {  // the longest caption must fit after the queries and the prompt
    const int prompt = static_cast<int>(tok.Encode(ds::CaptionPrompt(), true).size());
    for (const auto& [name, tower] :
         {std::pair{"teacher", &family->teacher}, std::pair{"student", &family->student}}) {
      // The image's LM positions: the queries, or a LLaVA family's patch tokens.
      const int image =
          family->architecture == "llava" ? family->vision.NumPatches() : tower->num_queries;
      const int need = image + prompt + ds::kMaxCaptionTokens;
      if (tower->max_positions < need) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, ".max_positions is ", tower->max_positions, "; captions need ", need, " (", image,
            " image tokens + ", prompt, " prompt + ", ds::kMaxCaptionTokens, " caption tokens)"));
      }
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(opt.out_dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create ", opt.out_dir));
  const torch::Device device = PickDevice(opt.force_cpu);
  SetThreads(TowerThreads(opt.threads, device));
  KeepFreedMemory();
  std::fprintf(stderr, "cdcca pretrain: %s on %s, %d intra-op threads, seed %llu\n",
               family->name.c_str(), device.str().c_str(), torch::get_num_threads(),
               static_cast<unsigned long long>(sched.seed));
  absl::StatusOr<ds::ImageSet> train =
      ds::LoadFashionMnist(ds::Split::kTrain, opt.fashion_mnist_dir);
  if (!train.ok()) return train.status();
  absl::StatusOr<ds::ImageSet> test = ds::LoadFashionMnist(ds::Split::kTest, opt.fashion_mnist_dir);
  if (!test.ok()) return test.status();

  json record;
  const std::string rec_path = opt.out_dir + "/pretrain_record.json";
  if (std::ifstream in(rec_path); in) {
    try {
      in >> record;
    } catch (const json::exception&) {
      record = json::object();
    }
  }
  auto save_record = [&] { std::ofstream(rec_path) << record.dump(2) << "\n"; };
  StepBudget budget(opt.stop_after_steps);

  try {
    // Stage 1: the shared ViT on the source domain.
    torch::manual_seed(sched.seed);
    const FamilyVit vit = MakeVit(*family);
    const std::shared_ptr<torch::nn::Module>& enc = vit.module;
    enc->to(device);
    // Each finished stage is kept in stages/ (for resuming): the ViT as one safetensors file,
    // each tower as the Hugging Face folder it ends as.
    const std::string stage_dir = opt.out_dir + "/stages";
    std::filesystem::create_directories(stage_dir, ec);
    if (ec) return absl::UnavailableError(absl::StrCat("cannot create ", stage_dir));
    const std::string enc_path = stage_dir + "/vision.safetensors";
    if (record.contains("vision") && std::filesystem::exists(enc_path)) {
      absl::StatusOr<SafetensorsContents> loaded = ReadSafetensors(enc_path);
      if (!loaded.ok()) return loaded.status();
      torch::NoGradGuard no_grad;
      auto params = enc->named_parameters();
      for (const auto& [name, t] : loaded->tensors) {
        if (!params.contains(name) || params[name].sizes() != t.sizes()) {
          return absl::DataLossError(
              absl::StrCat(enc_path, ": tensor ", name, " is not one of the family's ViT"));
        }
        params[name].copy_(t);
      }
      std::fprintf(stderr, "[vision  ] done earlier, loaded %s\n", enc_path.c_str());
    } else {
      if (absl::Status s =
              TrainVision(sched, opt, *train, family->vision, vit, device, &budget, &record);
          !s.ok()) {
        return s;
      }
      std::vector<std::pair<std::string, torch::Tensor>> tensors;
      for (const auto& p : enc->named_parameters()) {
        tensors.emplace_back(p.key(), p.value().detach().to(torch::kCPU).contiguous());
      }
      if (absl::Status s = WriteSafetensors(enc_path, tensors, {{"format", "pt"}}); !s.ok()) {
        return s;
      }
      save_record();
    }
    enc->eval();
    for (auto& p : enc->parameters()) p.set_requires_grad(false);

    // Source-domain test set, encoded once, for scoring the towers.
    absl::StatusOr<ds::SampleGenerator> eval_gen =
        MakeGenerator(&*test, ds::StudentSourceDomain(ds::Split::kTest), sched.seed * 31 + 9);
    if (!eval_gen.ok()) return eval_gen.status();
    std::vector<ds::Sample> eval_samples = Generate(*eval_gen, 0, sched.eval_scenes, false);
    torch::Tensor eval_tokens = EncodeAll(vit, eval_samples, device).cpu();

    // After each tower stage: its source-test VQA accuracy and/or captioning scores, through
    // the interface every program answers with.
    auto score_tower = [&](const std::string& name, const FamilyTower& m) -> absl::Status {
      std::unique_ptr<MultimodalModel> mm = m.wrap(device);
      json& rec = record[name];
      if (sched.questions) {
        absl::StatusOr<EvalResult> r =
            ScoreAnswers(*mm, eval_tokens, eval_samples, tok, sched.max_answer_tokens);
        if (!r.ok()) return r.status();
        rec["source_test_da"] = r->accuracy;
        rec["source_test_by_type"] = r->by_type;
        std::fprintf(stderr, "[%-8s] source-test DA accuracy %.2f%% (%d questions): %s\n",
                     name.c_str(), r->accuracy, r->questions, r->by_type.c_str());
      }
      if (sched.captions) {
        absl::StatusOr<CaptionEval> c =
            ScoreCaptionsOf(*mm, eval_tokens, eval_samples, tok, ds::kMaxCaptionTokens);
        if (!c.ok()) return c.status();
        rec["source_test_bleu4"] = c->bleu4;
        rec["source_test_cider"] = c->cider;
        std::fprintf(stderr,
                     "[%-8s] source-test captions BLEU-4 %.2f, CIDEr-D %.2f (%d images), e.g. "
                     "\"%s\"\n",
                     name.c_str(), c->bleu4, c->cider, c->images,
                     c->captions.empty() ? "" : c->captions.front().c_str());
      }
      return absl::OkStatus();
    };

    // A tower stage: a fresh model holding the trained ViT, trained unless stages/<name>/
    // holds it already (then loaded from there).
    auto tower_stage = [&](const std::string& name, const TowerConfig& tower, uint64_t seed,
                           auto train) -> absl::StatusOr<FamilyTower> {
      const std::string folder = stage_dir + "/" + name;
      if (record.contains(name) && std::filesystem::exists(folder + "/model.safetensors")) {
        absl::StatusOr<FamilyTower> loaded =
            LoadTower(folder, *family, tower, tok.tokens(), device);
        if (!loaded.ok()) return loaded.status();
        std::fprintf(stderr, "[%-8s] done earlier, loaded %s\n", name.c_str(), folder.c_str());
        return loaded;
      }
      torch::manual_seed(seed);
      absl::StatusOr<FamilyTower> model = NewTower(*family, tower, tok.tokens());
      if (!model.ok()) return model.status();
      {
        torch::NoGradGuard no_grad;
        auto own = model->module->named_parameters();
        for (const auto& p : enc->named_parameters()) {
          own[model->vit_prefix + p.key()].copy_(p.value());
        }
      }
      model->module->to(device);
      if (absl::Status s = train(*model); !s.ok()) return s;
      if (absl::Status s = score_tower(name, *model); !s.ok()) return s;
      if (absl::Status s = model->save(folder, json::object()); !s.ok()) return s;
      save_record();
      return model;
    };

    // Stage 2: the teacher on its broader domain, tokens from the frozen ViT per step.
    ds::DomainSpec teacher_domain = ds::TeacherDomain(ds::Split::kTrain);
    absl::StatusOr<ds::SampleGenerator> tgen =
        MakeGenerator(&*train, teacher_domain, sched.seed * 31 + 2);
    if (!tgen.ok()) return tgen.status();
    absl::StatusOr<FamilyTower> teacher =
        tower_stage("teacher", family->teacher, sched.seed + 2, [&](const FamilyTower& m) {
          return TrainTower("teacher", sched.teacher, sched, opt, *tgen, tok, vit, m,
                            torch::Tensor(), nullptr,
                            sched.teacher.token_mask >= 0 ? sched.teacher.token_mask
                                                          : teacher_domain.token_mask_probability,
                            device, &budget, &record);
        });
    if (!teacher.ok()) return teacher.status();

    // Stage 3: the student on the narrow source domain, from cached ViT tokens.
    absl::StatusOr<ds::SampleGenerator> sgen =
        MakeGenerator(&*train, ds::StudentSourceDomain(ds::Split::kTrain), sched.seed * 31 + 3);
    if (!sgen.ok()) return sgen.status();
    absl::StatusOr<FamilyTower> student = tower_stage(
        "student", family->student, sched.seed + 3, [&](const FamilyTower& m) -> absl::Status {
          const auto tc = Clock::now();
          std::vector<ds::Sample> cache = Generate(*sgen, 0, sched.student_cache_scenes, false);
          torch::Tensor cache_tokens = EncodeAll(vit, cache, device);
          for (ds::Sample& smp : cache) {  // keep the text, drop the pixels
            smp.image = ds::Image();
            smp.scene.image = ds::Image();
          }
          const double cache_seconds = Seconds(tc);
          std::fprintf(stderr, "[student ] cached %d scenes' tokens in %.1fs\n",
                       sched.student_cache_scenes, cache_seconds);
          if (absl::Status s = TrainTower("student", sched.student, sched, opt, *sgen, tok, vit, m,
                                          cache_tokens, &cache, 0.0, device, &budget, &record);
              !s.ok()) {
            return s;
          }
          record["student"]["cache_seconds"] = cache_seconds;
          return absl::OkStatus();
        });
    if (!student.ok()) return student.status();

    record["device"] = device.str();
    record["threads"] = torch::get_num_threads();  // intra-op; the BLAS has its own
    record["total_seconds_this_run"] = Seconds(t0);
    save_record();
    teacher->module->to(torch::kCPU);
    student->module->to(torch::kCPU);
    // The family: the student's folder, with the teacher's in teacher/; the student's
    // config.json names the family (sizes, vocabulary, schedule and this record).
    json family_json;
    family_json["name"] = family->name;
    family_json["architecture"] = family->architecture;
    family_json["vocabulary"] = family->vocabulary;
    family_json["vocab_size"] = family->vocab_size;
    family_json["vision"] = json::parse(VisionConfigToJson(family->vision));
    family_json["teacher"] = json::parse(TowerConfigToJson(family->teacher));
    family_json["student"] = json::parse(TowerConfigToJson(family->student));
    if (!family->pretrain_json.empty())
      family_json["pretrain"] = json::parse(family->pretrain_json);
    family_json["training"] = record;
    if (absl::Status s = teacher->save(opt.out_dir + "/teacher", {{"role", "teacher"}}); !s.ok()) {
      return s;
    }
    if (absl::Status s = student->save(opt.out_dir, {{"role", "student"}, {"family", family_json}});
        !s.ok()) {
      return s;
    }
    // What the student answers on two source-test scenes, for transformers to compare
    // (python3 scripts/hf_fixtures.py --check_family DIR).
    {
      const size_t k = std::min<size_t>(2, eval_samples.size());
      std::vector<ds::Sample> some(eval_samples.begin(), eval_samples.begin() + k);
      std::vector<std::vector<int64_t>> prompts;
      std::vector<std::string> texts;
      for (const ds::Sample& smp : some) {
        const std::string q = smp.questions.empty() ? std::string(ds::CaptionPrompt())
                                                    : smp.questions.front().question;
        const std::vector<int> ids = tok.Encode(q, /*add_bos=*/true);
        prompts.emplace_back(ids.begin(), ids.end());
        texts.push_back("<bos> " + q);
        if (family->architecture == "llava") {  // llava_family.h's layout: the image first
          prompts.back().insert(prompts.back().begin(), family->vocab_size - 1);
          texts.back() = "<image> " + texts.back();
        }
      }
      torch::NoGradGuard no_grad;
      std::unique_ptr<MultimodalModel> mm = student->wrap(torch::kCPU);
      mm->module().eval();
      if (absl::Status s = WriteFamilyParityCases(opt.out_dir, *mm, PixelValuesOf(some), prompts,
                                                  texts, sched.max_answer_tokens + 1);
          !s.ok()) {
        return s;
      }
    }
    std::fprintf(stderr, "cdcca pretrain: wrote %s in %.1fs\n", opt.out_dir.c_str(), Seconds(t0));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("pretrain: ", e.what()));
  }
  return absl::OkStatus();
}

namespace {

// What model-eval compares: the teacher and the student at each precision, loaded from the
// family's folders as any program loads a model folder (LoadModel), in eval() mode.
struct EvalModels {
  ds::ImageSet test;  // the Fashion-MNIST test split the scenes are drawn from
  std::vector<std::pair<std::string, std::unique_ptr<MultimodalModel>>> models;
};

// Everything model-eval's tables share: device and threads, the test split, the models.
absl::StatusOr<EvalModels> LoadEvalModels(const AccuracyOptions& opt) {
  const torch::Device device = PickDevice(opt.force_cpu);
  SetThreads(TowerThreads(opt.threads, device));
  absl::StatusOr<ds::ImageSet> test = ds::LoadFashionMnist(ds::Split::kTest, opt.fashion_mnist_dir);
  if (!test.ok()) return test.status();
  if (!std::filesystem::exists(opt.checkpoint_dir + "/teacher/config.json")) {
    return absl::NotFoundError(
        absl::StrCat(opt.checkpoint_dir, " is not a family: it has no teacher/config.json"));
  }
  EvalModels out;
  out.test = *std::move(test);
  for (const auto& [name, dir, precision] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"teacher fp32", opt.checkpoint_dir + "/teacher", "fp32"},
           {"student fp32", opt.checkpoint_dir, "fp32"},
           {"student int8", opt.checkpoint_dir, "int8"},
           {"student int4", opt.checkpoint_dir, "int4"}}) {
    ModelOptions o;
    o.precision = precision;
    o.device = device;
    absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(dir, o);
    if (!m.ok()) return m.status();
    (*m)->module().eval();
    out.models.emplace_back(name, *std::move(m));
  }
  return out;
}

std::string TableHeader(const EvalModels& e, const std::string& first_column) {
  std::string table = absl::StrCat("| ", first_column, " | ");
  for (const auto& [name, m] : e.models) absl::StrAppend(&table, name, " | ");
  table += "\n|---|";
  for (size_t i = 0; i < e.models.size(); ++i) table += "---|";
  return table + "\n";
}

}  // namespace

absl::StatusOr<std::string> CaptionTable(const AccuracyOptions& opt) {
  ds::Tokenizer tok = ds::Tokenizer::SceneLanguage();
  try {
    absl::StatusOr<EvalModels> e = LoadEvalModels(opt);
    if (!e.ok()) return e.status();
    const ds::ImageSet* test = &e->test;
    // Per model: every category's candidates and references, pooled for "all".
    const size_t k = e->models.size();
    std::vector<std::vector<std::string>> all_cands(k);
    std::vector<std::vector<std::vector<std::string>>> all_refs(k);
    std::string table = TableHeader(*e, "captions: BLEU-4 / CIDEr-D (%)");
    for (ds::CategoryDomain c :
         {ds::CategoryDomain::kIn, ds::CategoryDomain::kNear, ds::CategoryDomain::kOut}) {
      absl::StatusOr<ds::SampleGenerator> gen =
          MakeGenerator(test, ds::CategoryShiftDomain(c), opt.seed);
      if (!gen.ok()) return gen.status();
      std::vector<ds::Sample> samples = Generate(*gen, 0, opt.scenes, false);
      absl::StrAppend(&table, "| ", std::string(ds::CategoryDomainName(c)), " |");
      for (size_t i = 0; i < k; ++i) {
        absl::StatusOr<torch::Tensor> tokens = EncodeWith(*e->models[i].second, samples);
        if (!tokens.ok()) return tokens.status();
        absl::StatusOr<CaptionEval> scored =
            ScoreCaptionsOf(*e->models[i].second, *tokens, samples, tok, ds::kMaxCaptionTokens);
        if (!scored.ok()) return scored.status();
        const CaptionEval& r = *scored;
        absl::StrAppend(&table, absl::StrFormat(" %.1f / %.1f |", r.bleu4, r.cider));
        for (size_t j = 0; j < samples.size(); ++j) {
          all_cands[i].push_back(r.captions[j]);
          all_refs[i].push_back(samples[j].captions);
        }
        if (i < 2) {
          std::fprintf(stderr, "%s, %s: \"%s\" (references: \"%s\")\n",
                       std::string(ds::CategoryDomainName(c)).c_str(), e->models[i].first.c_str(),
                       r.captions.front().c_str(), samples.front().captions.front().c_str());
        }
      }
      table += "\n";
    }
    absl::StrAppend(&table, "| all |");
    for (size_t i = 0; i < k; ++i) {
      const ds::CaptionScores s = ds::ScoreCaptions(all_cands[i], all_refs[i]);
      absl::StrAppend(&table, absl::StrFormat(" %.1f / %.1f |", 100 * s.bleu[3], 100 * s.cider));
    }
    return table + "\n";
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("model-eval: ", e.what()));
  }
}

double AtcThreshold(std::vector<double> confidences, double accuracy) {
  if (confidences.empty()) return 0.0;
  std::sort(confidences.begin(), confidences.end());
  const size_t n = confidences.size();
  const size_t below = static_cast<size_t>(
      std::llround(std::clamp(1.0 - accuracy, 0.0, 1.0) * static_cast<double>(n)));
  if (below >= n) return std::nextafter(confidences.back(), 2.0);  // none at or above it
  return confidences[below];
}

double AtcEstimate(const std::vector<double>& confidences, double threshold) {
  if (confidences.empty()) return 0.0;
  size_t at_or_above = 0;
  for (double c : confidences) at_or_above += c >= threshold ? 1 : 0;
  return static_cast<double>(at_or_above) / static_cast<double>(confidences.size());
}

absl::StatusOr<std::string> AccuracyTable(const AccuracyOptions& opt) {
  ds::Tokenizer tok = ds::Tokenizer::SceneLanguage();
  try {
    absl::StatusOr<EvalModels> loaded = LoadEvalModels(opt);
    if (!loaded.ok()) return loaded.status();
    const ds::ImageSet* test = &loaded->test;
    auto& models = loaded->models;
    struct Row {
      std::string name;
      ds::DomainSpec spec;
      int severity;
    };
    std::vector<Row> rows;
    rows.push_back({"source test (clean)", ds::StudentSourceDomain(ds::Split::kTest), 0});
    const auto& seen = ds::TeacherSeenShifts();
    for (ds::ImageShift shift : ds::AllImageShifts()) {
      const bool teacher_saw = std::find(seen.begin(), seen.end(), shift) != seen.end();
      for (int sev : {1, 3, 5}) {
        rows.push_back({absl::StrCat(std::string(ds::ImageShiftName(shift)),
                                     teacher_saw ? "" : " (held out)", " s", sev),
                        ds::ImageShiftDomain(shift, sev), sev});
      }
    }
    rows.push_back({"text shift (paraphrase + knowledge)", ds::TextShiftDomain(), 0});
    std::string table = TableHeader(*loaded, "domain");
    std::vector<double> sev5_sum(models.size(), 0.0);
    std::vector<double> source(models.size(), 0.0);
    std::vector<double> threshold(models.size(), 0.0);  // opt.estimates: from the source row
    int sev5_rows = 0;
    for (const Row& row : rows) {
      absl::StatusOr<ds::SampleGenerator> gen = MakeGenerator(test, row.spec, opt.seed);
      if (!gen.ok()) return gen.status();
      std::vector<ds::Sample> samples = Generate(*gen, 0, opt.scenes, false);
      absl::StrAppend(&table, "| ", row.name, " |");
      for (size_t i = 0; i < models.size(); ++i) {
        absl::StatusOr<torch::Tensor> tokens = EncodeWith(*models[i].second, samples);
        if (!tokens.ok()) return tokens.status();
        absl::StatusOr<EvalResult> scored =
            ScoreAnswers(*models[i].second, *tokens, samples, tok, 4);
        if (!scored.ok()) return scored.status();
        const EvalResult& r = *scored;
        if (opt.estimates) {
          if (&row == &rows.front()) {
            threshold[i] = AtcThreshold(r.first_token_confidence, r.accuracy / 100);
          }
          absl::StrAppend(
              &table, absl::StrFormat(" %.1f (%.1f) |", r.accuracy,
                                      100 * AtcEstimate(r.first_token_confidence, threshold[i])));
        } else {
          absl::StrAppend(&table, absl::StrFormat(" %.1f |", r.accuracy));
        }
        if (row.severity == 5) sev5_sum[i] += r.accuracy;
        if (&row == &rows.front()) {
          source[i] = r.accuracy;
          std::fprintf(stderr, "%s, %s: %s\n", row.name.c_str(), models[i].first.c_str(),
                       r.by_type.c_str());
        }
      }
      if (row.severity == 5) ++sev5_rows;
      table += "\n";
      std::fprintf(stderr, "\r%s", row.name.c_str());
    }
    std::fprintf(stderr, "\n");
    absl::StrAppend(&table, "| mean over image shifts, severity 5 |");
    for (double v : sev5_sum) absl::StrAppend(&table, absl::StrFormat(" %.1f |", v / sev5_rows));
    absl::StrAppend(&table, "\n| drop from source at severity 5 |");
    for (size_t i = 0; i < models.size(); ++i) {
      absl::StrAppend(&table, absl::StrFormat(" %.1f |", source[i] - sev5_sum[i] / sev5_rows));
    }
    table += "\n";
    return table;
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("model-eval: ", e.what()));
  }
}

}  // namespace cdcca::model
