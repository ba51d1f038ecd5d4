#include "distill/sample_batch.h"

#include <torch/torch.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace cdcca::distill {

absl::StatusOr<SamplePool> BuildSamplePool(
    const std::vector<const compress::UplinkSample*>& samples, int64_t num_tokens, int64_t d_vis) {
  const int64_t p = static_cast<int64_t>(samples.size());
  SamplePool pool;
  pool.visual_tokens = torch::zeros({p, num_tokens, d_vis});
  pool.visual_mask = torch::zeros({p, num_tokens}, torch::kBool);
  float* tokens = pool.visual_tokens.data_ptr<float>();
  bool* mask = pool.visual_mask.data_ptr<bool>();
  for (int64_t i = 0; i < p; ++i) {
    const compress::UplinkSample& s = *samples[i];
    const std::string id = absl::StrCat("sample ", s.sample_id, ": ");
    if (s.grid_tokens != num_tokens || s.feature_dim != d_vis) {
      return absl::InvalidArgumentError(absl::StrCat(id, "grid ", s.grid_tokens, "x", s.feature_dim,
                                                     " but the model expects ", num_tokens, "x",
                                                     d_vis));
    }
    if (s.features.size() != s.kept_indices.size() * static_cast<size_t>(d_vis)) {
      return absl::InvalidArgumentError(absl::StrCat(id, "features hold ", s.features.size(),
                                                     " values for ", s.kept_indices.size(),
                                                     " kept tokens"));
    }
    if (s.prompt_tokens.empty()) return absl::InvalidArgumentError(id + "empty prompt");
    int64_t previous = -1;
    for (size_t k = 0; k < s.kept_indices.size(); ++k) {
      const int64_t idx = s.kept_indices[k];
      if (idx <= previous || idx >= num_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(id, "bad kept index ", idx));
      }
      previous = idx;
      std::copy_n(s.features.data() + k * d_vis, d_vis, tokens + (i * num_tokens + idx) * d_vis);
      mask[i * num_tokens + idx] = true;
    }
    pool.prompts.emplace_back(s.prompt_tokens.begin(), s.prompt_tokens.end());
    pool.device_answers.emplace_back(s.answer_tokens.begin(), s.answer_tokens.end());
  }
  return pool;
}

TextBatch CollateText(const std::vector<std::vector<int64_t>>& prompts,
                      const std::vector<std::vector<int64_t>>& answers, int64_t pad_id) {
  TORCH_CHECK(prompts.size() == answers.size(), "CollateText: prompts and answers differ");
  const int64_t b = static_cast<int64_t>(prompts.size());
  TextBatch out;
  int64_t pmax = 0, amax = 0;
  for (int64_t i = 0; i < b; ++i) {
    out.prompt_lengths.push_back(static_cast<int64_t>(prompts[i].size()));
    out.answer_lengths.push_back(static_cast<int64_t>(answers[i].size()));
    pmax = std::max(pmax, out.prompt_lengths.back());
    amax = std::max(amax, out.answer_lengths.back());
  }
  const int64_t t = pmax + amax;
  out.prompt_width = pmax;
  out.text_ids = torch::full({b, t}, pad_id, torch::kLong);
  out.text_valid = torch::zeros({b, t}, torch::kBool);
  out.targets = torch::full({b, t}, int64_t{-1}, torch::kLong);
  out.answer_mask = torch::zeros({b, t}, torch::kBool);
  auto ids = out.text_ids.accessor<int64_t, 2>();
  auto valid = out.text_valid.accessor<bool, 2>();
  auto targets = out.targets.accessor<int64_t, 2>();
  auto answer = out.answer_mask.accessor<bool, 2>();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t pl = out.prompt_lengths[i];
    for (int64_t k = 0; k < pl; ++k) {
      ids[i][pmax - pl + k] = prompts[i][k];
      valid[i][pmax - pl + k] = true;
    }
    for (int64_t j = 0; j < out.answer_lengths[i]; ++j) {
      ids[i][pmax + j] = answers[i][j];
      valid[i][pmax + j] = true;
      answer[i][pmax + j] = true;
      if (pl > 0 || j > 0) targets[i][pmax + j - 1] = answers[i][j];
    }
  }
  return out;
}

torch::Tensor SelectRows(const torch::Tensor& x, const std::vector<int64_t>& index) {
  torch::Tensor idx = torch::tensor(index, torch::kLong).to(x.device());
  return x.index_select(0, idx);
}

std::vector<int64_t> AnswerTokens(const torch::Tensor& tokens, const torch::Tensor& lengths,
                                  int64_t row) {
  torch::Tensor r = tokens[row].to(torch::kCPU, torch::kLong).contiguous();
  const int64_t n = r.size(0);
  const int64_t len = std::min<int64_t>(lengths[row].item<int64_t>() + 1, n);
  const int64_t* data = r.data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + len);
}

}  // namespace cdcca::distill
