#include "cloud/internal/work_pool.h"

namespace cdcca::cloud::internal {

WorkPool::WorkPool(int threads) {
  for (int i = 0; i < (threads < 1 ? 1 : threads); ++i) threads_.emplace_back([this] { Loop(); });
}

WorkPool::~WorkPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void WorkPool::Schedule(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(fn));
}

void WorkPool::Loop() {
  while (true) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkPool* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return !p->queue_.empty() || p->stopping_;
          },
          this));
      if (queue_.empty()) return;
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

}  // namespace cdcca::cloud::internal
