// CreateHubMirrorTrainer where the build has no Hugging Face tokenizers.
#include "absl/strings/str_cat.h"
#include "cloud/internal/mirror_trainer.h"

namespace cdcca::cloud::internal {

absl::StatusOr<std::unique_ptr<MirrorTrainer>> CreateHubMirrorTrainer(
    const PerDeviceStrategyOptions& options) {
  return absl::UnimplementedError(absl::StrCat(
      "--teacher ", options.teacher_dir,
      ": this cdcca-cloud was built without Hugging Face support (PCRE2/ICU tokenizers missing "
      "at configure time)"));
}

}  // namespace cdcca::cloud::internal
