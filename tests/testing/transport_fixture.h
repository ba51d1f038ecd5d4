// An in-process cloud (OpenCloud's stores, service and gRPC server on a loopback port) and helpers
// to make device clients for it, for end-to-end transport tests and benchmarks.
#ifndef CDCCA_TESTS_TESTING_TRANSPORT_FIXTURE_H_
#define CDCCA_TESTS_TESTING_TRANSPORT_FIXTURE_H_

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cloud/cloud_server.h"
#include "cloud/cloud_service.h"
#include "cloud/device_registry.h"
#include "cloud/open_cloud.h"
#include "cloud/sample_store.h"
#include "cloud/update_store.h"
#include "compress/uplink_codec.h"
#include "device/cloud_client.h"

namespace cdcca::testing {

// Random printable token of 32 bytes.
inline std::string RandomToken(std::mt19937_64& rng) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string t(32, 'x');
  for (char& c : t) c = kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return t;
}

struct CloudFixtureOptions {
  std::string data_dir;
  int devices = 3;  // tokens for dev-0 .. dev-(n-1)
  cloud::ServerOptions server;
  cloud::CloudServiceOptions service;
  cloud::CloudObserver* observer = nullptr;
  uint64_t device_quota_bytes = 0;  // SampleStoreOptions::max_device_bytes
  // "" = the embedded stores in data_dir; else a PostgreSQL conninfo, served as a front (no
  // model; samples(), updates() and registry() are then null).
  std::string store;
};

// Owns one running cloud (cloud::OpenCloud, transport only: no model). Restart() shuts it down
// and opens it again on the same data directory and port, as a process restart would.
class CloudFixture {
 public:
  explicit CloudFixture(CloudFixtureOptions options) : options_(std::move(options)) {
    std::mt19937_64 rng(std::random_device{}());
    for (int i = 0; i < options_.devices; ++i) {
      tokens_.push_back(RandomToken(rng));
      absl::StrAppend(&tokens_text_, "dev-", i, " ", tokens_.back(), "\n");
    }
  }
  ~CloudFixture() { Stop(); }

  absl::Status Start() {
    cloud::CloudOptions o;
    o.data_dir = options_.data_dir;
    o.tokens_text = tokens_text_;
    o.server = options_.server;
    if (port_ != 0) o.server.listen_address = absl::StrCat("127.0.0.1:", port_);
    o.service = options_.service;
    o.observer = options_.observer;
    o.device_quota_bytes = options_.device_quota_bytes;
    if (!options_.store.empty()) {
      o.store = options_.store;
      o.role = "front";
    }
    absl::StatusOr<std::unique_ptr<cloud::Cloud>> opened = cloud::OpenCloud(o);
    if (!opened.ok()) return opened.status();
    cloud_ = *std::move(opened);
    port_ = cloud_->port();
    return absl::OkStatus();
  }

  void Stop() {
    if (cloud_) cloud_->Shutdown(absl::Milliseconds(200));
    cloud_.reset();
  }

  absl::Status Restart() {
    Stop();
    return Start();
  }

  std::unique_ptr<device::CloudClient> Client(int device, device::CloudClientOptions base = {}) {
    base.target = absl::StrCat("localhost:", port_);
    base.device_id = absl::StrCat("dev-", device);
    if (base.token.empty()) base.token = tokens_[device];
    if (options_.server.insecure) base.insecure = true;
    return std::move(device::CloudClient::Create(base)).value();
  }

  const std::string& token(int device) const { return tokens_[device]; }
  int port() const { return port_; }
  cloud::SampleStore* samples() { return cloud_ ? cloud_->sample_store() : nullptr; }
  cloud::UpdateStore* updates() { return cloud_ ? cloud_->update_store() : nullptr; }
  cloud::DeviceRegistry* registry() { return cloud_ ? cloud_->device_registry() : nullptr; }
  cloud::CloudService* service() { return cloud_ ? cloud_->service() : nullptr; }

 private:
  CloudFixtureOptions options_;
  std::vector<std::string> tokens_;
  std::string tokens_text_;
  std::unique_ptr<cloud::Cloud> cloud_;
  int port_ = 0;
};

// A valid uplink batch (4 samples in the sample codec, compress/uplink_codec.h) whose payload
// is a deterministic function of (device, sequence, size), at most about `bytes` long. Its samples
// have a 32-wide token grid of `grid` tokens (at least the kept ones) and feature width 32.
inline v1::UplinkBatch MakeBatch(int device, uint64_t seq, size_t bytes = 2048) {
  constexpr uint32_t kSamples = 4, kDim = 32;
  const uint32_t kept =
      static_cast<uint32_t>(std::clamp<size_t>(bytes / (kSamples * kDim * 2), 1, 4096));
  uint64_t x = (static_cast<uint64_t>(device) << 40) ^ (seq * 0x9E3779B97F4A7C15ull) ^ 1;
  const auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  std::vector<compress::UplinkSample> samples(kSamples);
  for (uint32_t i = 0; i < kSamples; ++i) {
    compress::UplinkSample& s = samples[i];
    s.sample_id = seq * kSamples + i;
    s.model_version = 1;
    s.grid_tokens = std::max<uint32_t>(kept, 64);
    s.feature_dim = kDim;
    for (uint32_t k = 0; k < kept; ++k) s.kept_indices.push_back(static_cast<uint16_t>(k));
    s.prompt_tokens = {1, static_cast<uint32_t>(2 + i), 3};
    s.answer_tokens = {4};
    s.features.resize(size_t{kept} * kDim);
    for (float& f : s.features) f = static_cast<float>(next() % 2001) / 1000.0f - 1.0f;
  }
  v1::UplinkBatch b;
  b.set_sequence(seq);
  b.set_model_version(1);
  b.set_sample_count(kSamples);
  b.set_codec_version(1);
  b.set_payload(
      std::move(compress::EncodeUplinkBatch(samples, compress::FeaturePrecision::kFp16)).value());
  return b;
}

// A batch of 4 samples that fits a model's SampleSpec (its token grid, feature width and
// vocabulary): half the tokens kept, random features, one-token answers. Deterministic in
// (device, sequence).
inline v1::UplinkBatch MakeModelBatch(const cloud::SampleSpec& spec, int device,
                                      uint64_t sequence) {
  std::mt19937_64 rng(device * 1000003ull + sequence);
  std::normal_distribution<float> normal;
  std::vector<compress::UplinkSample> samples(4);
  for (size_t i = 0; i < samples.size(); ++i) {
    compress::UplinkSample& s = samples[i];
    s.sample_id = sequence * 10 + i;
    s.grid_tokens = spec.grid_tokens;
    s.feature_dim = spec.feature_dim;
    for (uint32_t k = 0; k < spec.grid_tokens; k += 2) s.kept_indices.push_back(k);
    for (size_t k = 0; k < s.kept_indices.size() * spec.feature_dim; ++k) {
      s.features.push_back(normal(rng));
    }
    const uint32_t vocab = std::max<uint32_t>(spec.vocab_size, 16);
    s.prompt_tokens = {1, static_cast<uint32_t>(4 + rng() % (vocab - 8)), 3};
    s.answer_tokens = {static_cast<uint32_t>(4 + rng() % (vocab - 8))};
  }
  v1::UplinkBatch b;
  b.set_sequence(sequence);
  b.set_sample_count(static_cast<uint32_t>(samples.size()));
  b.set_codec_version(1);
  b.set_payload(
      std::move(compress::EncodeUplinkBatch(samples, compress::FeaturePrecision::kFp16)).value());
  return b;
}

}  // namespace cdcca::testing

#endif  // CDCCA_TESTS_TESTING_TRANSPORT_FIXTURE_H_
