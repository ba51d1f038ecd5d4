// How many LibTorch intra-op threads the CPU paths of cdcca use.
//
// These models spend their CPU time in matrix products, which the BLAS (OpenBLAS on Debian)
// spreads over every core with threads of its own. LibTorch's OpenMP intra-op threads on the
// same cores add little to the small element-wise ops and spin against the BLAS threads: on
// a 2-core machine one intra-op thread trains the teacher 2.7x faster and runs the quickstart
// experiment 4.5x faster than two (docs/BENCHMARKS.md). So "automatic" means one.
#ifndef CDCCA_MODEL_RUNTIME_THREADS_H_
#define CDCCA_MODEL_RUNTIME_THREADS_H_

#include "absl/status/statusor.h"

namespace cdcca::model {

// `requested` if positive, else the automatic count (1). Thread-safe.
int IntraOpThreads(int requested);

// Sets LibTorch's (process-wide) intra-op thread count to IntraOpThreads(requested) and
// returns it. Also flushes denormals on the calling thread (FlushDenormals).
int SetIntraOpThreads(int requested);

// Caps the threads of the BLAS LibTorch multiplies with (OpenBLAS on Debian) at `n` >= 1 and
// returns the count the BLAS reports afterwards; process-wide. By default OpenBLAS runs one
// thread per core, and between two products its idle workers spin on sched_yield: a trainer
// beside a serving path on two cores spent most of a core so, in the kernel, at any niceness
// (docs/BENCHMARKS.md, "A fleet against the scaled cloud"). FailedPrecondition where the BLAS
// has no such control (another BLAS than OpenBLAS).
absl::StatusOr<int> SetBlasThreads(int n);

// The programs' --blas_threads: 0 leaves the BLAS at its own count, anything else goes to
// SetBlasThreads (whose errors it returns).
absl::Status ApplyBlasThreadsFlag(int requested);

// The BLAS's thread count, or -1 where it does not say.
int BlasThreads();

// Makes the calling thread's CPU arithmetic flush denormal floats to zero (FTZ/DAZ) where the
// processor supports it; returns whether it does. Training the project's towers produces
// denormals (tiny gradients and attention weights); without this the 2-core machine spent
// ~40 % of each teacher step on them (0.40 against 0.25 s a step in the full schedule). Values
// below 1.2e-38 are far under anything the models compute with, so results do not change.
bool FlushDenormals();

// Makes glibc's malloc keep freed memory for reuse instead of handing it back to the system:
// blocks under 32 MiB come from the heap, and the heap is not trimmed. A training step frees
// and reallocates tensors of a few MiB hundreds of times; by default glibc serves them from
// fresh pages (mmap, or heap it trimmed at the last free), each of which faults on first
// touch. On the 2-core machine that is ~560,000 faults in a 50 s pretraining run, half of them
// gone with this, and element-wise ops on [2000, 432] up to 10x faster. Resident memory then
// stays at its peak, so only training calls this, not the inference paths whose memory is
// measured. Process-wide, idempotent; returns whether it applied (glibc only).
bool KeepFreedMemory();

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_RUNTIME_THREADS_H_
