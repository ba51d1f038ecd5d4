// DeltaEncoder: the cloud side of DWC (Dynamic Weight-update Compression).
//
// Each round: delta = theta_new - theta_mirror (+ the error-feedback residual), per named
// tensor; an allocator gives each tensor 0 (skip), 1 (sign + scale), 2, 3, 4 or 8 bits in
// groups (compress/group_codec.h) so that the whole payload fits a byte budget, greedily
// taking the upgrade with the largest reduction of squared error per added byte; then
// packs, zstd-compresses and checksums (compress/wire_format.h). Deterministic: the same
// inputs and state give the same bytes.
//
// Contract on the inputs: theta_mirror is the device's exact current trainable set (the
// cloud keeps it by applying every payload it sends with ApplyUpdate), and theta_new is what
// training produced starting from theta_mirror. The part of the delta that a payload did not
// carry is kept as the residual and added to the next round's delta, so the sum of applied
// updates tracks the sum of trained deltas. A trainer that instead continues from its own
// full-precision weights (so that theta_new - theta_mirror already holds what was not
// sent) must set error_feedback = false, or the unsent part would be counted twice.
#ifndef CDCCA_COMPRESS_DELTA_ENCODER_H_
#define CDCCA_COMPRESS_DELTA_ENCODER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "compress/named_tensors.h"
#include "compress/tensor_view.h"

namespace cdcca::compress {

struct DeltaEncoderOptions {
  // Payload size cap in bytes, header and checksum included; 0 = no byte cap.
  uint64_t byte_budget = 0;
  // Payload size cap as bits per trainable parameter (the project's target: 2.0); the budget
  // is the smaller of the two caps that are set; 0 = no cap. Default: 2 bits/param.
  double bits_per_param = 2.0;
  // Stop adding bits once ||delta - sent|| / ||delta|| <= this, even under budget; 0 = off.
  double target_relative_error = 0.0;
  // Widths the receiver accepts (from its Register capabilities); subset of {0,1,2,3,4,8}.
  // 0 is always allowed.
  std::vector<int> allowed_bits = {0, 1, 2, 3, 4, 8};
  // Values per scale. The allocator also tries 4x this group size per tensor (fewer scale
  // bytes, coarser scales) when coarse_groups is set. Default: 64.
  uint32_t group_size = 64;
  bool coarse_groups = true;
  // Top-k sparsity: in (0, 1) each tensor codes only its ceil(f * numel) largest |delta|
  // entries (plus their indices); 0 or >= 1 = dense.
  double topk_fraction = 0.0;
  // zstd level for the body; <= 0 stores it raw. Default: 3.
  int zstd_level = 3;
  // Carry what was not sent into the next round (see the contract above). Default: on.
  bool error_feedback = true;
};

struct TensorEncodeStats {
  std::string name;
  uint64_t numel = 0;
  int bits = 0;
  uint32_t group_size = 0;
  uint64_t coded_count = 0;    // values coded (numel when dense)
  uint64_t record_bytes = 0;   // uncompressed record size in the body
  double delta_sq_norm = 0.0;  // ||delta||^2 including the carried residual
  double error_sq_norm = 0.0;  // ||delta - decoded||^2, the new residual's squared norm
};

struct EncodeStats {
  uint64_t params = 0;
  uint64_t payload_bytes = 0;
  uint64_t budget_bytes = 0;  // 0 = none
  double bits_per_param = 0.0;
  double relative_error = 0.0;  // ||delta - decoded|| / ||delta|| over the whole set
  std::vector<TensorEncodeStats> tensors;
};

struct UpdatePayload {
  std::string bytes;  // the wire payload; apply with ApplyUpdate
  uint64_t base_version = 0;
  uint64_t new_version = 0;
  EncodeStats stats;
};

// Not thread-safe: one encoder per device, used by one thread at a time. Copyable, so a
// caller can snapshot state before an encode it may discard.
class DeltaEncoder {
 public:
  explicit DeltaEncoder(DeltaEncoderOptions options = {});

  // Encodes the update from base_version to new_version. theta_new and theta_mirror must
  // name the same tensors with the same shapes (INVALID_ARGUMENT otherwise, also for
  // non-finite values); RESOURCE_EXHAUSTED if the budget is below the smallest payload
  // (header plus one empty record per tensor). On success the residual becomes what this
  // payload leaves out: the caller is expected to apply the payload to its mirror.
  absl::StatusOr<UpdatePayload> Encode(absl::Span<const TensorView> theta_new,
                                       absl::Span<const TensorView> theta_mirror,
                                       uint64_t base_version, uint64_t new_version);
  // Same over LibTorch tensors (float32, contiguous, CPU); defined in cdcca_compress.
  absl::StatusOr<UpdatePayload> Encode(const NamedTensors& theta_new,
                                       const NamedTensors& theta_mirror, uint64_t base_version,
                                       uint64_t new_version);

  // The residual as bytes the cloud persists with the device's mirror, and back. Restore
  // fails with DATA_LOSS for corrupted or truncated state and leaves the state unchanged;
  // it allocates no more than the floats `bytes` holds (fuzzed with the mirror file,
  // cloud/fuzz/).
  std::string SerializeState() const;
  absl::Status RestoreState(absl::string_view bytes);

  // ||residual||^2 summed over tensors.
  double ResidualSquaredNorm() const;
  void ClearResidual() { residual_.clear(); }
  const DeltaEncoderOptions& options() const { return options_; }

 private:
  DeltaEncoderOptions options_;
  absl::flat_hash_map<std::string, std::vector<float>> residual_;
};

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_DELTA_ENCODER_H_
