#include "distill/data_parallel.h"

#include <torch/torch.h>

#include <cstring>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#if CDCCA_HAVE_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif

#include "absl/strings/str_cat.h"

namespace cdcca::distill {

namespace {

// Flattens `gradients` into one float tensor on the CPU.
torch::Tensor Flatten(const std::vector<torch::Tensor>& gradients) {
  std::vector<torch::Tensor> flat;
  for (const auto& g : gradients) {
    flat.push_back(g.detach().to(torch::kCPU, torch::kFloat).reshape(-1));
  }
  return torch::cat(flat).contiguous();
}

// Copies consecutive slices of `flat` back into `gradients` (their devices and dtypes).
void Unflatten(const torch::Tensor& flat, std::vector<torch::Tensor>& gradients) {
  int64_t offset = 0;
  for (auto& g : gradients) {
    g.copy_(flat.narrow(0, offset, g.numel()).view(g.sizes()).to(g.device(), g.scalar_type()));
    offset += g.numel();
  }
}

}  // namespace

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
    torch::Tensor mine = Flatten(gradients);
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
    Unflatten(sum, gradients);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("gradient all-reduce: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("gradient all-reduce: ", e.what()));
  }
  return absl::OkStatus();
}

// ---- Gloo ----------------------------------------------------------------------------------

#if CDCCA_HAVE_GLOO
struct GlooGradientReducer::Impl {
  int world_size = 1;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
};

bool GlooGradientReducer::Available() { return true; }

absl::StatusOr<std::unique_ptr<GlooGradientReducer>> GlooGradientReducer::Create(
    const std::string& store_path, int rank, int world_size, const std::string& hostname) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " of ", world_size));
  }
  try {
    auto impl = std::make_unique<Impl>();
    impl->world_size = world_size;
    auto store = c10::make_intrusive<c10d::FileStore>(store_path, world_size);
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    options->threads = 1;
    impl->group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
    return std::unique_ptr<GlooGradientReducer>(new GlooGradientReducer(std::move(impl)));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("gloo process group (rank ", rank, " of ", world_size,
                                            ", store ", store_path, "): ", e.what()));
  }
}

absl::Status GlooGradientReducer::AllReduceMean(std::vector<torch::Tensor>& gradients) {
  try {
    std::vector<torch::Tensor> buffer = {Flatten(gradients)};
    impl_->group->allreduce(buffer)->wait();  // SUM
    Unflatten(buffer[0] / static_cast<double>(impl_->world_size), gradients);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("gloo all-reduce: ", e.what()));
  }
  return absl::OkStatus();
}
#else
struct GlooGradientReducer::Impl {};

bool GlooGradientReducer::Available() { return false; }

absl::StatusOr<std::unique_ptr<GlooGradientReducer>> GlooGradientReducer::Create(
    const std::string&, int, int, const std::string&) {
  return absl::UnimplementedError(
      "this build has no Gloo (the gloo headers were missing at configure time; on Debian "
      "install libgloo-dev and reconfigure)");
}

absl::Status GlooGradientReducer::AllReduceMean(std::vector<torch::Tensor>&) {
  return absl::UnimplementedError("this build has no Gloo");
}
#endif

GlooGradientReducer::GlooGradientReducer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GlooGradientReducer::~GlooGradientReducer() = default;

}  // namespace cdcca::distill
