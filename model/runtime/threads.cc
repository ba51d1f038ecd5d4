#include "model/runtime/threads.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <climits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

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

namespace {

// OpenBLAS's own entry points, looked up in the process (LibTorch links the BLAS; cdcca does
// not, so another BLAS leaves them null).
template <typename F>
F OpenBlasSymbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

}  // namespace

absl::StatusOr<int> SetBlasThreads(int n) {
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("BLAS threads must be >= 1, not ", n));
  auto set = OpenBlasSymbol<void (*)(int)>("openblas_set_num_threads");
  if (set == nullptr) {
    return absl::FailedPreconditionError(
        "the BLAS this LibTorch multiplies with has no thread control cdcca knows "
        "(openblas_set_num_threads): set its own environment variable instead");
  }
  set(n);
  return BlasThreads();
}

absl::Status ApplyBlasThreadsFlag(int requested) {
  return requested == 0 ? absl::OkStatus() : SetBlasThreads(requested).status();
}

int BlasThreads() {
  auto get = OpenBlasSymbol<int (*)()>("openblas_get_num_threads");
  return get == nullptr ? -1 : get();
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
