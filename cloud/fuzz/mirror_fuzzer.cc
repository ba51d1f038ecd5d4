// libFuzzer entry for the trainer's per-device state file (`<state_dir>/<device>.mirror`):
// the file's framing, then each blob with the decoder the trainer uses on it (safetensors,
// DWC encoder state, DWC payload).
// Input: one flag byte, then the file. Flag bit 0 reseals the file's checksum (the sealed
// envelope's or the older framing's: storage/fuzz/reseal_envelope.h), bit 1 the
// encoder state's and the update payload's own checksums (compress/fuzz/reseal.h), so
// mutations reach the parsers behind them.
#include <cstddef>
#include <cstdint>
#include <string>

#include "cloud/internal/mirror_file.h"
#include "compress/delta_encoder.h"
#include "compress/fuzz/reseal.h"
#include "compress/wire_format.h"
#include "model/hub/safetensors_view.h"
#include "storage/fuzz/reseal_envelope.h"

namespace {

// The blob with its trailing Hash64 recomputed.
std::string ResealBlob(const std::string& blob) {
  std::string flagged(1, '\1');
  flagged += blob;
  return cdcca::compress::fuzz::Reseal(reinterpret_cast<const uint8_t*>(flagged.data()),
                                       flagged.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string file = cdcca::storage::fuzz::ResealStateFile(data, size);
  const bool reseal_blobs = size > 0 && (data[0] & 2) != 0;
  absl::StatusOr<cdcca::cloud::internal::MirrorFile> f =
      cdcca::cloud::internal::DecodeMirrorFile(file, "fuzz.mirror");
  if (!f.ok()) return 0;
  if (f->mirror.size() + f->residual.size() + f->update.size() + f->snapshot.size() > file.size()) {
    __builtin_trap();
  }
  (void)cdcca::model::ParseSafetensors(f->mirror);
  (void)cdcca::model::ParseSafetensors(f->snapshot);
  cdcca::compress::DeltaEncoder encoder;
  (void)encoder.RestoreState(reseal_blobs ? ResealBlob(f->residual) : f->residual);
  (void)cdcca::compress::ParsePayload(reseal_blobs ? ResealBlob(f->update) : f->update);
  return 0;
}
