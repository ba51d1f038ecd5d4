// AKD on Hugging Face pairs (distill/pair_distiller.h) on the tiny random checkpoints under
// tests/fixtures/hf/models/:
// - the training forward: on all tokens it gives the logits the generation path gives
//   (whose parity with transformers the parity tests hold); a dropped token has no effect;
// - the trainable set: the paper's members under the checkpoint's names, LoRA drawn from the
//   seed alone, nothing else changes in a job;
// - a job: the loss falls, the KL term runs only with identical tokenizers and the job says
//   why it does not, an int8 student trains on the CPU;
// - a complete sample (every token of the frame): the teacher labels it from all its tokens;
// - several devices' jobs run together over one student give each what its job alone gives;
// - the same for a T5 language model (encoder-decoder: the prompt in the encoder, the answer
//   teacher-forced in the decoder);
// - the device learners (distill/self_learner.h): TENT moves the norms alone and lowers
//   its entropy, CoTTA's stochastic restore returns the set to its source state.
#include "distill/pair_distiller.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "compress/named_tensors.h"
#include "distill/greedy_answers.h"
#include "distill/self_learner.h"
#include "model/arch/layers.h"
#include "model/arch/multimodal_model.h"
#include "model/hub/safetensors.h"
#include "model/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"

namespace cdcca::distill {
namespace {

using model::MultimodalModel;

std::string FixtureDir(const std::string& variant) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + variant;
}

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A loaded folder and its text codec.
struct Side {
  std::unique_ptr<MultimodalModel> model;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer, qformer;
  PairSide side;
};

std::unique_ptr<Side> LoadSide(const std::string& variant, const std::string& precision = "fp32") {
  const std::string dir = FixtureDir(variant);
  auto s = std::make_unique<Side>();
  model::ModelOptions o;
  o.precision = precision;
  absl::StatusOr<std::unique_ptr<MultimodalModel>> m = model::LoadModel(dir, o);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return nullptr;
  s->model = *std::move(m);
  s->tokenizer = *tokenizer::Tokenizer::FromFolder(dir);
  if (variant.rfind("instructblip", 0) == 0) {
    s->qformer = *tokenizer::Tokenizer::FromFolder(dir + "/qformer_tokenizer");
  }
  Side* raw = s.get();
  s->side.model = raw->model.get();
  s->side.encode = [raw](const std::string& text,
                         bool special) -> absl::StatusOr<std::vector<int64_t>> {
    absl::StatusOr<std::vector<int32_t>> ids = raw->tokenizer->Encode(text, special);
    if (!ids.ok()) return ids.status();
    return std::vector<int64_t>(ids->begin(), ids->end());
  };
  s->side.decode = [raw](const std::vector<int64_t>& ids) {
    return raw->tokenizer->Decode(std::vector<int32_t>(ids.begin(), ids.end()), true);
  };
  if (s->qformer) {
    s->side.qformer_encode =
        [raw](const std::string& text) -> absl::StatusOr<std::vector<int64_t>> {
      absl::StatusOr<std::vector<int32_t>> ids = raw->qformer->Encode(text, true);
      if (!ids.ok()) return ids.status();
      return std::vector<int64_t>(ids->begin(), ids->end());
    };
  }
  s->side.tokenizer_id = FileBytes(dir + "/tokenizer.json");
  return s;
}

// The first fixture case's prompt and its tower tokens (from the model's own tower).
struct Case {
  std::string prompt;
  model::MultimodalInputs inputs;
  torch::Tensor tokens;  // [N, D]
};

Case FirstCase(const std::string& variant, MultimodalModel& m) {
  const std::string dir = FixtureDir(variant);
  std::ifstream in(dir + "/expected.json");
  const nlohmann::json c = nlohmann::json::parse(in)["cases"][0];
  Case out;
  out.prompt = c["prompt"].get<std::string>();
  absl::StatusOr<model::SafetensorsContents> pixels =
      model::ReadSafetensors(dir + "/expected_pixels.safetensors");
  EXPECT_TRUE(pixels.ok()) << pixels.status();
  for (const auto& [name, t] : pixels->tensors) {
    if (name == "case0") out.inputs.pixel_values = t.unsqueeze(0);
  }
  out.inputs.input_ids =
      torch::tensor(c["input_ids"].get<std::vector<int64_t>>(), torch::kLong).unsqueeze(0);
  if (c.contains("qformer_input_ids")) {
    out.inputs.qformer_input_ids =
        torch::tensor(c["qformer_input_ids"].get<std::vector<int64_t>>(), torch::kLong)
            .unsqueeze(0);
    out.inputs.qformer_attention_mask = torch::ones_like(out.inputs.qformer_input_ids);
  }
  absl::StatusOr<torch::Tensor> tokens = m.EncodeImages(out.inputs);
  EXPECT_TRUE(tokens.ok()) << tokens.status();
  out.tokens = (*tokens)[0];
  return out;
}

model::TokenInputs TokenInputsOf(const Case& c) {
  model::TokenInputs in;
  in.visual_tokens = c.tokens.unsqueeze(0);
  in.input_ids = c.inputs.input_ids;
  in.qformer_input_ids = c.inputs.qformer_input_ids;
  in.qformer_attention_mask = c.inputs.qformer_attention_mask;
  return in;
}

class TokenForwardTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenForwardTest, AllTokensGiveTheGenerationPathsLogits) {
  std::unique_ptr<Side> s = LoadSide(GetParam());
  ASSERT_NE(s, nullptr);
  Case c = FirstCase(GetParam(), *s->model);
  model::GreedyOptions g;
  g.max_new_tokens = 1;
  ASSERT_OK_AND_ASSIGN(model::GreedyResult gen, s->model->Generate(c.inputs, g));
  torch::NoGradGuard no_grad;
  ASSERT_OK_AND_ASSIGN(model::TokenForward f, s->model->ForwardTokens(TokenInputsOf(c)));
  const int64_t t = c.inputs.input_ids.size(1);
  ASSERT_EQ(f.logits.size(1), t);
  EXPECT_TRUE(torch::allclose(f.logits[0][t - 1], gen.first_logits[0], 1e-4, 1e-4));
  EXPECT_EQ(f.representation.size(1), t);
  EXPECT_EQ(f.queries.size(0), 1);
  EXPECT_TRUE(f.queries_present.all().item<bool>());
}

TEST_P(TokenForwardTest, ADroppedTokenHasNoEffect) {
  std::unique_ptr<Side> s = LoadSide(GetParam());
  ASSERT_NE(s, nullptr);
  Case c = FirstCase(GetParam(), *s->model);
  torch::NoGradGuard no_grad;
  model::TokenInputs in = TokenInputsOf(c);
  const int64_t n = c.tokens.size(0);
  in.visual_present = torch::ones({1, n}, torch::kBool);
  in.visual_present[0][1] = false;
  in.visual_present[0][n - 1] = false;
  ASSERT_OK_AND_ASSIGN(model::TokenForward a, s->model->ForwardTokens(in));
  in.visual_tokens = in.visual_tokens.clone();
  in.visual_tokens[0][1].fill_(7.0);
  in.visual_tokens[0][n - 1].normal_();
  ASSERT_OK_AND_ASSIGN(model::TokenForward b, s->model->ForwardTokens(in));
  // The last position reads the image through attention only: it must not see the change.
  const int64_t t = in.input_ids.size(1);
  EXPECT_TRUE(torch::equal(a.logits[0][t - 1], b.logits[0][t - 1]));
  // And a kept token does change it.
  in.visual_tokens[0][0].fill_(7.0);
  ASSERT_OK_AND_ASSIGN(model::TokenForward d, s->model->ForwardTokens(in));
  EXPECT_FALSE(torch::equal(a.logits[0][t - 1], d.logits[0][t - 1]));
}

TEST_P(TokenForwardTest, TrainableSetIsThePapersUnderCheckpointNames) {
  std::unique_ptr<Side> s = LoadSide(GetParam());
  ASSERT_NE(s, nullptr);
  model::AdapterOptions a;
  a.lora_rank = 4;
  a.seed = 11;
  ASSERT_OK(s->model->AddAdapters(a));
  EXPECT_FALSE(s->model->AddAdapters(a).ok());
  model::NamedTensors set = s->model->TrainableParameters();
  const bool llava = GetParam().rfind("llava", 0) == 0;
  int lora = 0, norms = 0, visual = 0;
  for (const auto& [name, t] : set) {
    SCOPED_TRACE(name);
    EXPECT_EQ(name.find("vision"), std::string::npos);
    EXPECT_EQ(name.find("embed"), std::string::npos);
    EXPECT_EQ(name.find("qformer."), std::string::npos);
    if (name.find(".lora_") != std::string::npos) {
      ++lora;
      EXPECT_TRUE(name.find("q_proj") != std::string::npos ||
                  name.find("v_proj") != std::string::npos);
    }
    if (name.find("norm") != std::string::npos) ++norms;
    if (name == "query_tokens" || name.find("multi_modal_projector") != std::string::npos) {
      ++visual;
    }
    // The name is the checkpoint's: transformers' LM layers sit under language_model.
    if (name != "query_tokens" && name.find("multi_modal_projector") == std::string::npos) {
      EXPECT_NE(name.find("language_model."), std::string::npos);
    }
  }
  EXPECT_EQ(lora, 2 * 2 * 2);   // 2 layers x q, v x A, B
  EXPECT_EQ(norms, 2 * 2 + 1);  // two per layer and the final norm
  EXPECT_EQ(visual, llava ? 2 : 1);
  // The same seed draws the same LoRA in another load.
  std::unique_ptr<Side> again = LoadSide(GetParam());
  ASSERT_OK(again->model->AddAdapters(a));
  model::NamedTensors set2 = again->model->TrainableParameters();
  ASSERT_EQ(set.size(), set2.size());
  for (size_t i = 0; i < set.size(); ++i) {
    EXPECT_EQ(set[i].first, set2[i].first);
    EXPECT_TRUE(torch::equal(set[i].second, set2[i].second)) << set[i].first;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TokenForwardTest,
                         ::testing::Values("llava_clip_llama", "llava_siglip_qwen2", "blip2_llama",
                                           "instructblip_llama"));

// TokenInputs::logits_tail: the last N positions' logits of a left-padded batch, as the
// whole forward pass gives them, and everything else unchanged.
class LogitsTailTest : public ::testing::TestWithParam<std::string> {};

// Two left-padded rows of the first case for `s`: its prompt with an answer of three ids,
// and a longer prompt with an answer of one.
void TwoRowBatch(Side& s, const Case& c, TextBatch* out) {
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> short_prompt, SidePromptIds(s.side, c.prompt));
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> long_prompt,
                       SidePromptIds(s.side, c.prompt + " Say more about it."));
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> qformer, SideQformerIds(s.side, c.prompt));
  ASSERT_GT(long_prompt.size(), short_prompt.size());
  const std::vector<int64_t> a1 = {5, 6, 7}, a2 = {9};
  const torch::Tensor tokens = c.tokens.unsqueeze(0);
  const torch::Tensor present = torch::ones({1, c.tokens.size(0)}, torch::kBool);
  *out = CollateHfRows({{tokens, present, {}, &short_prompt, &a1, &qformer},
                        {tokens, present, {}, &long_prompt, &a2, &qformer}},
                       torch::kCPU);
}

TEST_P(LogitsTailTest, IsTheLastPositionsOfTheWholeLogits) {
  std::unique_ptr<Side> s = LoadSide(GetParam());
  ASSERT_NE(s, nullptr);
  Case c = FirstCase(GetParam(), *s->model);
  TextBatch batch;
  ASSERT_NO_FATAL_FAILURE(TwoRowBatch(*s, c, &batch));
  torch::NoGradGuard no_grad;
  ASSERT_OK_AND_ASSIGN(model::TokenForward whole, s->model->ForwardTokens(batch.inputs));
  const int64_t t = batch.inputs.input_ids.size(1);
  ASSERT_EQ(whole.logits.size(1), t);
  for (int64_t n : {int64_t{4}, int64_t{1}, t + 3}) {
    SCOPED_TRACE(n);
    batch.inputs.logits_tail = n;
    ASSERT_OK_AND_ASSIGN(model::TokenForward part, s->model->ForwardTokens(batch.inputs));
    const int64_t kept = std::min(n, t);
    ASSERT_EQ(part.logits.sizes(), (std::vector<int64_t>{2, kept, whole.logits.size(2)}));
    EXPECT_TRUE(torch::allclose(part.logits, whole.logits.narrow(1, t - kept, kept), 1e-5, 1e-5));
    EXPECT_TRUE(torch::equal(part.representation, whole.representation));
    EXPECT_TRUE(torch::equal(part.queries, whole.queries));
  }
}

// The answer's cross-entropy from the tail's logits has the whole pass's gradients in the
// trainable set: the training step that asks for the tail alone moves the student as before.
TEST_P(LogitsTailTest, GivesTheWholePassGradients) {
  std::unique_ptr<Side> s = LoadSide(GetParam());
  ASSERT_NE(s, nullptr);
  ASSERT_OK(s->model->AddAdapters({}));
  Case c = FirstCase(GetParam(), *s->model);
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    for (auto& [name, t] : s->model->TrainableParameters()) {
      if (name.find("lora_b") != std::string::npos) t.normal_(0.0, 0.3);
    }
  }
  TextBatch batch;
  ASSERT_NO_FATAL_FAILURE(TwoRowBatch(*s, c, &batch));
  model::NamedTensors trainable = s->model->TrainableParameters();
  for (auto& [name, t] : trainable) t.set_requires_grad(true);
  auto gradients = [&](int64_t tail) {
    for (auto& [name, t] : trainable) t.mutable_grad() = torch::Tensor();
    batch.inputs.logits_tail = tail;
    absl::StatusOr<model::TokenForward> f = s->model->ForwardTokens(batch.inputs);
    EXPECT_TRUE(f.ok()) << f.status();
    const int64_t n = f->logits.size(1);
    const torch::Tensor targets = batch.targets.narrow(1, batch.targets.size(1) - n, n);
    const torch::Tensor predictors = targets >= 0;
    torch::nn::functional::cross_entropy(f->logits.index({predictors}), targets.index({predictors}))
        .backward();
    std::vector<torch::Tensor> out;
    for (auto& [name, t] : trainable) {
      out.push_back(t.grad().defined() ? t.grad().clone() : torch::zeros_like(t));
    }
    return out;
  };
  const std::vector<torch::Tensor> whole = gradients(0), tail = gradients(4);
  int nonzero = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    SCOPED_TRACE(trainable[i].first);
    const double scale = 1e-5 * (1.0 + whole[i].abs().max().item<double>());
    EXPECT_LE((tail[i] - whole[i]).abs().max().item<double>(), scale);
    nonzero += whole[i].abs().sum().item<double>() > 0;
  }
  EXPECT_GT(nonzero, static_cast<int>(whole.size()) / 2);
}

INSTANTIATE_TEST_SUITE_P(Families, LogitsTailTest,
                         ::testing::Values("llava_clip_llama", "llava_siglip_qwen2", "blip2_llama",
                                           "blip2_opt", "instructblip_llama", "blip2_flan_t5",
                                           "instructblip_flan_t5"));

// A job of `steps` on the first case with a few token masks.
struct JobRun {
  absl::StatusOr<PairJobResult> result;
  model::NamedTensors before, frozen_before, frozen_after;
};

std::vector<PairSample> Samples(const Case& c, int count) {
  std::vector<PairSample> out;
  torch::manual_seed(3);
  for (int i = 0; i < count; ++i) {
    PairSample s;
    s.tokens = c.tokens + 0.05 * torch::randn_like(c.tokens);
    s.present = torch::rand({c.tokens.size(0)}) > 0.3;
    s.prompt = c.prompt;
    out.push_back(s);
  }
  return out;
}

model::NamedTensors Frozen(torch::nn::Module& m, const model::NamedTensors& trainable) {
  std::set<const void*> train;
  for (const auto& [n, t] : trainable) train.insert(t.data_ptr());
  model::NamedTensors out;
  for (const auto& p : m.named_parameters()) {
    if (p.value().numel() > 1 && !train.count(p.value().data_ptr())) {
      out.emplace_back(p.key(), p.value().detach().clone());
    }
  }
  return out;
}

// Teacher and student from one fixture folder, the student with its adapters.
void LoadPair(const std::string& variant, std::unique_ptr<Side>* teacher,
              std::unique_ptr<Side>* student, const model::AdapterOptions& adapters = {}) {
  *teacher = LoadSide(variant);
  *student = LoadSide(variant);
  ASSERT_NE(*teacher, nullptr);
  ASSERT_NE(*student, nullptr);
  ASSERT_OK((*student)->model->AddAdapters(adapters));
}

// Gives each sample the case's frame (pixel values, slightly perturbed per sample) and makes
// `student` read it through its own tower: what the cloud does for a student that trains its
// vision side.
void GiveFrames(const Case& c, std::vector<PairSample>* samples, Side* student) {
  torch::manual_seed(11);
  for (PairSample& s : *samples) {
    s.pixels = c.inputs.pixel_values[0] + 0.05 * torch::randn_like(c.inputs.pixel_values[0]);
  }
  student->side.reads_pixels = true;
}

class PairJobTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PairJobTest, SameTokenizerPairLearnsTheTeachersAnswersWithTheKl) {
  std::unique_ptr<Side> teacher, student;
  ASSERT_NO_FATAL_FAILURE(LoadPair(GetParam(), &teacher, &student));
  Case c = FirstCase(GetParam(), *student->model);
  // The student's norms and LoRA move away from the teacher first, so there is a gap to close.
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    for (auto& [name, t] : student->model->TrainableParameters()) {
      if (name.find("lora_b") != std::string::npos) t.normal_(0.0, 0.5);
    }
  }
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("akd"));
  config.l_kl = 0.5;
  JobOptions o;
  o.max_steps = 25;
  o.batch_size = 4;
  o.lr = 1e-2;
  o.max_answer_tokens = 4;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                       PairDistiller::Create(teacher->side, student->side, config, o));
  EXPECT_TRUE(job->same_tokenizer());
  model::NamedTensors before;
  for (auto& [n, t] : student->model->TrainableParameters()) before.emplace_back(n, t.clone());
  model::NamedTensors frozen =
      Frozen(student->model->module(), student->model->TrainableParameters());
  ASSERT_OK_AND_ASSIGN(PairJobResult r, job->Run(Samples(c, 6)));
  EXPECT_TRUE(r.kl_used);
  EXPECT_TRUE(r.notes.empty());
  ASSERT_EQ(r.pseudo_labels.size(), 6u);
  std::map<std::string, LossTerm> terms;
  for (const LossTerm& t : r.stats.terms) terms[t.name] = t;
  ASSERT_TRUE(terms.count("kl") && terms.count("query") && terms.count("repr") &&
              terms.count("ce"));
  EXPECT_LT(terms["ce"].last, terms["ce"].first);
  EXPECT_LT(terms["kl"].last, terms["kl"].first);
  EXPECT_EQ(r.stats.steps, 25);
  // The trainable set moved (every member that gets a gradient), nothing else did.
  ASSERT_EQ(r.trainable.size(), before.size());
  int moved = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(r.trainable[i].first, before[i].first);
    moved += !torch::equal(r.trainable[i].second, before[i].second.to(torch::kFloat));
  }
  EXPECT_GT(moved, static_cast<int>(before.size()) / 2);
  model::NamedTensors after =
      Frozen(student->model->module(), student->model->TrainableParameters());
  ASSERT_EQ(after.size(), frozen.size());
  for (size_t i = 0; i < frozen.size(); ++i) {
    EXPECT_TRUE(torch::equal(after[i].second, frozen[i].second)) << frozen[i].first;
  }
}

// A complete sample (the cloud recomputed every token from the frame): the teacher labels it
// from all its tokens, whatever UTS kept; the student trains on its present ones. Masks that
// keep two tokens make the teacher's answer differ from its all-token one on some sample
// (checked first, so the test can tell the two apart).
TEST_P(PairJobTest, ACompleteSampleIsLabelledFromAllItsTokens) {
  std::unique_ptr<Side> teacher, student;
  ASSERT_NO_FATAL_FAILURE(LoadPair(GetParam(), &teacher, &student));
  Case c = FirstCase(GetParam(), *student->model);
  const int64_t n = c.tokens.size(0);
  std::vector<PairSample> kept_only, complete;
  std::vector<std::string> masked_labels, all_labels;
  torch::manual_seed(11);
  for (int i = 0; i < 6; ++i) {
    PairSample s;
    s.tokens = c.tokens + 0.5 * torch::randn_like(c.tokens);
    s.present = torch::zeros({n}, torch::kBool);
    s.present[i % n] = true;
    s.present[(i + 3) % n] = true;
    s.prompt = c.prompt;
    PairSample all = s;
    all.present = torch::Tensor();
    ASSERT_OK_AND_ASSIGN(std::string masked, GreedyAnswer(teacher->side, s, 4));
    ASSERT_OK_AND_ASSIGN(std::string full, GreedyAnswer(teacher->side, all, 4));
    masked_labels.push_back(masked);
    all_labels.push_back(full);
    kept_only.push_back(s);
    s.complete = true;
    complete.push_back(s);
  }
  ASSERT_NE(masked_labels, all_labels) << "the masks never change the teacher's answer";

  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("akd"));
  JobOptions o;
  o.max_steps = 3;
  o.batch_size = 2;
  o.max_answer_tokens = 4;
  const compress::NamedTensors start = compress::Fp32Clones(student->model->TrainableParameters());
  auto run = [&](const std::vector<PairSample>& samples) {
    EXPECT_OK(compress::CopyInto(start, student->model->TrainableParameters()));
    absl::StatusOr<std::unique_ptr<PairDistiller>> job =
        PairDistiller::Create(teacher->side, student->side, config, o);
    EXPECT_TRUE(job.ok()) << job.status();
    return (*job)->Run(samples);
  };
  ASSERT_OK_AND_ASSIGN(PairJobResult on_kept, run(kept_only));
  EXPECT_EQ(on_kept.pseudo_labels, masked_labels);
  ASSERT_OK_AND_ASSIGN(PairJobResult teacher_all, run(complete));
  EXPECT_EQ(teacher_all.pseudo_labels, all_labels);
  std::vector<PairSample> complete_student_all = complete;
  for (PairSample& s : complete_student_all) s.present = torch::Tensor();
  ASSERT_OK_AND_ASSIGN(PairJobResult both_all, run(complete_student_all));
  EXPECT_EQ(both_all.pseudo_labels, all_labels);
  // The same labels and steps; only what the student reads differs, and so does its state.
  bool differs = false;
  for (size_t i = 0; i < teacher_all.trainable.size(); ++i) {
    differs =
        differs || !torch::equal(teacher_all.trainable[i].second, both_all.trainable[i].second);
  }
  EXPECT_TRUE(differs);
}

// An answer's teacher-forced probability is the product of the probabilities greedy
// decoding (with its KV cache) chose its ids with, the EOS included: the update guard's
// teacher_probability measure reads the same distributions the teacher answers from.
TEST_P(PairJobTest, AnAnswersProbabilityIsWhatGreedyDecodingChoseItWith) {
  std::unique_ptr<Side> teacher, student;
  ASSERT_NO_FATAL_FAILURE(LoadPair(GetParam(), &teacher, &student));
  Case c = FirstCase(GetParam(), *teacher->model);
  teacher->model->module().eval();
  PairSample s;
  s.tokens = c.tokens;
  s.prompt = c.prompt;
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> prompt, SidePromptIds(teacher->side, c.prompt));
  ASSERT_OK_AND_ASSIGN(std::vector<int64_t> qformer, SideQformerIds(teacher->side, c.prompt));
  model::TokenInputs in;
  in.visual_tokens = c.tokens.unsqueeze(0);
  in.visual_present = torch::ones({1, c.tokens.size(0)}, torch::kBool);
  in.input_ids = torch::tensor(prompt, torch::kLong).unsqueeze(0);
  if (!qformer.empty()) {
    in.qformer_input_ids = torch::tensor(qformer, torch::kLong).unsqueeze(0);
    in.qformer_attention_mask = torch::ones_like(in.qformer_input_ids);
  }
  model::GreedyOptions g;
  g.max_new_tokens = 5;
  g.eos_token_ids = teacher->model->eos_token_ids();
  g.keep_step_logits = true;
  ASSERT_OK_AND_ASSIGN(model::GreedyResult gen, teacher->model->GenerateFromTokens(in, g));
  const std::vector<int64_t>& ids = gen.tokens[0];
  ASSERT_FALSE(ids.empty());
  ASSERT_EQ(gen.step_logits.size(), ids.size());
  double expected = 1.0;
  for (size_t k = 0; k < ids.size(); ++k) {
    expected *= torch::softmax(gen.step_logits[k][0].to(torch::kDouble), -1)[ids[k]].item<double>();
  }
  ASSERT_OK_AND_ASSIGN(double p, AnswerIdsProbability(teacher->side, s, ids));
  EXPECT_GT(p, 0.0);
  EXPECT_LE(p, 1.0);
  EXPECT_NEAR(p, expected, 1e-3 * expected);
  // One id fewer: the last factor drops out.
  const std::vector<int64_t> shorter(ids.begin(), ids.end() - 1);
  ASSERT_OK_AND_ASSIGN(double q, AnswerIdsProbability(teacher->side, s, shorter));
  EXPECT_GE(q, p);
  EXPECT_DOUBLE_EQ(*AnswerIdsProbability(teacher->side, s, {}), 1.0);
}

// The teacher labels a job's samples a chunk at a time (JobOptions::prepare_batch): each
// sample's label and targets are what it gets alone. The samples differ in prompt length (so
// the chunk's rows are padded), in what UTS kept, in being complete, and one carries its own
// label; six samples in chunks of four leave a partial chunk. One step over all six reads
// every sample's targets: its loss terms must agree.
TEST_P(PairJobTest, TheTeacherLabelsAChunkAsEachSampleAlone) {
  std::unique_ptr<Side> teacher, student;
  ASSERT_NO_FATAL_FAILURE(LoadPair(GetParam(), &teacher, &student));
  Case c = FirstCase(GetParam(), *student->model);
  std::vector<PairSample> samples = Samples(c, 6);
  samples[1].prompt = c.prompt + " Answer in one word, please.";
  samples[2].complete = true;
  samples[3].prompt = c.prompt + " Why?";
  samples[4].label = "a";
  samples[5].present = torch::Tensor();
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("akd"));
  config.l_kl = 0.5;
  config.confidence_power = 1.0;
  const compress::NamedTensors start = compress::Fp32Clones(student->model->TrainableParameters());
  auto run = [&](int prepare_batch) {
    JobOptions o;
    o.max_steps = 1;
    o.batch_size = 6;
    o.max_answer_tokens = 4;
    o.prepare_batch = prepare_batch;
    EXPECT_OK(compress::CopyInto(start, student->model->TrainableParameters()));
    absl::StatusOr<std::unique_ptr<PairDistiller>> job =
        PairDistiller::Create(teacher->side, student->side, config, o);
    EXPECT_TRUE(job.ok()) << job.status();
    return (*job)->Run(samples);
  };
  ASSERT_OK_AND_ASSIGN(PairJobResult alone, run(1));
  ASSERT_OK_AND_ASSIGN(PairJobResult chunked, run(4));
  ASSERT_EQ(alone.pseudo_labels.size(), 6u);
  EXPECT_EQ(chunked.pseudo_labels, alone.pseudo_labels);
  EXPECT_EQ(alone.pseudo_labels[4], "a");
  ASSERT_EQ(chunked.stats.terms.size(), alone.stats.terms.size());
  ASSERT_GE(alone.stats.terms.size(), 3u);
  for (size_t i = 0; i < alone.stats.terms.size(); ++i) {
    const LossTerm& want = alone.stats.terms[i];
    EXPECT_EQ(chunked.stats.terms[i].name, want.name);
    EXPECT_NEAR(chunked.stats.terms[i].first, want.first, 1e-4 * (1 + std::abs(want.first)))
        << want.name;
  }
}

// The guard's and the labels' batched calls: each sample's answer, ids and entropy from
// GreedyAnswers, and each answer's probability from AnswerProbabilities, are what the
// one-sample calls give it (prompts of different lengths, so the rows are padded; an empty
// answer among them).
TEST_P(PairJobTest, BatchedAnswersAndProbabilitiesAreEachSamplesAlone) {
  std::unique_ptr<Side> teacher, student;
  ASSERT_NO_FATAL_FAILURE(LoadPair(GetParam(), &teacher, &student));
  Case c = FirstCase(GetParam(), *teacher->model);
  std::vector<PairSample> samples = Samples(c, 4);
  samples[1].prompt = c.prompt + " Answer in one word, please.";
  samples[3].present = torch::Tensor();
  std::vector<const PairSample*> pointers;
  for (const PairSample& s : samples) pointers.push_back(&s);
  std::vector<std::vector<int64_t>> ids;
  std::vector<double> entropies;
  ASSERT_OK_AND_ASSIGN(std::vector<std::string> texts,
                       GreedyAnswers(teacher->side, pointers, 4, &ids, &entropies));
  ASSERT_EQ(texts.size(), 4u);
  ASSERT_EQ(ids.size(), 4u);
  ASSERT_EQ(entropies.size(), 4u);
  std::vector<std::string> answers = texts;
  answers[2] = "";
  ASSERT_OK_AND_ASSIGN(std::vector<double> p,
                       AnswerProbabilities(teacher->side, pointers, answers));
  ASSERT_EQ(p.size(), 4u);
  for (size_t i = 0; i < samples.size(); ++i) {
    SCOPED_TRACE(i);
    std::vector<int64_t> one_ids;
    double one_entropy = 0;
    ASSERT_OK_AND_ASSIGN(std::string one,
                         GreedyAnswer(teacher->side, samples[i], 4, &one_ids, &one_entropy));
    EXPECT_EQ(texts[i], one);
    EXPECT_EQ(ids[i], one_ids);
    EXPECT_NEAR(entropies[i], one_entropy, 1e-4 * (1 + one_entropy));
    ASSERT_OK_AND_ASSIGN(double q, AnswerProbability(teacher->side, samples[i], answers[i]));
    EXPECT_GT(q, 0.0);
    EXPECT_NEAR(p[i], q, 1e-4 * q);
  }
  EXPECT_FALSE(AnswerProbabilities(teacher->side, pointers, {"a"}).ok());

  // A side that reads frames, some samples with one and some without: two batches, each
  // sample still answered and scored as alone.
  GiveFrames(c, &samples, student.get());
  samples[0].pixels = torch::Tensor();
  samples[2].pixels = torch::Tensor();
  ASSERT_OK_AND_ASSIGN(texts, GreedyAnswers(student->side, pointers, 4));
  ASSERT_OK_AND_ASSIGN(p, AnswerProbabilities(student->side, pointers, texts));
  for (size_t i = 0; i < samples.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_OK_AND_ASSIGN(std::string one, GreedyAnswer(student->side, samples[i], 4));
    EXPECT_EQ(texts[i], one);
    ASSERT_OK_AND_ASSIGN(double q, AnswerProbability(student->side, samples[i], texts[i]));
    EXPECT_NEAR(p[i], q, 1e-4 * q);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, PairJobTest,
                         ::testing::Values("llava_clip_llama", "blip2_llama", "instructblip_llama",
                                           "blip2_flan_t5", "instructblip_flan_t5"));

// An OPT student (biases and LayerNorms trainable, LoRA on q_proj/v_proj) moves towards its
// teacher's distributions. The KL term alone: the tiny random OPT's distributions are flat, so
// fitting its argmax labels (CE) sharpens the student past them and the KL would rise with it.
TEST(PairJobTest, OptStudentLearnsTheTeachersDistributions) {
  std::unique_ptr<Side> teacher, student;
  ASSERT_NO_FATAL_FAILURE(LoadPair("blip2_opt", &teacher, &student));
  Case c = FirstCase("blip2_opt", *student->model);
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    for (auto& [name, t] : student->model->TrainableParameters()) {
      if (name.find("lora_b") != std::string::npos) t.normal_(0.0, 0.5);
    }
  }
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("akd"));
  config.l_ce = 0;
  config.l_kl = 0.5;
  JobOptions o;
  o.max_steps = 25;
  o.batch_size = 4;
  o.lr = 1e-2;
  o.max_answer_tokens = 4;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                       PairDistiller::Create(teacher->side, student->side, config, o));
  ASSERT_OK_AND_ASSIGN(PairJobResult r, job->Run(Samples(c, 6)));
  EXPECT_TRUE(r.kl_used);
  std::map<std::string, LossTerm> terms;
  for (const LossTerm& t : r.stats.terms) terms[t.name] = t;
  ASSERT_TRUE(terms.count("kl"));
  EXPECT_LT(terms["kl"].last, 0.5 * terms["kl"].first);
  int biases = 0;
  for (const auto& [name, t] : r.trainable) {
    biases += name.find("language_model.model.decoder.layers.") == 0 && name.size() > 5 &&
              name.compare(name.size() - 5, 5, ".bias") == 0;
  }
  EXPECT_EQ(biases, 2 * (4 + 2 + 2));  // per layer: q, k, v, out, fc1, fc2, two LayerNorms
}

TEST(PairJobTest, DifferentTokenizersTrainWithoutTheKlAndSaySo) {
  // Same tower shapes, different tokenizers (vocabularies of 857 and 700).
  std::unique_ptr<Side> teacher = LoadSide("llava_clip_llama");
  std::unique_ptr<Side> student = LoadSide("llava_clip_llama_gqa_rope");
  ASSERT_NE(teacher, nullptr);
  ASSERT_NE(student, nullptr);
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase("llava_clip_llama", *teacher->model);
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("akd"));
  config.l_kl = 0.5;
  JobOptions o;
  o.max_steps = 4;
  o.batch_size = 2;
  o.max_answer_tokens = 4;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                       PairDistiller::Create(teacher->side, student->side, config, o));
  EXPECT_FALSE(job->same_tokenizer());
  ASSERT_OK_AND_ASSIGN(PairJobResult r, job->Run(Samples(c, 3)));
  EXPECT_FALSE(r.kl_used);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find("tokenizers differ"), std::string::npos) << r.notes[0];
  for (const LossTerm& t : r.stats.terms) {
    EXPECT_NE(t.name, "kl");
    EXPECT_TRUE(std::isfinite(t.last)) << t.name;
  }
}

TEST(PairJobTest, AnInt8StudentTrainsOnTheCpu) {
  std::unique_ptr<Side> teacher = LoadSide("llava_siglip_qwen2");
  std::unique_ptr<Side> student = LoadSide("llava_siglip_qwen2", "int8");
  ASSERT_NE(student, nullptr);
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase("llava_siglip_qwen2", *teacher->model);
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("pkd"));
  JobOptions o;
  o.max_steps = 3;
  o.batch_size = 2;
  o.max_answer_tokens = 3;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                       PairDistiller::Create(teacher->side, student->side, config, o));
  model::NamedTensors before;
  for (auto& [n, t] : student->model->TrainableParameters()) before.emplace_back(n, t.clone());
  ASSERT_OK_AND_ASSIGN(PairJobResult r, job->Run(Samples(c, 2)));
  int lora_moved = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    if (before[i].first.find("q_proj.lora_b") != std::string::npos) {
      lora_moved += !torch::equal(r.trainable[i].second, before[i].second);
    }
  }
  // LoRA B of the first layer gets its gradient through the second layer's packed weights.
  EXPECT_EQ(lora_moved, 2);
}

// A time budget ends a job after the step that used it up: here the first of 50.
TEST(PairJobTest, ATimeBudgetEndsTheJobAfterTheStepThatUsedItUp) {
  std::unique_ptr<Side> teacher = LoadSide("llava_clip_llama");
  std::unique_ptr<Side> student = LoadSide("llava_clip_llama");
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase("llava_clip_llama", *teacher->model);
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("pl"));
  JobOptions o;
  o.max_steps = 50;
  o.batch_size = 2;
  o.max_answer_tokens = 3;
  o.time_budget_s = 1e-9;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                       PairDistiller::Create(teacher->side, student->side, config, o));
  ASSERT_OK_AND_ASSIGN(PairJobResult r, job->Run(Samples(c, 2)));
  EXPECT_EQ(r.stats.steps, 1);
  EXPECT_TRUE(r.stats.stopped_by_budget);
  o.time_budget_s = 0;  // none: every step
  o.max_steps = 3;
  ASSERT_OK_AND_ASSIGN(job, PairDistiller::Create(teacher->side, student->side, config, o));
  ASSERT_OK_AND_ASSIGN(r, job->Run(Samples(c, 2)));
  EXPECT_EQ(r.stats.steps, 3);
  EXPECT_FALSE(r.stats.stopped_by_budget);
}

// phase_steps: the last N steps are timed phase by phase; the job's result is the same.
TEST(PairJobTest, TheLastStepsAreTimedPhaseByPhase) {
  std::unique_ptr<Side> teacher = LoadSide("llava_clip_llama");
  std::unique_ptr<Side> student = LoadSide("llava_clip_llama");
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase("llava_clip_llama", *teacher->model);
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("akd"));
  JobOptions o;
  o.max_steps = 4;
  o.batch_size = 2;
  o.max_answer_tokens = 3;
  const model::NamedTensors start = compress::Fp32Clones(student->model->TrainableParameters());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> plain,
                       PairDistiller::Create(teacher->side, student->side, config, o));
  ASSERT_OK_AND_ASSIGN(PairJobResult untimed, plain->Run(Samples(c, 2)));
  EXPECT_EQ(untimed.stats.phase_timed_steps, 0);
  EXPECT_TRUE(untimed.stats.phases.empty());
  EXPECT_TRUE(untimed.stats.prepare_phases.empty());
  ASSERT_OK(compress::CopyInto(start, student->model->TrainableParameters()));
  o.phase_steps = 3;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> timed,
                       PairDistiller::Create(teacher->side, student->side, config, o));
  ASSERT_OK_AND_ASSIGN(PairJobResult r, timed->Run(Samples(c, 2)));
  EXPECT_EQ(r.stats.phase_timed_steps, 3);
  std::vector<std::string> names;
  for (const auto& [name, seconds] : r.stats.phases) {
    names.push_back(name);
    EXPECT_GE(seconds, 0) << name;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"batch", "forward", "losses", "backward", "optimizer"}));
  // The preparation's phases, in order, within its time.
  names.clear();
  double prepared = 0;
  for (const auto& [name, seconds] : r.stats.prepare_phases) {
    names.push_back(name);
    EXPECT_GE(seconds, 0) << name;
    prepared += seconds;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"greedy", "forced", "fit"}));
  EXPECT_LE(prepared, r.stats.prepare_seconds);
  // One wall time per training step, timed or not, together within the training's.
  for (const PairJobResult* job : {&untimed, &r}) {
    ASSERT_EQ(job->stats.step_seconds.size(), static_cast<size_t>(job->stats.steps));
    double stepped = 0;
    for (double seconds : job->stats.step_seconds) {
      EXPECT_GT(seconds, 0);
      stepped += seconds;
    }
    EXPECT_LE(stepped, job->stats.train_seconds);
  }
  ASSERT_EQ(r.trainable.size(), untimed.trainable.size());
  for (size_t i = 0; i < r.trainable.size(); ++i) {
    EXPECT_TRUE(torch::equal(r.trainable[i].second, untimed.trainable[i].second))
        << r.trainable[i].first;
  }
}

// fp8_base on: the job's steps multiply the student's quantized base in FP8 (emulated on the
// CPU). The job trains from the same first losses to a set near the plain job's but not equal
// to it, and leaves the base as it was: no layer holds FP8 after it. native, the default, is
// the plain job on the CPU (no native FP8 there), bit for bit; a mode of no other name is
// refused.
TEST(PairJobTest, AnFp8BaseJobRoundsItsStepsAndLeavesTheBaseAsItWas) {
  std::unique_ptr<Side> teacher = LoadSide("llava_clip_llama");
  std::unique_ptr<Side> student = LoadSide("llava_clip_llama", "int8");
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase("llava_clip_llama", *teacher->model);
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("akd"));
  JobOptions o;
  o.max_steps = 4;
  o.batch_size = 2;
  o.max_answer_tokens = 3;
  const model::NamedTensors start = compress::Fp32Clones(student->model->TrainableParameters());
  auto run = [&](const std::string& mode) -> PairJobResult {
    EXPECT_OK(compress::CopyInto(start, student->model->TrainableParameters()));
    o.fp8_base = mode;
    absl::StatusOr<std::unique_ptr<PairDistiller>> d =
        PairDistiller::Create(teacher->side, student->side, config, o);
    EXPECT_OK(d.status());
    absl::StatusOr<PairJobResult> r = (*d)->Run(Samples(c, 2));
    EXPECT_OK(r.status());
    return r.ok() ? *std::move(r) : PairJobResult();
  };
  auto fp8_layers = [&] {
    int64_t n = 0;
    for (const auto& m : student->model->module().modules()) {
      const auto* l = dynamic_cast<const model::LinearImpl*>(m.get());
      if (l != nullptr && l->holds_fp8()) ++n;
    }
    return n;
  };
  EXPECT_EQ(JobOptions().fp8_base, "native");
  const PairJobResult plain = run("off");
  const PairJobResult rounded = run("on");
  const PairJobResult native = run("native");
  EXPECT_EQ(fp8_layers(), 0);
  ASSERT_EQ(native.trainable.size(), plain.trainable.size());
  for (size_t i = 0; i < plain.trainable.size(); ++i) {
    EXPECT_TRUE(torch::equal(native.trainable[i].second, plain.trainable[i].second))
        << plain.trainable[i].first;
  }
  o.fp8_base = "fp8";
  const absl::Status refused =
      PairDistiller::Create(teacher->side, student->side, config, o).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.message(), "native, on or off")) << refused;
  ASSERT_FALSE(plain.stats.terms.empty());
  ASSERT_EQ(plain.stats.terms.size(), rounded.stats.terms.size());
  const double first = plain.stats.terms[0].first, first_fp8 = rounded.stats.terms[0].first;
  EXPECT_NEAR(first_fp8, first, 0.05 * std::abs(first));
  ASSERT_EQ(plain.trainable.size(), rounded.trainable.size());
  double moved = 0, differs = 0, size = 0;
  for (size_t i = 0; i < plain.trainable.size(); ++i) {
    const torch::Tensor& a = plain.trainable[i].second;
    const torch::Tensor& b = rounded.trainable[i].second;
    moved += (b - start[i].second.to(b.scalar_type())).norm().item<double>();
    differs += (b - a).norm().item<double>();
    size += (a - start[i].second.to(a.scalar_type())).norm().item<double>();
  }
  EXPECT_GT(moved, 0);       // it trained
  EXPECT_GT(differs, 0);     // through the rounded base
  EXPECT_LT(differs, size);  // to near where the plain job went
}

// confidence_power: a sample's CE and KL weigh the teacher's confidence in its label; at 0
// the job is the plain one, above it the same samples train the student otherwise.
TEST(PairJobTest, TheTeachersConfidenceWeighsItsLabels) {
  std::unique_ptr<Side> teacher = LoadSide("llava_clip_llama");
  std::unique_ptr<Side> student = LoadSide("llava_clip_llama");
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase("llava_clip_llama", *teacher->model);
  JobOptions o;
  o.max_steps = 3;
  o.batch_size = 3;
  o.max_answer_tokens = 3;
  const model::NamedTensors start = compress::Fp32Clones(student->model->TrainableParameters());
  std::vector<PairJobResult> results;
  for (const char* spec : {"akd", "akd+confidence_power=0", "akd+confidence_power=2"}) {
    ASSERT_OK(compress::CopyInto(start, student->model->TrainableParameters()));
    ASSERT_OK_AND_ASSIGN(DistillConfig config, ParseLearnerSpec(spec));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                         PairDistiller::Create(teacher->side, student->side, config, o));
    ASSERT_OK_AND_ASSIGN(PairJobResult r, job->Run(Samples(c, 3)));
    results.push_back(std::move(r));
  }
  int same = 0, moved = 0;
  for (size_t i = 0; i < results[0].trainable.size(); ++i) {
    same += torch::equal(results[0].trainable[i].second, results[1].trainable[i].second);
    moved += !torch::allclose(results[0].trainable[i].second, results[2].trainable[i].second, 1e-6,
                              1e-7);
  }
  EXPECT_EQ(same, static_cast<int>(results[0].trainable.size()));
  EXPECT_GT(moved, 0);
  absl::StatusOr<DistillConfig> negative = ParseLearnerSpec("akd+confidence_power=-1");
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(negative.status().message(), "confidence_power"));
}

TEST(PairJobTest, RefusesMissingCodecsAndBadOptions) {
  std::unique_ptr<Side> s = LoadSide("llava_clip_llama");
  ASSERT_OK(s->model->AddAdapters({}));
  PairSide broken = s->side;
  broken.decode = nullptr;
  DistillConfig config;
  EXPECT_EQ(PairDistiller::Create(s->side, broken, config, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  JobOptions o;
  o.max_steps = 0;
  EXPECT_EQ(PairDistiller::Create(s->side, s->side, config, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                       PairDistiller::Create(s->side, s->side, config, {}));
  EXPECT_EQ(job->Run({}).status().code(), absl::StatusCode::kInvalidArgument);
  PairSample wrong;
  wrong.tokens = torch::zeros({3, 5});
  wrong.prompt = "USER: <image>\nhi ASSISTANT:";
  absl::Status st = job->Run({wrong}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("sample 0"), std::string::npos) << st;
}

// A sample the teacher cannot read fails the job naming it by its index in the job, once,
// wherever the chunks and the given labels put it in the batch that failed: chunks of 3,
// sample 5 the second unlabelled sample of the second chunk (sample 4 carries a label, so the
// greedy pass reads 3 and 5); then, given a label, in the teacher-forced pass.
TEST(PairJobTest, AnErrorNamesTheSampleByItsIndexInTheJob) {
  std::unique_ptr<Side> teacher = LoadSide("llava_clip_llama");
  std::unique_ptr<Side> student = LoadSide("llava_clip_llama");
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase("llava_clip_llama", *teacher->model);
  PairSide picky = teacher->side;
  const auto encode = picky.encode;
  picky.encode = [encode](const std::string& text,
                          bool special) -> absl::StatusOr<std::vector<int64_t>> {
    if (absl::StrContains(text, "unreadable")) return absl::InvalidArgumentError("unreadable");
    return encode(text, special);
  };
  JobOptions o;
  o.max_steps = 1;
  o.batch_size = 1;
  o.prepare_batch = 3;
  o.max_answer_tokens = 2;
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("pl"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                       PairDistiller::Create(picky, student->side, config, o));
  std::vector<PairSample> samples = Samples(c, 6);
  samples[4].label = "yes";
  samples[5].prompt = c.prompt + " unreadable";
  const absl::Status greedy = job->Run(samples).status();
  EXPECT_EQ(std::string(greedy.message()), "sample 5: unreadable");
  samples[5].label = "no";  // now read only by the teacher-forced pass
  const absl::Status forced = job->Run(samples).status();
  EXPECT_EQ(std::string(forced.message()), "sample 5: unreadable");
}

// Three devices' jobs over one student base, run together and each alone, two rounds (the
// second with the phi and psi its first fitted): each device gets what its job alone gives.
// The devices start from different mirrors, hold different samples (so different batch
// draws) and one runs fewer steps, so a row that read another job's values, a loss mean over
// mixed rows or a step too many would show.
class PairJobsTogetherTest : public ::testing::TestWithParam<std::string> {};

// Three devices' jobs over one student, two rounds each, alone and together: every result
// equal. `frames`: the student trains its vision side from each sample's frame too.
void CheckJobsTogetherEqualAlone(const std::string& variant, const model::AdapterOptions& adapters,
                                 bool frames) {
  std::unique_ptr<Side> teacher, student;
  ASSERT_NO_FATAL_FAILURE(LoadPair(variant, &teacher, &student, adapters));
  Case c = FirstCase(variant, *student->model);
  constexpr int kDevices = 3;
  std::vector<compress::NamedTensors> mirrors(kDevices);
  std::vector<std::vector<PairSample>> samples(kDevices);
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(7);
    for (int d = 0; d < kDevices; ++d) {
      for (const auto& [name, t] : student->model->TrainableParameters()) {
        torch::Tensor m = t.detach().to(torch::kFloat).clone();
        if (name.find("lora_b") != std::string::npos) m.normal_(0.0, 0.3);
        if (name.find("norm") != std::string::npos) m.mul_(1.0 + 0.1 * torch::randn_like(m));
        mirrors[d].emplace_back(name, m);
      }
      samples[d] = Samples(c, 3 + d);
      for (PairSample& s : samples[d]) s.tokens = s.tokens + 0.05 * torch::randn_like(s.tokens);
      if (frames) GiveFrames(c, &samples[d], student.get());
    }
  }
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("akd"));
  config.l_kl = 0.5;
  auto options = [](int d) {
    JobOptions o;
    o.max_steps = d == 1 ? 2 : 4;
    o.batch_size = 2;
    // The teacher's chunks as the tolerances below were measured with (alone and together
    // prepare alike whatever the chunk).
    o.prepare_batch = 2;
    o.lr = 1e-2;
    o.max_answer_tokens = 3;
    return o;
  };
  std::vector<std::unique_ptr<PairDistiller>> alone, together;
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> a,
                         PairDistiller::Create(teacher->side, student->side, config, options(d)));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> t,
                         PairDistiller::Create(teacher->side, student->side, config, options(d)));
    alone.push_back(std::move(a));
    together.push_back(std::move(t));
  }
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    std::vector<PairJobResult> expected;
    for (int d = 0; d < kDevices; ++d) {
      ASSERT_OK_AND_ASSIGN(PairJobResult r, alone[d]->RunFrom(mirrors[d], samples[d]));
      expected.push_back(std::move(r));
    }
    std::vector<PairJobInput> jobs;
    for (int d = 0; d < kDevices; ++d)
      jobs.push_back({together[d].get(), &mirrors[d], &samples[d]});
    std::vector<absl::StatusOr<PairJobResult>> got = PairDistiller::RunTogether(jobs);
    ASSERT_EQ(got.size(), static_cast<size_t>(kDevices));
    for (int d = 0; d < kDevices; ++d) {
      SCOPED_TRACE(d);
      ASSERT_OK(got[d].status());
      const PairJobResult& r = *got[d];
      EXPECT_EQ(r.pseudo_labels, expected[d].pseudo_labels);
      EXPECT_EQ(r.stats.steps, options(d).max_steps);
      EXPECT_EQ(r.stats.samples_seen, expected[d].stats.samples_seen);
      ASSERT_EQ(r.trainable.size(), expected[d].trainable.size());
      int moved = 0;
      for (size_t i = 0; i < r.trainable.size(); ++i) {
        const torch::Tensor& want = expected[d].trainable[i].second;
        const torch::Tensor& have = r.trainable[i].second;
        EXPECT_EQ(r.trainable[i].first, expected[d].trainable[i].first);
        // A key projection's bias adds the same q.b_k to every score of a query, which the
        // softmax takes away: its gradient is zero but for rounding, which AdamW scales up to
        // steps of the learning rate's size, so alone and together it moves by noise alone.
        if (absl::EndsWith(r.trainable[i].first, "k_proj.bias")) continue;
        // Rows in one batch or in several reduce in other orders; through the tower's own
        // layers (frames) the rounding that AdamW scales grows past 1e-5 on some CPUs (2.8e-5
        // measured on an AVX-512 one). A row that read another job's values is off by ~1e-2.
        const double scale = 1.0 + want.abs().max().item<double>();
        const double tolerance = frames ? 1e-4 : 1e-5;
        EXPECT_LE((have - want).abs().max().item<double>(), tolerance * scale)
            << r.trainable[i].first;
        moved += !torch::equal(want, mirrors[d][i].second);
      }
      EXPECT_GT(moved, static_cast<int>(r.trainable.size()) / 2);
      ASSERT_EQ(r.stats.terms.size(), expected[d].stats.terms.size());
      for (size_t i = 0; i < r.stats.terms.size(); ++i) {
        const LossTerm& want = expected[d].stats.terms[i];
        EXPECT_EQ(r.stats.terms[i].name, want.name);
        EXPECT_NEAR(r.stats.terms[i].first, want.first, 1e-5 * (1 + std::abs(want.first)));
        EXPECT_NEAR(r.stats.terms[i].last, want.last, 1e-5 * (1 + std::abs(want.last)))
            << want.name;
      }
      mirrors[d] = r.trainable;  // the next round starts where the device is
    }
  }
}

TEST_P(PairJobsTogetherTest, EachDeviceGetsWhatItsJobAloneGives) {
  CheckJobsTogetherEqualAlone(GetParam(), {}, /*frames=*/false);
}

// The same with the vision side trainable, the students reading the frames: each row's tower
// runs with its own job's LoRA and LayerNorms.
TEST_P(PairJobsTogetherTest, EachDeviceGetsWhatItsJobAloneGivesWithTheVisionSideTrained) {
  model::AdapterOptions adapters;
  adapters.lora_vision = true;
  CheckJobsTogetherEqualAlone(GetParam(), adapters, /*frames=*/true);
}

// The decoder-only language models. The tiny T5 pair trains members whose gradient is below
// AdamW's epsilon for a few elements, where float rounding alone decides the step (a few of 512
// elements differ after one step, alone against together, and the difference grows over
// rounds), so it would test AdamW's sensitivity rather than the rows' adapters.
INSTANTIATE_TEST_SUITE_P(Families, PairJobsTogetherTest,
                         ::testing::Values("llava_clip_llama", "llava_siglip_qwen2", "blip2_opt",
                                           "instructblip_llama"));

TEST(PairJobsTogetherTest, RefusesJobsOnOtherStudentsOrTwiceOnOneDistiller) {
  std::unique_ptr<Side> teacher, student, other;
  ASSERT_NO_FATAL_FAILURE(LoadPair("llava_clip_llama", &teacher, &student));
  other = LoadSide("llava_clip_llama");
  ASSERT_OK(other->model->AddAdapters({}));
  Case c = FirstCase("llava_clip_llama", *student->model);
  ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("pl"));
  JobOptions o;
  o.max_steps = 1;
  o.batch_size = 1;
  o.max_answer_tokens = 2;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> a,
                       PairDistiller::Create(teacher->side, student->side, config, o));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> b,
                       PairDistiller::Create(teacher->side, other->side, config, o));
  const compress::NamedTensors mirror = compress::Fp32Clones(student->model->TrainableParameters());
  const std::vector<PairSample> s = Samples(c, 1);
  std::vector<absl::StatusOr<PairJobResult>> got =
      PairDistiller::RunTogether({{a.get(), &mirror, &s}, {b.get(), &mirror, &s}});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_OK(got[0].status());  // alone in the end
  EXPECT_EQ(got[1].status().code(), absl::StatusCode::kInvalidArgument);
  got = PairDistiller::RunTogether({{a.get(), &mirror, &s}, {a.get(), &mirror, &s}});
  EXPECT_EQ(got[0].status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(got[1].status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SampleFromUplinkTest, PlacesTheKeptTokensInTheirRowsAndDecodesThePrompt) {
  compress::UplinkSample u;
  u.sample_id = 9;
  u.grid_tokens = 4;
  u.feature_dim = 2;
  u.kept_indices = {1, 3};
  u.features = {1, 2, 3, 4};
  u.prompt_tokens = {1, 856, 40};
  const PairSide side = IdsAsTextSide(nullptr);
  absl::StatusOr<PairSample> h = SampleFromUplink(u, side);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(torch::equal(
      h->tokens, torch::tensor({0.f, 0.f, 1.f, 2.f, 0.f, 0.f, 3.f, 4.f}).reshape({4, 2})));
  EXPECT_TRUE(torch::equal(h->present, torch::tensor({false, true, false, true})));
  EXPECT_EQ(h->prompt, "1 856 40");
  absl::StatusOr<std::vector<int64_t>> ids = side.encode(h->prompt, true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int64_t>{1, 856, 40}));
  EXPECT_FALSE(side.encode("1 x", true).ok());

  compress::UplinkSample outside = u;
  outside.kept_indices = {1, 4};
  EXPECT_THAT(SampleFromUplink(outside, side).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  compress::UplinkSample short_features = u;
  short_features.features.pop_back();
  EXPECT_THAT(SampleFromUplink(short_features, side).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(CompleteHfSampleTest, HoldsEveryTokenAndTheKeptOnesAsPresent) {
  compress::UplinkSample u;
  u.sample_id = 4;
  u.grid_tokens = 3;
  u.feature_dim = 2;
  u.kept_indices = {2};
  u.features = {5, 6};
  u.prompt_tokens = {1, 40};
  const PairSide side = IdsAsTextSide(nullptr);
  absl::StatusOr<PairSample> h = CompleteHfSample(u, {1, 2, 3, 4, 5, 6}, side);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_TRUE(h->complete);
  EXPECT_TRUE(
      torch::equal(h->tokens, torch::tensor({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}).reshape({3, 2})));
  EXPECT_TRUE(torch::equal(h->present, torch::tensor({false, false, true})));
  EXPECT_EQ(h->prompt, "1 40");
  EXPECT_THAT(CompleteHfSample(u, {1, 2, 3, 4, 5}, side).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE(SampleFromUplink(u, side)->complete);
}

// The tensors an adapter option adds to `variant`'s trainable set: `with` holds the student
// with `extra`, `added` the names the default adapters do not have. The shared ones are
// checked equal, so the LM's LoRA draw does not move with the option.
struct ExtraLora {
  std::unique_ptr<Side> plain, with;
  std::set<std::string> added;
};
ExtraLora AddExtraLora(const std::string& variant, const model::AdapterOptions& extra) {
  ExtraLora e{LoadSide(variant), LoadSide(variant), {}};
  EXPECT_NE(e.plain, nullptr);
  EXPECT_NE(e.with, nullptr);
  if (e.plain == nullptr || e.with == nullptr) return e;
  EXPECT_OK(e.plain->model->AddAdapters({}));
  EXPECT_OK(e.with->model->AddAdapters(extra));
  std::map<std::string, torch::Tensor> base;
  for (auto& [n, t] : e.plain->model->TrainableParameters()) base[n] = t;
  for (auto& [n, t] : e.with->model->TrainableParameters()) {
    if (!base.count(n)) {
      e.added.insert(n);
    } else {
      EXPECT_TRUE(torch::equal(t, base[n])) << n;  // the LM's draw is unchanged
    }
  }
  return e;
}

// A short PL job (5 steps of 3 at lr 1e-2, every LoRA B drawn non-zero first so that every A
// gets a gradient) on `student` from a teacher of `variant`: the names of the trainable
// tensors it moved.
absl::StatusOr<std::set<std::string>> MovedByAShortJob(const std::string& variant, Side& student,
                                                       bool frames = false) {
  std::unique_ptr<Side> teacher = LoadSide(variant);
  if (teacher == nullptr) return absl::InternalError("no teacher");
  Case c = FirstCase(variant, *student.model);
  std::vector<PairSample> samples = Samples(c, 4);
  if (frames) GiveFrames(c, &samples, &student);
  absl::StatusOr<DistillConfig> config = PresetDistillConfig("pl");
  if (!config.ok()) return config.status();
  JobOptions o;
  o.max_steps = 5;
  o.batch_size = 3;
  o.lr = 1e-2;
  o.max_answer_tokens = 4;
  {
    torch::NoGradGuard no_grad;
    torch::manual_seed(5);
    for (auto& [name, t] : student.model->TrainableParameters()) {
      if (absl::EndsWith(name, ".lora_b")) t.normal_(0.0, 0.5);
    }
  }
  const compress::NamedTensors before = compress::Fp32Clones(student.model->TrainableParameters());
  absl::StatusOr<std::unique_ptr<PairDistiller>> job =
      PairDistiller::Create(teacher->side, student.side, *config, o);
  if (!job.ok()) return job.status();
  absl::StatusOr<PairJobResult> r = (*job)->Run(samples);
  if (!r.ok()) return r.status();
  std::set<std::string> moved;
  for (size_t i = 0; i < before.size(); ++i) {
    if (!torch::equal(r->trainable[i].second, before[i].second)) moved.insert(before[i].first);
  }
  return moved;
}

// lora_qformer adds LoRA on the Q-Former's query and value (self and cross) to the trainable
// set, under the checkpoint's names, leaves the LM's LoRA draw as it was, and trains: a job
// moves the Q-Former's factors. LLaVA has no Q-Former and refuses it.
TEST(QFormerLoraTest, TheQFormersQueryAndValueTrainUnderTheCheckpointsNames) {
  for (const std::string variant : {"blip2_llama", "instructblip_llama"}) {
    SCOPED_TRACE(variant);
    model::AdapterOptions q;
    q.lora_qformer = true;
    ExtraLora e = AddExtraLora(variant, q);
    ASSERT_NE(e.with, nullptr);
    for (const std::string& n : e.added) {
      EXPECT_EQ(n.rfind("qformer.", 0), 0u) << n;
      EXPECT_TRUE(absl::EndsWith(n, ".query.lora_a") || absl::EndsWith(n, ".query.lora_b") ||
                  absl::EndsWith(n, ".value.lora_a") || absl::EndsWith(n, ".value.lora_b"))
          << n;
    }
    EXPECT_GT(e.added.size(), 0u);
    EXPECT_EQ(e.added.size() % 4, 0u);  // A and B of query and value per attention

    ASSERT_OK_AND_ASSIGN(std::set<std::string> moved, MovedByAShortJob(variant, *e.with));
    int qformer_moved = 0;
    for (const std::string& n : moved) qformer_moved += n.rfind("qformer.", 0) == 0;
    EXPECT_GT(qformer_moved, 0);
  }
  std::unique_ptr<Side> llava = LoadSide("llava_clip_llama");
  ASSERT_NE(llava, nullptr);
  model::AdapterOptions q;
  q.lora_qformer = true;
  EXPECT_THAT(llava->model->AddAdapters(q),
              ::cdcca::testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

// lora_projector adds LoRA on the projector into the LM (LLaVA's multi_modal_projector
// linear_1 and linear_2, BLIP-2's and InstructBLIP's language_projection) to the trainable
// set, under the checkpoint's names, leaves the LM's LoRA draw as it was, changes what the
// student computes once its B factors are non-zero, and trains: a job moves every factor.
TEST(ProjectorLoraTest, TheProjectorTrainsUnderTheCheckpointsNamesOnEveryArchitecture) {
  for (const std::string variant : {"blip2_llama", "instructblip_llama", "llava_clip_llama"}) {
    SCOPED_TRACE(variant);
    model::AdapterOptions p;
    p.lora_projector = true;
    ExtraLora e = AddExtraLora(variant, p);
    ASSERT_NE(e.with, nullptr);
    for (const std::string& n : e.added) {
      EXPECT_TRUE(absl::StrContains(n, "multi_modal_projector.linear_") ||
                  absl::StartsWith(n, "language_projection."))
          << n;
      EXPECT_TRUE(absl::EndsWith(n, ".lora_a") || absl::EndsWith(n, ".lora_b")) << n;
    }
    EXPECT_EQ(e.added.size(), variant == "llava_clip_llama" ? 4u : 2u);

    Case c = FirstCase(variant, *e.with->model);
    auto logits_of = [&](model::MultimodalModel& m) -> torch::Tensor {
      torch::NoGradGuard no_grad;
      absl::StatusOr<model::TokenForward> f = m.ForwardTokens(TokenInputsOf(c));
      EXPECT_TRUE(f.ok()) << f.status();
      return f.ok() ? f->logits : torch::zeros({1});
    };
    // B starts at zero: the same logits as without; the projector's B alone non-zero moves them.
    EXPECT_TRUE(torch::allclose(logits_of(*e.with->model), logits_of(*e.plain->model)));
    {
      torch::NoGradGuard no_grad;
      torch::manual_seed(5);
      for (auto& [name, t] : e.with->model->TrainableParameters()) {
        if (e.added.count(name) && absl::EndsWith(name, ".lora_b")) t.normal_(0.0, 0.5);
      }
    }
    EXPECT_FALSE(torch::allclose(logits_of(*e.with->model), logits_of(*e.plain->model)));

    ASSERT_OK_AND_ASSIGN(std::set<std::string> moved, MovedByAShortJob(variant, *e.with));
    for (const std::string& n : e.added) EXPECT_TRUE(moved.count(n)) << n;
  }
}

// lora_vision adds the vision tower's attention LoRA (BLIP-2's fused qkv; CLIP's and SigLIP's
// q_proj and v_proj) and its LayerNorms to the trainable set, under the checkpoint's names and
// only in the layers the model reads (LLaVA stops at its feature layer and never reads
// post_layernorm), leaves the other LoRA draws as they were, and trains from frames: the
// pixel path gives what the tower's tokens give, a job on frames moves every added tensor, and
// a batch of frames and tokens mixed is refused.
TEST(VisionLoraTest, TheTowerTrainsFromFramesUnderTheCheckpointsNamesOnEveryArchitecture) {
  for (const std::string variant :
       {"blip2_llama", "instructblip_llama", "llava_clip_llama", "llava_siglip_qwen2"}) {
    SCOPED_TRACE(variant);
    const bool llava = variant.rfind("llava", 0) == 0;
    model::AdapterOptions v;
    v.lora_vision = true;
    ExtraLora e = AddExtraLora(variant, v);
    ASSERT_NE(e.with, nullptr);
    int factors = 0, norms = 0;
    for (const std::string& n : e.added) {
      EXPECT_TRUE(absl::StartsWith(n, llava ? "model.vision_tower.vision_model." : "vision_model."))
          << n;
      EXPECT_FALSE(llava && absl::StrContains(n, "post_layernorm")) << n;
      if (absl::EndsWith(n, ".lora_a") || absl::EndsWith(n, ".lora_b")) {
        ++factors;
        EXPECT_TRUE(absl::StrContains(n, llava ? "_proj." : ".qkv.")) << n;
      } else {
        ++norms;
        EXPECT_TRUE(absl::StrContains(n, "layer_norm") || absl::StrContains(n, "layrnorm") ||
                    absl::StrContains(n, "post_layernorm"))
            << n;
      }
    }
    EXPECT_GT(factors, 0);
    EXPECT_GT(norms, 0);
    // A and B per adapted linear: one linear (qkv) per BLIP-2 layer, two (q, v) per LLaVA one.
    EXPECT_EQ(factors % (llava ? 4 : 2), 0);

    Case c = FirstCase(variant, *e.with->model);
    auto logits_of = [&](model::MultimodalModel& m, bool pixels) -> torch::Tensor {
      torch::NoGradGuard no_grad;
      model::TokenInputs in = TokenInputsOf(c);
      if (pixels) in.pixel_values = c.inputs.pixel_values;
      absl::StatusOr<model::TokenForward> f = m.ForwardTokens(in);
      EXPECT_TRUE(f.ok()) << f.status();
      return f.ok() ? f->logits : torch::zeros({1});
    };
    // B starts at zero and the norms as loaded: the frame gives what its tokens give.
    EXPECT_TRUE(torch::allclose(logits_of(*e.with->model, true), logits_of(*e.plain->model, false),
                                1e-4, 1e-5));
    {
      torch::NoGradGuard no_grad;
      torch::manual_seed(5);
      for (auto& [name, t] : e.with->model->TrainableParameters()) {
        if (e.added.count(name) && absl::EndsWith(name, ".lora_b")) t.normal_(0.0, 0.5);
      }
    }
    // The tower's LoRA moves what the model reads from the frame (the tokens path skips it).
    EXPECT_FALSE(torch::allclose(logits_of(*e.with->model, true), logits_of(*e.plain->model, false),
                                 1e-4, 1e-5));
    EXPECT_TRUE(
        torch::allclose(logits_of(*e.with->model, false), logits_of(*e.plain->model, false)));

    ASSERT_OK_AND_ASSIGN(std::set<std::string> moved,
                         MovedByAShortJob(variant, *e.with, /*frames=*/true));
    for (const std::string& n : e.added) EXPECT_TRUE(moved.count(n)) << n;

    // Frames and tokens in one job: refused before any work.
    std::unique_ptr<Side> teacher = LoadSide(variant);
    ASSERT_NE(teacher, nullptr);
    std::vector<PairSample> mixed = Samples(c, 2);
    GiveFrames(c, &mixed, e.with.get());
    mixed[1].pixels = torch::Tensor();
    ASSERT_OK_AND_ASSIGN(DistillConfig config, PresetDistillConfig("pl"));
    JobOptions o;
    o.max_steps = 1;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PairDistiller> job,
                         PairDistiller::Create(teacher->side, e.with->side, config, o));
    EXPECT_THAT(job->Run(mixed).status(),
                ::cdcca::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("frame")));
  }
}

// lora_vision_mlp adds LoRA on the tower's MLP (fc1, fc2) to the vision side, in the same
// layers as its attention LoRA, leaves every other draw as it was (the attention's too), and a
// job on frames moves every tensor it adds. Without lora_vision it is refused.
TEST(VisionLoraTest, TheTowersMlpTrainsInTheSameLayersOnEveryArchitecture) {
  for (const std::string variant :
       {"blip2_llama", "instructblip_llama", "llava_clip_llama", "llava_siglip_qwen2"}) {
    SCOPED_TRACE(variant);
    model::AdapterOptions v;
    v.lora_vision = true;
    ExtraLora attention = AddExtraLora(variant, v);
    v.lora_vision_mlp = true;
    ExtraLora e = AddExtraLora(variant, v);
    ASSERT_NE(attention.with, nullptr);
    ASSERT_NE(e.with, nullptr);
    std::map<std::string, torch::Tensor> before;
    for (auto& [n, t] : attention.with->model->TrainableParameters()) before[n] = t;
    // The layer of a tower tensor: the number after "layers.".
    auto layer_of = [](const std::string& n) {
      const size_t at = n.find("layers.") + 7;
      return n.substr(at, n.find('.', at) - at);
    };
    std::set<std::string> attention_layers, mlp_layers;
    for (const std::string& n : attention.added) {
      if (absl::EndsWith(n, ".lora_a")) attention_layers.insert(layer_of(n));
    }
    int mlp_factors = 0;
    for (const std::string& n : e.added) {
      if (before.count(n)) continue;  // the attention's side, compared below
      ++mlp_factors;
      EXPECT_TRUE(absl::StrContains(n, ".mlp.fc1.lora_") || absl::StrContains(n, ".mlp.fc2.lora_"))
          << n;
      mlp_layers.insert(layer_of(n));
    }
    for (auto& [n, t] : e.with->model->TrainableParameters()) {
      if (before.count(n)) EXPECT_TRUE(torch::equal(t, before[n])) << n;  // draws unchanged
    }
    EXPECT_EQ(mlp_factors, 4 * static_cast<int>(attention_layers.size()));
    EXPECT_EQ(mlp_layers, attention_layers);

    ASSERT_OK_AND_ASSIGN(std::set<std::string> moved,
                         MovedByAShortJob(variant, *e.with, /*frames=*/true));
    for (const std::string& n : e.added) EXPECT_TRUE(moved.count(n)) << n;

    std::unique_ptr<Side> alone = LoadSide(variant);
    ASSERT_NE(alone, nullptr);
    model::AdapterOptions mlp_alone;
    mlp_alone.lora_vision_mlp = true;
    EXPECT_THAT(alone->model->AddAdapters(mlp_alone),
                ::cdcca::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("lora_vision")));
  }
}

class SelfLearnerTest : public ::testing::TestWithParam<std::string> {};

// TENT on the student's own answers: its entropy falls, the norm parameters of the trainable
// set move, and nothing else in it or in the model does.
TEST_P(SelfLearnerTest, TentMovesTheNormsAloneAndLowersItsEntropy) {
  std::unique_ptr<Side> student = LoadSide(GetParam());
  ASSERT_NE(student, nullptr);
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase(GetParam(), *student->model);
  JobOptions o;
  o.max_steps = 15;
  o.batch_size = 3;
  o.lr = 3e-2;
  o.max_answer_tokens = 4;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<SelfLearner> tent,
                       SelfLearner::Create("tent", student->side, o));
  model::NamedTensors before;
  for (auto& [n, t] : student->model->TrainableParameters()) before.emplace_back(n, t.clone());
  model::NamedTensors frozen =
      Frozen(student->model->module(), student->model->TrainableParameters());
  torch::manual_seed(3);
  ASSERT_OK_AND_ASSIGN(PairJobResult r, tent->Run(Samples(c, 6)));
  std::map<std::string, LossTerm> terms;
  for (const LossTerm& t : r.stats.terms) terms[t.name] = t;
  ASSERT_TRUE(terms.count("entropy"));
  EXPECT_LT(terms["entropy"].last, terms["entropy"].first);
  ASSERT_EQ(r.trainable.size(), before.size());
  int norms_moved = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    const bool moved = !torch::equal(r.trainable[i].second, before[i].second.to(torch::kFloat));
    if (IsNormParameterName(before[i].first)) {
      norms_moved += moved;
    } else {
      EXPECT_FALSE(moved) << before[i].first;
    }
  }
  EXPECT_GT(norms_moved, 0);
  model::NamedTensors after =
      Frozen(student->model->module(), student->model->TrainableParameters());
  for (size_t i = 0; i < frozen.size(); ++i) {
    EXPECT_TRUE(torch::equal(after[i].second, frozen[i].second)) << frozen[i].first;
  }
}

// CoTTA trains the whole trainable set toward its EMA's soft labels; with every element
// restored after every step (restore_prob 1) the job ends where it started, and with none
// restored it moves. Its EMA carries over to the next job.
TEST_P(SelfLearnerTest, CottaRestoresToTheSourceStateItsProbabilitySays) {
  std::unique_ptr<Side> student = LoadSide(GetParam());
  ASSERT_NE(student, nullptr);
  ASSERT_OK(student->model->AddAdapters({}));
  Case c = FirstCase(GetParam(), *student->model);
  JobOptions o;
  o.max_steps = 4;
  o.batch_size = 3;
  o.lr = 1e-2;
  o.max_answer_tokens = 4;
  const compress::NamedTensors start = compress::Fp32Clones(student->model->TrainableParameters());
  CottaConfig always;
  always.restore_prob = 1.0;
  always.confidence_threshold = 2.0;  // always unsure: the augmented views run too
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<SelfLearner> restored,
                       SelfLearner::Create("cotta", student->side, o, always));
  ASSERT_OK_AND_ASSIGN(PairJobResult r, restored->Run(Samples(c, 4)));
  EXPECT_EQ(compress::StateDigest(r.trainable), compress::StateDigest(start));
  std::map<std::string, LossTerm> terms;
  for (const LossTerm& t : r.stats.terms) terms[t.name] = t;
  EXPECT_TRUE(terms.count("soft_ce") && terms.count("confidence"));

  CottaConfig never;
  never.restore_prob = 0.0;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<SelfLearner> cotta,
                       SelfLearner::Create("cotta", student->side, o, never));
  ASSERT_OK_AND_ASSIGN(PairJobResult first, cotta->Run(Samples(c, 4)));
  EXPECT_NE(compress::StateDigest(first.trainable), compress::StateDigest(start));
  ASSERT_OK_AND_ASSIGN(PairJobResult second, cotta->Run(Samples(c, 4)));
  EXPECT_NE(compress::StateDigest(second.trainable), compress::StateDigest(first.trainable));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SelfLearnerTest,
                         ::testing::Values("llava_clip_llama", "blip2_llama",
                                           "instructblip_llama"));

TEST(SelfLearnerCreateTest, RefusesUnknownLearnersAndMissingCodecs) {
  std::unique_ptr<Side> student = LoadSide("llava_clip_llama");
  ASSERT_NE(student, nullptr);
  ASSERT_OK(student->model->AddAdapters({}));
  ASSERT_OK(SelfLearner::Create("cotta", student->side, JobOptions{}).status());
  EXPECT_THAT(SelfLearner::Create("akd", student->side, JobOptions{}),
              ::cdcca::testing::StatusIs(absl::StatusCode::kInvalidArgument));
  PairSide no_codec = student->side;
  no_codec.decode = nullptr;
  EXPECT_THAT(SelfLearner::Create("tent", no_codec, JobOptions{}),
              ::cdcca::testing::StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace cdcca::distill
