// Greedy decoding of a DecoderLm with a preallocated ("static") KV cache: the prompt runs through
// DecoderLmImpl::Forward as usual (prefill), its keys and values are copied into buffers sized for
// prompt + max_new_tokens, and every further token runs one fixed-shape step: fused QKV and gate-up
// projections (DecoderLmImpl::FuseProjections), grouped-query attention over the whole buffer with
// positions past the current one masked, and the argmax taken on the device. The step reads its
// token and position from device tensors and writes the next token into one, so no step waits for
// the host; on CUDA builds of LibTorch (CDCCA_HAVE_CUDA_GRAPHS) the step is captured once as a CUDA
// graph and replayed.
//
// A batch's rows are left-padded to one length (attention_mask), so all rows write the same
// cache slot at each step; each row keeps its own padding mask and positions, and a row past
// its eos id runs on unread until every row is done, as in the reference loop.
//
// Same tokens as the reference loop (generation.h): the mask gives the extra positions zero
// probability, so only the order of floating-point reductions can differ.
//
// Not thread-safe: one generation per DecoderLm at a time (the captured graph is kept on it).
#ifndef CDCCA_MODEL_RUNTIME_STATIC_DECODE_H_
#define CDCCA_MODEL_RUNTIME_STATIC_DECODE_H_

#include <torch/torch.h>

#include "model/arch/decoder_lm.h"
#include "model/runtime/generation.h"

namespace cdcca::model {

// Whether StaticGreedyGenerate can serve this call: float (unquantized, fused)
// weights without LoRA, no per-step logits kept, a RoPE type whose table does not depend on the
// sequence length (not `dynamic`). Reads nothing from the device.
bool StaticDecodeApplies(const DecoderLmImpl& lm, const torch::Tensor& inputs_embeds,
                         const GreedyOptions& options);

// Greedy generation as GreedyGenerateFromEmbeds (attention_mask [B, T], 1 = token, 0 = left
// padding; undefined = all tokens), through the static cache. A batch of one keeps its
// buffers and graph on `lm` for the next call; a larger batch's live for the call only. Requires
// StaticDecodeApplies. `use_graph`: capture the step as a CUDA graph when the build and the
// device allow (ignored elsewhere; the environment variable CDCCA_NO_CUDA_GRAPH turns it off).
GreedyResult StaticGreedyGenerate(DecoderLmImpl& lm, const torch::Tensor& inputs_embeds,
                                  const torch::Tensor& attention_mask, const GreedyOptions& options,
                                  bool use_graph = true);

// Whether this build of cdcca can capture CUDA graphs.
bool CudaGraphsCompiledIn();

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_STATIC_DECODE_H_
