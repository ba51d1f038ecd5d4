#include "model/runtime/threads.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <climits>

#ifdef __GLIBC__
#include <malloc.h>
#endif

namespace cdcca::model {

int IntraOpThreads(int requested) { return requested > 0 ? requested : 1; }

int SetIntraOpThreads(int requested) {
  const int n = IntraOpThreads(requested);
  at::set_num_threads(n);
  FlushDenormals();
  return n;
}

bool FlushDenormals() { return at::globalContext().setFlushDenormal(true); }

bool KeepFreedMemory() {
#ifdef __GLIBC__
  // 32 MiB is the largest threshold glibc takes on 64-bit; fixing it also stops glibc from
  // adjusting it.
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
#else
  return false;
#endif
}

}  // namespace cdcca::model
