// Gradient averaging across the processes of a data-parallel AKD job, over LibTorch's own
// c10d key-value store (c10d::FileStore: a file on a filesystem every rank sees).
//
// Why a store and not ProcessGroupGloo: Debian's LibTorch 1.13 ships the c10d headers and
// the Gloo symbols but not the gloo headers that ProcessGroupGloo.hpp includes, so a Gloo
// process group cannot be compiled against here. The store exchange is an all-gather of
// each rank's flattened gradients followed by a local mean, summed in rank order, so every
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

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_DATA_PARALLEL_H_
