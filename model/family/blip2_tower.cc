#include "model/family/blip2_tower.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/arch/blip2.h"
#include "model/arch/hf_model.h"
#include "model/hub/hf_folder.h"
#include "model/hub/safetensors.h"
#include "model/runtime/fused_ops.h"

namespace cdcca::model {
namespace {

using nlohmann::json;

constexpr int64_t kBos = 1, kEos = 2, kPad = 0;  // the scene vocabulary's specials

torch::Tensor AllValid(const torch::Tensor& valid, const torch::Tensor& ids) {
  return valid.defined()
             ? valid.to(torch::kBool)
             : torch::ones(ids.sizes(), torch::dtype(torch::kBool).device(ids.device()));
}

// [ones(B, L), valid] as the LM's 0/1 attention mask.
torch::Tensor PrefixedMask(const torch::Tensor& valid, int64_t l) {
  return torch::cat({torch::ones({valid.size(0), l}, valid.options()), valid}, 1).to(torch::kLong);
}

// The Hugging Face folder name of a tower parameter: the decoder body lives under
// "language_model.model." there, its head under "language_model.lm_head.".
std::string HfName(const std::string& name) {
  const std::string lm = "language_model.";
  if (absl::StartsWith(name, lm) && !absl::StartsWith(name, lm + "lm_head.")) {
    return lm + "model." + name.substr(lm.size());
  }
  return name;
}

// Tensors of the adaptation, not of the architecture (no checkpoint holds them).
bool IsAdaptationName(const std::string& name) {
  return absl::EndsWith(name, ".lora_a") || absl::EndsWith(name, ".lora_b") ||
         absl::EndsWith(name, ".adapter_prompt") || absl::EndsWith(name, ".adapter_gate");
}

absl::Status WriteJson(const std::string& path, const json& j) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

Blip2VisionConfig FamilyVitConfig(const VisionConfig& v) {
  Blip2VisionConfig c;
  c.hidden_size = v.d_vis;
  c.intermediate_size = v.mlp_hidden;
  c.num_hidden_layers = v.layers;
  c.num_attention_heads = v.heads;
  c.num_channels = 3;
  c.image_size = v.image_size;
  c.patch_size = v.patch_size;
  c.layer_norm_eps = 1e-6;
  c.hidden_act = "gelu";
  c.qkv_bias = false;
  return c;
}

FamilyTowerArchitecture FamilyTowerConfig(const VisionConfig& vision, const TowerConfig& t) {
  FamilyTowerArchitecture a;
  a.blip2.instruct = false;
  a.blip2.vision = FamilyVitConfig(vision);
  QFormerConfig& q = a.blip2.qformer;
  q.hidden_size = t.qa_dim;
  q.num_hidden_layers = t.qa_layers;
  q.num_attention_heads = t.qa_heads;
  q.intermediate_size = t.qa_mlp_hidden;
  q.hidden_act = "gelu";
  q.layer_norm_eps = 1e-12;
  q.cross_attention_frequency = 1;  // every layer reads the image, as the query adapter did
  q.encoder_hidden_size = vision.d_vis;
  q.use_qformer_text_input = false;
  a.blip2.num_query_tokens = t.num_queries;
  a.blip2.image_token_id = t.vocab_size - 1;
  DecoderConfig& d = a.text;
  d.model_type = "llama";
  d.vocab_size = t.vocab_size;
  d.hidden_size = t.d_model;
  d.intermediate_size = t.ffn_hidden;
  d.num_hidden_layers = t.lm_layers;
  d.num_attention_heads = t.lm_heads;
  d.num_key_value_heads = t.lm_heads;
  d.head_dim = t.d_model / t.lm_heads;
  d.rms_norm_eps = 1e-5;
  d.hidden_act = "silu";
  d.max_position_embeddings = t.max_positions;
  d.rope.theta = t.rope_theta;
  d.tie_word_embeddings = false;
  d.eos_token_ids = {kEos};
  d.bos_token_id = kBos;
  d.pad_token_id = kPad;
  return a;
}

json FamilyHfConfigJson(const VisionConfig& vision, const TowerConfig& t) {
  const FamilyTowerArchitecture a = FamilyTowerConfig(vision, t);
  const Blip2VisionConfig& v = a.blip2.vision;
  const QFormerConfig& q = a.blip2.qformer;
  const DecoderConfig& d = a.text;
  json vision_config = {{"model_type", "blip_2_vision_model"},
                        {"hidden_size", v.hidden_size},
                        {"intermediate_size", v.intermediate_size},
                        {"num_hidden_layers", v.num_hidden_layers},
                        {"num_attention_heads", v.num_attention_heads},
                        {"num_channels", v.num_channels},
                        {"image_size", v.image_size},
                        {"patch_size", v.patch_size},
                        {"layer_norm_eps", v.layer_norm_eps},
                        {"hidden_act", v.hidden_act},
                        {"qkv_bias", v.qkv_bias},
                        {"attention_dropout", 0.0}};
  json qformer_config = {{"model_type", "blip_2_qformer"},
                         {"hidden_size", q.hidden_size},
                         {"num_hidden_layers", q.num_hidden_layers},
                         {"num_attention_heads", q.num_attention_heads},
                         {"intermediate_size", q.intermediate_size},
                         {"hidden_act", q.hidden_act},
                         {"hidden_dropout_prob", t.dropout},
                         {"attention_probs_dropout_prob", t.dropout},
                         {"layer_norm_eps", q.layer_norm_eps},
                         {"cross_attention_frequency", q.cross_attention_frequency},
                         {"encoder_hidden_size", q.encoder_hidden_size},
                         {"vocab_size", q.vocab_size},
                         {"max_position_embeddings", q.max_position_embeddings},
                         {"position_embedding_type", "absolute"},
                         {"use_qformer_text_input", false}};
  json text_config = {{"model_type", "llama"},
                      {"vocab_size", d.vocab_size},
                      {"hidden_size", d.hidden_size},
                      {"intermediate_size", d.intermediate_size},
                      {"num_hidden_layers", d.num_hidden_layers},
                      {"num_attention_heads", d.num_attention_heads},
                      {"num_key_value_heads", d.num_key_value_heads},
                      {"head_dim", d.head_dim},
                      {"max_position_embeddings", d.max_position_embeddings},
                      {"rms_norm_eps", d.rms_norm_eps},
                      // transformers 5 spelling; 4.x reads the top-level rope_theta.
                      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", d.rope.theta}}},
                      {"rope_theta", d.rope.theta},
                      {"hidden_act", d.hidden_act},
                      {"attention_bias", false},
                      {"mlp_bias", false},
                      {"tie_word_embeddings", false},
                      {"bos_token_id", kBos},
                      {"eos_token_id", kEos},
                      {"pad_token_id", kPad}};
  return json{{"architectures", {"Blip2ForConditionalGeneration"}},
              {"model_type", "blip-2"},
              {"num_query_tokens", a.blip2.num_query_tokens},
              {"image_token_index", *a.blip2.image_token_id},
              {"use_decoder_only_language_model", true},
              {"tie_word_embeddings", false},
              {"initializer_range", 0.02},
              {"vision_config", vision_config},
              {"qformer_config", qformer_config},
              {"text_config", text_config},
              {"cdcca",
               {{"lora_rank", t.lora_rank},
                {"lora_alpha", t.lora_alpha},
                {"dropout", t.dropout},
                {"adapter_prompt_len", t.adapter_prompt_len},
                {"adapter_layers", t.adapter_layers},
                {"representation_layer", t.lm_layers / 2}}}};
}

torch::Tensor FamilyPixelValues(const torch::Tensor& images01) {
  return (images01.to(torch::kFloat) - 0.5) / 0.25;
}

namespace {

// A 2-D sinusoid over the patch grid, unit amplitude: per quarter of the channels sin/cos of
// the row and of the column at geometric frequencies; the class token's row is zero.
// [1 + grid^2, dim].
torch::Tensor GridPositionInit(int64_t grid, int64_t dim) {
  const int64_t n = grid * grid;
  torch::Tensor idx = torch::arange(n, torch::kDouble);
  torch::Tensor row = (idx / grid).floor();
  torch::Tensor col = idx - row * grid;
  const int64_t quarter = std::max<int64_t>(1, dim / 4);
  torch::Tensor freq =
      torch::pow(grid * 2.0, -torch::arange(quarter, torch::kDouble) / quarter) * M_PI;
  torch::Tensor parts =
      torch::cat({torch::sin(torch::outer(row, freq)), torch::cos(torch::outer(row, freq)),
                  torch::sin(torch::outer(col, freq)), torch::cos(torch::outer(col, freq))},
                 1);
  torch::Tensor out = torch::zeros({1 + n, dim}, torch::kDouble);
  const int64_t used = std::min(dim, parts.size(1));
  out.narrow(0, 1, n).narrow(1, 0, used).copy_(parts.narrow(1, 0, used));
  return out.to(torch::kFloat);
}

}  // namespace

Blip2VisionModel MakeFamilyVit(const VisionConfig& vision) {
  Blip2VisionModel vit(FamilyVitConfig(vision));
  InitializeHfParameters(*vit);
  // The position embedding starts as a grid sinusoid rather than transformers' small random
  // init: the Q-Former's cross-attention is blind to token order, so "where" questions need
  // each patch token to carry its position, and with a small random init they stayed at
  // chance (26 % DA on `small`).
  {
    torch::NoGradGuard no_grad;
    vit->named_parameters()["embeddings.position_embedding"].copy_(
        GridPositionInit(vision.GridSide(), vision.d_vis).unsqueeze(0));
  }
  for (auto& p : vit->parameters()) p.set_requires_grad(true);
  return vit;
}

Blip2TowerImpl::Blip2TowerImpl(const VisionConfig& vision, const TowerConfig& tower)
    : vision_(vision), config_(tower), arch_(FamilyTowerConfig(vision, tower)) {
  const absl::Status valid = ValidateTower(tower);
  TORCH_CHECK(valid.ok(), "invalid tower config: ", std::string(valid.message()));
  TORCH_CHECK(tower.d_vis == vision.d_vis, "tower d_vis ", tower.d_vis, " is not the vision d_vis ",
              vision.d_vis);
  HfPrecision stored;
  stored.weights = tower.precision;
  stored.int4_group = tower.int4_group;
  query_tokens = register_parameter(
      "query_tokens", Placeholder({1, tower.num_queries, tower.qa_dim}, torch::kFloat));
  qformer = register_module("qformer", QFormerModel(arch_.blip2.qformer, false, stored));
  language_projection = register_module(
      "language_projection", HfLinear(HfLinearOptions{tower.qa_dim, tower.d_model, true, stored}));
  language_model = register_module("language_model", DecoderLm(arch_.text, stored));
  InitializeHfParameters(*this);
  std::vector<HfLinearImpl*> quantized;
  for (const auto& m : modules(/*include_self=*/false)) {
    auto* linear = dynamic_cast<HfLinearImpl*>(m.get());
    if (linear != nullptr && linear->quantized()) {
      TORCH_CHECK(linear->Adopt("weight", linear->weight.clone()).ok(),
                  "quantizing a tower weight");
      quantized.push_back(linear);
    }
  }
  const int first_adapter = tower.lm_layers - tower.adapter_layers;
  for (int i = first_adapter; tower.adapter_prompt_len > 0 && i < tower.lm_layers; ++i) {
    language_model->layers[i]->as<DecoderLayerImpl>()->self_attn->AddAdapterPrompt(
        tower.adapter_prompt_len);
  }
  if (tower.lora_rank > 0) {
    for (const auto& layer : *language_model->layers) {
      auto* attn = layer->as<DecoderLayerImpl>()->self_attn.get();
      attn->q_proj->AddLora(tower.lora_rank, tower.lora_alpha);
      attn->v_proj->AddLora(tower.lora_rank, tower.lora_alpha);
    }
    for (const auto& m : qformer->modules(/*include_self=*/false)) {
      if (auto* attn = dynamic_cast<QFormerMultiHeadAttentionImpl*>(m.get())) {
        attn->query->AddLora(tower.lora_rank, tower.lora_alpha);
        attn->value->AddLora(tower.lora_rank, tower.lora_alpha);
      }
    }
  }
  for (auto& p : parameters()) p.set_requires_grad(true);
  for (HfLinearImpl* linear : quantized) linear->weight.set_requires_grad(false);
}

Blip2Tower ConvertTowerPrecision(Blip2TowerImpl& src, Precision precision) {
  torch::NoGradGuard no_grad;
  TowerConfig c = src.config();
  c.precision = precision;
  Blip2Tower dst(src.vision(), c);
  std::map<std::string, std::shared_ptr<torch::nn::Module>> targets;
  for (const auto& m : dst->named_modules("", /*include_self=*/false)) targets[m.key()] = m.value();
  auto copy_own = [](const torch::nn::Module& from, torch::nn::Module& to) {
    for (auto& p : to.named_parameters(/*recurse=*/false)) {
      p.value().set_data(from.named_parameters(/*recurse=*/false)[p.key()].detach().clone());
    }
    for (auto& b : to.named_buffers(/*recurse=*/false)) {
      b.value().set_data(from.named_buffers(/*recurse=*/false)[b.key()].detach().clone());
    }
  };
  copy_own(src, *dst);
  for (const auto& m : src.named_modules("", /*include_self=*/false)) {
    torch::nn::Module& to = *targets.at(m.key());
    auto* from_linear = dynamic_cast<HfLinearImpl*>(m.value().get());
    if (from_linear == nullptr) {
      copy_own(*m.value(), to);
      continue;
    }
    auto& to_linear = dynamic_cast<HfLinearImpl&>(to);
    TORCH_CHECK(
        to_linear.Adopt("weight", from_linear->EffectiveWeight().to(torch::kFloat).clone()).ok(),
        "converting ", m.key());
    if (from_linear->bias.defined()) to_linear.bias.set_data(from_linear->bias.detach().clone());
    if (from_linear->has_lora()) {
      to_linear.lora_a.set_data(from_linear->lora_a.detach().clone());
      to_linear.lora_b.set_data(from_linear->lora_b.detach().clone());
    }
  }
  dst->train(src.is_training());
  return dst;
}

int64_t TowerLinearWeightBytes(Blip2TowerImpl& tower) {
  int64_t total = 0;
  for (const auto& m : tower.modules(/*include_self=*/false)) {
    if (auto* linear = dynamic_cast<HfLinearImpl*>(m.get())) total += linear->WeightBytes();
  }
  return total;
}

Blip2TowerImpl::QueryPass Blip2TowerImpl::Queries(const torch::Tensor& visual_tokens,
                                                  const torch::Tensor& visual_mask,
                                                  double dropout_p,
                                                  std::vector<torch::Tensor>* contributions) {
  TORCH_CHECK(
      visual_tokens.dim() == 3 && visual_tokens.size(2) == arch_.blip2.qformer.encoder_hidden_size,
      "Blip2Tower expects visual tokens [B, N, ", arch_.blip2.qformer.encoder_hidden_size, "]");
  const int64_t b = visual_tokens.size(0);
  std::vector<torch::Tensor> probs;
  QueryPass q;
  q.queries = qformer->ForwardQueries(query_tokens.expand({b, -1, -1}), visual_tokens, visual_mask,
                                      dropout_p, &probs, contributions);
  q.prefix = language_projection->forward(q.queries);
  torch::Tensor mass = torch::zeros({b, visual_tokens.size(1)}, visual_tokens.options());
  for (const torch::Tensor& p : probs) mass = mass + p.mean(1).mean(1);  // heads, then queries
  q.attention_mass = mass / static_cast<double>(std::max<size_t>(1, probs.size()));
  return q;
}

MllmOutput Blip2TowerImpl::Forward(const MllmInput& input) {
  if (input.scene_index.defined()) {
    return ForwardGroups(input.visual_tokens, input.visual_mask,
                         {{input.text_ids, input.text_valid, input.scene_index}})
        .front();
  }
  const double p = TrainDropout();
  QueryPass q = Queries(input.visual_tokens, input.visual_mask, p);
  const int64_t l = config_.num_queries;
  const int64_t t = input.text_ids.size(1);
  torch::Tensor embeds = torch::cat({q.prefix, language_model->EmbedTokens(input.text_ids)}, 1);
  DecoderForwardOptions o;
  o.capture_layer = representation_layer();
  o.dropout_p = p;
  DecoderOutput d = language_model->Forward(
      embeds, PrefixedMask(AllValid(input.text_valid, input.text_ids), l), nullptr, o);
  MllmOutput out;
  out.logits = d.logits.narrow(1, l, t);
  out.queries = q.queries;
  out.representation = d.captured.narrow(1, l, t);
  out.attention_mass = q.attention_mass;
  return out;
}

std::vector<MllmOutput> Blip2TowerImpl::ForwardGroups(const torch::Tensor& visual_tokens,
                                                      const torch::Tensor& visual_mask,
                                                      const std::vector<QuestionGroup>& groups) {
  const double p = TrainDropout();
  QueryPass q = Queries(visual_tokens, visual_mask, p);
  const int64_t l = config_.num_queries;
  DecoderKvCache prefix;
  DecoderForwardOptions prefix_options;
  prefix_options.last_logits_only = true;
  prefix_options.dropout_p = p;
  language_model->Forward(q.prefix, torch::Tensor(), &prefix, prefix_options);
  std::vector<MllmOutput> outs;
  outs.reserve(groups.size());
  for (const QuestionGroup& g : groups) {
    const torch::Tensor& idx = g.scene_index;
    DecoderKvCache cache;
    for (size_t i = 0; i < prefix.keys.size(); ++i) {
      cache.keys.push_back(prefix.keys[i].index_select(0, idx));
      cache.values.push_back(prefix.values[i].index_select(0, idx));
    }
    DecoderForwardOptions o;
    o.capture_layer = representation_layer();
    o.dropout_p = p;
    DecoderOutput d =
        language_model->Forward(language_model->EmbedTokens(g.text_ids),
                                PrefixedMask(AllValid(g.text_valid, g.text_ids), l), &cache, o);
    MllmOutput out;
    out.logits = g.logit_count < 0 ? d.logits : d.logits.narrow(1, g.logit_first, g.logit_count);
    out.representation = d.captured;
    out.queries = q.queries.index_select(0, idx);
    out.attention_mass = q.attention_mass.index_select(0, idx);
    outs.push_back(std::move(out));
  }
  return outs;
}

GenerateResult Blip2TowerImpl::Generate(const torch::Tensor& visual_tokens,
                                        const torch::Tensor& visual_mask,
                                        const torch::Tensor& prompt_ids,
                                        const torch::Tensor& prompt_valid, int max_new_tokens,
                                        int64_t eos_id) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(max_new_tokens > 0, "max_new_tokens must be positive");
  const int64_t b = prompt_ids.size(0);
  QueryPass q = Queries(visual_tokens, visual_mask, 0.0);
  torch::Tensor mask = PrefixedMask(AllValid(prompt_valid, prompt_ids), config_.num_queries);
  torch::Tensor embeds = torch::cat({q.prefix, language_model->EmbedTokens(prompt_ids)}, 1);
  DecoderKvCache cache;
  DecoderForwardOptions o;
  o.last_logits_only = true;
  torch::Tensor logits = language_model->Forward(embeds, mask, &cache, o).logits.select(1, 0);
  const auto long_options = torch::dtype(torch::kLong).device(prompt_ids.device());
  std::vector<torch::Tensor> tokens, step_logits;
  torch::Tensor done = torch::zeros({b}, torch::dtype(torch::kBool).device(prompt_ids.device()));
  torch::Tensor lengths = torch::zeros({b}, long_options);
  torch::Tensor eos = torch::full({b}, eos_id, long_options);
  for (int step = 0; step < max_new_tokens; ++step) {
    torch::Tensor next = torch::where(done, eos, logits.argmax(-1));
    step_logits.push_back(logits);
    tokens.push_back(next);
    lengths = lengths + (done.logical_not() & (next != eos_id)).to(torch::kLong);
    done = done | (next == eos_id);
    if (step + 1 == max_new_tokens || done.all().item<bool>()) break;
    mask = torch::cat({mask, torch::ones({b, 1}, mask.options())}, 1);
    logits =
        language_model->Forward(language_model->EmbedTokens(next.unsqueeze(1)), mask, &cache, o)
            .logits.select(1, 0);
  }
  GenerateResult r;
  r.tokens = torch::stack(tokens, 1);
  r.step_logits = torch::stack(step_logits, 1);
  r.lengths = lengths;
  return r;
}

StochasticStats Blip2TowerImpl::StochasticPasses(const torch::Tensor& visual_tokens,
                                                 const torch::Tensor& visual_mask, int passes,
                                                 double dropout_p) {
  torch::NoGradGuard no_grad;
  TORCH_CHECK(passes > 0, "StochasticPasses needs at least one pass");
  const int64_t b = visual_tokens.size(0);
  StochasticStats s;
  if (dropout_p <= 0.0) {
    // Identical passes: run one and replicate it, so the variance is exactly zero.
    QueryPass q = Queries(visual_tokens, visual_mask, 0.0);
    s.attention_mass = q.attention_mass.unsqueeze(0).expand({passes, -1, -1}).contiguous();
    s.queries = q.queries.unsqueeze(0).expand({passes, -1, -1, -1}).contiguous();
    s.token_variance = torch::zeros({b, visual_tokens.size(1)}, visual_tokens.options());
  } else {
    // VIS: element-wise MC dropout on the encoded visual tokens, then the Q-Former with its
    // own dropout at the same rate.
    std::vector<torch::Tensor> contributions;
    QueryPass q = Queries(TrainingDropout(visual_tokens.repeat({passes, 1, 1}), dropout_p),
                          visual_mask.defined() ? visual_mask.repeat({passes, 1}) : torch::Tensor(),
                          dropout_p, &contributions);
    s.attention_mass = q.attention_mass.view({passes, b, -1});
    s.queries = q.queries.view({passes, b, q.queries.size(1), q.queries.size(2)});
    TORCH_CHECK(!contributions.empty(), "the Q-Former has no cross-attention layer");
    s.token_variance =
        VisVariance(torch::cat(contributions, -1).view({passes, b, visual_tokens.size(1), -1}));
  }
  s.attention_mass_variance = PassVariance(s.attention_mass);
  s.query_variance = PassVariance(s.queries).mean(-1);
  return s;
}

StochasticStats Blip2TowerImpl::StochasticAttention(const torch::Tensor& visual_tokens,
                                                    const torch::Tensor& visual_mask, int passes,
                                                    double dropout_p) {
  StochasticStats s = StochasticPasses(visual_tokens, visual_mask, passes, dropout_p);
  s.queries = torch::Tensor();
  s.query_variance = torch::Tensor();
  return s;
}

json WordLevelTokenizerJson(const std::vector<std::string>& vocabulary, int64_t vocab_size) {
  json vocab = json::object();
  json added = json::array();
  auto special = [&](int64_t id, const std::string& content) {
    added.push_back({{"id", id},
                     {"content", content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  };
  for (int64_t id = 0; id < vocab_size; ++id) {
    std::string word;
    if (id == vocab_size - 1) {
      word = "<image>";
    } else if (id < static_cast<int64_t>(vocabulary.size())) {
      word = vocabulary[id];
    } else {
      word = absl::StrCat("<unused_", id, ">");
    }
    vocab[word] = id;
    if (id < 4 || id == vocab_size - 1) special(id, word);
  }
  // Words: runs of letters, digits, '-', '\'', '<', '>', '_' (datasets::Tokenizer::Split);
  // any other non-space character is a word of its own; whitespace separates.
  const std::string word = "[\\p{L}\\p{N}'\\-<>_]+|[^\\s\\p{L}\\p{N}'\\-<>_]";
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", added},
              {"normalizer", {{"type", "Lowercase"}}},
              {"pre_tokenizer",
               {{"type", "Split"},
                {"pattern", {{"Regex", word}}},
                {"behavior", "Removed"},
                {"invert", true}}},
              {"post_processor", nullptr},
              {"decoder", nullptr},
              {"model", {{"type", "WordLevel"}, {"vocab", vocab}, {"unk_token", "<unk>"}}}};
}

absl::Status SaveBlip2FamilyFolder(const std::string& dir, Blip2VisionModelImpl& vit,
                                   Blip2TowerImpl& tower, const VisionConfig& vision,
                                   const std::vector<std::string>& vocabulary) {
  const TowerConfig& t = tower.config();
  if (static_cast<int64_t>(vocabulary.size()) > t.vocab_size - 1 || vocabulary.size() < 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, ": the vocabulary has ", vocabulary.size(), " words; the tower holds 4 to ",
        t.vocab_size - 1, " (its last id is the image token)"));
  }
  if (t.precision != Precision::kFp32) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": a Hugging Face folder holds an fp32 tower, not ", PrecisionName(t.precision)));
  }
  for (const auto& p : tower.named_parameters()) {
    if (absl::EndsWith(p.key(), ".adapter_gate") && p.value().abs().max().item<float>() != 0.0f) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, ": ", p.key(),
                       " is not zero: the adapter prompts change what the tower computes, "
                       "and transformers' Blip2 has none"));
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  try {
    torch::NoGradGuard no_grad;
    std::vector<std::pair<std::string, torch::Tensor>> tensors;
    for (const auto& p : vit.named_parameters()) {
      tensors.emplace_back("vision_model." + p.key(), p.value().detach().contiguous());
    }
    std::map<std::string, torch::Tensor> merged;  // LoRA folded into the base weights
    for (const auto& m : tower.named_modules()) {
      if (auto* linear = dynamic_cast<HfLinearImpl*>(m.value().get());
          linear != nullptr && linear->has_lora()) {
        merged[m.key() + ".weight"] = linear->MergedWeight();
      }
    }
    for (const auto& p : tower.named_parameters()) {
      if (IsAdaptationName(p.key())) continue;
      auto it = merged.find(p.key());
      torch::Tensor value = it != merged.end() ? it->second : p.value();
      tensors.emplace_back(HfName(p.key()), value.detach().to(torch::kFloat).contiguous());
    }
    if (absl::Status s = WriteSafetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
        !s.ok()) {
      return s;
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(dir, ": saving the tower: ", e.what_without_backtrace()));
  }
  const json specials = {{"bos_token", "<bos>"},
                         {"eos_token", "<eos>"},
                         {"unk_token", "<unk>"},
                         {"pad_token", "<pad>"}};
  json tokenizer_config = specials;
  tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast";
  tokenizer_config["model_max_length"] = t.max_positions;
  tokenizer_config["extra_special_tokens"] = {{"image_token", "<image>"}};
  json preprocessor = {{"image_processor_type", "BlipImageProcessor"},
                       {"do_convert_rgb", true},
                       {"do_resize", true},
                       {"size", {{"height", vision.image_size}, {"width", vision.image_size}}},
                       {"resample", 3},
                       {"do_rescale", true},
                       {"rescale_factor", 1.0 / 255.0},
                       {"do_normalize", true},
                       {"image_mean", {0.5, 0.5, 0.5}},
                       {"image_std", {0.25, 0.25, 0.25}}};
  for (const auto& [name, j] : std::vector<std::pair<std::string, json>>{
           {"config.json", FamilyHfConfigJson(vision, t)},
           {"tokenizer.json", WordLevelTokenizerJson(vocabulary, t.vocab_size)},
           {"tokenizer_config.json", tokenizer_config},
           {"special_tokens_map.json", specials},
           {"preprocessor_config.json", preprocessor},
           {"generation_config.json",
            {{"bos_token_id", kBos}, {"eos_token_id", kEos}, {"pad_token_id", kPad}}}}) {
    if (absl::Status s = WriteJson(dir + "/" + name, j); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status WriteFamilyParityCases(const std::string& dir, Blip2VisionModelImpl& vit,
                                    Blip2TowerImpl& tower, const torch::Tensor& pixel_values,
                                    const std::vector<std::vector<int64_t>>& prompts,
                                    const std::vector<std::string>& texts, int max_new_tokens) {
  if (pixel_values.dim() != 4 || pixel_values.size(0) != static_cast<int64_t>(prompts.size())) {
    return absl::InvalidArgumentError("WriteFamilyParityCases: one [3, S, S] image per prompt");
  }
  const TowerConfig& t = tower.config();
  json cases = json::array();
  std::vector<std::pair<std::string, torch::Tensor>> pixels;
  try {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < prompts.size(); ++i) {
      torch::Tensor pv = pixel_values.narrow(0, static_cast<int64_t>(i), 1).to(torch::kFloat);
      GenerateResult r = tower.Generate(vit.forward(pv), torch::Tensor(),
                                        torch::tensor(prompts[i], torch::kLong).unsqueeze(0),
                                        torch::Tensor(), max_new_tokens, kEos);
      const int64_t n = std::min<int64_t>(r.lengths[0].item<int64_t>() + 1, r.tokens.size(1));
      std::vector<int64_t> tokens(r.tokens.size(1));
      for (int64_t k = 0; k < r.tokens.size(1); ++k) tokens[k] = r.tokens[0][k].item<int64_t>();
      tokens.resize(n);
      std::vector<int64_t> input_ids(t.num_queries, t.vocab_size - 1);
      input_ids.insert(input_ids.end(), prompts[i].begin(), prompts[i].end());
      torch::Tensor first = r.step_logits[0][0].contiguous();
      json c = {{"input_ids", input_ids},
                {"prompt_ids", prompts[i]},
                {"greedy_tokens", tokens},
                {"max_new_tokens", max_new_tokens},
                {"first_logits", std::vector<float>(first.data_ptr<float>(),
                                                    first.data_ptr<float>() + first.numel())}};
      if (i < texts.size()) c["prompt"] = texts[i];
      cases.push_back(c);
      pixels.emplace_back(absl::StrCat("case", i), pv[0].contiguous());
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(dir, ": generating: ", e.what_without_backtrace()));
  }
  if (absl::Status s =
          WriteSafetensors(dir + "/cdcca_pixels.safetensors", pixels, {{"format", "pt"}});
      !s.ok()) {
    return s;
  }
  return WriteJson(
      dir + "/cdcca_expected.json",
      {{"note", "greedy answers of cdcca's Blip2Tower (fp32) on this folder"}, {"cases", cases}});
}

absl::StatusOr<LoadedFamilyTower> LoadBlip2FamilyFolder(const std::string& dir,
                                                        const VisionConfig& vision,
                                                        const TowerConfig& tower) {
  absl::StatusOr<HfFolder> folder = HfFolder::Open(dir);
  if (!folder.ok()) return folder.status();
  LoadedFamilyTower out;
  try {
    out.vit = MakeFamilyVit(vision);
    if (absl::Status s = LoadBlip2Vision(*folder, "vision_model.", *out.vit, torch::kCPU);
        !s.ok()) {
      return s;
    }
    TowerConfig fp32 = tower;
    fp32.precision = Precision::kFp32;
    out.tower = Blip2Tower(vision, fp32);
    torch::NoGradGuard no_grad;
    for (auto& p : out.tower->named_parameters()) {
      if (IsAdaptationName(p.key())) continue;
      const std::string name = HfName(p.key());
      absl::StatusOr<torch::Tensor> t = folder->Load(name, torch::kFloat);
      if (!t.ok()) return t.status();
      if (t->sizes() != p.value().sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            folder->FileOf(name), ": tensor ", name, " has shape ", c10::str(t->sizes()),
            ", the family config needs ", c10::str(p.value().sizes())));
      }
      p.value().set_data(*t);
    }
    for (auto& p : out.vit->parameters()) p.set_requires_grad(true);
    if (tower.precision != Precision::kFp32) {
      out.tower = ConvertTowerPrecision(*out.tower, tower.precision);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(dir, ": loading the tower: ", e.what_without_backtrace()));
  }
  return out;
}

torch::Tensor MeanTokenEntropy(const GenerateResult& result) {
  torch::NoGradGuard no_grad;
  torch::Tensor logp = torch::log_softmax(result.step_logits.to(torch::kFloat), -1);
  torch::Tensor ent = -(logp.exp() * logp).sum(-1);  // [B, n]
  const int64_t n = ent.size(1);
  torch::Tensor count = (result.lengths + 1).clamp_max(n);
  torch::Tensor idx = torch::arange(n, count.options()).unsqueeze(0);
  torch::Tensor keep = (idx < count.unsqueeze(1)).to(ent.dtype());
  return (ent * keep).sum(1) / count.to(ent.dtype());
}

}  // namespace cdcca::model
