// Rows of one batch that belong to different jobs, each with its own copy of a shared model's
// trainable set: the cloud trains several devices' mirrors over one resident student base in
// one forward pass (distill::PairDistiller::RunTogether).
//
// While a RowSegmentsScope is installed on a thread, the layers that hold members of the
// trainable set read each row's values from its job's copy instead of the model's own tensor:
// LinearImpl's LoRA factors (a per-row product: x_r A_j^T B_j^T for row r of job j) and bias,
// the norms' weight and bias (RmsNormLayer, LayerNormLayer), BLIP-2's query tokens. The frozen
// base runs once over all rows. Rows never mix in a forward pass (attention and norms act
// within a row), so job j's outputs, and the gradients of its copy, are those its rows alone
// would give.
//
// A layer that reads a member of the set without asking for its segments would compute every
// row with the model's own tensor: Unused() names the members no layer asked for, and callers
// refuse a model that leaves one (RunTogether checks after its first forward).
//
// Thread-safety: a RowSegments is read by the forwards of the thread whose scope holds it
// (Rows marks members used through a mutable flag: one thread at a time).
#ifndef CDCCA_MODEL_ARCH_ROW_SEGMENTS_H_
#define CDCCA_MODEL_ARCH_ROW_SEGMENTS_H_

#include <torch/types.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "model/arch/named_tensors.h"

namespace cdcca::model {

class RowSegments {
 public:
  // `shared`: the model's trainable set (MultimodalModel::TrainableParameters, aliasing the
  // model); `per_job[j]`: job j's copy, the same names and shapes in the same order (the
  // tensors that job's optimizer trains); `job_of_row`: [B] int64, the job of each batch row,
  // on the model's device. InvalidArgument for copies that do not match `shared`, a job index
  // outside per_job, or no jobs.
  static absl::StatusOr<RowSegments> Create(const NamedTensors& shared,
                                            std::vector<NamedTensors> per_job,
                                            torch::Tensor job_of_row);

  // Each row's value of the shared tensor `shared` (a tensor of the model, compared by
  // identity): [B, *shape], row r its job's copy, differentiable in the copies. Undefined
  // when `shared` is not a member of the set (a frozen tensor: every row reads the model's).
  torch::Tensor Rows(const torch::Tensor& shared) const;
  // Rows in the batch.
  int64_t rows() const { return job_of_row_.size(0); }
  // Names of the members no Rows call asked for since Create.
  std::vector<std::string> Unused() const;

 private:
  struct Member {
    std::string name;
    std::vector<torch::Tensor> per_job;
    mutable bool used = false;
  };
  std::unordered_map<const void*, Member> members_;  // by the model tensor's TensorImpl
  torch::Tensor job_of_row_;
};

// Installs `segments` (not owned; must outlive the scope) for the forwards that run on this
// thread until the scope ends, then restores what was installed before.
class RowSegmentsScope {
 public:
  explicit RowSegmentsScope(const RowSegments* segments);
  ~RowSegmentsScope();
  RowSegmentsScope(const RowSegmentsScope&) = delete;
  RowSegmentsScope& operator=(const RowSegmentsScope&) = delete;

 private:
  const RowSegments* previous_;
};

// The segments installed on this thread, or nullptr.
const RowSegments* ActiveRowSegments();

// Per-row values applied to y [B, ..., C] (any number of middle dimensions; B the rows):
// y + rows, y * rows with rows [B, C].
torch::Tensor AddPerRow(const torch::Tensor& y, const torch::Tensor& rows);
torch::Tensor MulPerRow(const torch::Tensor& y, const torch::Tensor& rows);
// The LoRA product of x [B, ..., in] with row r's own factors: (x_r a_r^T) b_r^T for
// a [B, rank, in] and b [B, out, rank]; [B, ..., out].
torch::Tensor PerRowLora(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_ARCH_ROW_SEGMENTS_H_
