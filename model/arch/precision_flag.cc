// --precision: the weights of the model `cdcca generate` and `cdcca answer` load (adapt and
// adapt-eval name their student's --student_precision, as cdcca-cloud and cdcca-device do).
#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, precision, "",
          "generate/answer: the model's weights, fp32|bf16|fp16|int8|int4; empty = fp32");
