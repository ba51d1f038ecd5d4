// --precision: one definition for the `cdcca` binary, whose adapt-eval and generate/answer
// commands both read it (each picks its default when it is empty).
#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, precision, "",
          "weights: generate/answer fp32|bf16|fp16|int8|int4 (default fp32); adapt-eval: the "
          "device student's base fp32|int8|int4 (default int8)");
