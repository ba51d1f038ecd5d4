// `cdcca eval vqa|aokvqa|caption` and `cdcca render`: the datasets module's sub-commands
// (cdcca_datasets_io). Each takes the positional arguments after its name and returns the
// process exit code (0 ok, 1 error, 2 usage).
//
// Flags defined here (global to the `cdcca` binary; other modules reuse them through
// these declarations rather than defining their own):
//   --out DIR, --questions, --annotations, --results, --predictions,
//   --fashion_mnist_dir, --render_seed, --render_scenes, --render_scale.
#ifndef CDCCA_DATASETS_COMMANDS_H_
#define CDCCA_DATASETS_COMMANDS_H_

#include <string>
#include <vector>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(std::string, fashion_mnist_dir);

namespace cdcca::datasets {

// `cdcca eval vqa --questions Q.json --annotations A.json --results R.json`
// `cdcca eval aokvqa --annotations D.json --predictions P.json`
// `cdcca eval caption --annotations A.json --results R.json`
// Prints one JSON object on stdout and a readable table on stderr.
int EvalCommand(const std::vector<std::string>& args);
// The flags `cdcca eval` reads (nullptr-terminated): its --help lists them; it accepts no other.
extern const char* const kEvalFlags[];

// `cdcca render --out DIR`: PNG grids of scenes, one per image shift (columns: clean,
// severity 1, 3, 5), plus DIR/<shift>.txt with the scenes' questions, answers and captions.
int RenderCommand(const std::vector<std::string>& args);
// The flags `cdcca render` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kRenderFlags[];

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_COMMANDS_H_
