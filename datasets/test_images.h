// Test helper: a small synthetic ImageSet (no Fashion-MNIST needed), 3 images per class,
// each a distinct filled shape so scenes have real content.
#ifndef CDCCA_DATASETS_TEST_IMAGES_H_
#define CDCCA_DATASETS_TEST_IMAGES_H_

#include "datasets/fashion_mnist.h"

namespace cdcca::datasets {

inline ImageSet SyntheticImageSet(Split split, int per_class = 3) {
  ImageSet set;
  set.split = split;
  set.rows = set.cols = 28;
  const int base = split == Split::kTrain ? 0 : 1000;  // ids differ per split via pixels
  for (int c = 0; c < kNumClasses; ++c) {
    for (int k = 0; k < per_class; ++k) {
      const int idx = static_cast<int>(set.labels.size());
      set.labels.push_back(static_cast<uint8_t>(c));
      set.by_class[c].push_back(idx);
      for (int y = 0; y < 28; ++y) {
        for (int x = 0; x < 28; ++x) {
          const bool inside = x >= 3 + c % 4 && x < 25 - k && y >= 2 + c / 4 && y < 26 - c % 3;
          set.pixels.push_back(inside ? static_cast<uint8_t>(150 + (x * 3 + y + base) % 100) : 0);
        }
      }
    }
  }
  return set;
}

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_TEST_IMAGES_H_
