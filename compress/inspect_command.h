// `cdcca inspect UPDATE...`: prints what DWC update payloads hold (versions, tensors, bit
// widths, sizes, compression ratio against fp32, bits per parameter). Torch-free.
#ifndef CDCCA_COMPRESS_INSPECT_COMMAND_H_
#define CDCCA_COMPRESS_INSPECT_COMMAND_H_

#include <string>
#include <vector>

namespace cdcca::compress {

// Runs the command over the payload files in `args`; returns the process exit code (0 when
// every payload verified, 1 when one did not, 2 for usage errors). Flags:
// --inspect_values decodes each tensor and adds the RMS and max |value| of its delta.
int InspectCommand(const std::vector<std::string>& args);
// The flags `cdcca inspect` reads (nullptr-terminated): its --help lists them; it accepts no
// other.
extern const char* const kInspectFlags[];

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_INSPECT_COMMAND_H_
