// cdcca's own CUDA kernels for a training step's element-wise work and for the rounding of FP8
// products' operands (runtime/cuda_kernels.cu), built where nvcc and a CUDA LibTorch are both
// present (CDCCA_HAVE_CUDA_KERNELS; CMake option CDCCA_CUDA_KERNELS). LibTorch runs the rotary
// embedding as a roll, broadcast products and a sum, the SwiGLU gate as silu and a product, a
// pre-norm decoder's residual addition and RMSNorm as an addition and a norm kernel forward,
// two norm kernels and the sum of the residual gradient backward, and an FP8 operand's rounding
// as passes for its magnitude, its largest, the division and the cast, each a pass over the
// tensor with its own launch; the kernels here do each in one pass, reading the operands once
// and rounding once. fused_ops.cc and fp8_product.cc dispatch to them for CUDA tensors;
// everything else keeps LibTorch's forms, and the CPU its own kernels.
//
// Raw pointers and plain types only, so that this header and its callers need neither nvcc nor
// CUDA's headers. Every function returns 0 on success, else the CUDA error code of the launch.
#ifndef CDCCA_MODEL_RUNTIME_CUDA_KERNELS_H_
#define CDCCA_MODEL_RUNTIME_CUDA_KERNELS_H_

#include <cstdint>

namespace cdcca::model::cuda_kernels {

// Element types the kernels take; every operand of one call has the same.
enum class Dtype { kFloat, kHalf, kBFloat16 };

// The rotary embedding of x [B, H, T, D] (the last dimension contiguous, other strides
// x_strides[0..2]) with cos, sin [B or 1, T, D] contiguous (cos_batch_stride 0 for one batch
// row); out [B, H, T, D] with the last dimension contiguous, other strides out_strides[0..2]
// (a [B, T, H, D] buffer seen as [B, H, T, D] keeps the heads side by side, as the
// projections read and write them). Forward (transpose false): out = x * cos +
// rotate_half(x) * sin; transpose true gives the gradient form out = x * cos +
// rotate_half^T(x * sin), where rotate_half(y) = cat(-y2, y1) and rotate_half^T(y) =
// cat(y2, -y1) of y's halves. Computes in float32, rounds once. D even.
int Rotary(Dtype dtype, const void* x, const int64_t x_strides[3], const void* cos, const void* sin,
           int64_t cos_batch_stride, void* out, const int64_t out_strides[3], int64_t batch,
           int64_t heads, int64_t positions, int64_t dim, bool transpose, void* stream);

// out = silu(gate) * up over n contiguous elements, in float32, rounded once.
int SiluMul(Dtype dtype, const void* gate, const void* up, void* out, int64_t n, void* stream);

// The gradients of SiluMul for the output's gradient go: gate_grad = go * up * s * (1 + gate *
// (1 - s)), up_grad = go * gate * s, s = sigmoid(gate); n contiguous elements each.
int SiluMulBackward(Dtype dtype, const void* go, const void* gate, const void* up, void* gate_grad,
                    void* up_grad, int64_t n, void* stream);

// A pre-norm decoder's residual addition and the RMSNorm that reads its result, in one pass:
// for rows of dim (x, a, h, y contiguous [rows, dim]; w [dim]), h = x + a rounded to the
// storage type, rstd[row] = 1 / sqrt(mean(h^2) + eps) in float32, y = h * rstd * w rounded
// once. AddRmsNormFits says whether a dim is taken (a multiple of 16 bytes' values, at most
// 4 x 1024 such packs); pointers must be 16-byte aligned (else cudaErrorInvalidValue).
bool AddRmsNormFits(Dtype dtype, int64_t dim);
int AddRmsNorm(Dtype dtype, const void* x, const void* a, const void* w, void* h, void* y,
               float* rstd, int64_t rows, int64_t dim, float eps, void* stream);

// Its gradients for dy (the gradient of y) and dres (of h along the residual stream; null for
// none): dh = rstd * (dy * w - n * mean(dy * w * n)) + dres with n = h * rstd, which is the
// gradient of x and of a alike; and the weight's gradient as partial sums of dy * n,
// dw_partial [partial_rows, dim] float32 (its column sums are the gradient), partial_rows =
// AddRmsNormPartialRows(dtype, rows, dim) on the current device (as many blocks as it runs at
// once, at most rows).
int64_t AddRmsNormPartialRows(Dtype dtype, int64_t rows, int64_t dim);
int AddRmsNormBackward(Dtype dtype, const void* dy, const void* h, const void* w, const float* rstd,
                       const void* dres, void* dh, float* dw_partial, int64_t partial_rows,
                       int64_t rows, int64_t dim, void* stream);

// Rows of x [rows, cols] (row stride row_stride values, each row contiguous) rounded for FP8
// products (model/runtime/fp8_product.h): each row's scale max(its largest magnitude, 448e-12)
// / 448 into scales[row] (float32), each value divided by it (float32 division) and rounded to
// e4m3 (nearest, ties to even, saturated at 448) into q [padded_rows, cols] (one byte each,
// float8_e4m3fn's bits); rows from `rows` to `padded_rows` are zeros with the smallest scale
// (the FP8 GEMM takes rows in multiples of 16). One read of x and one write of q.
int QuantizeRowsE4m3(Dtype dtype, const void* x, int64_t row_stride, int64_t rows,
                     int64_t padded_rows, int64_t cols, void* q, float* scales, void* stream);

// CUDA's description of an error code the functions above returned.
const char* ErrorString(int code);

}  // namespace cdcca::model::cuda_kernels

#endif  // CDCCA_MODEL_RUNTIME_CUDA_KERNELS_H_
