// Hash64: a fast, non-cryptographic 64-bit hash written for cdcca (not a port of xxHash or
// wyhash, though it follows the same four-lane multiply-rotate shape). It guards DWC payloads
// against truncation and corruption on the wire and in storage, and digests the trainable
// set so the device and the cloud mirror can prove they hold identical bits.
//
// Properties relied on: deterministic across platforms (reads little-endian words
// explicitly); every lane update is a bijection of the input word, so changing any single
// 64-bit word of the input always changes the hash; runs at several GB/s.
// Not for adversarial settings: it is no MAC (TLS and the bearer token cover that).
#ifndef CDCCA_COMPRESS_HASH64_H_
#define CDCCA_COMPRESS_HASH64_H_

#include <cstddef>
#include <cstdint>

namespace cdcca::compress {

// Hashes `size` bytes at `data` (may be null when size == 0). Thread-safe (pure function).
uint64_t Hash64(const void* data, size_t size, uint64_t seed = 0);

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_HASH64_H_
