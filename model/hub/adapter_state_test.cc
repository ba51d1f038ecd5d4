// The adapted state of a Hugging Face student (adapter_state.h): saved and loaded bit for
// bit, applied to a fresh load of its base so that it computes what the trained model
// computed, refused whole when it does not fit, and exported under PEFT's names.
#include "model/hub/adapter_state.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "model/hub/safetensors.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

std::string FixtureDir(const std::string& variant) {
  return std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/" + variant;
}

std::string TempDir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/adapter_state_" + name;
  std::filesystem::remove_all(d);
  return d;
}

// A student of `variant` with adapters whose every trainable tensor is moved off its start.
std::unique_ptr<MultimodalModel> Adapted(const std::string& variant, uint64_t seed) {
  absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(FixtureDir(variant), {});
  EXPECT_TRUE(m.ok()) << m.status();
  AdapterOptions o;
  o.lora_rank = 4;
  o.seed = 3;
  EXPECT_TRUE((*m)->AddAdapters(o).ok());
  torch::NoGradGuard no_grad;
  torch::manual_seed(seed);
  for (auto& [name, t] : (*m)->TrainableParameters()) t.add_(0.05 * torch::randn_like(t));
  return *std::move(m);
}

AdapterState StateOf(MultimodalModel& m, const std::string& variant) {
  AdapterState s;
  s.base_model = FixtureDir(variant);
  s.precision = "fp32";
  s.adapters.lora_rank = 4;
  s.adapters.seed = 3;
  for (auto& [name, t] : m.TrainableParameters()) s.trainable.emplace_back(name, t.clone());
  s.info = {{"teacher", "x"}};
  return s;
}

torch::Tensor FirstLogits(MultimodalModel& m) {
  torch::NoGradGuard no_grad;
  TokenInputs in;
  in.visual_tokens = torch::ones({1, 25, 32});
  in.input_ids = torch::tensor({1, 5, 6, 7}, torch::kLong).unsqueeze(0);
  // Image tokens: the LLaVA fixture's placeholder id, repeated for every feature.
  const std::vector<int64_t> ids = m.ExpandImageTokens({1, 856, 5, 6, 7});
  in.input_ids = torch::tensor(ids, torch::kLong).unsqueeze(0);
  absl::StatusOr<TokenForward> f = m.ForwardTokens(in);
  EXPECT_TRUE(f.ok()) << f.status();
  return f->logits;
}

TEST(AdapterStateTest, SavedStateReappliedToAFreshBaseComputesTheSame) {
  const std::string variant = "llava_clip_llama";
  std::unique_ptr<MultimodalModel> trained = Adapted(variant, 1);
  const std::string dir = TempDir("roundtrip");
  ASSERT_OK(SaveHfAdapterState(StateOf(*trained, variant), dir));
  ASSERT_OK_AND_ASSIGN(AdapterState loaded, LoadHfAdapterState(dir));
  EXPECT_EQ(loaded.adapters.lora_rank, 4);
  EXPECT_EQ(loaded.adapters.seed, 3u);
  EXPECT_EQ(loaded.info["teacher"], "x");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> fresh, LoadModel(FixtureDir(variant), {}));
  torch::Tensor base = FirstLogits(*fresh);
  ASSERT_OK(ApplyHfAdapterState(loaded, *fresh));
  NamedTensors a = trained->TrainableParameters(), b = fresh->TrainableParameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
  }
  torch::Tensor adapted = FirstLogits(*fresh);
  EXPECT_TRUE(torch::equal(adapted, FirstLogits(*trained)));
  EXPECT_FALSE(torch::allclose(adapted, base));
}

TEST(AdapterStateTest, AStateThatDoesNotFitIsRefusedAndNamesTheTensor) {
  const std::string variant = "llava_clip_llama";
  std::unique_ptr<MultimodalModel> trained = Adapted(variant, 2);
  AdapterState s = StateOf(*trained, variant);
  s.trainable[0].second = torch::zeros({3});
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> fresh, LoadModel(FixtureDir(variant), {}));
  absl::Status st = ApplyHfAdapterState(s, *fresh);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(s.trainable[0].first), std::string::npos) << st;
  // Nothing was copied: the norms are still the checkpoint's.
  for (auto& [name, t] : fresh->TrainableParameters()) {
    if (name.find("lora") == std::string::npos && name.find("norm") != std::string::npos) {
      ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> plain,
                           LoadModel(FixtureDir(variant), {}));
      ASSERT_OK(plain->AddAdapters(s.adapters));
      for (auto& [n2, t2] : plain->TrainableParameters()) {
        if (n2 == name) EXPECT_TRUE(torch::equal(t, t2)) << name;
      }
      break;
    }
  }
  // A state of another family does not fit either.
  std::unique_ptr<MultimodalModel> other = Adapted("blip2_llama", 3);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> fresh2, LoadModel(FixtureDir(variant), {}));
  EXPECT_EQ(ApplyHfAdapterState(StateOf(*other, "blip2_llama"), *fresh2).code(),
            absl::StatusCode::kInvalidArgument);
  // A folder without a state, or with a damaged one.
  EXPECT_EQ(LoadHfAdapterState(TempDir("none")).status().code(), absl::StatusCode::kNotFound);
  const std::string dir = TempDir("bad");
  ASSERT_OK(SaveHfAdapterState(StateOf(*trained, variant), dir));
  std::ofstream(dir + "/adapter_state.json") << "{\"format\": \"something else\"}";
  EXPECT_EQ(LoadHfAdapterState(dir).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AdapterStateTest, ExportUsesPeftNamesAndKeepsTheRestApart) {
  for (const std::string variant : {"llava_clip_llama", "blip2_llama"}) {
    SCOPED_TRACE(variant);
    std::unique_ptr<MultimodalModel> trained = Adapted(variant, 4);
    AdapterState s = StateOf(*trained, variant);
    const std::string out = TempDir("export_" + variant);
    ASSERT_OK(ExportPeftAdapter(s, out));
    ASSERT_OK_AND_ASSIGN(SafetensorsContents lora,
                         ReadSafetensors(out + "/adapter_model.safetensors"));
    ASSERT_OK_AND_ASSIGN(SafetensorsContents rest, ReadSafetensors(out + "/non_lora.safetensors"));
    EXPECT_EQ(lora.tensors.size() + rest.tensors.size(), s.trainable.size());
    EXPECT_EQ(lora.tensors.size(), 8u);  // 2 layers x q, v x A, B
    for (const auto& [name, t] : lora.tensors) {
      EXPECT_EQ(name.rfind("base_model.model.", 0), 0u) << name;
      EXPECT_TRUE(name.find(".lora_A.weight") != std::string::npos ||
                  name.find(".lora_B.weight") != std::string::npos)
          << name;
      if (name.find("lora_A") != std::string::npos) EXPECT_EQ(t.size(0), 4) << name;
    }
    for (const auto& [name, t] : rest.tensors) {
      EXPECT_EQ(name.find("lora"), std::string::npos) << name;
    }
    std::ifstream in(out + "/adapter_config.json");
    const nlohmann::json c = nlohmann::json::parse(in);
    EXPECT_EQ(c["peft_type"], "LORA");
    EXPECT_EQ(c["r"], 4);
    EXPECT_EQ(c["lora_alpha"], 16.0);
    EXPECT_EQ(c["target_modules"], ".*language_model.*\\.(q_proj|v_proj)");
  }
  // A LoRA factor without its partner.
  std::unique_ptr<MultimodalModel> trained = Adapted("llava_clip_llama", 5);
  AdapterState s = StateOf(*trained, "llava_clip_llama");
  for (auto it = s.trainable.begin(); it != s.trainable.end(); ++it) {
    if (it->first.find("lora_b") != std::string::npos) {
      s.trainable.erase(it);
      break;
    }
  }
  EXPECT_EQ(ExportPeftAdapter(s, TempDir("half")).code(), absl::StatusCode::kInvalidArgument);
}

// OPT's and T5's language models take LoRA on their own q/v names: the trainable set holds
// them under the checkpoint's names with the LM's norms (and OPT's biases), a saved state
// reapplied to a fresh base answers as the trained model, and the export targets those names.
TEST(AdapterStateTest, OptAndT5LoraUseTheirOwnNamesRoundTripAndExport) {
  struct Case {
    std::string variant;
    std::vector<std::string> expected;  // tensors the trainable set must hold
    std::string regex;
    size_t lora_tensors;
    std::vector<int64_t> prompt;
  };
  const std::vector<Case> cases = {
      {"blip2_opt",
       {"language_model.model.decoder.layers.0.self_attn.q_proj.lora_a",
        "language_model.model.decoder.layers.1.self_attn.v_proj.lora_b",
        "language_model.model.decoder.layers.0.self_attn.out_proj.bias",
        "language_model.model.decoder.layers.0.fc1.bias",
        "language_model.model.decoder.layers.1.self_attn_layer_norm.weight",
        "language_model.model.decoder.final_layer_norm.bias", "query_tokens"},
       ".*language_model.*\\.(q_proj|v_proj)",
       8,
       {2, 579, 29}},
      {"blip2_flan_t5",
       {"language_model.encoder.block.0.layer.0.SelfAttention.q.lora_a",
        "language_model.decoder.block.1.layer.0.SelfAttention.v.lora_b",
        "language_model.decoder.block.0.layer.1.EncDecAttention.q.lora_b",
        "language_model.decoder.block.1.layer.2.layer_norm.weight",
        "language_model.encoder.final_layer_norm.weight", "query_tokens"},
       ".*language_model.*\\.(q|v)",
       // encoder 2 blocks x 1 attention + decoder 2 blocks x 2 attentions, x q, v x A, B
       24,
       {196, 10, 52, 11, 1}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.variant);
    std::unique_ptr<MultimodalModel> trained = Adapted(c.variant, 6);
    AdapterState s = StateOf(*trained, c.variant);
    std::set<std::string> names;
    for (const auto& [name, t] : s.trainable) names.insert(name);
    for (const std::string& want : c.expected) EXPECT_EQ(names.count(want), 1u) << want;
    for (const std::string& name : names) {
      EXPECT_EQ(name.find("embed"), std::string::npos) << name;
      EXPECT_EQ(name.find("shared"), std::string::npos) << name;
    }

    const std::string dir = TempDir("opt_t5_" + c.variant);
    ASSERT_OK(SaveHfAdapterState(s, dir));
    ASSERT_OK_AND_ASSIGN(AdapterState loaded, LoadHfAdapterState(dir));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<MultimodalModel> fresh,
                         LoadModel(FixtureDir(c.variant), {}));
    ASSERT_OK_AND_ASSIGN(SafetensorsContents pixels,
                         ReadSafetensors(FixtureDir(c.variant) + "/expected_pixels.safetensors"));
    MultimodalInputs in;
    in.pixel_values = pixels.tensors[0].second.unsqueeze(0);
    in.input_ids = torch::tensor(c.prompt, torch::kLong).unsqueeze(0);
    GreedyOptions g;
    g.max_new_tokens = 3;
    ASSERT_OK_AND_ASSIGN(GreedyResult base, fresh->Generate(in, g));
    ASSERT_OK(ApplyHfAdapterState(loaded, *fresh));
    ASSERT_OK_AND_ASSIGN(GreedyResult want, trained->Generate(in, g));
    ASSERT_OK_AND_ASSIGN(GreedyResult got, fresh->Generate(in, g));
    EXPECT_TRUE(torch::equal(got.first_logits, want.first_logits));
    EXPECT_FALSE(torch::allclose(base.first_logits, want.first_logits));

    const std::string out = TempDir("export_" + c.variant);
    ASSERT_OK(ExportPeftAdapter(s, out));
    ASSERT_OK_AND_ASSIGN(SafetensorsContents lora,
                         ReadSafetensors(out + "/adapter_model.safetensors"));
    EXPECT_EQ(lora.tensors.size(), c.lora_tensors);
    std::ifstream config(out + "/adapter_config.json");
    EXPECT_EQ(nlohmann::json::parse(config)["target_modules"], c.regex);
  }
}

// A state with the Q-Former's LoRA (lora_qformer) round-trips with its option, exports its
// Q-Former factors beside the LM's with a target regex that names both, and changes the base
// fingerprint, which stays what it was without it.
TEST(AdapterStateTest, QFormerLoraRoundTripsExportsAndIsFingerprinted) {
  absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(FixtureDir("blip2_llama"), {});
  ASSERT_OK(m.status());
  AdapterOptions o;
  o.lora_rank = 4;
  o.seed = 3;
  o.lora_qformer = true;
  ASSERT_OK((*m)->AddAdapters(o));
  AdapterState s = StateOf(**m, "blip2_llama");
  s.adapters.lora_qformer = true;
  const std::string dir = TempDir("qformer_state");
  ASSERT_OK(SaveHfAdapterState(s, dir));
  ASSERT_OK_AND_ASSIGN(AdapterState loaded, LoadHfAdapterState(dir));
  EXPECT_TRUE(loaded.adapters.lora_qformer);
  EXPECT_EQ(loaded.trainable.size(), s.trainable.size());

  const std::string out = TempDir("qformer_export");
  ASSERT_OK(ExportPeftAdapter(s, out));
  ASSERT_OK_AND_ASSIGN(SafetensorsContents lora,
                       ReadSafetensors(out + "/adapter_model.safetensors"));
  int qformer = 0;
  for (const auto& [name, t] : lora.tensors) qformer += name.find(".qformer.") != std::string::npos;
  EXPECT_GT(qformer, 0);
  std::ifstream in(out + "/adapter_config.json");
  const nlohmann::json c = nlohmann::json::parse(in);
  EXPECT_EQ(c["target_modules"],
            "(.*language_model.*\\.(q_proj|v_proj))|(.*qformer.*\\.(query|value))");

  AdapterOptions plain = o;
  plain.lora_qformer = false;
  EXPECT_NE(StudentBaseFingerprint(1, "fp32", o, 2), StudentBaseFingerprint(1, "fp32", plain, 2));
  AdapterOptions mlp = plain;
  mlp.lora_mlp = true;
  EXPECT_NE(StudentBaseFingerprint(1, "fp32", mlp, 2), StudentBaseFingerprint(1, "fp32", plain, 2));
}

// A state with LoRA on the projector into the LM (lora_projector) round-trips with its
// option, exports the projector's factors under their module paths with a target regex that
// names them beside the LM's kinds, and changes the base fingerprint. On LLaVA the factors sit
// on multi_modal_projector.linear_1 and linear_2, on BLIP-2 on language_projection.
TEST(AdapterStateTest, ProjectorLoraRoundTripsExportsAndIsFingerprinted) {
  struct Want {
    std::string variant, module_path, regex;
  };
  for (const Want& w :
       {Want{"llava_clip_llama", "multi_modal_projector.linear_1",
             "(.*language_model.*\\.(q_proj|v_proj))|(.*(multi_modal_projector\\.linear_1|"
             "multi_modal_projector\\.linear_2))"},
        Want{"blip2_llama", "language_projection",
             "(.*language_model.*\\.(q_proj|v_proj))|(.*(language_projection))"}}) {
    SCOPED_TRACE(w.variant);
    absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(FixtureDir(w.variant), {});
    ASSERT_OK(m.status());
    AdapterOptions o;
    o.lora_rank = 4;
    o.seed = 3;
    o.lora_projector = true;
    ASSERT_OK((*m)->AddAdapters(o));
    AdapterState s = StateOf(**m, w.variant);
    s.adapters.lora_projector = true;
    const std::string dir = TempDir("projector_state_" + w.variant);
    ASSERT_OK(SaveHfAdapterState(s, dir));
    ASSERT_OK_AND_ASSIGN(AdapterState loaded, LoadHfAdapterState(dir));
    EXPECT_TRUE(loaded.adapters.lora_projector);
    EXPECT_FALSE(loaded.adapters.lora_qformer);
    EXPECT_EQ(loaded.trainable.size(), s.trainable.size());

    const std::string out = TempDir("projector_export_" + w.variant);
    ASSERT_OK(ExportPeftAdapter(s, out));
    ASSERT_OK_AND_ASSIGN(SafetensorsContents lora,
                         ReadSafetensors(out + "/adapter_model.safetensors"));
    int projector = 0;
    for (const auto& [name, t] : lora.tensors) {
      projector += name.find(w.module_path + ".lora_A.weight") != std::string::npos;
    }
    EXPECT_EQ(projector, 1);
    std::ifstream in(out + "/adapter_config.json");
    const nlohmann::json c = nlohmann::json::parse(in);
    EXPECT_EQ(c["target_modules"], w.regex);

    AdapterOptions plain = o;
    plain.lora_projector = false;
    EXPECT_NE(StudentBaseFingerprint(1, "fp32", o, 2), StudentBaseFingerprint(1, "fp32", plain, 2));
  }
}

// A state with the vision side trainable (lora_vision) round-trips with its option, exports the
// tower's LoRA factors under their module paths, with a target regex that PEFT matches (in
// full) against each adapted tower linear and the LM's kinds but no other tower linear, puts
// the tower's LayerNorms with the other non-LoRA tensors, and changes the base fingerprint.
TEST(AdapterStateTest, VisionLoraRoundTripsExportsAndIsFingerprinted) {
  // `adapted` and `not_adapted` as the export names them: transformers 5's module paths (its
  // LLaVA tower without the canonical names' `vision_model.` level).
  struct Want {
    std::string variant, adapted, not_adapted, lm_module;
  };
  for (const Want& w :
       {Want{"llava_clip_llama", "model.vision_tower.encoder.layers.0.self_attn.q_proj",
             "model.vision_tower.encoder.layers.0.self_attn.k_proj",
             "model.language_model.layers.0.self_attn.v_proj"},
        Want{"blip2_llama", "vision_model.encoder.layers.0.self_attn.qkv",
             "vision_model.encoder.layers.0.mlp.fc1",
             "language_model.model.layers.0.self_attn.q_proj"}}) {
    SCOPED_TRACE(w.variant);
    absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(FixtureDir(w.variant), {});
    ASSERT_OK(m.status());
    AdapterOptions o;
    o.lora_rank = 4;
    o.seed = 3;
    o.lora_vision = true;
    ASSERT_OK((*m)->AddAdapters(o));
    AdapterState s = StateOf(**m, w.variant);
    s.adapters.lora_vision = true;
    const std::string dir = TempDir("vision_state_" + w.variant);
    ASSERT_OK(SaveHfAdapterState(s, dir));
    ASSERT_OK_AND_ASSIGN(AdapterState loaded, LoadHfAdapterState(dir));
    EXPECT_TRUE(loaded.adapters.lora_vision);
    EXPECT_FALSE(loaded.adapters.lora_projector);
    EXPECT_EQ(loaded.trainable.size(), s.trainable.size());

    const std::string out = TempDir("vision_export_" + w.variant);
    ASSERT_OK(ExportPeftAdapter(s, out));
    ASSERT_OK_AND_ASSIGN(SafetensorsContents lora,
                         ReadSafetensors(out + "/adapter_model.safetensors"));
    int adapted = 0;
    for (const auto& [name, t] : lora.tensors) {
      adapted += name == "base_model.model." + w.adapted + ".lora_A.weight";
    }
    EXPECT_EQ(adapted, 1);
    ASSERT_OK_AND_ASSIGN(SafetensorsContents rest, ReadSafetensors(out + "/non_lora.safetensors"));
    int tower_norms = 0;
    const std::string tower = w.adapted.substr(0, w.adapted.find("encoder."));
    for (const auto& [name, t] : rest.tensors) {
      tower_norms += absl::StartsWith(name, tower) && absl::StrContains(name, "norm");
      EXPECT_FALSE(absl::StartsWith(name, "model.vision_tower.vision_model.")) << name;
    }
    EXPECT_GT(tower_norms, 0);
    std::ifstream in(out + "/adapter_config.json");
    const nlohmann::json c = nlohmann::json::parse(in);
    const std::regex targets(c["target_modules"].get<std::string>());
    EXPECT_TRUE(std::regex_match(w.adapted, targets)) << c["target_modules"];
    EXPECT_TRUE(std::regex_match(w.lm_module, targets)) << c["target_modules"];
    EXPECT_FALSE(std::regex_match(w.not_adapted, targets)) << c["target_modules"];

    AdapterOptions plain = o;
    plain.lora_vision = false;
    EXPECT_NE(StudentBaseFingerprint(1, "fp32", o, 2), StudentBaseFingerprint(1, "fp32", plain, 2));
  }
}

// With the tower's MLP too (lora_vision_mlp) the state round-trips with both options, the
// export's target regex matches the tower's fc1 and fc2 (which the attention-only export above
// must not) and the attention's linears, and the base fingerprint differs from the attention's
// alone.
TEST(AdapterStateTest, VisionMlpLoraRoundTripsExportsAndIsFingerprinted) {
  for (const auto& [variant, fc1, fc2] :
       {std::tuple<std::string, std::string, std::string>{
            "llava_clip_llama", "model.vision_tower.encoder.layers.0.mlp.fc1",
            "model.vision_tower.encoder.layers.0.mlp.fc2"},
        {"blip2_llama", "vision_model.encoder.layers.0.mlp.fc1",
         "vision_model.encoder.layers.0.mlp.fc2"}}) {
    SCOPED_TRACE(variant);
    absl::StatusOr<std::unique_ptr<MultimodalModel>> m = LoadModel(FixtureDir(variant), {});
    ASSERT_OK(m.status());
    AdapterOptions o;
    o.lora_rank = 4;
    o.seed = 3;
    o.lora_vision = true;
    o.lora_vision_mlp = true;
    ASSERT_OK((*m)->AddAdapters(o));
    AdapterState s = StateOf(**m, variant);
    s.adapters = o;
    const std::string dir = TempDir("vision_mlp_state_" + variant);
    ASSERT_OK(SaveHfAdapterState(s, dir));
    ASSERT_OK_AND_ASSIGN(AdapterState loaded, LoadHfAdapterState(dir));
    EXPECT_TRUE(loaded.adapters.lora_vision);
    EXPECT_TRUE(loaded.adapters.lora_vision_mlp);
    EXPECT_EQ(loaded.trainable.size(), s.trainable.size());

    const std::string out = TempDir("vision_mlp_export_" + variant);
    ASSERT_OK(ExportPeftAdapter(s, out));
    ASSERT_OK_AND_ASSIGN(SafetensorsContents lora,
                         ReadSafetensors(out + "/adapter_model.safetensors"));
    int factors = 0;
    for (const auto& [name, t] : lora.tensors) {
      factors += name == "base_model.model." + fc1 + ".lora_A.weight" ||
                 name == "base_model.model." + fc2 + ".lora_B.weight";
    }
    EXPECT_EQ(factors, 2);
    std::ifstream in(out + "/adapter_config.json");
    const nlohmann::json c = nlohmann::json::parse(in);
    const std::regex targets(c["target_modules"].get<std::string>());
    EXPECT_TRUE(std::regex_match(fc1, targets)) << c["target_modules"];
    EXPECT_TRUE(std::regex_match(fc2, targets)) << c["target_modules"];

    AdapterOptions attention = o;
    attention.lora_vision_mlp = false;
    EXPECT_NE(StudentBaseFingerprint(1, "fp32", o, 2),
              StudentBaseFingerprint(1, "fp32", attention, 2));
  }
}

}  // namespace
}  // namespace cdcca::model
