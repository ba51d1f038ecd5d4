#include "model/arch/row_segments.h"

#include <torch/torch.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace cdcca::model {
namespace {

thread_local const RowSegments* active_segments = nullptr;

// y as [B, rest, C]: the rows first, the channels last.
torch::Tensor RowsFirst(const torch::Tensor& y, int64_t b) {
  return y.reshape({b, -1, y.size(-1)});
}

}  // namespace

absl::StatusOr<RowSegments> RowSegments::Create(const NamedTensors& shared,
                                                std::vector<NamedTensors> per_job,
                                                torch::Tensor job_of_row) {
  if (per_job.empty()) return absl::InvalidArgumentError("row segments need at least one job");
  const auto jobs = static_cast<int64_t>(per_job.size());
  if (!job_of_row.defined() || job_of_row.dim() != 1 || job_of_row.numel() == 0 ||
      job_of_row.min().item<int64_t>() < 0 || job_of_row.max().item<int64_t>() >= jobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_of_row must be [B] with jobs in [0, ", jobs, ")"));
  }
  RowSegments out;
  out.job_of_row_ = job_of_row.to(torch::kLong);
  for (size_t i = 0; i < shared.size(); ++i) {
    const auto& [name, tensor] = shared[i];
    Member m;
    m.name = name;
    for (size_t j = 0; j < per_job.size(); ++j) {
      if (per_job[j].size() != shared.size() || per_job[j][i].first != name ||
          !per_job[j][i].second.sizes().equals(tensor.sizes())) {
        return absl::InvalidArgumentError(
            absl::StrCat("job ", j, "'s copy of the trainable set does not match at ", name));
      }
      m.per_job.push_back(per_job[j][i].second);
    }
    out.members_.emplace(tensor.unsafeGetTensorImpl(), std::move(m));
  }
  return out;
}

torch::Tensor RowSegments::Rows(const torch::Tensor& shared) const {
  if (!shared.defined()) return torch::Tensor();
  auto it = members_.find(shared.unsafeGetTensorImpl());
  if (it == members_.end()) return torch::Tensor();
  it->second.used = true;
  const torch::Tensor stacked = torch::stack(it->second.per_job);  // [jobs, *shape]
  return stacked.index_select(0, job_of_row_.to(stacked.device()));
}

std::vector<std::string> RowSegments::Unused() const {
  std::vector<std::string> out;
  for (const auto& [impl, m] : members_) {
    if (!m.used) out.push_back(m.name);
  }
  return out;
}

RowSegmentsScope::RowSegmentsScope(const RowSegments* segments) : previous_(active_segments) {
  active_segments = segments;
}

RowSegmentsScope::~RowSegmentsScope() { active_segments = previous_; }

const RowSegments* ActiveRowSegments() { return active_segments; }

torch::Tensor AddPerRow(const torch::Tensor& y, const torch::Tensor& rows) {
  const int64_t b = rows.size(0);
  return (RowsFirst(y, b) + rows.reshape({b, 1, -1}).to(y.scalar_type())).view(y.sizes());
}

torch::Tensor MulPerRow(const torch::Tensor& y, const torch::Tensor& rows) {
  const int64_t b = rows.size(0);
  return (RowsFirst(y, b) * rows.reshape({b, 1, -1}).to(y.scalar_type())).view(y.sizes());
}

torch::Tensor PerRowLora(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b) {
  const int64_t n = a.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = b.size(1);
  const torch::Tensor low = torch::bmm(RowsFirst(x, n), a.transpose(1, 2).to(x.scalar_type()));
  return torch::bmm(low, b.transpose(1, 2).to(x.scalar_type())).view(shape);
}

}  // namespace cdcca::model
