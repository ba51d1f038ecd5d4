#include "compress/inspect_command.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "compress/wire_format.h"

ABSL_FLAG(bool, inspect_values, false,
          "inspect: also decode every tensor and print the RMS and max |value| of its delta");

namespace cdcca::compress {
namespace {

int InspectOne(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "inspect: cannot read %s\n", path.c_str());
    return 1;
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  absl::StatusOr<ParsedPayload> parsed = ParsePayload(bytes);
  if (!parsed.ok()) {
    std::printf("%s: INVALID (%s)\n", path.c_str(), parsed.status().ToString().c_str());
    return 1;
  }
  const PayloadInfo& info = parsed->info;
  const bool values = absl::GetFlag(FLAGS_inspect_values);
  std::printf("%s: DWC update v%u, version %llu -> %llu, %zu tensors, checksum %016llx ok\n",
              path.c_str(), info.format_version, static_cast<unsigned long long>(info.base_version),
              static_cast<unsigned long long>(info.new_version), parsed->tensors.size(),
              static_cast<unsigned long long>(info.checksum));
  std::printf("  body %llu bytes, stored %llu bytes (%s)\n",
              static_cast<unsigned long long>(info.body_bytes),
              static_cast<unsigned long long>(info.stored_body_bytes),
              (info.flags & kFlagBodyZstd) != 0 ? "zstd" : "raw");
  std::printf("  %-44s %-12s %10s %4s %6s %10s %10s %8s", "tensor", "shape", "params", "bits",
              "group", "coded", "bytes", "bit/par");
  if (values) std::printf(" %11s %11s", "rms", "max|d|");
  std::printf("\n");
  uint64_t params = 0;
  for (const TensorRecord& r : parsed->tensors) {
    const uint64_t n = r.numel();
    params += n;
    const uint64_t data = r.block.size() + r.indices.size();
    std::printf("  %-44s %-12s %10llu %4d %6u %10llu %10llu %8.3f", r.name.c_str(),
                ("[" + absl::StrJoin(r.shape, ",") + "]").c_str(),
                static_cast<unsigned long long>(n), r.bits, r.group_size,
                static_cast<unsigned long long>(r.coded_count),
                static_cast<unsigned long long>(data),
                n == 0 ? 0.0 : 8.0 * static_cast<double>(data) / static_cast<double>(n));
    if (values) {
      std::vector<float> out(n);
      const absl::Status s = DecodeRecord(r, absl::MakeSpan(out));
      if (!s.ok()) {
        std::printf("  decode failed: %s\n", s.ToString().c_str());
        return 1;
      }
      double sq = 0.0;
      float max_abs = 0.0f;
      for (float v : out) {
        sq += static_cast<double>(v) * v;
        max_abs = std::max(max_abs, std::fabs(v));
      }
      std::printf(" %11.4g %11.4g", n == 0 ? 0.0 : std::sqrt(sq / static_cast<double>(n)), max_abs);
    }
    std::printf("\n");
  }
  const double fp32 = 4.0 * static_cast<double>(params);
  std::printf(
      "  total: %llu params, payload %zu bytes, fp32 %.0f bytes, ratio %.2fx, %.3f bits/param\n",
      static_cast<unsigned long long>(params), bytes.size(), fp32,
      bytes.empty() ? 0.0 : fp32 / static_cast<double>(bytes.size()),
      params == 0 ? 0.0 : 8.0 * static_cast<double>(bytes.size()) / static_cast<double>(params));
  return 0;
}

}  // namespace

const char* const kInspectFlags[] = {"inspect_values", nullptr};

int InspectCommand(const std::vector<std::string>& args) {
  if (args.empty()) {
    std::fprintf(stderr, "usage: cdcca inspect [--inspect_values] UPDATE...\n");
    return 2;
  }
  int rc = 0;
  for (const std::string& path : args) rc = std::max(rc, InspectOne(path));
  return rc;
}

}  // namespace cdcca::compress
