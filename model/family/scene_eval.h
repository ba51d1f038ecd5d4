// Scoring an MLLM on benchmark scenes (datasets/): encode scenes with the frozen vision
// encoder, answer every question greedily, and compute DA accuracy with the official VQA
// metric. Shared by pretraining's checks, `cdcca model-eval` and `cdcca adapt-eval`.
//
// Thread-safety: as torch modules (concurrent const use under NoGradGuard is fine).
#ifndef CDCCA_MODEL_FAMILY_SCENE_EVAL_H_
#define CDCCA_MODEL_FAMILY_SCENE_EVAL_H_

#include <torch/torch.h>

#include <string>
#include <vector>

#include "datasets/domain.h"
#include "datasets/tokenizer.h"
#include "model/family/blip2_tower.h"
#include "model/family/vision_encoder.h"

namespace cdcca::model {

struct EvalResult {
  double accuracy = 0;  // percent, DA (official VQA metric against the 10 direct answers)
  int questions = 0;
  std::string by_type;  // "what 91.0  color 88.2 ..." (percent per question type)
};

// DA accuracy of `model`'s greedy answers (at most max_answer_tokens) to every question of
// `samples`, given their visual tokens [S, N, d_vis] on `device` (all tokens present).
// Puts `model` in eval() mode.
EvalResult ScoreAnswers(Blip2Tower& model, const torch::Tensor& tokens,
                        const std::vector<datasets::Sample>& samples,
                        const datasets::Tokenizer& tok, int max_answer_tokens,
                        torch::Device device);

struct CaptionEval {
  double bleu4 = 0;  // percent: corpus BLEU-4 against each scene's 5 references
  double cider = 0;  // percent: CIDEr-D x 100 (1.0 in COCO's units = 100)
  int images = 0;
  std::vector<std::string> captions;    // the generated caption of each sample
  std::vector<double> cider_per_image;  // COCO units; their mean is cider / 100
};

// Greedy captions (prompt datasets::CaptionPrompt(), at most max_tokens tokens) of every
// sample, scored with the COCO caption metrics. Puts `model` in eval() mode.
CaptionEval ScoreCaptionsOf(Blip2Tower& model, const torch::Tensor& tokens,
                            const std::vector<datasets::Sample>& samples,
                            const datasets::Tokenizer& tok, int max_tokens, torch::Device device);

// The frozen encoder's tokens [S, N, d_vis] of every sample's (shifted) image, on `device`,
// encoded in chunks of 256 images. No gradients.
torch::Tensor EncodeAll(VisionEncoder& enc, const std::vector<datasets::Sample>& samples,
                        torch::Device device);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_FAMILY_SCENE_EVAL_H_
