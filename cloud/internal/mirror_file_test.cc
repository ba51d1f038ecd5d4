// The trainer's state file: sealed, read back, damage refused, and the files written before
// the sealed envelope (format 1) still read.
#include "cloud/internal/mirror_file.h"

#include <cstring>
#include <string>

#include "compress/byte_io.h"
#include "compress/hash64.h"
#include "gtest/gtest.h"
#include "storage/sealed_file.h"

namespace cdcca::cloud::internal {
namespace {

MirrorFile Sample() {
  MirrorFile f;
  f.version = 7;
  f.consumed = 41;
  f.digest = 0x1234567890abcdefULL;
  f.mirror = "safetensors bytes";
  f.residual = "residual";
  f.update = "update payload";
  f.snapshot = "";
  f.replay = "replay buffer bytes";
  return f;
}

void ExpectSame(const MirrorFile& a, const MirrorFile& b) {
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.consumed, b.consumed);
  EXPECT_EQ(a.digest, b.digest);
  EXPECT_EQ(a.mirror, b.mirror);
  EXPECT_EQ(a.residual, b.residual);
  EXPECT_EQ(a.update, b.update);
  EXPECT_EQ(a.snapshot, b.snapshot);
  EXPECT_EQ(a.replay, b.replay);
}

using compress::Put;

TEST(MirrorFileTest, ReadsBackWhatItWrites) {
  absl::StatusOr<MirrorFile> back = DecodeMirrorFile(EncodeMirrorFile(Sample()), "d.mirror");
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(*back, Sample());
}

TEST(MirrorFileTest, RefusesEveryDamagedByteAndATruncation) {
  const std::string good = EncodeMirrorFile(Sample());
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] ^= 0x20;
    EXPECT_TRUE(absl::IsDataLoss(DecodeMirrorFile(bad, "d.mirror").status())) << "byte " << i;
  }
  EXPECT_TRUE(
      absl::IsDataLoss(DecodeMirrorFile(good.substr(0, good.size() - 1), "d.mirror").status()));
}

TEST(MirrorFileTest, ReadsTheFilesOfFormatTwoWithoutAReplayBuffer) {
  MirrorFile f = Sample();
  f.replay.clear();
  std::string body;
  Put(body, f.version);
  Put(body, f.consumed);
  Put(body, f.digest);
  for (const std::string* blob : {&f.mirror, &f.residual, &f.update, &f.snapshot}) {
    Put<uint64_t>(body, blob->size());
    body += *blob;
  }
  const std::string two = storage::Seal(storage::SealKind("CDMS"), 2, body);
  absl::StatusOr<MirrorFile> back = DecodeMirrorFile(two, "d.mirror");
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(*back, f);
  // Format 3 holds the replay blob: the same body read as format 3 is short of it.
  EXPECT_TRUE(absl::IsDataLoss(
      DecodeMirrorFile(storage::Seal(storage::SealKind("CDMS"), 3, body), "d.mirror").status()));
}

TEST(MirrorFileTest, ReadsTheFilesOfFormatOne) {
  MirrorFile f = Sample();
  f.replay.clear();
  std::string legacy;
  Put<uint32_t>(legacy, 0x534d4443);  // "CDMS"
  Put<uint32_t>(legacy, 1);
  Put(legacy, f.version);
  Put(legacy, f.consumed);
  Put(legacy, f.digest);
  for (const std::string* blob : {&f.mirror, &f.residual, &f.update, &f.snapshot}) {
    Put<uint64_t>(legacy, blob->size());
    legacy += *blob;
  }
  Put(legacy, compress::Hash64(legacy.data(), legacy.size()));
  absl::StatusOr<MirrorFile> back = DecodeMirrorFile(legacy, "d.mirror");
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(*back, f);
  legacy[20] ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(DecodeMirrorFile(legacy, "d.mirror").status()));
}

}  // namespace
}  // namespace cdcca::cloud::internal
