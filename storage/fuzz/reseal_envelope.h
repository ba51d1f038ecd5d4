// Fuzz-input preparation for state files that are either in the sealed envelope
// (storage/sealed_file.h: u32 "CDSF" | u32 kind | u32 format | u64 body size | body | u32
// CRC-32) or in an older framing that ends in a u64 Hash64 (compress/fuzz/reseal.h).
//
// The first input byte is a flag: if odd, the file's checksum is recomputed (for a sealed
// file also its body size), so mutations reach the parsers behind it; if even, the bytes stay
// as they are (the checksum path is fuzzed too).
#ifndef CDCCA_STORAGE_FUZZ_RESEAL_ENVELOPE_H_
#define CDCCA_STORAGE_FUZZ_RESEAL_ENVELOPE_H_

#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "compress/fuzz/reseal.h"

namespace cdcca::storage::fuzz {

inline std::string ResealStateFile(const uint8_t* data, size_t size) {
  if (size < 5 || std::string(reinterpret_cast<const char*>(data) + 1, 4) != "CDSF") {
    return compress::fuzz::Reseal(data, size);
  }
  std::string s(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) != 0 && s.size() >= 24) {
    const uint64_t body = s.size() - 24;
    for (int i = 0; i < 8; ++i) s[12 + i] = static_cast<char>((body >> (8 * i)) & 0xff);
    const size_t covered = s.size() - 4;
    const uint32_t crc =
        static_cast<uint32_t>(crc32_z(0L, reinterpret_cast<const Bytef*>(s.data()), covered));
    for (int i = 0; i < 4; ++i) s[covered + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
  }
  return s;
}

}  // namespace cdcca::storage::fuzz

#endif  // CDCCA_STORAGE_FUZZ_RESEAL_ENVELOPE_H_
