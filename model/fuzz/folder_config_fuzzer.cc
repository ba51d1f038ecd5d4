// libFuzzer entry for a Hugging Face folder's config.json and generation_config.json: the
// bounded JSON reader, then every config parser the loaders run on that file (model_type,
// the decoder, rope, CLIP/SigLIP, LLaVA, BLIP-2 / InstructBLIP with its text_config, eos
// ids). An accepted config must give the sizes the model constructors rely on.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "model/hub/blip2_config.h"
#include "model/hub/folder_config.h"
#include "model/hub/folder_json.h"

namespace {

using namespace cdcca::model;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void CheckDecoder(const DecoderConfig& d) {
  Check(d.vocab_size > 0 && d.vocab_size <= kMaxHfConfigSize);
  Check(d.hidden_size > 0 && d.hidden_size <= kMaxHfConfigSize);
  Check(d.intermediate_size > 0 && d.intermediate_size <= kMaxHfConfigSize);
  Check(d.num_hidden_layers >= 0 && d.num_hidden_layers <= kMaxHfConfigSize);
  Check(d.num_attention_heads > 0 && d.num_attention_heads <= kMaxHfConfigSize);
  Check(d.num_key_value_heads > 0 && d.num_attention_heads % d.num_key_value_heads == 0);
  Check(d.head_dim > 0 && d.head_dim % 2 == 0 && d.head_dim <= kMaxHfConfigSize);
  Check(d.max_position_embeddings >= 0 && d.max_position_embeddings <= kMaxHfPositions);
  Check(d.rope.original_max_position_embeddings >= 0 &&
        d.rope.original_max_position_embeddings <= kMaxHfPositions);
  Check(CheckActivation(d.hidden_act, "hidden_act").ok());
  if (d.is_opt()) Check(d.word_embed_proj_dim > 0 && d.word_embed_proj_dim <= kMaxHfConfigSize);
}

void CheckT5(const T5Config& t) {
  for (int64_t v : {t.vocab_size, t.d_model, t.d_kv, t.d_ff, t.num_layers, t.num_decoder_layers,
                    t.num_heads, t.relative_attention_max_distance}) {
    Check(v > 0 && v <= kMaxHfConfigSize);
  }
  Check(t.relative_attention_num_buckets >= 4 &&
        t.relative_attention_num_buckets <= kMaxHfConfigSize);
  Check(t.decoder_start_token_id >= 0 && t.decoder_start_token_id < t.vocab_size);
  Check(CheckActivation(t.dense_act_fn, "feed_forward_proj").ok());
}

void CheckVision(const ClipVisionConfig& v) {
  Check(v.hidden_size > 0 && v.num_attention_heads > 0 &&
        v.hidden_size % v.num_attention_heads == 0);
  Check(v.num_patches() > 0 && v.num_positions() >= v.num_patches());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string file = "config.json";
  absl::StatusOr<nlohmann::json> j = ParseHfJson(text, file);
  if (!j.ok()) return 0;
  (void)ConfigModelType(*j, file);
  (void)ConfigIdList(*j, "eos_token_id");
  (void)ConfigInt(*j, "vocab_size", file);
  if (absl::StatusOr<RopeConfig> r = ParseRopeConfig(*j, file); r.ok()) {
    Check(r->original_max_position_embeddings >= 0);
  }
  if (absl::StatusOr<DecoderConfig> d = ParseDecoderConfig(*j, file); d.ok()) CheckDecoder(*d);
  if (absl::StatusOr<T5Config> t = ParseT5Config(*j, file); t.ok()) CheckT5(*t);
  if (absl::StatusOr<ClipVisionConfig> v = ParseClipVisionConfig(*j, file); v.ok()) {
    CheckVision(*v);
  }
  if (absl::StatusOr<LlavaConfig> l = ParseLlavaConfig(*j, file); l.ok()) {
    CheckDecoder(l->text);
    CheckVision(l->vision);
    Check(l->NumImageTokens() >= 0);
    Check(CheckActivation(l->projector_hidden_act, "projector_hidden_act").ok());
  }
  if (absl::StatusOr<Blip2Config> b = ParseBlip2Config(*j, file); b.ok()) {
    Check(b->vision.NumPositions() > 1 && b->num_query_tokens > 0);
    Check(b->qformer.cross_attention_frequency > 0 &&
          b->qformer.hidden_size % b->qformer.num_attention_heads == 0);
    // blip2.cc parses the text_config the same way (T5's by ParseT5Config).
    auto text = j->find("text_config");
    if (text != j->end() && text->is_object()) {
      if (absl::StatusOr<DecoderConfig> d = ParseDecoderConfig(*text, file); d.ok()) {
        CheckDecoder(*d);
      }
      if (absl::StatusOr<T5Config> t = ParseT5Config(*text, file); t.ok()) CheckT5(*t);
    }
  }
  return 0;
}
