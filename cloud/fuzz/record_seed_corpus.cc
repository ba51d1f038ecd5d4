// Writes seed inputs for record_scan_fuzzer into the directory given as argv[1]: segment
// files (clean, with a record across a block boundary, a torn tail, a flipped bit) and step
// lists of the odd mode (a record that plants a well-formed record inside its payload, then
// damage before it).
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "cloud/internal/record_log.h"
#include "proto/store.pb.h"

namespace rl = cdcca::cloud::internal;

namespace {

std::string Body(uint64_t sequence, const std::string& payload) {
  cdcca::store::v1::SampleRecord record;
  record.set_device_id("cam-" + std::to_string(sequence));
  record.mutable_batch()->set_sequence(sequence);
  record.mutable_batch()->set_sample_count(1);
  record.mutable_batch()->set_payload(payload);
  return record.SerializeAsString();
}

// One step of the odd mode.
std::string Step(int tag, int repeat, const std::string& bytes) {
  std::string out = {static_cast<char>(tag), static_cast<char>(repeat),
                     static_cast<char>(bytes.size() & 0xff),
                     static_cast<char>((bytes.size() >> 8) & 0xff)};
  return out + bytes;
}

std::string U32(uint32_t v) {
  return std::string{static_cast<char>(v & 0xff), static_cast<char>((v >> 8) & 0xff),
                     static_cast<char>((v >> 16) & 0xff), static_cast<char>((v >> 24) & 0xff)};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  std::vector<std::string> seeds;
  const uint64_t nonce = 0x1234;
  std::string clean = rl::SegmentHeader(nonce);
  rl::LogWriter writer(clean.size(), nonce);
  for (int i = 0; i < 4; ++i) {
    writer.AddRecord(Body(i + 1, std::string(20 + 7 * i, static_cast<char>('a' + i))), clean);
    if (i % 2 == 1) writer.AddSync(clean);
  }
  seeds.push_back(std::string(1, '\0') + clean);
  seeds.push_back(std::string(1, '\0') + clean.substr(0, clean.size() - 9));  // torn tail
  std::string flipped = clean;
  flipped[clean.size() / 2] ^= 0x10;
  seeds.push_back(std::string(1, '\0') + flipped);
  // A record across a block boundary, then a small one and a SYNC fragment.
  std::string blocks = clean;
  writer.AddRecord(Body(5, std::string(rl::kLogBlockBytes, 'x')), blocks);
  writer.AddRecord(Body(6, "tail"), blocks);
  writer.AddSync(blocks);
  seeds.push_back(std::string(1, '\0') + blocks);

  // A payload that carries a well-formed segment's records (a device planting them), a bit
  // flipped in the record before it, and the records after it.
  std::string planted;
  rl::LogWriter inner(0, nonce);
  inner.AddRecord(Body(99, "forged"), planted);
  inner.AddSync(planted);
  std::string odd = "\x01";
  odd += Step(0, 0, "first");
  odd += Step(0, 3, planted);
  odd += Step(1, 0, "");
  odd += Step(0, 0, "after");
  odd += Step(1, 0, "");
  odd += Step(2 | (4 << 2), 0, U32(rl::kSegmentHeaderBytes + 12));
  seeds.push_back(odd);
  // Payloads repeated across blocks, a truncation in the middle.
  std::string big = "\x01";
  big += Step(0, 200, std::string(250, 'p') + planted);
  big += Step(1, 0, "");
  big += Step(0, 100, planted);
  big += Step(3, 0, U32(50000));
  seeds.push_back(big);

  for (size_t i = 0; i < seeds.size(); ++i) {
    std::ofstream out(std::string(argv[1]) + "/seed-" + std::to_string(i), std::ios::binary);
    out << seeds[i];
    if (!out) return 1;
  }
  return 0;
}
