#include "distill/model/threads.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

namespace cdcca::model {

int IntraOpThreads(int requested) { return requested > 0 ? requested : 1; }

int SetIntraOpThreads(int requested) {
  const int n = IntraOpThreads(requested);
  at::set_num_threads(n);
  FlushDenormals();
  return n;
}

bool FlushDenormals() { return at::globalContext().setFlushDenormal(true); }

}  // namespace cdcca::model
