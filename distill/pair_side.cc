#include "distill/pair_side.h"

#include <fstream>
#include <iterator>

#include "absl/strings/str_format.h"
#include "compress/hash64.h"
#include "model/hub/image_processor.h"
#include "model/tokenizer/tokenizer.h"

namespace cdcca::distill {
namespace {

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<int64_t> Widen(const std::vector<int32_t>& ids) {
  return std::vector<int64_t>(ids.begin(), ids.end());
}

}  // namespace

PairSide PairSideOf(model::Answerer& answerer, const std::string& dir, model::PromptFormat format) {
  PairSide side;
  side.model = &answerer.model();
  const tokenizer::Tokenizer* tok = &answerer.tokenizer();
  side.encode = [tok](const std::string& text,
                      bool special) -> absl::StatusOr<std::vector<int64_t>> {
    absl::StatusOr<std::vector<int32_t>> ids = tok->Encode(text, special);
    if (!ids.ok()) return ids.status();
    return Widen(*ids);
  };
  side.decode = [tok](const std::vector<int64_t>& ids) {
    return tok->Decode(std::vector<int32_t>(ids.begin(), ids.end()), /*skip_special_tokens=*/true);
  };
  if (const tokenizer::Tokenizer* q = answerer.qformer_tokenizer(); q != nullptr) {
    side.qformer_encode = [q](const std::string& text) -> absl::StatusOr<std::vector<int64_t>> {
      absl::StatusOr<std::vector<int32_t>> ids = q->Encode(text, true);
      if (!ids.ok()) return ids.status();
      return Widen(*ids);
    };
  }
  side.format_prompt = [format = std::move(format)](const std::string& prompt) {
    return format.Apply(prompt);
  };
  std::string bytes = FileBytes(dir + "/tokenizer.json");
  if (bytes.empty()) bytes = FileBytes(dir + "/tokenizer.model");
  if (!bytes.empty()) {
    side.tokenizer_id = absl::StrFormat("%016x", compress::Hash64(bytes.data(), bytes.size()));
  }
  return side;
}

absl::StatusOr<torch::Tensor> FramePixels(const model::Answerer& answerer, absl::string_view jpeg,
                                          const std::string& source) {
  absl::StatusOr<model::PixelValues> px = answerer.TowerPixelsOfJpeg(jpeg, source);
  if (!px.ok()) return px.status();
  return torch::from_blob(px->data.data(), {px->channels, px->height, px->width}, torch::kFloat)
      .clone();
}

}  // namespace cdcca::distill
