// Gradient averaging across the processes of a data-parallel AKD job, with LibTorch's c10d.
// Two reducers: GlooGradientReducer (c10d's ProcessGroupGloo), built when the gloo headers
// are present, and StoreGradientReducer, which needs nothing beyond LibTorch: an
// all-gather through c10d::FileStore (a file on a filesystem every rank sees) of each
// rank's flattened gradients followed by a local mean, summed in rank order, so every
// rank computes bit-identical averages. It moves world_size x gradient bytes per step per
// rank, fine for the adapter-sized trainable sets AKD trains (tens to hundreds of KiB),
// not for full-model training. Keys are namespaced by a per-reducer step counter; the
// file grows by world_size x gradient bytes per step (a job's store file is scratch).
//
// Thread-safety: one reducer per rank; AllReduceMean is called by one thread of that rank.
#ifndef CDCCA_DISTILL_DATA_PARALLEL_H_
#define CDCCA_DISTILL_DATA_PARALLEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "distill/learner.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace cdcca::distill {

class StoreGradientReducer : public GradientReducer {
 public:
  // Opens (or creates) the FileStore at `path` shared by `world_size` ranks.
  StoreGradientReducer(const std::string& path, int rank, int world_size);
  ~StoreGradientReducer() override;

  // Blocks until every rank has contributed this step's gradients (c10d's store timeout,
  // 300 s by default, then INTERNAL). The tensors must have the same shapes on all ranks.
  absl::Status AllReduceMean(std::vector<torch::Tensor>& gradients) override;

 private:
  int rank_;
  int world_size_;
  uint64_t step_ = 0;
  std::shared_ptr<void> store_holder_;  // keeps the c10d store alive (intrusive_ptr inside)
  c10d::Store* store_;
};

// Gradient averaging through a c10d ProcessGroupGloo (ring all-reduce over TCP), the
// rendezvous through a FileStore at `store_path`. Built when the gloo headers are present
// (Debian: libgloo-dev, which scripts/setup.sh installs); Available() says whether this
// build has it. The ring's summation order differs by rank position, so ranks agree to
// rounding, not bit for bit.
class GlooGradientReducer : public GradientReducer {
 public:
  static bool Available();
  // `hostname`: the address this rank binds and advertises (127.0.0.1 for one host).
  // UNIMPLEMENTED when the build has no Gloo; INTERNAL when the rendezvous fails.
  static absl::StatusOr<std::unique_ptr<GlooGradientReducer>> Create(
      const std::string& store_path, int rank, int world_size,
      const std::string& hostname = "127.0.0.1");
  ~GlooGradientReducer() override;

  absl::Status AllReduceMean(std::vector<torch::Tensor>& gradients) override;

 private:
  struct Impl;
  explicit GlooGradientReducer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_DATA_PARALLEL_H_
