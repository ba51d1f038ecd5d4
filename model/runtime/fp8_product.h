// The frozen base's products in FP8 (e4m3, scaled per row), for a trainer: y = x W^T with x
// and W each rounded to e4m3 after dividing every row by its largest magnitude over 448 (the
// format's largest finite value), the products summed in fp32 and scaled back. The backward
// pass (the gradient of x only: the base is frozen) rounds the incoming gradient the same way
// and multiplies it with a second copy of W, transposed and scaled per input channel, so both
// passes read row-scaled operands. The two copies hold one byte an element each: what the
// bf16 weight they replace held.
//
// Native on a CUDA GPU that runs LibTorch's scaled FP8 product (compute capability 8.9 or
// later, LibTorch 2.5 or later; at::_scaled_mm with a scale per row of each operand), where it
// runs the tensor cores' FP8 GEMM, each input rounded in one pass of cdcca's kernel
// (cuda_kernels.h QuantizeRowsE4m3, where it is built); emulated elsewhere: the same rounding of
// the same operands (values on the e4m3 grid, held in bf16, which holds them exactly) multiplied in
// fp32, so a CPU run measures what the rounding does to a job. The two agree up to the order of the
// fp32 sums (model/bench/fp8_product_check.cc measures it on the GPU machine).
#ifndef CDCCA_MODEL_RUNTIME_FP8_PRODUCT_H_
#define CDCCA_MODEL_RUNTIME_FP8_PRODUCT_H_

#include <torch/types.h>

namespace cdcca::model {

// e4m3's largest finite magnitude ("fn": no infinities, one NaN pattern).
inline constexpr double kE4m3Max = 448.0;

// `x` (any float dtype) rounded to the nearest e4m3 value, ties to even, saturated at
// +-kE4m3Max, as fp32: 3 mantissa bits, exponents from -6 (subnormals below, steps of 2^-9).
torch::Tensor RoundToE4m3(const torch::Tensor& x);

// A [rows, cols] matrix scaled per row and rounded: values * scales[:, None] is the matrix's
// FP8 form. values: float8_e4m3fn on the native path, bf16 on the grid when emulated.
struct Fp8Rows {
  torch::Tensor values;  // [rows, cols]
  torch::Tensor scales;  // [rows] fp32, the row's largest magnitude / kE4m3Max (1e-12 at least)
};

// Rounds the rows of a 2-D tensor (natively when `native`).
Fp8Rows QuantizeRowsE4m3(const torch::Tensor& m, bool native);

// A frozen weight [out, in] held for FP8 products: row-scaled as it is (the forward pass) and
// transposed (the backward pass).
struct Fp8Weight {
  Fp8Rows w;   // [out, in]
  Fp8Rows wt;  // [in, out]
  bool native = false;
};

// Whether `device` runs the native product: LibTorch 2.5 or later built with CUDA, and a probe
// product on that device succeeds (cached per device index).
bool NativeFp8Available(const torch::Device& device);

// The weight's two copies, on the weight's device, natively where NativeFp8Available says so.
Fp8Weight MakeFp8Weight(const torch::Tensor& weight);

// The FP8 form's values as a float matrix [out, in] in `dtype` (what the products multiply).
torch::Tensor Fp8WeightValues(const Fp8Weight& w, torch::ScalarType dtype);

// x [..., in] -> [..., out] in x's dtype: the FP8 product with w, differentiable in x.
torch::Tensor Fp8Linear(const torch::Tensor& x, const Fp8Weight& w);

// Bytes the two copies hold (values and scales).
int64_t Fp8WeightBytes(const Fp8Weight& w);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_FP8_PRODUCT_H_
