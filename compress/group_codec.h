// Group-wise quantization of float values for DWC (torch-free: byte spans and float buffers,
// so the decoder builds under libFuzzer with clang).
//
// A coded block of n values at `bits` b and `group_size` g is, little-endian:
//   ceil(n / g) scales, each a bfloat16 (u16), then n codes of b bits packed LSB-first into
//   bytes (the last byte zero-padded).
// Decoding, one rule per width, shared by every caller (device, cloud mirror, tests):
//   b = 0: nothing is coded, every value is 0.
//   b = 1: code 1 -> +scale, code 0 -> -scale (sign and per-group mean |x|, BitDelta-style).
//   b = 2, 3, 4, 8: value = (code - (2^b - 1) / 2) * scale, a symmetric mid-rise grid with
//   no zero level, so all 2^b codes carry information.
// Scales are bfloat16 rather than IEEE fp16 because weight deltas of 1e-6..1e-3 put 8-bit
// steps into fp16's subnormal range; bf16 keeps float32's exponent. The encoder quantizes
// against the rounded scale, so the coarser mantissa moves the grid, not the error bound.
#ifndef CDCCA_COMPRESS_GROUP_CODEC_H_
#define CDCCA_COMPRESS_GROUP_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace cdcca::compress {

// Largest |scale| a decoder accepts; bounds every decoded value far below float overflow.
inline constexpr float kMaxScale = 1e30f;

// True for the widths the format defines: 0, 1, 2, 3, 4, 8.
bool IsSupportedBits(int bits);

// Bytes of a coded block (scales + packed codes); 0 when bits == 0. Requires group_size >= 1
// when bits > 0. Saturates at UINT64_MAX instead of overflowing.
uint64_t CodedBlockBytes(uint64_t n, int bits, uint64_t group_size);

uint16_t FloatToBfloat16(float f);  // round to nearest even
float Bfloat16ToFloat(uint16_t h);

// Appends the coded block of x[0..n) to *out. Values must be finite (the caller checks).
// For b >= 2 each group's scale is the best of a few clipping ratios of the group's max |x|
// (least squared error), since a max-abs grid wastes 2- and 3-bit levels on the tails of
// roughly Gaussian deltas. Deterministic. Thread-safe (pure function).
void QuantizeBlock(const float* x, size_t n, int bits, size_t group_size, std::string* out);

// Decodes a coded block of n values into out[0..n) (overwriting). Returns DATA_LOSS if
// `block` is not exactly CodedBlockBytes(n, bits, group_size) bytes or a scale is not a
// finite value in [0, kMaxScale]; out may then hold partial results. Thread-safe.
absl::Status DequantizeBlock(absl::string_view block, size_t n, int bits, size_t group_size,
                             float* out);

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_GROUP_CODEC_H_
