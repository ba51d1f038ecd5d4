#include "model/arch/blip2_inputs.h"

#include <torch/torch.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace cdcca::model {

std::vector<int64_t> ExpandBlip2InputIds(const std::vector<int64_t>& prompt_ids,
                                         int64_t num_query_tokens,
                                         std::optional<int64_t> image_token_id) {
  if (!image_token_id.has_value()) return prompt_ids;
  std::vector<int64_t> ids(static_cast<size_t>(num_query_tokens), *image_token_id);
  ids.insert(ids.end(), prompt_ids.begin(), prompt_ids.end());
  return ids;
}

absl::StatusOr<torch::Tensor> MergeBlip2Queries(const torch::Tensor& text_embeds,
                                                const torch::Tensor& input_ids,
                                                const torch::Tensor& queries,
                                                std::optional<int64_t> image_token_id) {
  const bool wider = image_token_id.has_value() && queries.dim() == 3 && text_embeds.dim() == 3 &&
                     queries.size(2) > text_embeds.size(2);
  if (text_embeds.dim() != 3 || queries.dim() != 3 || input_ids.dim() != 2 ||
      queries.size(0) != text_embeds.size(0) ||
      (queries.size(2) != text_embeds.size(2) && !wider) ||
      input_ids.size(0) != text_embeds.size(0) || input_ids.size(1) != text_embeds.size(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("BLIP-2 inputs: text embeds ", c10::str(text_embeds.sizes()), ", ids ",
                     c10::str(input_ids.sizes()), " and queries ", c10::str(queries.sizes()),
                     " do not fit together"));
  }
  torch::Tensor q = queries.to(text_embeds.scalar_type());
  if (!image_token_id.has_value()) return torch::cat({q, text_embeds}, 1);
  if (wider) {
    q = q.reshape(-1)
            .narrow(0, 0, q.size(0) * q.size(1) * text_embeds.size(2))
            .view({q.size(0), q.size(1), text_embeds.size(2)});
  }
  torch::Tensor mask = input_ids.eq(*image_token_id);  // [B, T]
  torch::Tensor per_row = mask.sum(1);
  if (!per_row.eq(queries.size(1)).all().item<bool>()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "BLIP-2 inputs: every row needs ", queries.size(1), " image tokens (id ", *image_token_id,
        "), a row has ", per_row.min().item<int64_t>(), " to ", per_row.max().item<int64_t>()));
  }
  return text_embeds.masked_scatter(mask.unsqueeze(-1).expand_as(text_embeds), q);
}

}  // namespace cdcca::model
