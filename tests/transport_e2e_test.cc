// End-to-end tests of the device-cloud transport over a real loopback gRPC server.
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "cloud/uplink_check.h"
#include "compress/uplink_codec.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/impl/rpc_method.h"
#include "grpcpp/support/sync_stream.h"
#include "gtest/gtest.h"
#include "proto/wire.h"
#include "tests/testing/jpeg_header.h"
#ifdef CDCCA_TEST_POSTGRES
#include "tests/testing/postgres_server.h"
#endif
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_pki.h"
#include "tests/testing/transport_fixture.h"

namespace cdcca {
namespace {

using ::cdcca::testing::CloudFixture;
using ::cdcca::testing::CloudFixtureOptions;
using ::cdcca::testing::JpegHeader;
using ::cdcca::testing::MakeBatch;
using ::cdcca::testing::StatusIs;
using ::cdcca::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

CloudFixtureOptions Insecure(const TempDir& dir, int devices = 3) {
  CloudFixtureOptions o;
  o.data_dir = dir.path();
  o.devices = devices;
  o.server.listen_address = "127.0.0.1:0";
  o.server.insecure = true;
  return o;
}

device::CloudClientOptions FastRetries() {
  device::CloudClientOptions o;
  o.initial_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(200);
  return o;
}

v1::RegisterRequest Registration(uint64_t fingerprint = 0xF1F1, uint64_t vision = 0xE1E1) {
  v1::RegisterRequest r;
  r.set_model_fingerprint(fingerprint);
  r.set_vision_fingerprint(vision);
  r.mutable_capabilities()->add_delta_bit_widths(2);
  r.mutable_capabilities()->add_delta_bit_widths(4);
  r.mutable_capabilities()->set_update_byte_budget(1 << 20);
  return r;
}

TEST(TransportE2eTest, ConcurrentDevicesUplinkAndEverythingAckedSurvivesRestart) {
  TempDir dir;
  constexpr int kDevices = 5, kStreams = 8, kPerStream = 10;
  CloudFixture cloud(Insecure(dir, kDevices));
  ASSERT_OK(cloud.Start());
  std::vector<uint64_t> acked(kDevices, 0);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int d = 0; d < kDevices; ++d) {
    threads.emplace_back([&, d] {
      auto client = cloud.Client(d);
      auto reg = client->Register(Registration());
      if (!reg.ok() || reg->next_uplink_sequence() != 1) ++failures;
      uint64_t seq = 1;
      for (int s = 0; s < kStreams; ++s) {
        std::vector<v1::UplinkBatch> batches;
        for (int i = 0; i < kPerStream; ++i) batches.push_back(MakeBatch(d, seq++));
        auto ack = client->Uplink(batches);
        if (!ack.ok() || ack->has_error() || ack->stored() != kPerStream) {
          ++failures;
          continue;
        }
        acked[d] = ack->highest_durable_sequence();
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_OK(cloud.Restart());
  for (int d = 0; d < kDevices; ++d) {
    EXPECT_EQ(acked[d], static_cast<uint64_t>(kStreams * kPerStream));
    ASSERT_OK_AND_ASSIGN(auto records, cloud.samples()->Read(absl::StrCat("dev-", d), 1, 1000));
    ASSERT_EQ(records.size(), acked[d]);
    for (const auto& r : records) {
      EXPECT_EQ(r.batch().payload(), MakeBatch(d, r.batch().sequence()).payload());
    }
    // The restarted cloud tells the device where to continue.
    ASSERT_OK_AND_ASSIGN(auto reg, cloud.Client(d)->Register(Registration()));
    EXPECT_EQ(reg.next_uplink_sequence(), acked[d] + 1);
  }
}

TEST(TransportE2eTest, ResentBatchesAreAckedNotDuplicated) {
  TempDir dir;
  CloudFixture cloud(Insecure(dir));
  ASSERT_OK(cloud.Start());
  auto client = cloud.Client(0);
  ASSERT_OK(client->Register(Registration()));
  std::vector<v1::UplinkBatch> batches = {MakeBatch(0, 1), MakeBatch(0, 2), MakeBatch(0, 3)};
  ASSERT_OK(client->Uplink(batches));
  batches.push_back(MakeBatch(0, 4));
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack, client->Uplink(batches));
  EXPECT_EQ(ack.duplicates(), 3u);
  EXPECT_EQ(ack.stored(), 1u);
  EXPECT_EQ(ack.highest_durable_sequence(), 4u);
  EXPECT_EQ(cloud.samples()->Stats().records, 4u);
}

TEST(TransportE2eTest, BadBatchStopsTheStreamWithErrorAsDataAndKeepsWhatCameBefore) {
  TempDir dir;
  CloudFixture cloud(Insecure(dir));
  ASSERT_OK(cloud.Start());
  auto client = cloud.Client(0);
  v1::UplinkBatch no_samples = MakeBatch(0, 3);
  no_samples.set_sample_count(0);
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack,
                       client->Uplink({MakeBatch(0, 1), MakeBatch(0, 2), no_samples}));
  EXPECT_EQ(ack.highest_durable_sequence(), 2u);
  EXPECT_EQ(ack.error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ack.error().message(), HasSubstr("sample_count"));
  EXPECT_EQ(ack.rejected_sequence(), 3u);
  EXPECT_EQ(ack.refusal(), v1::UPLINK_REFUSAL_PERMANENT);
  EXPECT_EQ(ack.refusal_reason(), v1::REFUSAL_REASON_MALFORMED);

  ASSERT_OK_AND_ASSIGN(ack, client->Uplink({MakeBatch(0, 5)}));
  EXPECT_EQ(ack.error().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(ack.error().message(), HasSubstr("next expected is 3"));
  EXPECT_EQ(ack.refusal(), v1::UPLINK_REFUSAL_RESEQUENCE);
  EXPECT_EQ(ack.refusal_reason(), v1::REFUSAL_REASON_SEQUENCE_GAP);

  v1::UplinkBatch too_big = MakeBatch(0, 3);
  too_big.set_payload(std::string(wire::kMaxChunkBytes + 1, 'x'));
  EXPECT_THAT(client->Uplink({too_big}), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(TransportE2eTest, FetchUpdateCutMidStreamResumesAndVerifies) {
  TempDir dir;
  CloudFixtureOptions options = Insecure(dir);
  options.service.inject_cut_fetch_after_bytes = 1500 * 1024;
  CloudFixture cloud(options);
  ASSERT_OK(cloud.Start());
  std::string payload(3 * 1024 * 1024 + 12345, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 7 + (i >> 9));
  ASSERT_OK(cloud.updates()->PutUpdate("dev-0", 0, 1, 0xABCD, payload));
  auto client = cloud.Client(0, FastRetries());
  ASSERT_OK(client->Register(Registration()));
  ASSERT_OK_AND_ASSIGN(device::FetchedPayload fetched, client->FetchUpdate(0));
  EXPECT_TRUE(fetched.info.available());
  EXPECT_EQ(fetched.resumes, 1);
  EXPECT_EQ(fetched.bytes, payload);
  EXPECT_EQ(fetched.info.new_version(), 1u);
  EXPECT_EQ(fetched.info.state_digest(), 0xABCDu);

  // Current: nothing to fetch, said as data.
  ASSERT_OK_AND_ASSIGN(device::FetchedPayload none, client->FetchUpdate(1));
  EXPECT_FALSE(none.info.available());
  // Unknown base: resync.
  EXPECT_THAT(client->FetchUpdate(9),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("snapshot")));
}

TEST(TransportE2eTest, SnapshotAndReportAppliedDetectMismatch) {
  TempDir dir;
  CloudFixture cloud(Insecure(dir));
  ASSERT_OK(cloud.Start());
  ASSERT_OK(cloud.updates()->PutUpdate("dev-1", 0, 1, 77, "delta"));
  ASSERT_OK(cloud.updates()->PutSnapshot("dev-1", 1, 77, "full-state"));
  auto client = cloud.Client(1);
  ASSERT_OK(client->Register(Registration()));
  ASSERT_OK_AND_ASSIGN(v1::ReportAppliedReply good, client->ReportApplied(1, 77));
  EXPECT_TRUE(good.in_sync());
  ASSERT_OK_AND_ASSIGN(v1::ReportAppliedReply bad, client->ReportApplied(1, 78));
  EXPECT_FALSE(bad.in_sync());
  EXPECT_TRUE(bad.resync_required());
  EXPECT_EQ(bad.snapshot_version(), 1u);
  EXPECT_EQ(bad.error().code(), static_cast<int>(absl::StatusCode::kDataLoss));
  ASSERT_OK_AND_ASSIGN(device::FetchedPayload snap, client->FetchSnapshot(0));
  EXPECT_EQ(snap.bytes, "full-state");
  ASSERT_OK_AND_ASSIGN(auto record, cloud.registry()->Get("dev-1"));
  EXPECT_FALSE(record.in_sync());
}

// Version 0 is the pretrained base, whose digest a cloud with the model knows: a device that
// reports it with another digest (its base state damaged) is out of sync and told to resync,
// to the base while the cloud holds no snapshot of it, else to the newest snapshot. A cloud
// without the model (base digest unknown) takes any version-0 digest.
TEST(TransportE2eTest, ReportAppliedChecksVersionZeroAgainstTheBaseDigest) {
  TempDir dir;
  CloudFixtureOptions options = Insecure(dir);
  options.service.base_state_digest = 0xBA5E;
  CloudFixture cloud(options);
  ASSERT_OK(cloud.Start());
  auto client = cloud.Client(0);
  ASSERT_OK(client->Register(Registration()));
  ASSERT_OK_AND_ASSIGN(v1::ReportAppliedReply good, client->ReportApplied(0, 0xBA5E));
  EXPECT_TRUE(good.in_sync());
  EXPECT_FALSE(good.resync_required());
  ASSERT_OK_AND_ASSIGN(v1::ReportAppliedReply bad, client->ReportApplied(0, 0xDA3A6ED));
  EXPECT_FALSE(bad.in_sync());
  EXPECT_TRUE(bad.resync_required());
  EXPECT_EQ(bad.snapshot_version(), 0u);  // no snapshot: back to the base
  EXPECT_EQ(bad.error().code(), static_cast<int>(absl::StatusCode::kDataLoss));
  EXPECT_THAT(bad.error().message(), HasSubstr("000000000da3a6ed of version 0"));
  ASSERT_OK_AND_ASSIGN(auto record, cloud.registry()->Get("dev-0"));
  EXPECT_FALSE(record.in_sync());
  // Once the device has updates, version 0 is still the base, and a resync goes to the newest
  // snapshot.
  ASSERT_OK(cloud.updates()->PutUpdate("dev-0", 0, 1, 77, "delta"));
  ASSERT_OK(cloud.updates()->PutSnapshot("dev-0", 1, 77, "full-state"));
  ASSERT_OK_AND_ASSIGN(good, client->ReportApplied(0, 0xBA5E));
  EXPECT_TRUE(good.in_sync());
  ASSERT_OK_AND_ASSIGN(bad, client->ReportApplied(0, 0xDA3A6ED));
  EXPECT_FALSE(bad.in_sync());
  EXPECT_EQ(bad.snapshot_version(), 1u);

  TempDir other_dir;
  CloudFixture without_model(Insecure(other_dir));
  ASSERT_OK(without_model.Start());
  auto other = without_model.Client(0);
  ASSERT_OK(other->Register(Registration()));
  ASSERT_OK_AND_ASSIGN(v1::ReportAppliedReply any, other->ReportApplied(0, 0xDA3A6ED));
  EXPECT_TRUE(any.in_sync());
}

TEST(TransportE2eTest, WrongOrMissingTokenIsUnauthenticated) {
  TempDir dir;
  CloudFixture cloud(Insecure(dir));
  ASSERT_OK(cloud.Start());
  device::CloudClientOptions wrong;
  wrong.token = "not-the-right-token-at-all-000000";
  auto client = cloud.Client(0, wrong);
  EXPECT_THAT(client->Register(Registration()), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(client->Uplink({MakeBatch(0, 1)}), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_THAT(client->FetchUpdate(0), StatusIs(absl::StatusCode::kUnauthenticated));
  EXPECT_EQ(cloud.samples()->Stats().records, 0u);

  // No token at all, through a raw stub.
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", cloud.port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Cloud::NewStub(channel);
  grpc::ClientContext ctx;
  v1::RegisterRequest req = Registration();
  req.set_device_id("dev-0");
  v1::RegisterReply reply;
  grpc::Status s = stub->Register(&ctx, req, &reply);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("missing bearer token"));
}

TEST(TransportE2eTest, DeviceCannotTouchAnotherDevicesData) {
  TempDir dir;
  CloudFixture cloud(Insecure(dir));
  ASSERT_OK(cloud.Start());
  ASSERT_OK(cloud.updates()->PutUpdate("dev-1", 0, 1, 1, "secret update of dev-1"));
  ASSERT_OK(cloud.updates()->PutSnapshot("dev-1", 1, 1, "secret state of dev-1"));
  // dev-0's token, claiming to be dev-1.
  device::CloudClientOptions impostor;
  impostor.token = cloud.token(0);
  auto client = cloud.Client(1, impostor);
  EXPECT_THAT(client->FetchUpdate(0),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("belongs to device dev-0")));
  EXPECT_THAT(client->FetchSnapshot(0), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(client->Register(Registration()), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(client->ReportApplied(1, 1), StatusIs(absl::StatusCode::kPermissionDenied));
  // Uplink names no device: samples land under the token's own device, never dev-1's.
  ASSERT_OK(client->Uplink({MakeBatch(0, 1)}));
  EXPECT_EQ(cloud.samples()->HighestDurable("dev-1"), 0u);
  EXPECT_EQ(cloud.samples()->HighestDurable("dev-0"), 1u);
}

// A device whose vision tower is not the teacher's: the teacher could not read
// its tokens. Refused with both fingerprints named; a device that reports none is refused too.
TEST(TransportE2eTest, RegisterRefusesADeviceWhoseVisionTowerIsNotTheTeachers) {
  TempDir dir;
  CloudFixtureOptions options = Insecure(dir);
  options.service.expected_fingerprint = 0xF1F1;
  options.service.expected_vision_fingerprint = 0xE1E1;
  CloudFixture cloud(options);
  ASSERT_OK(cloud.Start());
  auto client = cloud.Client(0);
  EXPECT_THAT(client->Register(Registration(0xF1F1, 0xBEEF)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("vision tower 000000000000beef"),
                             HasSubstr("tokens of tower 000000000000e1e1"))));
  EXPECT_THAT(client->Register(Registration(0xF1F1, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("did not report its vision tower")));
  // Nothing was recorded for the refused device: the right tower registers from scratch.
  ASSERT_OK_AND_ASSIGN(v1::RegisterReply ok, client->Register(Registration()));
  EXPECT_EQ(ok.next_uplink_sequence(), 1u);
}

TEST(TransportE2eTest, InvalidRegistrationsAreRejectedWithActionableCodes) {
  TempDir dir;
  CloudFixtureOptions options = Insecure(dir);
  options.service.expected_fingerprint = 0xF1F1;
  CloudFixture cloud(options);
  ASSERT_OK(cloud.Start());
  auto client = cloud.Client(0);
  v1::RegisterRequest bad_bits = Registration();
  bad_bits.mutable_capabilities()->add_delta_bit_widths(5);
  EXPECT_THAT(client->Register(bad_bits),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("supported widths")));
  v1::RegisterRequest big_chunk = Registration();
  big_chunk.mutable_capabilities()->set_max_chunk_bytes(2u << 20);
  EXPECT_THAT(client->Register(big_chunk), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(client->Register(Registration(0xBAD)),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("fingerprint")));
  ASSERT_OK_AND_ASSIGN(v1::RegisterReply ok, client->Register(Registration()));
  EXPECT_EQ(ok.next_uplink_sequence(), 1u);
}

// Raw bytes through a generic stub: what a broken or hostile client could send.
grpc::Status RawUnary(int port, const std::string& method, const std::string& bytes,
                      const std::string& token) {
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer " + token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status result;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    result = std::move(s);
    done = true;
    cv.notify_one();
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  return result;
}

TEST(TransportE2eTest, OversizedTruncatedAndGarbageMessagesAreRejectedAndServerLives) {
  TempDir dir;
  CloudFixture cloud(Insecure(dir));
  ASSERT_OK(cloud.Start());
  const std::string method = "/cdcca.v1.Cloud/Register";
  // Garbage: not a protobuf at all. gRPC itself refuses a request that does not parse, before
  // any handler runs (gRPC 1.51 answers UNIMPLEMENTED, newer versions INTERNAL).
  const auto refused_by_grpc =
      ::testing::AnyOf(grpc::StatusCode::UNIMPLEMENTED, grpc::StatusCode::INTERNAL);
  grpc::Status garbage = RawUnary(cloud.port(), method, "\xff\xff\xff\xff\xff\x0f", cloud.token(0));
  EXPECT_THAT(garbage.error_code(), refused_by_grpc) << garbage.error_message();
  // Truncated: a valid request cut in the middle of a field.
  v1::RegisterRequest req = Registration();
  req.set_device_id("dev-0");
  req.set_agent_version(std::string(100, 'v'));
  std::string bytes = req.SerializeAsString();
  grpc::Status truncated =
      RawUnary(cloud.port(), method, bytes.substr(0, bytes.size() - 40), cloud.token(0));
  EXPECT_THAT(truncated.error_code(), refused_by_grpc) << truncated.error_message();
  EXPECT_EQ(cloud.registry()->size(), 0u);
  // Oversized: beyond the message limit set on the server.
  v1::RegisterRequest huge = req;
  huge.set_agent_version(std::string(wire::kMaxMessageBytes + 10, 'x'));
  grpc::Status oversized = RawUnary(cloud.port(), method, huge.SerializeAsString(), cloud.token(0));
  EXPECT_EQ(oversized.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << oversized.error_message();
  // Over our own field bound, under the message limit.
  v1::RegisterRequest long_version = req;
  long_version.set_agent_version(std::string(1000, 'x'));
  grpc::Status too_long =
      RawUnary(cloud.port(), method, long_version.SerializeAsString(), cloud.token(0));
  EXPECT_EQ(too_long.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Hostile device id.
  req.set_device_id("../../etc");
  grpc::Status bad_id = RawUnary(cloud.port(), method, req.SerializeAsString(), cloud.token(0));
  EXPECT_EQ(bad_id.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // Still serving.
  ASSERT_OK_AND_ASSIGN(v1::HealthReply health, cloud.Client(0)->Health());
  EXPECT_EQ(health.status(), v1::HealthReply::SERVING);
}

TEST(TransportE2eTest, TlsAndMutualTls) {
  TempDir dir;
  testing::TestPki pki;
  ASSERT_TRUE(testing::GenerateTestPki(dir.path(), &pki));
  CloudFixtureOptions options;
  options.data_dir = dir.path() + "/data";
  options.devices = 1;
  options.server.listen_address = "127.0.0.1:0";
  options.server.tls = {pki.server_cert, pki.server_key, pki.ca_cert, true};
  CloudFixture cloud(options);
  ASSERT_OK(cloud.Start());

  device::CloudClientOptions trusted;
  trusted.max_attempts = 1;
  trusted.tls.root_ca_path = pki.ca_cert;
  trusted.tls.cert_chain_path = pki.client_cert;
  trusted.tls.private_key_path = pki.client_key;
  auto good = cloud.Client(0, trusted);
  ASSERT_OK(good->Register(Registration()));
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack, good->Uplink({MakeBatch(0, 1)}));
  EXPECT_EQ(ack.highest_durable_sequence(), 1u);

  // Without a client certificate, mutual TLS refuses the connection.
  device::CloudClientOptions no_cert;
  no_cert.max_attempts = 1;
  no_cert.call_timeout = absl::Seconds(3);
  no_cert.tls.root_ca_path = pki.ca_cert;
  EXPECT_THAT(cloud.Client(0, no_cert)->Health(), StatusIs(absl::StatusCode::kUnavailable));
  // A client that does not trust the server's CA refuses it.
  device::CloudClientOptions untrusting;
  untrusting.max_attempts = 1;
  untrusting.call_timeout = absl::Seconds(3);
  untrusting.tls.cert_chain_path = pki.client_cert;
  untrusting.tls.private_key_path = pki.client_key;
  untrusting.tls.root_ca_path = pki.client_cert;  // not the CA
  EXPECT_THAT(cloud.Client(0, untrusting)->Health(), StatusIs(absl::StatusCode::kUnavailable));
}

// A client CA alone means mutual TLS: a device without a certificate is refused; only the
// explicit allow_token_only_devices lets one in on its token.
TEST(TransportE2eTest, ClientCaRequiresACertificateUnlessTokenOnlyDevicesAreAllowed) {
  TempDir dir;
  testing::TestPki pki;
  ASSERT_TRUE(testing::GenerateTestPki(dir.path(), &pki));
  device::CloudClientOptions no_cert;
  no_cert.max_attempts = 1;
  no_cert.call_timeout = absl::Seconds(3);
  no_cert.tls.root_ca_path = pki.ca_cert;
  device::CloudClientOptions with_cert = no_cert;
  with_cert.tls.cert_chain_path = pki.client_cert;
  with_cert.tls.private_key_path = pki.client_key;
  for (const bool allow : {false, true}) {
    SCOPED_TRACE(allow ? "allow_token_only_devices" : "client CA alone");
    CloudFixtureOptions options;
    options.data_dir = dir.path() + (allow ? "/allow" : "/strict");
    options.devices = 1;
    options.server.listen_address = "127.0.0.1:0";
    options.server.tls = {pki.server_cert, pki.server_key, pki.ca_cert,
                          /*require_client_cert=*/false, /*allow_token_only_devices=*/allow};
    CloudFixture cloud(options);
    ASSERT_OK(cloud.Start());
    auto token_only = cloud.Client(0, no_cert);
    if (allow) {
      ASSERT_OK(token_only->Register(Registration()));
    } else {
      EXPECT_THAT(token_only->Register(Registration()), StatusIs(absl::StatusCode::kUnavailable));
    }
    ASSERT_OK(cloud.Client(0, with_cert)->Register(Registration()));
  }
}

// Regression: with mutual TLS a certificate issued
// to one device carried another device's token and acted as that device.
TEST(TransportE2eTest, MutualTlsCertificateMustStandForTheTokensDevice) {
  TempDir dir;
  testing::TestPki pki;
  ASSERT_TRUE(testing::GenerateTestPki(dir.path(), &pki));  // client.pem: CN=dev-0
  ASSERT_TRUE(testing::IssueClientCert(dir.path(), "dev-1", "dev-1"));
  ASSERT_TRUE(testing::IssueClientCert(dir.path(), "lobby", "lobby-camera", "lobby.example"));
  CloudFixtureOptions options;
  options.data_dir = dir.path() + "/data";
  options.devices = 3;
  options.server.listen_address = "127.0.0.1:0";
  options.server.tls = {pki.server_cert, pki.server_key, pki.ca_cert, true};
  options.service.client_certificates = {{"lobby.example", "dev-2"}};
  CloudFixture cloud(options);
  ASSERT_OK(cloud.Start());
  const auto with_cert = [&](const std::string& name, const std::string& token) {
    device::CloudClientOptions o;
    o.max_attempts = 1;
    o.tls.root_ca_path = pki.ca_cert;
    o.tls.cert_chain_path = dir.file(name + ".pem");
    o.tls.private_key_path = dir.file(name + ".key");
    o.token = token;
    return o;
  };

  // dev-0's certificate with dev-1's token, claiming dev-1: refused on every call.
  auto impostor = cloud.Client(1, with_cert("client", cloud.token(1)));
  EXPECT_THAT(impostor->Register(Registration()),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("dev-0")));
  EXPECT_THAT(impostor->Uplink({MakeBatch(1, 1)}), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(impostor->FetchUpdate(0), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(impostor->ReportApplied(0, 0), StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(cloud.samples()->HighestDurable("dev-1"), 0u);

  // Each certificate with its own device's token works.
  auto dev0 = cloud.Client(0, with_cert("client", cloud.token(0)));
  ASSERT_OK(dev0->Register(Registration()));
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack0, dev0->Uplink({MakeBatch(0, 1)}));
  EXPECT_EQ(ack0.highest_durable_sequence(), 1u);
  auto dev1 = cloud.Client(1, with_cert("dev-1", cloud.token(1)));
  ASSERT_OK(dev1->Register(Registration()));
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack1, dev1->Uplink({MakeBatch(1, 1)}));
  EXPECT_EQ(ack1.highest_durable_sequence(), 1u);

  // A name mapped by the certificate map (a SAN here) stands for its device only.
  auto lobby = cloud.Client(2, with_cert("lobby", cloud.token(2)));
  ASSERT_OK(lobby->Register(Registration()));
  auto lobby_as_dev1 = cloud.Client(1, with_cert("lobby", cloud.token(1)));
  EXPECT_THAT(lobby_as_dev1->Register(Registration()),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("lobby.example")));
  // Health needs no token and no particular certificate.
  EXPECT_OK(impostor->Health());
}

// The model's sample shape for the ingest tests: MakeBatch's samples fit it.
CloudFixtureOptions Checked(const TempDir& dir) {
  CloudFixtureOptions o = Insecure(dir);
  o.service.sample_spec.grid_tokens = 64;
  o.service.sample_spec.feature_dim = 32;
  o.service.sample_spec.vocab_size = 100;
  o.service.sample_spec.max_prompt_tokens = 256;  // a Hugging Face pair's bound
  return o;
}

v1::UplinkBatch Encoded(uint64_t seq, const std::vector<compress::UplinkSample>& samples,
                        compress::FeaturePrecision precision = compress::FeaturePrecision::kFp16) {
  v1::UplinkBatch b;
  b.set_sequence(seq);
  b.set_sample_count(static_cast<uint32_t>(samples.size()));
  b.set_codec_version(1);
  compress::UplinkLimits roomy;
  roomy.max_body_bytes = 1ull << 30;
  b.set_payload(std::move(compress::EncodeUplinkBatch(samples, precision, roomy)).value());
  return b;
}

compress::UplinkSample Zeros(uint32_t grid, uint32_t dim, uint32_t kept) {
  compress::UplinkSample s;
  s.grid_tokens = grid;
  s.feature_dim = dim;
  for (uint32_t k = 0; k < kept; ++k) s.kept_indices.push_back(static_cast<uint16_t>(k));
  s.features.assign(size_t{kept} * dim, 0.0f);
  s.prompt_tokens = {1, 2};
  return s;
}

// Regression: batches that do not fit the model, that
// decompress to far more than they weigh, or whose header fields lie, were acked and stored,
// and then failed or bloated every job of their device.
TEST(TransportE2eTest, IngestRefusesBatchesThatDoNotFitTheModelAndNeverStoresThem) {
  TempDir dir;
  CloudFixture cloud(Checked(dir));
  ASSERT_OK(cloud.Start());
  auto client = cloud.Client(0);
  ASSERT_OK(client->Register(Registration()));
  ASSERT_OK(client->Uplink({MakeBatch(0, 1)}));

  // Every one is refused for good (the device drops it), with its reason.
  const auto refused = [&](const v1::UplinkBatch& batch, absl::string_view why,
                           v1::RefusalReason reason) {
    absl::StatusOr<v1::UplinkAck> ack = client->Uplink({batch});
    ASSERT_OK(ack);
    EXPECT_EQ(ack->error().code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << why;
    EXPECT_THAT(ack->error().message(), HasSubstr(std::string(why)));
    EXPECT_EQ(ack->rejected_sequence(), batch.sequence());
    EXPECT_EQ(ack->refusal(), v1::UPLINK_REFUSAL_PERMANENT) << why;
    EXPECT_EQ(wire::RefusalReasonName(ack->refusal_reason()), wire::RefusalReasonName(reason))
        << why;
    EXPECT_EQ(ack->stored(), 0u);
    EXPECT_EQ(ack->highest_durable_sequence(), 1u);
  };
  // Poison: well-formed batches whose grid is not the model's, larger or smaller.
  refused(Encoded(2, {Zeros(128, 32, 4)}), "grid 128x32 but the cloud's model expects 64x32",
          v1::REFUSAL_REASON_SHAPE);
  refused(Encoded(2, {Zeros(32, 32, 4)}), "grid 32x32 but the cloud's model expects 64x32",
          v1::REFUSAL_REASON_SHAPE);
  // Bomb: 16 MiB of zeros in a few KiB, refused from its header before decompression.
  const v1::UplinkBatch bomb = Encoded(2, {Zeros(4096, 2048, 4096)});
  EXPECT_LT(bomb.payload().size(), 64u << 10);
  refused(bomb, "max_body_bytes", v1::REFUSAL_REASON_TOO_LARGE);
  // Many empty samples, correctly shaped: over the per-batch sample bound.
  refused(Encoded(2, std::vector<compress::UplinkSample>(2000, Zeros(64, 32, 0))),
          "sample count 2000", v1::REFUSAL_REASON_TOO_LARGE);
  // Token ids outside the model's vocabulary.
  compress::UplinkSample bad_token = Zeros(64, 32, 1);
  bad_token.prompt_tokens = {1, 100};
  refused(Encoded(2, {bad_token}), "vocabulary", v1::REFUSAL_REASON_VOCABULARY);
  // A question longer than the model takes (the codec carries up to 512 tokens).
  compress::UplinkSample long_question = Zeros(64, 32, 1);
  long_question.prompt_tokens.assign(300, 1);
  refused(Encoded(2, {long_question}), "a prompt of 300 tokens; this cloud takes 256 at most",
          v1::REFUSAL_REASON_PROMPT_TOO_LONG);
  // sample_count is derived from the payload, never trusted.
  v1::UplinkBatch lying = MakeBatch(0, 2);
  lying.set_sample_count(400);
  refused(lying, "sample_count 400 but the payload holds 4", v1::REFUSAL_REASON_SAMPLE_COUNT);
  // An unknown codec version.
  v1::UplinkBatch future = MakeBatch(0, 2);
  future.set_codec_version(2);
  refused(future, "codec_version 2 is not supported", v1::REFUSAL_REASON_CODEC);
  // Bytes that are no payload at all.
  v1::UplinkBatch junk = MakeBatch(0, 2);
  junk.set_payload("not a payload");
  refused(junk, "payload", v1::REFUSAL_REASON_DAMAGED);
  // A frame (the jpeg uplink) to a cdcca family's cloud, which takes tokens only.
  compress::UplinkSample frame = Zeros(64, 32, 2);
  frame.features.clear();
  frame.frame = JpegHeader(64, 64);
  refused(Encoded(2, {frame}, compress::FeaturePrecision::kJpeg), "takes visual tokens only",
          v1::REFUSAL_REASON_FRAME);

  // None was stored, and each is counted by its reason.
  EXPECT_EQ(cloud.samples()->Stats().records, 1u);
  const cloud::DeviceRefusals counts = cloud.service()->Refusals()["dev-0"];
  EXPECT_THAT(counts.refused,
              ::testing::UnorderedElementsAre(
                  ::testing::Pair("shape", 2), ::testing::Pair("too_large", 2),
                  ::testing::Pair("vocabulary", 1), ::testing::Pair("prompt_too_long", 1),
                  ::testing::Pair("sample_count", 1), ::testing::Pair("codec", 1),
                  ::testing::Pair("damaged", 1), ::testing::Pair("frame", 1)));
  // The device's next valid batch takes sequence 2, and reports what it dropped: counted, not
  // stored with the batch.
  v1::UplinkBatch next = MakeBatch(0, 2);
  v1::DroppedBatch* report = next.add_dropped();
  report->set_sequence(2);
  report->set_reason(v1::REFUSAL_REASON_PROMPT_TOO_LONG);
  report->set_sample_count(1);
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ok, client->Uplink({next}));
  EXPECT_EQ(ok.stored(), 1u);
  EXPECT_EQ(ok.highest_durable_sequence(), 2u);
  EXPECT_EQ(cloud.samples()->SampleCount("dev-0", 1, 2), 8u);
  EXPECT_THAT(cloud.service()->Refusals()["dev-0"].dropped,
              ::testing::ElementsAre(::testing::Pair("prompt_too_long", 1)));
  ASSERT_OK_AND_ASSIGN(std::vector<store::v1::SampleRecord> stored,
                       cloud.samples()->Read("dev-0", 2, 1));
  ASSERT_EQ(stored.size(), 1u);
  EXPECT_EQ(stored[0].batch().dropped_size(), 0);
}

// A cloud that takes frames (a Hugging Face pair's, SampleSpec::frame_width) checks the size a
// frame declares before anything decodes it.
TEST(TransportE2eTest, IngestTakesFramesOfTheTowersInputSizeOnly) {
  cloud::SampleSpec spec;
  spec.grid_tokens = 64;
  spec.feature_dim = 32;
  spec.frame_width = 336;
  spec.frame_height = 336;
  compress::UplinkSample frame = Zeros(64, 32, 2);
  frame.features.clear();
  frame.frame = JpegHeader(336, 336);
  ASSERT_OK_AND_ASSIGN(
      cloud::CheckedBatch ok,
      cloud::CheckUplinkBatch(Encoded(1, {frame}, compress::FeaturePrecision::kJpeg), spec));
  EXPECT_EQ(ok.samples[0].frame, frame.frame);
  frame.frame = JpegHeader(4096, 336);
  EXPECT_THAT(cloud::CheckUplinkBatch(Encoded(1, {frame}, compress::FeaturePrecision::kJpeg), spec)
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a 4096x336 frame, but the tower takes 336x336")));
  // Progressive frames (many scans, a decoder's worst case) and frames far larger than their
  // pixels are refused too.
  frame.frame = JpegHeader(336, 336, 3, 0xC2);
  EXPECT_THAT(cloud::CheckUplinkBatch(Encoded(1, {frame}, compress::FeaturePrecision::kJpeg), spec)
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("baseline only")));
  frame.frame = JpegHeader(336, 336) + std::string(336 * 336 * 3 + (64 << 10), '\0');
  EXPECT_THAT(cloud::CheckUplinkBatch(Encoded(1, {frame}, compress::FeaturePrecision::kJpeg), spec)
                  .status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("for its size")));
}

// Regression: bytes that are not an UplinkBatch ended the
// stream OK with stored=0, as if the client had simply closed it.
TEST(TransportE2eTest, MalformedUplinkMessageIsInvalidArgument) {
  TempDir dir;
  CloudFixture cloud(Insecure(dir));
  ASSERT_OK(cloud.Start());
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", cloud.port()),
                                     grpc::InsecureChannelCredentials());
  grpc::internal::RpcMethod method("/cdcca.v1.Cloud/Uplink",
                                   grpc::internal::RpcMethod::CLIENT_STREAMING, channel);
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", "Bearer " + cloud.token(0));
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::ByteBuffer response;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), method, &ctx,
                                                                    &response));
  grpc::Slice good(MakeBatch(0, 1).SerializeAsString());
  writer->Write(grpc::ByteBuffer(&good, 1));
  grpc::Slice garbage(std::string("\xff\xff\xff\xff\xff\x0f", 6));
  writer->Write(grpc::ByteBuffer(&garbage, 1));
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("does not parse"));
  EXPECT_EQ(cloud.samples()->HighestDurable("dev-0"), 1u);
}

// Regression: one device could fill the disk.
TEST(TransportE2eTest, DeviceQuotaIsResourceExhaustedAndLeavesOtherDevicesAlone) {
  TempDir dir;
  CloudFixtureOptions options = Insecure(dir);
  options.device_quota_bytes = 10000;
  CloudFixture cloud(options);
  ASSERT_OK(cloud.Start());
  auto client = cloud.Client(0);
  std::vector<v1::UplinkBatch> batches;
  for (uint64_t seq = 1; seq <= 20; ++seq) batches.push_back(MakeBatch(0, seq));
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack, client->Uplink(batches));
  EXPECT_EQ(ack.error().code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(ack.error().message(), HasSubstr("quota of 10000 bytes"));
  EXPECT_EQ(ack.refusal(), v1::UPLINK_REFUSAL_TRANSIENT);
  EXPECT_EQ(ack.refusal_reason(), v1::REFUSAL_REASON_QUOTA);
  EXPECT_GT(ack.stored(), 0u);
  EXPECT_LT(ack.stored(), 20u);
  EXPECT_EQ(ack.rejected_sequence(), ack.stored() + 1);
  EXPECT_LE(cloud.samples()->DeviceBytes("dev-0"), 10000u);
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck other, cloud.Client(1)->Uplink({MakeBatch(1, 1)}));
  EXPECT_EQ(other.stored(), 1u);
  // The quota holds across a restart (it counts what the log holds).
  ASSERT_OK(cloud.Restart());
  ASSERT_OK_AND_ASSIGN(ack, cloud.Client(0)->Uplink({MakeBatch(0, ack.stored() + 1)}));
  EXPECT_EQ(ack.error().code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
}

#ifdef CDCCA_TEST_POSTGRES
// The same quota on the shared store: a front on a real PostgreSQL refuses a device past
// --device_quota_mib with the same transient QUOTA refusal, counting what the database holds.
TEST(TransportE2eTest, DeviceQuotaOnPostgresIsTheSameTransientRefusal) {
  ASSERT_OK_AND_ASSIGN(const std::string conninfo, testing::CreateSharedPostgresDatabase());
  TempDir dir;
  CloudFixtureOptions options = Insecure(dir);
  options.device_quota_bytes = 10000;
  options.store = conninfo;
  CloudFixture cloud(options);
  ASSERT_OK(cloud.Start());
  std::vector<v1::UplinkBatch> batches;
  for (uint64_t seq = 1; seq <= 20; ++seq) batches.push_back(MakeBatch(0, seq));
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack, cloud.Client(0)->Uplink(batches));
  EXPECT_EQ(ack.error().code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(ack.error().message(), HasSubstr("quota of 10000 bytes"));
  EXPECT_EQ(ack.refusal(), v1::UPLINK_REFUSAL_TRANSIENT);
  EXPECT_EQ(ack.refusal_reason(), v1::REFUSAL_REASON_QUOTA);
  EXPECT_GT(ack.stored(), 0u);
  EXPECT_LT(ack.stored(), 20u);
  EXPECT_EQ(ack.rejected_sequence(), ack.stored() + 1);
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck other, cloud.Client(1)->Uplink({MakeBatch(1, 1)}));
  EXPECT_EQ(other.stored(), 1u);
  // Another front on the same database (here: the restarted one) holds it too.
  ASSERT_OK(cloud.Restart());
  ASSERT_OK_AND_ASSIGN(ack, cloud.Client(0)->Uplink({MakeBatch(0, ack.stored() + 1)}));
  EXPECT_EQ(ack.error().code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(ack.refusal_reason(), v1::REFUSAL_REASON_QUOTA);
}
#endif

TEST(TransportE2eTest, ClientRetriesWhileTheCloudIsAway) {
  TempDir dir;
  CloudFixture cloud(Insecure(dir));
  ASSERT_OK(cloud.Start());
  auto client = cloud.Client(0, FastRetries());
  ASSERT_OK(client->Register(Registration()));
  cloud.Stop();
  std::thread restarter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    ASSERT_OK(cloud.Start());
  });
  device::CloudClientOptions patient = FastRetries();
  patient.max_attempts = 40;
  auto waiting = cloud.Client(0, patient);
  ASSERT_OK_AND_ASSIGN(v1::UplinkAck ack, waiting->Uplink({MakeBatch(0, 1)}));
  restarter.join();
  EXPECT_EQ(ack.highest_durable_sequence(), 1u);
  EXPECT_GT(waiting->stats().retries, 0u);
}

}  // namespace
}  // namespace cdcca
