#include "cloud/train_round.h"

#include <torch/torch.h>

#include <chrono>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/hub/safetensors.h"

namespace cdcca::cloud {
namespace {

using SteadyClock = std::chrono::steady_clock;

double Since(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

compress::NamedTensors Clones(const compress::NamedTensors& in) {
  compress::NamedTensors out;
  out.reserve(in.size());
  for (const auto& [name, t] : in) out.emplace_back(name, t.detach().clone());
  return out;
}

// `next.state` digested and snapshotted as version next.version.
absl::Status Seal(NewVersion& next) {
  next.digest = compress::StateDigest(next.state);
  absl::StatusOr<std::string> snapshot =
      model::EncodeSafetensors(next.state, {{"version", std::to_string(next.version)}});
  if (!snapshot.ok()) return snapshot.status();
  next.snapshot = *std::move(snapshot);
  return absl::OkStatus();
}

// A version after `version`, filled by `fill` under the guard that turns LibTorch's
// exceptions into a Status.
absl::StatusOr<NewVersion> NextVersion(uint64_t version,
                                       absl::FunctionRef<absl::Status(NewVersion&)> fill) {
  NewVersion next;
  next.base_version = version;
  next.version = version + 1;
  try {
    if (absl::Status s = fill(next); !s.ok()) return s;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("encoding version ", next.version, ": ", e.what_without_backtrace()));
  }
  return next;
}

}  // namespace

absl::StatusOr<NewVersion> EncodeVersion(const compress::NamedTensors& trained,
                                         const compress::NamedTensors& mirror, uint64_t version,
                                         const compress::DeltaEncoder& encoder) {
  return NextVersion(version, [&](NewVersion& next) -> absl::Status {
    SteadyClock::time_point start = SteadyClock::now();
    compress::DeltaEncoder used = encoder;
    absl::StatusOr<compress::UpdatePayload> payload =
        used.Encode(trained, mirror, version, next.version);
    // A budget below the smallest payload (a small model under a bits-per-parameter cap: the
    // per-tensor headers alone exceed it) would block the device forever; send the smallest
    // budget that fits instead, and say so.
    for (uint64_t budget = 4096; absl::IsResourceExhausted(payload.status()); budget *= 4) {
      compress::DeltaEncoderOptions raised = encoder.options();
      raised.bits_per_param = 0;
      raised.byte_budget = budget;
      used = compress::DeltaEncoder(raised);
      if (absl::Status s = used.RestoreState(encoder.SerializeState()); !s.ok()) return s;
      payload = used.Encode(trained, mirror, version, next.version);
      next.budget_raised_to = budget;
      if (budget > (1ull << 30)) break;
    }
    if (!payload.ok()) return payload.status();
    next.update = *std::move(payload);
    next.residual = used.SerializeState();
    next.encode_seconds = Since(start);

    // The device's state after the update: the same bytes applied to a copy of its mirror.
    start = SteadyClock::now();
    next.state = Clones(mirror);
    absl::StatusOr<uint64_t> applied =
        compress::ApplyUpdate(next.update.bytes, version, next.state);
    if (!applied.ok()) return applied.status();
    if (absl::Status s = Seal(next); !s.ok()) return s;
    next.apply_seconds = Since(start);
    return absl::OkStatus();
  });
}

absl::StatusOr<NewVersion> RestoreVersion(compress::NamedTensors target,
                                          const compress::NamedTensors& mirror, uint64_t version,
                                          const compress::DeltaEncoderOptions& options) {
  return NextVersion(version, [&](NewVersion& next) -> absl::Status {
    SteadyClock::time_point start = SteadyClock::now();
    compress::DeltaEncoderOptions uncapped = options;
    uncapped.byte_budget = 0;
    uncapped.bits_per_param = 0;
    compress::DeltaEncoder encoder(uncapped);
    absl::StatusOr<compress::UpdatePayload> payload =
        encoder.Encode(target, mirror, version, next.version);
    if (!payload.ok()) return payload.status();
    next.update = *std::move(payload);
    next.residual = compress::DeltaEncoder(options).SerializeState();
    next.encode_seconds = Since(start);
    start = SteadyClock::now();
    next.state = std::move(target);
    if (absl::Status s = Seal(next); !s.ok()) return s;
    next.apply_seconds = Since(start);
    return absl::OkStatus();
  });
}

absl::StatusOr<TrainedRound> TrainRound(absl::FunctionRef<absl::StatusOr<TrainedSet>()> learn,
                                        const compress::NamedTensors& mirror, uint64_t version,
                                        const compress::DeltaEncoder& encoder) {
  TrainedRound round;
  try {
    absl::StatusOr<TrainedSet> job = learn();
    if (!job.ok()) {
      round.outcome = RoundOutcome::kFailed;
      round.why = job.status();
      return round;
    }
    round.job = *std::move(job);
    if (round.job.trainable.empty()) {
      round.outcome = RoundOutcome::kNothingUsable;
      return round;
    }
    // Uplinked features are finite (the codec checks) but may be large enough to overflow
    // training: a non-finite result must never become an update.
    for (const auto& [name, t] : round.job.trainable) {
      if (torch::isfinite(t).all().item<bool>()) continue;
      round.outcome = RoundOutcome::kNonFinite;
      round.why = absl::DataLossError(
          absl::StrCat("training on them took ", name, " to a non-finite value"));
      return round;
    }
  } catch (const c10::Error& e) {
    round.outcome = RoundOutcome::kFailed;
    round.why = absl::InternalError(e.what_without_backtrace());
    return round;
  }
  absl::StatusOr<NewVersion> next = EncodeVersion(round.job.trainable, mirror, version, encoder);
  if (!next.ok()) return next.status();
  round.next = *std::move(next);
  round.outcome = RoundOutcome::kTrained;
  return round;
}

}  // namespace cdcca::cloud
