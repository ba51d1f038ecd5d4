// The UTS settings a cloud sends in its Register reply, over a device's own (device/uts.h).
// Apart from uts.h so that UTS itself needs no protobuf (the GPU machine's core build runs
// it in sim/inprocess_round.h).
#ifndef CDCCA_DEVICE_UTS_CLOUD_SETTINGS_H_
#define CDCCA_DEVICE_UTS_CLOUD_SETTINGS_H_

#include "absl/status/status.h"
#include "device/uts.h"
#include "proto/cdcca.pb.h"

namespace cdcca::device {

// Local defaults overridden by the fields the cloud set in its Register reply (zero fields
// keep the local value). INVALID_ARGUMENT (CheckUtsOptions) if a value is out of range;
// `options` is then unchanged.
absl::Status MergeCloudSettings(const v1::UtsSettings& cloud, UtsOptions* options);

}  // namespace cdcca::device

#endif  // CDCCA_DEVICE_UTS_CLOUD_SETTINGS_H_
