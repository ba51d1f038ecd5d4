#include "distill/data_parallel.h"

#include <torch/torch.h>

#include <cstring>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include "absl/strings/str_cat.h"

namespace cdcca::distill {

StoreGradientReducer::StoreGradientReducer(const std::string& path, int rank, int world_size)
    : rank_(rank), world_size_(world_size) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  store_ = store.get();
  // Own the intrusive pointer through a type-erased holder so the header needs no c10d.
  store_holder_ = std::make_shared<c10::intrusive_ptr<c10d::FileStore>>(std::move(store));
}

StoreGradientReducer::~StoreGradientReducer() = default;

absl::Status StoreGradientReducer::AllReduceMean(std::vector<torch::Tensor>& gradients) {
  try {
    std::vector<torch::Tensor> flat;
    for (const auto& g : gradients)
      flat.push_back(g.detach().to(torch::kCPU, torch::kFloat).reshape(-1));
    torch::Tensor mine = torch::cat(flat).contiguous();
    const size_t bytes = mine.numel() * sizeof(float);
    std::vector<uint8_t> buffer(bytes);
    std::memcpy(buffer.data(), mine.data_ptr<float>(), bytes);
    const std::string prefix = absl::StrCat("grad/", step_++, "/");
    store_->set(absl::StrCat(prefix, rank_), buffer);
    torch::Tensor sum = torch::zeros_like(mine);
    for (int r = 0; r < world_size_; ++r) {
      std::vector<uint8_t> other = store_->get(absl::StrCat(prefix, r));
      if (other.size() != bytes) {
        return absl::InternalError(
            absl::StrCat("rank ", r, " sent ", other.size(), " gradient bytes, expected ", bytes));
      }
      torch::Tensor t = torch::empty_like(mine);
      std::memcpy(t.data_ptr<float>(), other.data(), bytes);
      sum += t;
    }
    sum /= static_cast<double>(world_size_);
    int64_t offset = 0;
    for (auto& g : gradients) {
      g.copy_(sum.narrow(0, offset, g.numel()).view(g.sizes()).to(g.device(), g.scalar_type()));
      offset += g.numel();
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("gradient all-reduce: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("gradient all-reduce: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace cdcca::distill
