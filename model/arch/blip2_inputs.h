// Where BLIP-2 / InstructBLIP put the image's query outputs in the LM input, as transformers
// 5.x does it:
//   - The processor prepends num_query_tokens copies of the image token (config
//     `image_token_index` / `image_token_id`) to the tokenized prompt, before BOS:
//     input_ids = [img] * Q + tokenizer(prompt). The model embeds input_ids and writes the
//     projected query outputs, in order, over the image-token positions (masked_scatter).
//   - Checkpoints from before that change (no image token id in config.json, e.g. the
//     InstructBLIP checkpoints transformers 4.x published) go the old way: input_ids =
//     tokenizer(prompt) and the projected queries are concatenated in front of its embeddings.
//     Both give the LM the same sequence [queries ; prompt]; only input_ids differ.
#ifndef CDCCA_MODEL_ARCH_BLIP2_INPUTS_H_
#define CDCCA_MODEL_ARCH_BLIP2_INPUTS_H_

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"

namespace cdcca::model {

// The LM's input ids for a tokenized prompt (specials included as the tokenizer adds them).
std::vector<int64_t> ExpandBlip2InputIds(const std::vector<int64_t>& prompt_ids,
                                         int64_t num_query_tokens,
                                         std::optional<int64_t> image_token_id);

// text_embeds [B, T, H] = embed(input_ids); queries [B, Q, H] (projected). With an image
// token id: returns text_embeds with row b's image-token positions replaced by queries[b]
// (InvalidArgument unless each row has exactly Q image tokens). Without: [B, Q + T, H].
// Queries wider than the embeddings (queries [B, Q, H'] with H' > H: OPT with project_in,
// whose projection gives the blocks' width) fill the image positions as transformers'
// masked_scatter does: with the first B * Q * H values of the queries in row-major order.
absl::StatusOr<torch::Tensor> MergeBlip2Queries(const torch::Tensor& text_embeds,
                                                const torch::Tensor& input_ids,
                                                const torch::Tensor& queries,
                                                std::optional<int64_t> image_token_id);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_BLIP2_INPUTS_H_
