#include "datasets/fashion_mnist.h"

#include <zlib.h>

#include <cstdio>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace cdcca::datasets {
namespace {

constexpr std::string_view kClassNames[kNumClasses] = {
    "t-shirt", "trouser", "pullover", "dress", "coat",
    "sandal",  "shirt",   "sneaker",  "bag",   "ankle boot"};

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzPtr = std::unique_ptr<gzFile_s, GzCloser>;

absl::StatusOr<std::vector<uint8_t>> ReadWholeGz(const std::string& path) {
  if (std::FILE* probe = std::fopen(path.c_str(), "rb")) {
    std::fclose(probe);
  } else {
    return absl::NotFoundError(absl::StrCat(
        "cannot open ", path,
        ": Fashion-MNIST is missing; install the Debian package `dataset-fashion-mnist` "
        "(apt-get install dataset-fashion-mnist) or pass its directory"));
  }
  GzPtr f(gzopen(path.c_str(), "rb"));
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  gzbuffer(f.get(), 1 << 17);
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  for (;;) {
    const int n = gzread(f.get(), buf, sizeof(buf));
    if (n < 0) {
      int err = 0;
      return absl::DataLossError(absl::StrCat(path, ": gzip error: ", gzerror(f.get(), &err)));
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  return out;
}

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

}  // namespace

std::string_view ClassName(int label) {
  return label >= 0 && label < kNumClasses ? kClassNames[label] : std::string_view("?");
}

int ClassFromName(std::string_view name) {
  for (int i = 0; i < kNumClasses; ++i) {
    if (kClassNames[i] == name) return i;
  }
  return -1;
}

std::string_view SplitName(Split split) { return split == Split::kTrain ? "train" : "test"; }

absl::StatusOr<ImageSet> ReadIdxPair(const std::string& images_path, const std::string& labels_path,
                                     Split split) {
  absl::StatusOr<std::vector<uint8_t>> images = ReadWholeGz(images_path);
  if (!images.ok()) return images.status();
  absl::StatusOr<std::vector<uint8_t>> labels = ReadWholeGz(labels_path);
  if (!labels.ok()) return labels.status();
  // IDX: magic = 0x0000 08 <ndims>, then ndims big-endian uint32 sizes, then the data.
  if (images->size() < 16 || BigEndian32(images->data()) != 0x00000803) {
    return absl::DataLossError(
        absl::StrCat(images_path, ": not an IDX file of 3-d unsigned bytes (bad magic)"));
  }
  if (labels->size() < 8 || BigEndian32(labels->data()) != 0x00000801) {
    return absl::DataLossError(
        absl::StrCat(labels_path, ": not an IDX file of 1-d unsigned bytes (bad magic)"));
  }
  const uint32_t n = BigEndian32(images->data() + 4);
  const uint32_t rows = BigEndian32(images->data() + 8);
  const uint32_t cols = BigEndian32(images->data() + 12);
  const uint32_t n_labels = BigEndian32(labels->data() + 4);
  if (rows == 0 || cols == 0 || rows > 4096 || cols > 4096) {
    return absl::DataLossError(absl::StrCat(images_path, ": bad image size ", rows, "x", cols));
  }
  if (n != n_labels) {
    return absl::DataLossError(absl::StrCat(images_path, " holds ", n, " images but ", labels_path,
                                            " holds ", n_labels, " labels"));
  }
  const size_t need = 16 + static_cast<size_t>(n) * rows * cols;
  if (images->size() < need) {
    return absl::DataLossError(
        absl::StrCat(images_path, ": truncated: ", images->size(), " bytes, header says ", need));
  }
  if (labels->size() < 8 + static_cast<size_t>(n)) {
    return absl::DataLossError(absl::StrCat(labels_path, ": truncated"));
  }
  ImageSet set;
  set.split = split;
  set.rows = static_cast<int>(rows);
  set.cols = static_cast<int>(cols);
  set.pixels.assign(images->begin() + 16, images->begin() + need);
  set.labels.assign(labels->begin() + 8, labels->begin() + 8 + n);
  for (uint32_t i = 0; i < n; ++i) {
    if (set.labels[i] >= kNumClasses) {
      return absl::DataLossError(absl::StrCat(labels_path, ": label ", int{set.labels[i]},
                                              " of item ", i, " is out of range"));
    }
    set.by_class[set.labels[i]].push_back(static_cast<int>(i));
  }
  return set;
}

absl::StatusOr<ImageSet> LoadFashionMnist(Split split, const std::string& dir) {
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  return ReadIdxPair(absl::StrCat(dir, "/", prefix, "-images-idx3-ubyte.gz"),
                     absl::StrCat(dir, "/", prefix, "-labels-idx1-ubyte.gz"), split);
}

}  // namespace cdcca::datasets
