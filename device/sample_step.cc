#include "device/sample_step.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "compress/hash64.h"

namespace cdcca::device {

SampleStep::SampleStep(SampleStepOptions options)
    : options_(std::move(options)),
      gate_(std::make_unique<EntropyGate>(options_.uts)),
      token_rng_(options_.token_seed) {}

void SampleStep::Reconfigure(const UtsOptions& uts, double holdout_fraction) {
  options_.uts = uts;
  options_.holdout_fraction = holdout_fraction;
  gate_ = std::make_unique<EntropyGate>(uts);
}

SampleDecision SampleStep::Run(const AnsweredFrame& frame, const FrameModel& model,
                               uint64_t sample_id) {
  const UtsOptions& uts = options_.uts;
  if (frame.model_version != gate_version_) {
    gate_ = std::make_unique<EntropyGate>(uts);
    gate_version_ = frame.model_version;
  }
  SampleDecision d;
  d.ordinal = next_ordinal_++;
  // The guard's share is picked among all answers, before stage 1: the held-out pool is then
  // a sample of what the device answers, not of the uncertain answers stage 1 keeps, and an
  // update is judged on the device's inputs. The cloud decides by the id alone.
  d.held_out = compress::IsHeldOutSample(options_.device_id, sample_id, options_.holdout_fraction);
  d.threshold = gate_->threshold();
  d.stage1_kept = gate_->Keep(frame.entropy);  // records every entropy
  d.random_kept = !d.stage1_kept && !d.held_out &&
                  IsRandomShareSample(options_.device_id, sample_id, uts.random_share);
  if (!d.chosen()) return d;

  std::vector<uint16_t> kept;
  if (d.held_out) {
    // The guard scores the sample as the device answers it: from the whole frame.
    kept = EveryToken(frame.tokens);
  } else if (uts.random_tokens) {
    kept = RandomTokenSelection(frame.tokens, {}, uts.token_ratio, token_rng_);
  } else if (uts.token_ratio >= 1) {
    // SelectTokens would keep every token whatever the scores: the passes are not run.
    kept = EveryToken(frame.tokens);
  } else {
    if (!model.scores) {
      d.status = absl::FailedPreconditionError("UTS stage 2: this model cannot score tokens");
      return d;
    }
    std::optional<uint64_t> seed;
    if (options_.score_seed != 0) {
      const uint64_t key[2] = {options_.score_seed, d.ordinal};
      seed = compress::Hash64(key, sizeof(key));
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<std::vector<float>> scores =
        model.scores(uts.mc_passes, uts.dropout_p, uts.score, seed);
    d.stage2_seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (!scores.ok()) {
      d.status = scores.status();
      return d;
    }
    if (scores->size() != static_cast<size_t>(frame.tokens)) {
      d.status = absl::InternalError(absl::StrCat("UTS stage 2 scored ", scores->size(),
                                                  " tokens of a ", frame.tokens, "-token grid"));
      return d;
    }
    kept = SelectTokens(*scores, {}, uts.token_ratio, uts.variance_beta);
  }

  std::string jpeg;
  if (uts.precision == compress::FeaturePrecision::kJpeg) {
    // The frame instead of the tokens: the cloud recomputes them with the shared tower.
    if (!model.jpeg) {
      d.status = absl::FailedPreconditionError("the jpeg uplink: this model cannot send frames");
      return d;
    }
    absl::StatusOr<std::string> encoded = model.jpeg(options_.jpeg_quality);
    if (!encoded.ok()) {
      d.status = encoded.status();
      return d;
    }
    jpeg = *std::move(encoded);
  }
  absl::StatusOr<compress::UplinkSample> sample = MakeUplinkSample(
      frame, std::move(kept), uts.precision, std::move(jpeg), sample_id, options_.limits);
  if (!sample.ok()) {
    d.status = sample.status();
    return d;
  }
  d.sample = *std::move(sample);
  return d;
}

absl::StatusOr<compress::UplinkSample> MakeUplinkSample(const AnsweredFrame& frame,
                                                        std::vector<uint16_t> kept,
                                                        compress::FeaturePrecision precision,
                                                        std::string jpeg, uint64_t sample_id,
                                                        const compress::UplinkLimits& limits) {
  const bool frames = precision == compress::FeaturePrecision::kJpeg;
  if (frame.tokens < 0 || frame.dim < 0 ||
      (!frames && frame.features.size() != static_cast<size_t>(frame.tokens) * frame.dim)) {
    return absl::InvalidArgumentError(absl::StrCat("the answer's visual tokens hold ",
                                                   frame.features.size(), " values, not ",
                                                   frame.tokens, " x ", frame.dim));
  }
  compress::UplinkSample s;
  s.sample_id = sample_id;
  s.model_version = frame.model_version;
  s.entropy = frame.entropy;
  s.grid_tokens = static_cast<uint32_t>(frame.tokens);
  s.feature_dim = static_cast<uint32_t>(frame.dim);
  s.kept_indices = std::move(kept);
  if (frames) {
    s.frame = std::move(jpeg);
  } else {
    s.features.reserve(s.kept_indices.size() * static_cast<size_t>(frame.dim));
    for (uint16_t t : s.kept_indices) {
      if (t >= frame.tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("kept token ", t, " of a ", frame.tokens, "-token grid"));
      }
      const float* row = frame.features.data() + static_cast<size_t>(t) * frame.dim;
      s.features.insert(s.features.end(), row, row + frame.dim);
    }
  }
  s.prompt_tokens.assign(frame.question_ids.begin(), frame.question_ids.end());
  s.answer_tokens.assign(frame.answer_ids.begin(), frame.answer_ids.end());
  if (!s.kept_indices.empty()) {
    if (absl::Status ok = compress::CheckUplinkSample(s, precision, limits); !ok.ok()) return ok;
  }
  return s;
}

}  // namespace cdcca::device
