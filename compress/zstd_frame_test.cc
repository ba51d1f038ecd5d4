// Bounded zstd decoding (compress/zstd_frame.h), directly and through the uplink decoder.
// The binary counts its allocations (operator new below) to check the stated bounds.
#include "compress/zstd_frame.h"

#include <zstd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "compress/hash64.h"
#include "compress/uplink_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace {
std::atomic<size_t> largest_allocation{0};
}  // namespace

void* operator new(size_t n) {
  size_t seen = largest_allocation.load();
  while (n > seen && !largest_allocation.compare_exchange_weak(seen, n)) {
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace cdcca::compress {
namespace {

using ::cdcca::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

std::string Compress(const std::string& body, int level = 3) {
  std::string out(ZSTD_compressBound(body.size()), '\0');
  const size_t n = ZSTD_compress(out.data(), out.size(), body.data(), body.size(), level);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

// A 14-byte frame whose header claims `claimed` bytes (window 1 MiB) but whose one RLE block
// holds 100 bytes.
std::string LyingFrame(uint32_t claimed) {
  std::string f;
  const uint32_t magic = 0xFD2FB528u;
  f.append(reinterpret_cast<const char*>(&magic), 4);
  f.push_back(static_cast<char>(0x80));  // 4-byte content size, window descriptor follows
  f.push_back(static_cast<char>(0x50));  // window log 20
  f.append(reinterpret_cast<const char*>(&claimed), 4);
  const uint32_t block = 1 | (1 << 1) | (100 << 3);  // last, RLE, 100 bytes
  f.append(reinterpret_cast<const char*>(&block), 3);
  f.push_back('\0');
  return f;
}

TEST(ZstdFrameTest, DecodesFramesThatNeedTheOutputToGrow) {
  std::string body(5 * kMiB + 123, '\0');
  for (size_t i = 0; i < body.size(); ++i) body[i] = static_cast<char>((i * 7919) >> 9);
  ASSERT_OK_AND_ASSIGN(std::string out,
                       DecompressBoundedFrame(Compress(body), body.size(), 64 * kMiB, "t"));
  EXPECT_EQ(out, body);
  ASSERT_OK_AND_ASSIGN(std::string empty, DecompressBoundedFrame(Compress(""), 0, kMiB, "t"));
  EXPECT_TRUE(empty.empty());
}

TEST(ZstdFrameTest, RejectsDeclaredSizesOverTheLimitBeforeAllocating) {
  EXPECT_THAT(DecompressBoundedFrame(Compress("abc"), 3, 2, "body"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("body")));
  EXPECT_THAT(DecompressBoundedFrame(Compress("abc"), 4, kMiB, "body"),
              StatusIs(absl::StatusCode::kDataLoss));
}

// Regression: a frame claiming 60 MiB (under the limit) made the decoders allocate all 60 MiB
// before zstd found that the frame holds 100 bytes.
TEST(ZstdFrameTest, SmallFrameClaimingMuchMoreAllocatesWhatItProduces) {
  const std::string frame = LyingFrame(60 * kMiB);
  largest_allocation = 0;
  EXPECT_THAT(DecompressBoundedFrame(frame, 60 * kMiB, 64 * kMiB, "body"),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_LE(largest_allocation.load(), 4 * kMiB);
}

TEST(ZstdFrameTest, UplinkBatchWithALyingFrameAllocatesLittle) {
  std::string payload;
  const auto put = [&](auto v) { payload.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(uint32_t{0x50554443u});  // "CDUP"
  put(uint16_t{1});
  put(uint16_t{1});  // fp16
  put(uint32_t{1});
  put(uint64_t{60 * kMiB});
  payload += LyingFrame(60 * kMiB);
  put(Hash64(payload.data(), payload.size()));
  largest_allocation = 0;
  EXPECT_THAT(DecodeUplinkBatch(payload), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_LE(largest_allocation.load(), 4 * kMiB);
}

TEST(ZstdFrameTest, RejectsTrailingBytesSecondFramesAndHugeWindows) {
  const std::string one = Compress("hello hello hello");
  EXPECT_THAT(DecompressBoundedFrame(one + one, 17, kMiB, "t"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("one zstd frame")));
  EXPECT_THAT(DecompressBoundedFrame(one + "x", 17, kMiB, "t"),
              StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(DecompressBoundedFrame(one.substr(0, one.size() - 2), 17, kMiB, "t"),
              StatusIs(absl::StatusCode::kDataLoss));
  // A 20 MiB body under a 32 MiB window: over 2^kMaxZstdWindowLog, which levels 1-19 never
  // ask for.
  const std::string big(20 * kMiB, 'z');
  std::string frame(ZSTD_compressBound(big.size()), '\0');
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, 1);
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_windowLog, 25);
  const size_t n = ZSTD_compress2(cctx, frame.data(), frame.size(), big.data(), big.size());
  ZSTD_freeCCtx(cctx);
  ASSERT_FALSE(ZSTD_isError(n));
  frame.resize(n);
  EXPECT_THAT(DecompressBoundedFrame(frame, big.size(), 64 * kMiB, "t"),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("zstd")));
}

}  // namespace
}  // namespace cdcca::compress
