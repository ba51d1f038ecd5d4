// Fuzz-input preparation shared by the fuzzers of checksummed formats (DWC payloads, uplink
// batches, state files), which all end in a u64 Hash64 of every byte before it.
//
// The first input byte is a flag: if odd, the trailing 8 bytes of the rest are overwritten
// with the checksum of what precedes them, so mutations reach the parsers behind the
// checksum; if even, the bytes stay as they are (the checksum path is fuzzed too).
#ifndef CDCCA_COMPRESS_FUZZ_RESEAL_H_
#define CDCCA_COMPRESS_FUZZ_RESEAL_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "compress/hash64.h"

namespace cdcca::compress::fuzz {

inline std::string Reseal(const uint8_t* data, size_t size) {
  if (size == 0) return std::string();
  std::string s(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) != 0 && s.size() >= 8) {
    const size_t covered = s.size() - 8;
    const uint64_t h = Hash64(s.data(), covered);
    for (int i = 0; i < 8; ++i) s[covered + i] = static_cast<char>((h >> (8 * i)) & 0xff);
  }
  return s;
}

// For seed generators: writes `flag` then `bytes` to DIR/NAME; false on an I/O error.
// flag 1 reseals (the usual seed), 0 leaves the input as is (for formats without checksum).
inline bool WriteSeed(const std::string& dir, const std::string& name, const std::string& bytes,
                      char flag = 1) {
  const std::string path = dir + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    std::perror(path.c_str());
    return false;
  }
  std::fputc(flag, f);
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

}  // namespace cdcca::compress::fuzz

#endif  // CDCCA_COMPRESS_FUZZ_RESEAL_H_
