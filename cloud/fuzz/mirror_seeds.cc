// Writes a seed corpus for the mirror state fuzzer: state files as the trainer writes them
// at version 0 (mirror only) and after an update (residual, update payload, snapshot).
// Usage: mirror_fuzz_seeds OUT_DIR
#include <cstdio>
#include <string>

#include "cloud/internal/mirror_file.h"
#include "compress/delta_encoder.h"
#include "compress/fuzz/fuzz_set.h"
#include "compress/fuzz/reseal.h"
#include "model/fuzz/safetensors_seed.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  using cdcca::cloud::internal::MirrorFile;
  const std::string tensors =
      cdcca::model::fuzz::SafetensorsSeed({{"norm.weight", "F32", 4, {48}},
                                           {"layers.0.q_lora.A", "F32", 4, {4, 40}},
                                           {"scalar", "F32", 4, {}}},
                                          {{"version", "1"}});
  const cdcca::compress::fuzz::FuzzSet mirror = cdcca::compress::fuzz::MakeFuzzSet(0.5f);
  const cdcca::compress::fuzz::FuzzSet fresh = cdcca::compress::fuzz::MakeFuzzSet(0.53f);
  cdcca::compress::DeltaEncoderOptions options;
  options.allowed_bits = {0, 2};
  options.bits_per_param = 0.0;
  options.group_size = 16;
  cdcca::compress::DeltaEncoder encoder(options);
  auto update = encoder.Encode(fresh.views, mirror.views, 0, 1);
  if (!update.ok()) {
    std::fprintf(stderr, "encode failed: %s\n", update.status().ToString().c_str());
    return 1;
  }
  MirrorFile v0;
  v0.mirror = tensors;
  v0.residual = cdcca::compress::DeltaEncoder(options).SerializeState();
  MirrorFile v1;
  v1.version = 1;
  v1.consumed = 12;
  v1.digest = 0x1234;
  v1.mirror = tensors;
  v1.residual = encoder.SerializeState();
  v1.update = update->bytes;
  v1.snapshot = tensors;
  int written = 0;
  for (const MirrorFile* f : {&v0, &v1}) {
    const std::string bytes = cdcca::cloud::internal::EncodeMirrorFile(*f);
    // A seed the decoder rejects would only test the rejection paths.
    auto back = cdcca::cloud::internal::DecodeMirrorFile(bytes, "seed");
    if (!back.ok() || back->version != f->version || back->mirror != f->mirror ||
        back->residual != f->residual || back->update != f->update ||
        back->snapshot != f->snapshot) {
      std::fprintf(stderr, "mirror file does not round-trip\n");
      return 1;
    }
    // Flag 3: reseal the file and the blobs' own checksums (see mirror_fuzzer.cc).
    if (!cdcca::compress::fuzz::WriteSeed(argv[1], "seed_" + std::to_string(written++), bytes, 3)) {
      return 1;
    }
  }
  std::printf("wrote %d seeds to %s\n", written, argv[1]);
  return 0;
}
