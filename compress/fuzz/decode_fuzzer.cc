// libFuzzer entry for the DWC decoder: parse, verify, decode and apply arbitrary bytes.
// Built with clang (-fsanitize=fuzzer,address,undefined) from the torch-free sources only.
// Input: reseal flag + payload (compress/fuzz/reseal.h), so most mutations get past the
// checksum to the header, zstd and record parsers behind it.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "compress/apply.h"
#include "compress/fuzz/fuzz_set.h"
#include "compress/fuzz/reseal.h"
#include "compress/wire_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string payload = cdcca::compress::fuzz::Reseal(data, size);
  using cdcca::compress::ParsedPayload;
  using cdcca::compress::ParseLimits;
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
