// Writes seed inputs for record_scan_fuzzer into the directory given as argv[1]: clean
// segments, a torn tail, a flipped bit mid-segment, and the piece lists of the odd mode.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cloud/internal/record_log.h"

namespace rl = cdcca::cloud::internal;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  std::vector<std::string> seeds;
  std::string clean;
  for (int i = 0; i < 5; ++i) {
    rl::AppendRecord(clean, std::string("\x0a\x05") + "cam-" + char('0' + i) +
                                std::string(20 + 7 * i, static_cast<char>('a' + i)));
  }
  seeds.push_back(std::string(1, '\0') + clean);
  seeds.push_back(std::string(1, '\0') + clean.substr(0, clean.size() - 9));  // torn tail
  std::string flipped = clean;
  flipped[clean.size() / 2] ^= 0x10;  // corruption followed by intact records
  seeds.push_back(std::string(1, '\0') + flipped);
  // Odd mode: record, garbage, record, record, torn piece.
  const char odd[] =
      "\x01"                           // mode: pieces
      "\x00\x06\x0a\x04" "cam1"        // record
      "\x01\x03" "xyz"                // garbage
      "\x02\x04\x0a\x02" "ab"          // record
      "\x00\x05\x0a\x03" "abc"         // record
      "\x01\x04\x11\x5a\xca\xcd";     // a torn frame
  seeds.push_back(std::string(odd, sizeof(odd) - 1));
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream out(std::string(argv[1]) + "/seed-" + std::to_string(i), std::ios::binary);
    out << seeds[i];
    if (!out) return 1;
  }
  return 0;
}
