// libFuzzer entry for the DWC decoder: parse, verify, decode and apply arbitrary bytes.
// Built with clang (-fsanitize=fuzzer,address,undefined) from the torch-free sources only.
//
// If the first input byte is odd, the rest gets a freshly computed checksum before parsing;
// otherwise almost every mutation would stop at the checksum and never reach the header,
// zstd and record parsers behind it.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "compress/apply.h"
#include "compress/fuzz/fuzz_set.h"
#include "compress/hash64.h"
#include "compress/wire_format.h"

namespace {

using cdcca::compress::ParsedPayload;
using cdcca::compress::ParseLimits;

std::string Prepare(const uint8_t* data, size_t size) {
  if (size == 0) return std::string();
  std::string s(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) != 0 &&
      s.size() >= cdcca::compress::kFixedHeaderBytes + cdcca::compress::kChecksumBytes) {
    const size_t covered = s.size() - cdcca::compress::kChecksumBytes;
    const uint64_t h = cdcca::compress::Hash64(s.data(), covered);
    for (int i = 0; i < 8; ++i) s[covered + i] = static_cast<char>((h >> (8 * i)) & 0xff);
  }
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string payload = Prepare(data, size);
  ParseLimits limits;
  limits.max_body_bytes = 1 << 20;

  // Every record on its own, as `cdcca inspect` and the staging decode see them.
  absl::StatusOr<ParsedPayload> parsed = cdcca::compress::ParsePayload(payload, limits);
  if (parsed.ok()) {
    for (const auto& record : parsed->tensors) {
      if (record.numel() > (1u << 20)) continue;
      std::vector<float> out(record.numel());
      (void)cdcca::compress::DecodeRecord(record, absl::MakeSpan(out));
    }
  }

  // The apply path: a failure must leave the set bit-identical.
  cdcca::compress::fuzz::FuzzSet set = cdcca::compress::fuzz::MakeFuzzSet(0.5f);
  const uint64_t before = cdcca::compress::DigestViews(set.views);
  const uint64_t base = parsed.ok() ? parsed->info.base_version : 0;
  absl::StatusOr<uint64_t> applied =
      cdcca::compress::ApplyUpdateToViews(payload, base, set.views, limits);
  if (!applied.ok() && cdcca::compress::DigestViews(set.views) != before) {
    __builtin_trap();  // a rejected payload changed the weights
  }
  return 0;
}
