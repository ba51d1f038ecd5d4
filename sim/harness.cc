#include "sim/harness.h"

#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cloud/cloud_server.h"
#include "cloud/cloud_service.h"
#include "cloud/device_registry.h"
#include "cloud/sample_store.h"
#include "cloud/token_authenticator.h"
#include "cloud/trainer.h"
#include "cloud/update_store.h"
#include "compress/uplink_codec.h"
#include "datasets/domain.h"
#include "datasets/fashion_mnist.h"
#include "datasets/language.h"
#include "datasets/metrics.h"
#include "device/agent.h"
#include "device/cloud_client.h"
#include "device/inference_runtime.h"
#include "distill/learner.h"
#include "distill/model/checkpoint.h"
#include "distill/model/safetensors.h"
#include "distill/model/trainable.h"
#include "sim/link_emulator.h"

namespace cdcca::sim {

namespace {

namespace ds = datasets;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

enum class MethodKind { kSourceOnly, kDevice, kCloud };

struct MethodPlan {
  MethodKind kind = MethodKind::kCloud;
  std::string learner;  // distill learner name
  device::UtsOptions uts;
};

absl::StatusOr<MethodPlan> PlanFor(const std::string& full_name, const Experiment& e) {
  const MethodName name = ParseMethodName(full_name);
  const std::string& method = name.base;
  MethodPlan p;
  p.uts.keep_fraction = e.uts.keep_fraction;
  p.uts.token_ratio = e.uts.token_ratio;
  p.uts.mc_passes = e.uts.mc_passes;
  p.uts.dropout_p = e.uts.dropout_p;
  p.uts.precision = e.uts.precision == "int8" ? compress::FeaturePrecision::kInt8
                                              : compress::FeaturePrecision::kFp16;
  // Validated when the experiment was read (Experiment's uts.score).
  p.uts.score = device::ParseTokenScore(e.uts.score).value_or(device::UtsOptions().score);
  if (e.uts.keep_fraction >= 1) {  // keep every sample: a fixed threshold below any entropy
    p.uts.keep_fraction = 0;
    p.uts.entropy_alpha = -1;
  }
  if (method == "source-only") {
    p.kind = MethodKind::kSourceOnly;
  } else if (method == "tent" || method == "cotta") {
    p.kind = MethodKind::kDevice;
    p.learner = method;
  } else if (method == "pl" || method == "pkd" || method == "cwd" || method == "akd") {
    p.learner = method;
  } else if (method == "cd-cca") {
    p.learner = "akd";
  } else if (method == "akd-all-tokens") {
    p.learner = "akd";
    p.uts.token_ratio = 1.0f;
  } else if (method == "akd-no-uts") {
    p.learner = "akd";
    p.uts.keep_fraction = 0;
    p.uts.entropy_alpha = -1;
    p.uts.token_ratio = 1.0f;
  } else if (method == "akd-random") {
    p.learner = "akd";
    p.uts.random_tokens = true;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown method ", method));
  }
  if (name.token_ratio < 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad token ratio in method ", full_name));
  }
  if (name.token_ratio > 0) p.uts.token_ratio = name.token_ratio;
  return p;
}

// The generator spec of a round's domain, and its label.
ds::DomainSpec DomainSpecFor(const RoundDomain& d, int round, ds::Split split) {
  if (d.continual) return ds::ContinualSchedule(round + 1, split)[static_cast<size_t>(round)];
  const ds::ImageShift shift = ds::ImageShiftFromName(d.shift).value_or(ds::ImageShift::kNone);
  if (d.text && shift != ds::ImageShift::kNone) {
    return ds::MultimodalShiftDomain(shift, d.severity, split);
  }
  if (d.text) return ds::TextShiftDomain(split);
  if (shift == ds::ImageShift::kNone) return ds::StudentSourceDomain(split);
  return ds::ImageShiftDomain(shift, d.severity, split);
}

std::string DomainLabel(const Experiment& e, const RoundDomain& d, int round) {
  if (e.captioning()) return "in+near+out";
  if (d.continual) return absl::StrCat("continual-", round + 1);
  std::string s = d.shift == "none" ? "clean" : absl::StrCat(d.shift, "-", d.severity);
  if (d.text) absl::StrAppend(&s, "+text");
  return s;
}

// The generators of a round: one for a VQA domain, or one per caption category (in,
// near, out) for a caption experiment.
absl::StatusOr<std::vector<ds::SampleGenerator>> Generators(const Experiment& e,
                                                            const RoundDomain& d, int round,
                                                            const ds::ImageSet& images,
                                                            ds::Split split, uint64_t seed) {
  std::vector<ds::DomainSpec> specs;
  if (e.captioning()) {
    for (ds::CategoryDomain c :
         {ds::CategoryDomain::kIn, ds::CategoryDomain::kNear, ds::CategoryDomain::kOut}) {
      specs.push_back(ds::CategoryShiftDomain(c, split));
    }
  } else {
    specs.push_back(DomainSpecFor(d, round, split));
  }
  std::vector<ds::SampleGenerator> gens;
  for (ds::DomainSpec& spec : specs) {
    auto gen = ds::SampleGenerator::Create(&images, std::move(spec), seed);
    if (!gen.ok()) return gen.status();
    gens.push_back(*std::move(gen));
  }
  return gens;
}

// One frame per scene, the generators taking turns. VQA: a question about each scene in
// turn; captions: the caption prompt.
std::vector<device::Frame> StreamFrames(const std::vector<ds::SampleGenerator>& gens, bool captions,
                                        int n) {
  std::vector<device::Frame> frames;
  frames.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const size_t g = static_cast<size_t>(i) % gens.size();
    ds::Sample s = gens[g].Generate(static_cast<uint64_t>(i) / gens.size());
    if (captions) {
      frames.push_back({std::move(s.image), std::string(ds::CaptionPrompt())});
    } else {
      const ds::VqaItem& q = s.questions[static_cast<size_t>(i) % s.questions.size()];
      frames.push_back({std::move(s.image), q.question});
    }
  }
  return frames;
}

// Answers `frames` in chunks of 64.
absl::StatusOr<std::vector<device::AnswerResult>> AnswerAll(
    device::InferenceRuntime& runtime, const std::vector<device::Frame>& frames) {
  std::vector<device::AnswerResult> out;
  const size_t chunk = 64;
  for (size_t b = 0; b < frames.size(); b += chunk) {
    std::vector<device::Frame> part(
        frames.begin() + static_cast<long>(b),
        frames.begin() + static_cast<long>(std::min(frames.size(), b + chunk)));
    absl::StatusOr<std::vector<device::AnswerResult>> answers = runtime.Answer(part);
    if (!answers.ok()) return answers.status();
    for (device::AnswerResult& a : *answers) out.push_back(std::move(a));
  }
  return out;
}

struct Score {
  double da = 0, mc = 0;
  int questions = 0;
  std::vector<float> question_da;
  std::vector<DeviceRound::CaptionScore> captions;
};

// DA and MC accuracy of the runtime on every question of `scenes` scenes.
absl::StatusOr<Score> EvaluateVqa(device::InferenceRuntime& runtime, const ds::SampleGenerator& gen,
                                  int scenes) {
  std::vector<device::Frame> frames;
  std::vector<ds::VqaItem> items;
  for (int i = 0; i < scenes; ++i) {
    ds::Sample s = gen.Generate(static_cast<uint64_t>(i));
    for (const ds::VqaItem& q : s.questions) {
      frames.push_back({s.image, q.question});
      items.push_back(q);
    }
  }
  absl::StatusOr<std::vector<device::AnswerResult>> answers = AnswerAll(runtime, frames);
  if (!answers.ok()) return answers.status();
  Score score;
  for (size_t i = 0; i < answers->size(); ++i) {
    const ds::VqaItem& q = items[i];
    const double da = ds::VqaAccuracy((*answers)[i].text, q.direct_answers);
    score.da += da;
    score.question_da.push_back(static_cast<float>(da));
    score.mc += ds::AokvqaMcAccuracy((*answers)[i].text, q.choices, q.correct_choice);
  }
  score.questions = static_cast<int>(items.size());
  if (score.questions > 0) {
    score.da = 100.0 * score.da / score.questions;
    score.mc = 100.0 * score.mc / score.questions;
  }
  return score;
}

// Captions of `scenes` scenes per category generator (in, near, out), scored per category
// and over all of them (DeviceRound::captions).
absl::StatusOr<Score> EvaluateCaptions(device::InferenceRuntime& runtime,
                                       const std::vector<ds::SampleGenerator>& gens, int scenes) {
  static constexpr const char* kNames[] = {"in-domain", "near-domain", "out-domain"};
  std::vector<std::string> all_cands;
  std::vector<std::vector<std::string>> all_refs;
  Score score;
  for (size_t g = 0; g < gens.size(); ++g) {
    std::vector<device::Frame> frames;
    std::vector<std::vector<std::string>> refs;
    for (int i = 0; i < scenes; ++i) {
      ds::Sample s = gens[g].Generate(static_cast<uint64_t>(i));
      frames.push_back({std::move(s.image), std::string(ds::CaptionPrompt())});
      refs.push_back(std::move(s.captions));
    }
    absl::StatusOr<std::vector<device::AnswerResult>> answers = AnswerAll(runtime, frames);
    if (!answers.ok()) return answers.status();
    std::vector<std::string> cands;
    for (const device::AnswerResult& a : *answers) cands.push_back(a.text);
    const ds::CaptionScores c = ds::ScoreCaptions(cands, refs);
    score.captions.push_back({g < 3 ? kNames[g] : "other", 100 * c.bleu[3], 100 * c.cider,
                              static_cast<int>(cands.size())});
    all_cands.insert(all_cands.end(), cands.begin(), cands.end());
    all_refs.insert(all_refs.end(), refs.begin(), refs.end());
  }
  const ds::CaptionScores all = ds::ScoreCaptions(all_cands, all_refs);
  score.captions.push_back(
      {"all", 100 * all.bleu[3], 100 * all.cider, static_cast<int>(all_cands.size())});
  score.da = 100 * all.cider;
  score.mc = 100 * all.bleu[3];
  score.questions = static_cast<int>(all_cands.size());
  for (double v : all.cider_per_item) score.question_da.push_back(static_cast<float>(v));
  return score;
}

absl::StatusOr<Score> Evaluate(const Experiment& e, device::InferenceRuntime& runtime,
                               const std::vector<ds::SampleGenerator>& gens) {
  if (e.captioning()) return EvaluateCaptions(runtime, gens, e.eval_scenes);
  return EvaluateVqa(runtime, gens.front(), e.eval_scenes);
}

// Copies an evaluation into the round's record.
void Record(Score score, DeviceRound& r) {
  r.da = score.da;
  r.mc = score.mc;
  r.questions = score.questions;
  r.question_da = std::move(score.question_da);
  r.captions = std::move(score.captions);
}

compress::UplinkSample AllTokensSample(const device::AnswerResult& a, uint64_t id) {
  compress::UplinkSample s;
  s.sample_id = id;
  s.entropy = a.entropy;
  s.grid_tokens = static_cast<uint32_t>(a.visual.tokens);
  s.feature_dim = static_cast<uint32_t>(a.visual.dim);
  for (int t = 0; t < a.visual.tokens; ++t) s.kept_indices.push_back(static_cast<uint16_t>(t));
  s.features = a.visual.values;
  s.prompt_tokens = a.prompt_ids;
  s.answer_tokens = a.answer_ids;
  return s;
}

std::string RandomToken(std::mt19937_64& rng) {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::string t(32, 'x');
  for (char& c : t) c = kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return t;
}

// Everything one method's run owns.
struct Device {
  std::unique_ptr<device::InferenceRuntime> runtime;
  std::unique_ptr<LinkEmulator> link;
  std::unique_ptr<device::CloudClient> client;
  std::unique_ptr<device::DeviceAgent> agent;
  // Device-side adaptation (tent, cotta).
  model::Mllm student{nullptr};
  std::unique_ptr<distill::Learner> learner;
};

struct Cloud {
  std::unique_ptr<cloud::TokenAuthenticator> auth;
  std::unique_ptr<cloud::DeviceRegistry> registry;
  std::unique_ptr<cloud::SampleStore> samples;
  std::unique_ptr<cloud::UpdateStore> updates;
  std::unique_ptr<cloud::PerDeviceStrategy> strategy;
  std::unique_ptr<cloud::CloudService> service;
  std::unique_ptr<cloud::CloudServer> server;
  std::vector<std::string> tokens;

  ~Cloud() {
    if (server) server->Shutdown(absl::Milliseconds(200));
  }
};

std::string DeviceId(int i) { return absl::StrCat("device-", i); }

absl::Status StartCloud(const Experiment& e, const MethodPlan& plan, const std::string& dir,
                        std::mt19937_64& rng, Cloud& c) {
  std::string text;
  for (int i = 0; i < e.devices; ++i) {
    c.tokens.push_back(RandomToken(rng));
    absl::StrAppend(&text, DeviceId(i), " ", c.tokens.back(), "\n");
  }
  auto auth = cloud::TokenAuthenticator::FromString(text, "harness tokens");
  if (!auth.ok()) return auth.status();
  c.auth = std::move(*auth);
  auto registry = cloud::DeviceRegistry::Open(dir + "/registry");
  if (!registry.ok()) return registry.status();
  c.registry = std::move(*registry);
  cloud::SampleStoreOptions so;
  so.dir = dir + "/samples";
  auto samples = cloud::SampleStore::Open(so);
  if (!samples.ok()) return samples.status();
  c.samples = std::move(*samples);
  auto updates = cloud::UpdateStore::Open({dir + "/updates", 16});
  if (!updates.ok()) return updates.status();
  c.updates = std::move(*updates);
  cloud::PerDeviceStrategyOptions po;
  po.checkpoint_dir = e.checkpoint;
  po.student_precision = e.precision;
  po.state_dir = dir + "/mirrors";
  po.learner = plan.learner;
  if (plan.learner == "akd" && fs::exists(e.distill_config)) po.distill_config = e.distill_config;
  po.max_steps = e.job.max_steps;
  po.batch_size = e.job.batch_size;
  po.max_answer_tokens = e.AnswerTokens();
  po.torch_threads = e.threads;
  po.bits_per_param = e.downlink_bits_per_param;
  po.max_batches_per_job = 1u << 20;  // a round's job trains on everything uplinked
  auto strategy =
      cloud::PerDeviceStrategy::Create(po, c.samples.get(), c.updates.get(), c.registry.get());
  if (!strategy.ok()) return strategy.status();
  c.strategy = std::move(*strategy);
  if (absl::Status s = c.strategy->Recover(); !s.ok()) return s;
  cloud::CloudServiceOptions svc;
  svc.expected_fingerprint = c.strategy->BaseFingerprint();
  c.service = std::make_unique<cloud::CloudService>(svc, c.auth.get(), c.registry.get(),
                                                    c.samples.get(), c.updates.get(), nullptr);
  cloud::ServerOptions server;
  server.listen_address = "127.0.0.1:0";
  server.insecure = true;  // loopback only
  auto started = cloud::CloudServer::Start(server, c.service.get());
  if (!started.ok()) return started.status();
  c.server = std::move(*started);
  return absl::OkStatus();
}

LinkOptions LinkFor(const Experiment& e, uint64_t seed) {
  LinkOptions o;
  o.up_bytes_per_s = e.link.up_mbit_s * 1e6 / 8;
  o.down_bytes_per_s = e.link.down_mbit_s * 1e6 / 8;
  o.latency = absl::Microseconds(static_cast<int64_t>(e.link.latency_ms * 1000));
  o.loss = e.link.loss;
  o.seed = seed;
  return o;
}

absl::StatusOr<MethodResult> RunMethod(const Experiment& e, const std::string& method,
                                       const HarnessOptions& options,
                                       const ds::ImageSet& train_images,
                                       const ds::ImageSet& test_images, int method_index) {
  absl::StatusOr<MethodPlan> plan = PlanFor(method, e);
  if (!plan.ok()) return plan.status();
  const std::string dir = absl::StrCat(options.work_dir, "/", method);
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  torch::manual_seed(options.seed);
  std::mt19937_64 rng(options.seed);

  const int total_steps = e.devices * (e.rounds + 1);
  const size_t methods = e.methods.size();
  int done_steps = 0;
  auto progress = [&](const std::string& what) {
    if (!options.progress) return;
    options.progress(absl::StrCat(method, ": ", what),
                     (method_index + static_cast<double>(done_steps) / total_steps) /
                         static_cast<double>(methods));
  };

  Cloud c;
  if (plan->kind == MethodKind::kCloud) {
    progress("starting the cloud");
    if (absl::Status s = StartCloud(e, *plan, dir + "/cloud", rng, c); !s.ok()) return s;
  }
  std::vector<Device> devices(static_cast<size_t>(e.devices));
  MethodResult result;
  result.method = method;
  for (int i = 0; i < e.devices; ++i) {
    Device& d = devices[static_cast<size_t>(i)];
    progress(absl::StrCat("loading device ", i));
    device::RuntimeOptions ro;
    ro.checkpoint_dir = e.checkpoint;
    ro.precision = e.precision;
    ro.threads = e.threads;
    ro.max_answer_tokens = e.AnswerTokens();
    auto runtime = device::InferenceRuntime::Load(ro);
    if (!runtime.ok()) return runtime.status();
    d.runtime = std::move(*runtime);
    result.trainable_parameters = d.runtime->TrainableParameters();
    if (plan->kind == MethodKind::kCloud) {
      auto link = LinkEmulator::Start(LinkFor(e, options.seed + static_cast<uint64_t>(i)),
                                      c.server->port());
      if (!link.ok()) return link.status();
      d.link = std::move(*link);
      device::CloudClientOptions co;
      co.target = absl::StrCat("127.0.0.1:", d.link->port());
      co.device_id = DeviceId(i);
      co.token = c.tokens[static_cast<size_t>(i)];
      co.insecure = true;
      co.stream_timeout = absl::Seconds(600);
      auto client = device::CloudClient::Create(co);
      if (!client.ok()) return client.status();
      d.client = std::move(*client);
      device::AgentOptions ao;
      ao.state_dir = absl::StrCat(dir, "/", DeviceId(i));
      ao.uts = plan->uts;
      ao.batch_samples = 16;
      ao.batch_max_age = absl::Hours(1);  // the harness flushes at the end of each round
      ao.uplink_max_batches = 1u << 20;
      ao.uplink_max_bytes = 1ull << 40;
      ao.queue_max_bytes = 1ull << 34;
      ao.queue_max_batches = 1u << 20;
      auto agent = device::DeviceAgent::Create(ao, d.runtime.get(), d.client.get());
      if (!agent.ok()) return agent.status();
      d.agent = std::move(*agent);
    } else if (plan->kind == MethodKind::kDevice) {
      auto family = model::LoadFamily(e.checkpoint, *model::ParsePrecision(e.precision));
      if (!family.ok()) return family.status();
      d.student = family->student;
      auto learner = distill::MakeLearner(plan->learner, model::Mllm(nullptr));
      if (!learner.ok()) return learner.status();
      d.learner = std::move(*learner);
    }
  }

  // The same held-out scenes whenever a domain recurs (any round, any device), so accuracy
  // differences between rounds are the model's, not the test sample's.
  auto eval_gen = [&](int device, int round) {
    const std::string label = DomainLabel(e, e.DomainFor(device, round), round);
    uint64_t h = options.seed * 7919;
    for (unsigned char ch : label) h = h * 1099511628211ull + ch;
    return Generators(e, e.DomainFor(device, round), round, test_images, ds::Split::kTest, h);
  };

  // Round 0: every device on its first domain, before any adaptation.
  for (int i = 0; i < e.devices; ++i) {
    progress(absl::StrCat("round 0 device ", i, ": evaluating"));
    auto gen = eval_gen(i, 0);
    if (!gen.ok()) return gen.status();
    auto score = Evaluate(e, *devices[static_cast<size_t>(i)].runtime, *gen);
    if (!score.ok()) return score.status();
    DeviceRound r;
    r.device = i;
    r.round = 0;
    r.domain = DomainLabel(e, e.DomainFor(i, 0), 0);
    Record(*std::move(score), r);
    result.rounds.push_back(r);
    ++done_steps;
  }

  for (int round = 0; round < e.rounds; ++round) {
    std::vector<DeviceRound> rows(static_cast<size_t>(e.devices));
    // 1-2. Stream and uplink.
    for (int i = 0; i < e.devices; ++i) {
      Device& d = devices[static_cast<size_t>(i)];
      DeviceRound& r = rows[static_cast<size_t>(i)];
      r.device = i;
      r.round = round + 1;
      const RoundDomain domain = e.DomainFor(i, round);
      r.domain = DomainLabel(e, domain, round);
      auto gens = Generators(
          e, domain, round, train_images, ds::Split::kTrain,
          options.seed * 104729 + static_cast<uint64_t>(i) * 977 + static_cast<uint64_t>(round));
      if (!gens.ok()) return gens.status();
      std::vector<device::Frame> frames = StreamFrames(*gens, e.captioning(), e.stream_frames);
      result.raw_frame_bytes = frames.front().image.pixels.size();
      std::vector<compress::UplinkSample> local;  // device-side methods train on these
      double answer_ms = 0;
      for (size_t b = 0; b < frames.size(); b += 16) {
        progress(absl::StrCat("round ", round + 1, " device ", i, ": answering ", b, "/",
                              frames.size()));
        std::vector<device::Frame> part(
            frames.begin() + static_cast<long>(b),
            frames.begin() + static_cast<long>(std::min(frames.size(), b + 16)));
        const auto t0 = Clock::now();
        if (d.agent) {
          auto out = d.agent->Process(part);
          if (!out.ok()) return out.status();
          for (const device::FrameResult& f : *out) {
            r.kept_samples += f.uplinked ? 1 : 0;
            r.kept_tokens += f.kept_tokens;
          }
        } else {
          auto out = d.runtime->Answer(part);
          if (!out.ok()) return out.status();
          for (const device::AnswerResult& a : *out) {
            local.push_back(AllTokensSample(a, local.size()));
          }
        }
        answer_ms += 1000 * Since(t0);
      }
      r.frames = static_cast<int64_t>(frames.size());
      r.answer_ms = answer_ms / static_cast<double>(frames.size());
      if (d.agent) {
        if (absl::Status s = d.agent->Flush(); !s.ok()) return s;
        progress(absl::StrCat("round ", round + 1, " device ", i, ": uplinking"));
        const LinkStats before = d.link->Stats();
        const uint64_t payload_before = d.agent->Stats().uplink_bytes;
        const auto t0 = Clock::now();
        if (absl::Status s = d.agent->SyncOnce(); !s.ok()) return s;
        r.uplink_seconds = Since(t0);
        r.uplink_wire_bytes = d.link->Stats().bytes_up - before.bytes_up;
        r.uplink_payload_bytes = d.agent->Stats().uplink_bytes - payload_before;
      } else if (d.learner) {
        progress(absl::StrCat("round ", round + 1, " device ", i, ": adapting on the device"));
        distill::JobOptions jo;
        jo.max_steps = e.job.max_steps;
        jo.batch_size = e.job.batch_size;
        jo.max_answer_tokens = e.AnswerTokens();
        if (e.job.lr > 0) jo.lr = e.job.lr;
        jo.seed = options.seed + static_cast<uint64_t>(round);
        jo.num_threads = e.threads;
        jo.train_in_place = true;
        const auto t0 = Clock::now();
        auto job = d.learner->Run(local, nullptr, d.student, jo);
        if (!job.ok()) return job.status();
        r.job_seconds = Since(t0);
        auto bytes = model::EncodeSafetensors(job->trainable, {});
        if (!bytes.ok()) return bytes.status();
        if (absl::Status s = d.runtime->LoadTrainableState(*bytes, d.runtime->version() + 1);
            !s.ok()) {
          return s;
        }
      }
    }
    // 3. Cloud jobs.
    if (c.strategy) {
      for (int i = 0; i < e.devices; ++i) {
        progress(absl::StrCat("round ", round + 1, " device ", i, ": cloud job"));
        absl::StatusOr<cloud::JobReport> job = c.strategy->RunJob(DeviceId(i));
        if (!job.ok() && !absl::IsNotFound(job.status())) return job.status();
        if (job.ok()) {
          rows[static_cast<size_t>(i)].job_seconds = job->train_seconds;
          rows[static_cast<size_t>(i)].downlink_payload_bytes = job->payload_bytes;
        }
      }
    }
    // 4-5. Downlink, then evaluation.
    for (int i = 0; i < e.devices; ++i) {
      Device& d = devices[static_cast<size_t>(i)];
      DeviceRound& r = rows[static_cast<size_t>(i)];
      if (d.agent) {
        progress(absl::StrCat("round ", round + 1, " device ", i, ": downlink and apply"));
        const LinkStats before = d.link->Stats();
        const auto t0 = Clock::now();
        if (absl::Status s = d.agent->SyncOnce(); !s.ok()) return s;
        r.downlink_seconds = Since(t0);
        r.downlink_wire_bytes = d.link->Stats().bytes_down - before.bytes_down;
        const device::AgentStats st = d.agent->Stats();
        r.in_sync = st.state_digest == c.strategy->State(DeviceId(i)).state_digest;
      }
      progress(absl::StrCat("round ", round + 1, " device ", i, ": evaluating"));
      auto gen = eval_gen(i, round);
      if (!gen.ok()) return gen.status();
      auto score = Evaluate(e, *d.runtime, *gen);
      if (!score.ok()) return score.status();
      Record(*std::move(score), r);
      r.version = d.runtime->version();
      result.rounds.push_back(r);
      ++done_steps;
    }
  }
  for (Device& d : devices) {
    if (d.agent) d.agent->Stop();
  }
  return result;
}

}  // namespace

absl::StatusOr<RunResult> RunExperiment(const Experiment& experiment,
                                        const HarnessOptions& options) {
  const auto start = Clock::now();
  auto train = ds::LoadFashionMnist(ds::Split::kTrain);
  if (!train.ok()) return train.status();
  auto test = ds::LoadFashionMnist(ds::Split::kTest);
  if (!test.ok()) return test.status();
  RunResult run;
  run.experiment = experiment;
  run.seed = options.seed;
  for (size_t m = 0; m < experiment.methods.size(); ++m) {
    auto result =
        RunMethod(experiment, experiment.methods[m], options, *train, *test, static_cast<int>(m));
    if (!result.ok()) {
      return absl::Status(result.status().code(), absl::StrCat("method ", experiment.methods[m],
                                                               ": ", result.status().message()));
    }
    run.methods.push_back(*std::move(result));
  }
  run.seconds = Since(start);
  if (options.progress) options.progress("done", 1.0);
  return run;
}

}  // namespace cdcca::sim
