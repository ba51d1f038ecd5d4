// Bounded store of earlier rounds' uplinked samples, mixed into each AKD job so that
// adapting to the current shift does not erase what earlier rounds taught (continual
// learning's forgetting). Reservoir sampling (Vitter's algorithm R): after any number of
// Add() calls every sample ever offered is held with equal probability capacity / seen.
// Everything is driven by one seeded generator, so the same sequence of calls gives the
// same contents and draws on every machine.
//
// Thread-safety: not thread-safe; one job owner (the cloud's per-device state) uses it.
#ifndef CDCCA_DISTILL_REPLAY_BUFFER_H_
#define CDCCA_DISTILL_REPLAY_BUFFER_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "compress/uplink_codec.h"

namespace cdcca::distill {

class ReplayBuffer {
 public:
  // capacity: most samples held (0 = the buffer stays empty). seed: fixes every choice.
  ReplayBuffer(size_t capacity, uint64_t seed);

  // Offers `samples` (copied) after a round's job has used them.
  void Add(const std::vector<compress::UplinkSample>& samples);

  // `count` samples drawn uniformly without replacement (all of them, shuffled, if count >=
  // size()). The pointers stay valid until the next Add(). Advances the generator.
  std::vector<const compress::UplinkSample*> Draw(size_t count);

  // The buffer's whole state as bytes: its samples in full (features as fp16 where every
  // value of the sample is one, else as fp32, so nothing is rounded), how many were offered,
  // and the generator's state. What a trainer that takes over the device's jobs restores, so
  // that replay goes on there as it would have here.
  std::string Serialize() const;
  // Replaces the state with what Serialize wrote. DATA_LOSS naming `what` for bytes that do
  // not parse, or that hold more samples than this buffer's capacity; the state is unchanged
  // then.
  absl::Status Restore(absl::string_view bytes, absl::string_view what);

  size_t size() const { return items_.size(); }
  size_t capacity() const { return capacity_; }
  uint64_t seen() const { return seen_; }

 private:
  size_t capacity_;
  uint64_t seen_ = 0;
  std::mt19937_64 rng_;
  std::vector<compress::UplinkSample> items_;
};

}  // namespace cdcca::distill

#endif  // CDCCA_DISTILL_REPLAY_BUFFER_H_
