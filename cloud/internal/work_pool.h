// A fixed pool of threads running queued closures in FIFO order. The gRPC reactions hand
// anything that touches the disk to it, so reaction threads never block on fsync.
#ifndef CDCCA_CLOUD_INTERNAL_WORK_POOL_H_
#define CDCCA_CLOUD_INTERNAL_WORK_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace cdcca::cloud::internal {

class WorkPool {
 public:
  explicit WorkPool(int threads);
  // Runs every queued closure, then joins the threads.
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  // Thread-safe.
  void Schedule(std::function<void()> fn);

 private:
  void Loop();
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace cdcca::cloud::internal

#endif  // CDCCA_CLOUD_INTERNAL_WORK_POOL_H_
