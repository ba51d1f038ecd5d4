#include "device/uts_cloud_settings.h"

namespace cdcca::device {

absl::Status MergeCloudSettings(const v1::UtsSettings& cloud, UtsOptions* options) {
  UtsOptions o = *options;
  if (cloud.entropy_alpha() != 0) o.entropy_alpha = cloud.entropy_alpha();
  if (cloud.keep_fraction() != 0) o.keep_fraction = cloud.keep_fraction();
  if (cloud.mc_passes() != 0) o.mc_passes = static_cast<int>(cloud.mc_passes());
  if (cloud.dropout_p() != 0) o.dropout_p = cloud.dropout_p();
  if (cloud.variance_beta() != 0) o.variance_beta = cloud.variance_beta();
  if (cloud.token_ratio() != 0) o.token_ratio = cloud.token_ratio();
  if (cloud.random_share() != 0) o.random_share = cloud.random_share();
  if (cloud.feature_precision() == v1::FEATURE_PRECISION_FP16) {
    o.precision = compress::FeaturePrecision::kFp16;
  } else if (cloud.feature_precision() == v1::FEATURE_PRECISION_INT8) {
    o.precision = compress::FeaturePrecision::kInt8;
  } else if (cloud.feature_precision() == v1::FEATURE_PRECISION_INT4) {
    o.precision = compress::FeaturePrecision::kInt4;
  } else if (cloud.feature_precision() == v1::FEATURE_PRECISION_JPEG) {
    o.precision = compress::FeaturePrecision::kJpeg;
  }
  if (absl::Status s = CheckUtsOptions(o); !s.ok()) return s;
  *options = o;
  return absl::OkStatus();
}

}  // namespace cdcca::device
