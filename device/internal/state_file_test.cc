// The device's trainable-state file: sealed, read back, damage refused, and the files written
// before the sealed envelope still read.
#include "device/internal/state_file.h"

#include <string>

#include "compress/hash64.h"
#include "gtest/gtest.h"

namespace cdcca::device::internal {
namespace {

TEST(TrainableStateFileTest, ReadsBackWhatItWrites) {
  const std::string bytes = EncodeTrainableStateFile(3, 0xfeedULL, "safetensors bytes");
  absl::StatusOr<TrainableStateFile> f = DecodeTrainableStateFile(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->version, 3u);
  EXPECT_EQ(f->digest, 0xfeedu);
  EXPECT_EQ(f->safetensors, "safetensors bytes");
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] ^= 0x04;
    EXPECT_FALSE(DecodeTrainableStateFile(bad).ok()) << "byte " << i;
  }
}

TEST(TrainableStateFileTest, ReadsTheFilesWrittenBeforeTheEnvelope) {
  std::string legacy;
  const uint64_t version = 9, digest = 77;
  legacy.append(reinterpret_cast<const char*>(&version), 8);
  legacy.append(reinterpret_cast<const char*>(&digest), 8);
  legacy += "tensors";
  const uint64_t hash = compress::Hash64(legacy.data(), legacy.size());
  legacy.append(reinterpret_cast<const char*>(&hash), 8);
  absl::StatusOr<TrainableStateFile> f = DecodeTrainableStateFile(legacy);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->version, 9u);
  EXPECT_EQ(f->digest, 77u);
  EXPECT_EQ(f->safetensors, "tensors");
  legacy[3] ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(DecodeTrainableStateFile(legacy).status()));
}

}  // namespace
}  // namespace cdcca::device::internal
