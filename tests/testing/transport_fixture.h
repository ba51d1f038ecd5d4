// An in-process cloud (stores + service + gRPC server on a loopback port) and helpers to
// make device clients for it, for end-to-end transport tests and benchmarks.
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
};

// Owns one running cloud. Restart() shuts everything down and opens it again on the same
// data directory and port, as a process restart would.
class CloudFixture {
 public:
  explicit CloudFixture(CloudFixtureOptions options) : options_(std::move(options)) {
    std::mt19937_64 rng(std::random_device{}());
    std::string text;
    for (int i = 0; i < options_.devices; ++i) {
      tokens_.push_back(RandomToken(rng));
      absl::StrAppend(&text, "dev-", i, " ", tokens_.back(), "\n");
    }
    auth_ = std::move(cloud::TokenAuthenticator::FromString(text, "test tokens")).value();
  }
  ~CloudFixture() { Stop(); }

  absl::Status Start() {
    auto registry = cloud::DeviceRegistry::Open(options_.data_dir + "/registry");
    if (!registry.ok()) return registry.status();
    registry_ = std::move(*registry);
    cloud::SampleStoreOptions so;
    so.dir = options_.data_dir + "/samples";
    so.max_device_bytes = options_.device_quota_bytes;
    auto samples = cloud::SampleStore::Open(so);
    if (!samples.ok()) return samples.status();
    samples_ = std::move(*samples);
    auto updates = cloud::UpdateStore::Open({options_.data_dir + "/updates", 16});
    if (!updates.ok()) return updates.status();
    updates_ = std::move(*updates);
    service_ =
        std::make_unique<cloud::CloudService>(options_.service, auth_.get(), registry_.get(),
                                              samples_.get(), updates_.get(), options_.observer);
    cloud::ServerOptions server_options = options_.server;
    if (port_ != 0) server_options.listen_address = absl::StrCat("127.0.0.1:", port_);
    auto server = cloud::CloudServer::Start(server_options, service_.get());
    if (!server.ok()) return server.status();
    server_ = std::move(*server);
    port_ = server_->port();
    return absl::OkStatus();
  }

  void Stop() {
    if (server_) server_->Shutdown(absl::Milliseconds(200));
    server_.reset();
    service_.reset();
    samples_.reset();
    updates_.reset();
    registry_.reset();
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
  cloud::SampleStore* samples() { return samples_.get(); }
  cloud::UpdateStore* updates() { return updates_.get(); }
  cloud::DeviceRegistry* registry() { return registry_.get(); }
  cloud::CloudService* service() { return service_.get(); }

 private:
  CloudFixtureOptions options_;
  std::vector<std::string> tokens_;
  std::unique_ptr<cloud::TokenAuthenticator> auth_;
  std::unique_ptr<cloud::DeviceRegistry> registry_;
  std::unique_ptr<cloud::SampleStore> samples_;
  std::unique_ptr<cloud::UpdateStore> updates_;
  std::unique_ptr<cloud::CloudService> service_;
  std::unique_ptr<cloud::CloudServer> server_;
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
