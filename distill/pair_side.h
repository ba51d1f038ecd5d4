// One side of a Hugging Face teacher-student pair (distill/pair_distiller.h PairSide) bound to a
// loaded folder: what `cdcca adapt` and the cloud's jobs on Hub pairs build their sides
// from.
#ifndef CDCCA_DISTILL_HF_PAIR_SIDE_H_
#define CDCCA_DISTILL_HF_PAIR_SIDE_H_

#include <string>

#include "distill/pair_distiller.h"
#include "model/arch/answerer.h"

namespace cdcca::distill {

// A loaded folder as one side of a pair: its model, its tokenizer as the text codec (the
// tokenizer's identity is a hash of tokenizer.json, else tokenizer.model), and its prompt
// format (model::ResolvePromptFormat: the folder's chat template, a named template, or the
// prompt as given). The answerer must outlive the side.
PairSide PairSideOf(model::Answerer& answerer, const std::string& dir, model::PromptFormat format);

// A frame (JPEG at the tower's input size, as a device uplinks it) as `answerer`'s tower
// takes it: PairSample::pixels, [C, H, W] float. Errors of Answerer::TowerPixelsOfJpeg.
absl::StatusOr<torch::Tensor> FramePixels(const model::Answerer& answerer, absl::string_view jpeg,
                                          const std::string& source);

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_HF_PAIR_SIDE_H_
