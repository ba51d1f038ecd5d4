#include "compress/zstd_frame.h"

#include <zstd.h>

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"

namespace cdcca::compress {
namespace {

struct DctxFree {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};

}  // namespace

absl::StatusOr<std::string> DecompressBoundedFrame(absl::string_view frame, uint64_t declared,
                                                   uint64_t max_bytes, absl::string_view what) {
  const auto lost = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(what, ": ", why));
  };
  if (declared > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": declares ", declared, " bytes, over the limit of ", max_bytes));
  }
  const unsigned long long content = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN ||
      content != declared) {
    return lost("not a zstd frame of the declared size");
  }
  // Exactly one frame: no trailing bytes or further frames that would decode past it.
  const size_t frame_bytes = ZSTD_findFrameCompressedSize(frame.data(), frame.size());
  if (ZSTD_isError(frame_bytes) || frame_bytes != frame.size()) {
    return lost("not exactly one zstd frame");
  }
  std::unique_ptr<ZSTD_DCtx, DctxFree> dctx(ZSTD_createDCtx());
  if (dctx == nullptr) return absl::ResourceExhaustedError("zstd: cannot create a context");
  if (ZSTD_isError(ZSTD_DCtx_setParameter(dctx.get(), ZSTD_d_windowLogMax, kMaxZstdWindowLog))) {
    return absl::InternalError("zstd: cannot bound the window");
  }
  std::string out;
  out.resize(std::min<uint64_t>(declared, uint64_t{1} << 20));
  ZSTD_inBuffer in{frame.data(), frame.size(), 0};
  ZSTD_outBuffer dst{out.data(), out.size(), 0};
  while (true) {
    const size_t in_before = in.pos, out_before = dst.pos;
    const size_t r = ZSTD_decompressStream(dctx.get(), &dst, &in);
    if (ZSTD_isError(r)) return lost(absl::StrCat("zstd: ", ZSTD_getErrorName(r)));
    if (r == 0) break;  // frame complete
    if (dst.pos == dst.size && dst.size < declared) {
      out.resize(std::min<uint64_t>(declared, uint64_t{dst.size} * 2));
      dst.dst = out.data();
      dst.size = out.size();
      continue;
    }
    if (in.pos == in_before && dst.pos == out_before) {
      return lost(in.pos == in.size ? "zstd frame is truncated"
                                    : "zstd frame decodes past its declared size");
    }
  }
  if (dst.pos != declared) return lost("zstd frame decodes to a size other than declared");
  return out;
}

}  // namespace cdcca::compress
