// Reader for the Fashion-MNIST IDX files shipped by the Debian package
// `dataset-fashion-mnist` (gzip-compressed IDX, read with zlib).
#ifndef CDCCA_DATASETS_FASHION_MNIST_H_
#define CDCCA_DATASETS_FASHION_MNIST_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace cdcca::datasets {

inline constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";
inline constexpr int kNumClasses = 10;

// Fashion-MNIST's class names, index = label: "t-shirt", "trouser", "pullover", "dress",
// "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot".
std::string_view ClassName(int label);
// Label of a class name, or -1.
int ClassFromName(std::string_view name);

enum class Split { kTrain, kTest };
std::string_view SplitName(Split split);

// A set of grayscale images with labels, as read from one IDX image/label file pair.
// Immutable after loading; safe to share between threads.
struct ImageSet {
  Split split = Split::kTrain;
  int rows = 0;
  int cols = 0;
  std::vector<uint8_t> pixels;  // size() * rows * cols bytes, image-major, row-major
  std::vector<uint8_t> labels;  // one per image, in [0, kNumClasses)
  // Image indices of each class, ascending (filled by the loaders).
  std::array<std::vector<int>, kNumClasses> by_class;

  size_t size() const { return labels.size(); }
  const uint8_t* image(size_t i) const { return pixels.data() + i * rows * cols; }
};

// Reads one IDX pair (gzip or plain; zlib reads both). Errors: NOT_FOUND when a file is
// missing (the message names the package), DATA_LOSS on bad magic, truncation, label out of
// range or counts that disagree.
absl::StatusOr<ImageSet> ReadIdxPair(const std::string& images_path, const std::string& labels_path,
                                     Split split);

// Loads the train (60000) or test (10000) split from `dir`
// (`train-images-idx3-ubyte.gz` / `t10k-...`). Takes ~0.2 s; load once and share.
absl::StatusOr<ImageSet> LoadFashionMnist(Split split, const std::string& dir = kFashionMnistDir);

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_FASHION_MNIST_H_
