#include "sim/harness.h"

#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "cloud/open_cloud.h"
#include "cloud/trainer.h"
#include "compress/uplink_codec.h"
#include "datasets/domain.h"
#include "datasets/fashion_mnist.h"
#include "datasets/language.h"
#include "datasets/metrics.h"
#include "device/agent.h"
#include "device/cloud_client.h"
#include "device/inference_runtime.h"
#include "device/internal/student.h"
#include "device/sample_step.h"
#include "device/uts.h"
#include "distill/pair_side.h"
#include "distill/self_learner.h"
#include "model/arch/answerer.h"
#include "model/hub/chat_template.h"
#include "model/hub/safetensors.h"
#include "nlohmann/json.hpp"
#include "proto/clock.h"
#include "sim/link_emulator.h"
#ifdef CDCCA_SIM_CLUSTER
#include "cloud/pg/pg_cloud_store.h"
#include "tests/testing/nginx_server.h"
#include "tests/testing/postgres_server.h"
#endif

namespace cdcca::sim {

namespace {

namespace ds = datasets;
namespace fs = std::filesystem;
using SteadyClock = std::chrono::steady_clock;

double Since(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

enum class MethodKind { kSourceOnly, kDevice, kCloud };

struct MethodPlan {
  MethodKind kind = MethodKind::kCloud;
  bool teacher = false;  // kSourceOnly with the cloud's teacher as the device's model
  std::string learner;   // distill learner name
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
  p.uts.random_share = e.uts.random_share;
  // Validated when the experiment was read.
  p.uts.precision =
      compress::ParseFeaturePrecision(e.uts.precision).value_or(compress::FeaturePrecision::kFp16);
  // Validated when the experiment was read (Experiment's uts.score).
  p.uts.score = device::ParseTokenScore(e.uts.score).value_or(device::UtsOptions().score);
  if (e.uts.keep_fraction >= 1) {  // keep every sample: a fixed threshold below any entropy
    p.uts.keep_fraction = 0;
    p.uts.entropy_alpha = -1;
  }
  if (method == "source-only") {
    p.kind = MethodKind::kSourceOnly;
  } else if (method == "teacher") {
    p.kind = MethodKind::kSourceOnly;
    p.teacher = true;
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

// The device scored with the state a withheld update would have given it (`withheld`, empty:
// none), then put back as it was: `r` gets that score and its paired gain over r's own.
// `evaluate` scores the runtime as it is into its argument.
absl::Status MeasureWithheld(const std::string& withheld, device::InferenceRuntime& runtime,
                             const std::function<absl::Status(DeviceRound&)>& evaluate,
                             DeviceRound& r) {
  if (withheld.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> own = runtime.SaveTrainableState();
  if (!own.ok()) return own.status();
  const uint64_t version = runtime.version();
  const uint64_t own_digest = runtime.StateDigest();
  if (absl::Status s = runtime.LoadTrainableState(withheld, version); !s.ok()) return s;
  r.withheld_state_digest = runtime.StateDigest();
  DeviceRound with;
  absl::Status scored = evaluate(with);
  if (absl::Status s = runtime.LoadTrainableState(*own, version); !s.ok()) return s;
  if (!scored.ok()) return scored;
  if (runtime.StateDigest() != own_digest) {
    return absl::InternalError(
        "the device's state did not come back after scoring a withheld update");
  }
  r.withheld_measured = true;
  r.withheld_da = with.da;
  r.withheld_gain = with.da - r.da;
  const size_t n = std::min(with.question_da.size(), r.question_da.size());
  if (n > 1) {
    double mean = 0, sq = 0;
    for (size_t q = 0; q < n; ++q) mean += with.question_da[q] - r.question_da[q];
    mean /= static_cast<double>(n);
    for (size_t q = 0; q < n; ++q) {
      const double d = with.question_da[q] - r.question_da[q] - mean;
      sq += d * d;
    }
    // Points of DA, as da is.
    r.withheld_gain_se =
        100.0 * std::sqrt(sq / static_cast<double>(n - 1) / static_cast<double>(n));
  }
  return absl::OkStatus();
}

// What a device-side method (TENT, CoTTA) trains on: the answer with every token, made as
// the device step makes an uplink sample.
absl::StatusOr<compress::UplinkSample> AllTokensSample(const device::AnswerResult& a, uint64_t id) {
  return device::MakeUplinkSample(device::AnsweredFrameOf(a, /*version=*/0),
                                  device::EveryToken(a.visual.tokens),
                                  compress::FeaturePrecision::kFp16, "", id);
}

std::string RandomToken(std::mt19937_64& rng) {
  static constexpr char kAlphabet[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::string t(32, 'x');
  for (char& c : t) c = kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return t;
}

// The round on the virtual clock (see harness.h). The programs' defaults where there is
// one: cdcca-device polls every 2 s. The trigger interval and the round's span are chosen
// so that a device's trigger cannot fire during the next round's stream (the round span
// minus the stream's clock ticks is at least the interval) and fires when the harness
// moves the clock by the interval after the uplink (span plus stream ticks below twice the
// interval).
constexpr absl::Duration kPollInterval = absl::Seconds(2);
constexpr absl::Duration kTriggerInterval = absl::Hours(1);
constexpr absl::Duration kRoundSpan = absl::Minutes(90);
constexpr absl::Duration kStreamTicks = absl::Minutes(10);  // most clock ticks while uplinking
// Real time the harness waits for an uplink, the round's jobs, or the updates to land.
constexpr absl::Duration kRealWaitLimit = absl::Minutes(60);

// Everything one method's run owns.
struct Device {
  std::unique_ptr<device::InferenceRuntime> runtime;
  std::unique_ptr<LinkEmulator> link;
  std::unique_ptr<device::CloudClient> client;
  std::unique_ptr<device::DeviceAgent> agent;
  // Device-side adaptation (tent, cotta) on a copy of the student the runtime loads: its
  // trainable set goes into the runtime after each round's job.
  std::unique_ptr<model::Answerer> learner_model;
  distill::PairSide learner_side;
  std::unique_ptr<distill::SelfLearner> learner;
};

struct Cloud {
  // The jobs' outcomes (the scheduler's or the workers' callback), until the harness takes them.
  absl::Mutex jobs_mu;
  std::map<std::string, cloud::JobReport> reports ABSL_GUARDED_BY(jobs_mu);
  std::vector<absl::Status> failures ABSL_GUARDED_BY(jobs_mu);
  // The shared fronts' observer: no trigger, the harness makes a round's jobs due itself.
  cloud::CloudObserver no_trigger;

  std::unique_ptr<cloud::Cloud> embedded;  // the one process's cloud (files)
  std::vector<std::string> tokens;
  int port = 0;              // where the devices dial: the server, or nginx in front of the fronts
  uint64_t base_digest = 0;  // the pretrained student's trainable set

#ifdef CDCCA_SIM_CLUSTER
  // "cloud": {"store": "postgresql"}: the database, fronts behind nginx, trainers.
  std::unique_ptr<testing::PostgresServer> postgres;
  std::unique_ptr<cloud::pg::PgCloudStore> control;  // the harness's own session
  std::vector<std::unique_ptr<cloud::Cloud>> fronts;
  std::unique_ptr<testing::NginxServer> nginx;
  std::vector<std::unique_ptr<cloud::Cloud>> trainers;
#endif
  bool shared() const {
#ifdef CDCCA_SIM_CLUSTER
    return control != nullptr;
#else
    return false;
#endif
  }
  cloud::JobScheduler* scheduler() const {
    return embedded != nullptr ? embedded->scheduler() : nullptr;
  }

  ~Cloud() {
    if (embedded) embedded->Shutdown(absl::Milliseconds(200));
#ifdef CDCCA_SIM_CLUSTER
    trainers.clear();  // workers stop (a running job finishes) before the servers go
    for (auto& f : fronts) f->Shutdown(absl::Milliseconds(200));
#endif
  }
};

std::string DeviceId(int i) { return absl::StrCat("device-", i); }

// The cloud of "cloud": {"store": "postgresql"}: a PostgreSQL server for the run, e.cloud.fronts
// services on it behind nginx, and e.cloud.trainers workers, each with its own strategy (its
// own copy of the models) committing through the database under job leases. No trigger
// runs on the fronts: the harness makes a round's jobs due once its uplink is stored.
absl::Status StartSharedCloud(const Experiment& e, const cloud::PerDeviceStrategyOptions& po,
                              const std::string& dir, const std::string& tokens, Cloud& c) {
#ifdef CDCCA_SIM_CLUSTER
  absl::StatusOr<std::unique_ptr<testing::PostgresServer>> postgres =
      testing::PostgresServer::Start();
  if (!postgres.ok()) return postgres.status();
  c.postgres = std::move(*postgres);
  absl::StatusOr<std::string> conninfo = c.postgres->CreateDatabase();
  if (!conninfo.ok()) return conninfo.status();
  auto control = cloud::pg::PgCloudStore::Open({*conninfo, 2, 16});
  if (!control.ok()) return control.status();
  c.control = std::move(*control);
  for (int t = 0; t < e.cloud.trainers; ++t) {
    cloud::CloudOptions to;
    to.data_dir = absl::StrCat(dir, "/trainer-", t);
    to.store = *conninfo;
    to.role = "trainer";
    to.strategy = po;
    to.strategy.state_dir = to.data_dir;
    to.scheduler.threads = e.job.workers;
    to.trainer_id = absl::StrCat("trainer-", t);
    to.worker_poll = absl::Milliseconds(20);
    to.on_job = [&c](const absl::StatusOr<cloud::JobReport>& r) {
      absl::MutexLock lock(&c.jobs_mu);
      if (r.ok()) {
        c.reports[r->device_id] = *r;
      } else if (!absl::IsNotFound(r.status())) {
        c.failures.push_back(r.status());
      }
    };
    auto trainer = cloud::OpenCloud(to);
    if (!trainer.ok()) return trainer.status();
    c.trainers.push_back(std::move(*trainer));
  }
  const cloud::PerDeviceStrategy& model = *c.trainers.front()->strategy();
  c.base_digest = model.BaseDigest();
  cloud::CloudOptions fo;
  fo.store = *conninfo;
  fo.role = "front";
  fo.tokens_text = tokens;
  fo.server.listen_address = "127.0.0.1:0";
  fo.server.insecure = true;  // loopback only
  fo.service.expected_fingerprint = model.BaseFingerprint();
  fo.service.expected_vision_fingerprint = model.VisionFingerprint();
  fo.service.sample_spec = model.Spec();
  fo.service.guard_holdout_fraction = e.job.guard ? e.job.guard_holdout_fraction : 0.0;
  fo.service.io_threads = 16;
  fo.store_sessions = 16;
  fo.observer = &c.no_trigger;
  testing::NginxProxyOptions proxy;
  for (int f = 0; f < e.cloud.fronts; ++f) {
    fo.data_dir = absl::StrCat(dir, "/front-", f);
    auto front = cloud::OpenCloud(fo);
    if (!front.ok()) return front.status();
    proxy.backends.push_back(absl::StrCat("127.0.0.1:", (*front)->port()));
    c.fronts.push_back(std::move(*front));
  }
  auto nginx = testing::NginxServer::Start(proxy);
  if (!nginx.ok()) return nginx.status();
  c.nginx = std::move(*nginx);
  c.port = c.nginx->port();
  return absl::OkStatus();
#else
  return absl::UnimplementedError(
      "\"cloud\": {\"store\": \"postgresql\"} needs a build with libpq and nginx "
      "(scripts/setup.sh)");
#endif
}

// The digest of the state a device at `version` holds on the cloud's side.
uint64_t MirrorDigest(Cloud& c, const std::string& id, uint64_t version) {
#ifdef CDCCA_SIM_CLUSTER
  if (c.shared()) {
    if (version == 0) return c.base_digest;
    return c.control->DigestOf(id, version).value_or(0);
  }
#endif
  return c.embedded->strategy()->State(id).state_digest;
}

// Makes the jobs of `ids` due now on the shared cloud (what a front's trigger does).
absl::Status TriggerJobs(Cloud& c, const std::vector<std::string>& ids) {
#ifdef CDCCA_SIM_CLUSTER
  for (const std::string& id : ids) {
    if (absl::Status s = c.control->Borrow()->TriggerJob(id, 1, absl::InfiniteDuration());
        !s.ok()) {
      return s;
    }
  }
#endif
  return absl::OkStatus();
}

// The cloud's strategy options for `plan` of experiment `e` (all but where its state lives):
// the experiment's settings, the defaults table's where it says nothing.
absl::StatusOr<cloud::PerDeviceStrategyOptions> StrategyOptionsFor(const Experiment& e,
                                                                   const MethodPlan& plan) {
  cloud::PerDeviceStrategyOptions po;
  po.lora_rank = e.lora_rank;  // the devices' adapters (a family's too)
  po.lora_alpha = e.lora_alpha;
  po.lora_mlp = e.lora_mlp;
  po.lora_qformer = e.lora_qformer;
  po.lora_projector = e.lora_projector;
  po.lora_vision = e.lora_vision;
  if (e.hub()) {
    po.teacher_dir = e.teacher;
    po.student_base_dir = e.student_base;
  } else {
    po.checkpoint_dir = e.checkpoint;
  }
  po.train_device = e.job.device;
  po.student_precision = e.precision;
  po.learner = plan.learner;
  // Every cloud method trains with the experiment's distill settings (CE, KL, replay, steps,
  // learning rate) and differs from AKD only in its feature term. Where the file is not
  // there (a run from outside the checkout), the presets are the same defaults table.
  if (fs::exists(e.distill_config)) po.distill_config = e.distill_config;
  po.max_steps = e.job.max_steps;
  po.batch_size = e.job.batch_size;
  po.lr = e.job.lr;
  po.max_answer_tokens = e.AnswerTokens();
  po.torch_threads = e.threads;
  po.bits_per_param = e.downlink_bits_per_param;
  po.max_batches_per_job = 1u << 20;  // a round's job trains on everything uplinked
  po.guard.enabled = e.job.guard;
  po.guard.holdout_fraction = e.job.guard_holdout_fraction;
  po.guard.z = e.job.guard_z;
  po.guard.min_pool = static_cast<size_t>(e.job.guard_min_pool);
  po.guard.pool_capacity = static_cast<size_t>(e.job.guard_pool);
  po.guard.confident_fraction = e.job.guard_confident_fraction;
  po.guard.restore_base = e.job.guard_restore_base;
  po.pool_samples = static_cast<size_t>(e.job.pool_samples);
  po.fp8_base = e.job.fp8_base;
  po.report_withheld_state = true;  // what a withheld update would have done is measured
  absl::StatusOr<cloud::GuardMeasure> m = cloud::ParseGuardMeasure(e.job.guard_measure);
  if (!m.ok()) return m.status();
  po.guard.measure = *m;
  return po;
}

// The devices' runtime options of experiment `e` (the student, as the devices load it).
device::RuntimeOptions RuntimeOptionsFor(const Experiment& e) {
  device::RuntimeOptions ro;
  ro.checkpoint_dir = e.hub() ? e.student_base : e.checkpoint;
  ro.lora_rank = e.lora_rank;
  ro.lora_alpha = e.lora_alpha;
  ro.lora_mlp = e.lora_mlp;
  ro.lora_qformer = e.lora_qformer;
  ro.lora_projector = e.lora_projector;
  ro.lora_vision = e.lora_vision;
  ro.precision = e.precision;
  ro.threads = e.threads;
  ro.max_answer_tokens = e.AnswerTokens();
  return ro;
}

absl::Status StartCloud(const Experiment& e, const MethodPlan& plan, const std::string& dir,
                        std::mt19937_64& rng, Clock* clock, Cloud& c) {
  std::string tokens;
  for (int i = 0; i < e.devices; ++i) {
    c.tokens.push_back(RandomToken(rng));
    absl::StrAppend(&tokens, DeviceId(i), " ", c.tokens.back(), "\n");
  }
  absl::StatusOr<cloud::PerDeviceStrategyOptions> strategy = StrategyOptionsFor(e, plan);
  if (!strategy.ok()) return strategy.status();
  if (e.cloud.store == "postgresql") return StartSharedCloud(e, *strategy, dir, tokens, c);
  cloud::CloudOptions o;
  o.data_dir = dir;
  o.tokens_text = tokens;
  o.strategy = *std::move(strategy);
  o.strategy.state_dir = dir + "/mirrors";
  // The program's scheduler on the virtual clock: a job per device once the trigger
  // interval has passed with new samples; no sample-count trigger, so that a job never
  // starts on part of a round's uplink.
  o.scheduler.trigger_samples = std::numeric_limits<int>::max();
  o.scheduler.trigger_interval = kTriggerInterval;
  o.scheduler.threads = e.job.workers;
  o.scheduler.clock = clock;
  o.on_job = [&c](const absl::StatusOr<cloud::JobReport>& r) {
    absl::MutexLock lock(&c.jobs_mu);
    if (r.ok()) {
      c.reports[r->device_id] = *r;
    } else {
      c.failures.push_back(r.status());
    }
  };
  o.service.guard_holdout_fraction = e.job.guard ? e.job.guard_holdout_fraction : 0.0;
  o.server.listen_address = "127.0.0.1:0";
  o.server.insecure = true;  // loopback only
  absl::StatusOr<std::unique_ptr<cloud::Cloud>> opened = cloud::OpenCloud(o);
  if (!opened.ok()) return opened.status();
  c.embedded = *std::move(opened);
  c.base_digest = c.embedded->strategy()->BaseDigest();
  c.port = c.embedded->port();
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

// Runs fn(0) ... fn(n - 1) on a thread each; the first error by index.
absl::Status ForEachDevice(int n, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> status(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&fn, &status, i] { status[static_cast<size_t>(i)] = fn(i); });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Waits (real time) until `done` holds. While it does not, after every `stall` of real time
// the virtual clock moves on by a poll interval, as long as it stays before `limit`: that
// wakes a link loop waiting out its poll interval (or a retry).
absl::Status AwaitDone(VirtualClock& clock, absl::Duration stall, absl::Time limit,
                       const std::function<bool()>& done, const std::string& what) {
  const absl::Time give_up = absl::Now() + kRealWaitLimit;
  absl::Time last_tick = absl::Now();
  while (!done()) {
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(absl::StrCat("timed out waiting for ", what));
    }
    absl::SleepFor(absl::Milliseconds(2));
    if (absl::Now() - last_tick >= stall && clock.Now() + kPollInterval <= limit) {
      clock.Advance(kPollInterval);
      last_tick = absl::Now();
    }
  }
  return absl::OkStatus();
}

// The most of something going on at once (devices streaming).
class PeakCounter {
 public:
  void Enter() {
    absl::MutexLock lock(&mu_);
    peak_ = std::max(peak_, ++now_);
  }
  void Leave() {
    absl::MutexLock lock(&mu_);
    --now_;
  }
  int peak() const {
    absl::MutexLock lock(&mu_);
    return peak_;
  }

 private:
  mutable absl::Mutex mu_;
  int now_ ABSL_GUARDED_BY(mu_) = 0;
  int peak_ ABSL_GUARDED_BY(mu_) = 0;
};

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
  absl::Mutex progress_mu;  // device threads report too
  int done_steps = 0;
  auto progress = [&](const std::string& what, bool step_done = false) {
    absl::MutexLock lock(&progress_mu);
    if (step_done) ++done_steps;
    if (!options.progress) return;
    options.progress(absl::StrCat(method, ": ", what),
                     (method_index + static_cast<double>(done_steps) / total_steps) /
                         static_cast<double>(methods));
  };

  // Declared before the cloud and the devices: both read it until they are gone.
  VirtualClock clock;
  Cloud c;
  if (plan->kind == MethodKind::kCloud) {
    progress("starting the cloud");
    if (absl::Status s = StartCloud(e, *plan, dir + "/cloud", rng, &clock, c); !s.ok()) return s;
  }
  std::vector<Device> devices(static_cast<size_t>(e.devices));
  MethodResult result;
  result.method = method;
  for (int i = 0; i < e.devices; ++i) {
    Device& d = devices[static_cast<size_t>(i)];
    progress(absl::StrCat("loading device ", i));
    device::RuntimeOptions ro = RuntimeOptionsFor(e);
    if (plan->teacher) {  // the cloud's teacher, as the cloud runs it
      ro.checkpoint_dir = e.hub() ? e.teacher : e.checkpoint + "/teacher";
      ro.precision = "fp32";
    }
    auto runtime = device::InferenceRuntime::Load(ro);
    if (!runtime.ok()) return runtime.status();
    d.runtime = std::move(*runtime);
    result.trainable_parameters = d.runtime->TrainableParameters();
    if (plan->kind == MethodKind::kCloud) {
      auto link = LinkEmulator::Start(LinkFor(e, options.seed + static_cast<uint64_t>(i)), c.port);
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
      ao.poll_interval = kPollInterval;
      ao.clock = &clock;
      // Stage 2's dropout draws per sample from the seed, not from whatever other devices'
      // threads drew before.
      ao.score_seed = options.seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i) + 1;
      auto agent = device::DeviceAgent::Create(ao, d.runtime.get(), d.client.get());
      if (!agent.ok()) return agent.status();
      d.agent = std::move(*agent);
      d.agent->Start();  // the program's sync loop: registers, uplinks, polls, applies
    } else if (plan->kind == MethodKind::kDevice) {
      auto answerer = model::Answerer::Load(ro.checkpoint_dir, ro.precision, "cpu");
      if (!answerer.ok()) return answerer.status();
      d.learner_model = *std::move(answerer);
      if (absl::Status s = d.learner_model->model().AddAdapters(device::internal::AdaptersOf(ro));
          !s.ok()) {
        return s;
      }
      auto format = model::ResolvePromptFormat(ro.student_template, d.learner_model->model_type(),
                                               ro.checkpoint_dir);
      if (!format.ok()) return format.status();
      d.learner_side = distill::PairSideOf(*d.learner_model, ro.checkpoint_dir, *format);
      distill::JobOptions jo;
      jo.max_steps = e.job.max_steps;
      jo.batch_size = e.job.batch_size;
      jo.max_answer_tokens = e.AnswerTokens();
      if (e.job.lr > 0) jo.lr = e.job.lr;
      jo.seed = options.seed;  // the learner varies it per job
      auto learner = distill::SelfLearner::Create(plan->learner, d.learner_side, jo);
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
  // `step`: the evaluation is one of the run's counted steps (a withheld update's is not).
  auto evaluate = [&](int i, int round, DeviceRound& r, bool step = true) -> absl::Status {
    const std::string what = step ? "" : " with its withheld update";
    progress(absl::StrCat("round ", r.round, " device ", i, ": evaluating", what));
    auto gen = eval_gen(i, round);
    if (!gen.ok()) return gen.status();
    auto score = Evaluate(e, *devices[static_cast<size_t>(i)].runtime, *gen);
    if (!score.ok()) return score.status();
    Record(*std::move(score), r);
    progress(absl::StrCat("round ", r.round, " device ", i, ": evaluated", what), step);
    return absl::OkStatus();
  };

  // Round 0: every device on its first domain, before any adaptation.
  {
    std::vector<DeviceRound> rows(static_cast<size_t>(e.devices));
    if (absl::Status s = ForEachDevice(e.devices,
                                       [&](int i) {
                                         DeviceRound& r = rows[static_cast<size_t>(i)];
                                         r.device = i;
                                         r.round = 0;
                                         r.domain = DomainLabel(e, e.DomainFor(i, 0), 0);
                                         return evaluate(i, 0, r);
                                       });
        !s.ok()) {
      return s;
    }
    for (DeviceRound& r : rows) result.rounds.push_back(std::move(r));
  }

  PeakCounter streaming;
  absl::Mutex device_learners;  // tent / cotta jobs, one at a time (they use every core)
  const absl::Time first_round = clock.Now();
  for (int round = 0; round < e.rounds; ++round) {
    // Every round starts at a fixed point of virtual time (sample ids and triggers repeat).
    clock.AdvanceTo(first_round + round * kRoundSpan);
    const absl::Time stream_limit = clock.Now() + kStreamTicks;
    std::vector<DeviceRound> rows(static_cast<size_t>(e.devices));
    std::vector<uint64_t> acked_before(static_cast<size_t>(e.devices), 0);
    std::vector<uint64_t> acked_after(static_cast<size_t>(e.devices), 0);
    // The states withheld updates would have given the devices (empty: none withheld).
    std::vector<std::string> withheld_states(static_cast<size_t>(e.devices));
    // 1-2. Every device streams its frames (UTS queues the kept samples) while its link
    // thread uplinks them; the device is done when all of them are acked durable. Devices
    // run at once.
    auto stream = [&](int i) -> absl::Status {
      Device& d = devices[static_cast<size_t>(i)];
      DeviceRound& r = rows[static_cast<size_t>(i)];
      streaming.Enter();
      struct Leave {
        PeakCounter* p;
        ~Leave() { p->Leave(); }
      } leave{&streaming};
      r.device = i;
      r.round = round + 1;
      const RoundDomain domain = e.DomainFor(i, round);
      r.domain = DomainLabel(e, domain, round);
      auto gens = Generators(
          e, domain, round, train_images, ds::Split::kTrain,
          options.seed * 104729 + static_cast<uint64_t>(i) * 977 + static_cast<uint64_t>(round));
      if (!gens.ok()) return gens.status();
      std::vector<device::Frame> frames = StreamFrames(*gens, e.captioning(), e.stream_frames);
      if (i == 0) result.raw_frame_bytes = frames.front().image.pixels.size();
      std::vector<compress::UplinkSample> local;  // device-side methods train on these
      device::AgentStats before;
      LinkStats link_before;
      if (d.agent) {
        before = d.agent->Stats();
        link_before = d.link->Stats();
      }
      double answer_ms = 0;
      for (size_t b = 0; b < frames.size(); b += 16) {
        progress(absl::StrCat("round ", round + 1, " device ", i, ": answering ", b, "/",
                              frames.size()));
        std::vector<device::Frame> part(
            frames.begin() + static_cast<long>(b),
            frames.begin() + static_cast<long>(std::min(frames.size(), b + 16)));
        const auto t0 = SteadyClock::now();
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
            absl::StatusOr<compress::UplinkSample> s = AllTokensSample(a, local.size());
            if (!s.ok()) return s.status();
            local.push_back(*std::move(s));
          }
        }
        answer_ms += 1000 * Since(t0);
      }
      r.frames = static_cast<int64_t>(frames.size());
      r.answer_ms = answer_ms / static_cast<double>(frames.size());
      if (d.agent) {
        if (absl::Status s = d.agent->Flush(); !s.ok()) return s;
        progress(absl::StrCat("round ", round + 1, " device ", i, ": uplinking"));
        if (absl::Status s = AwaitDone(
                clock, absl::Seconds(5), stream_limit,
                [&] { return d.agent->Stats().queue.batches == 0; },
                absl::StrCat(DeviceId(i), "'s uplink of round ", round + 1));
            !s.ok()) {
          return s;
        }
        const device::AgentStats after = d.agent->Stats();
        r.uplink_seconds = after.uplink_seconds - before.uplink_seconds;
        r.uplink_payload_bytes = after.uplink_bytes - before.uplink_bytes;
        r.uplink_wire_bytes = d.link->Stats().bytes_up - link_before.bytes_up;
        acked_before[static_cast<size_t>(i)] = before.queue.acked;
        acked_after[static_cast<size_t>(i)] = after.queue.acked;
      } else if (d.learner) {
        progress(absl::StrCat("round ", round + 1, " device ", i, ": adapting on the device"));
        std::vector<distill::PairSample> samples;
        for (const compress::UplinkSample& u : local) {
          auto sample = distill::SampleFromUplink(u, d.learner_side);
          if (!sample.ok()) return sample.status();
          samples.push_back(*std::move(sample));
        }
        absl::MutexLock lock(&device_learners);
        const auto t0 = SteadyClock::now();
        auto job = d.learner->Run(samples);
        if (!job.ok()) return job.status();
        r.job_seconds = Since(t0);
        auto bytes = model::EncodeSafetensors(job->trainable, {});
        if (!bytes.ok()) return bytes.status();
        if (absl::Status s = d.runtime->LoadTrainableState(*bytes, d.runtime->version() + 1);
            !s.ok()) {
          return s;
        }
      }
      return absl::OkStatus();
    };
    if (absl::Status s = ForEachDevice(e.devices, stream); !s.ok()) return s;

    // 3-4. Every uplink is durable: the trigger interval passes and the scheduler runs a
    // job per device with new samples; then the devices' link loops fetch and apply them.
    if (c.scheduler() != nullptr || c.shared()) {
      std::vector<int> expected;
      std::vector<LinkStats> link_before;
      std::vector<device::AgentStats> agent_before;
      for (int i = 0; i < e.devices; ++i) {
        if (acked_after[static_cast<size_t>(i)] > acked_before[static_cast<size_t>(i)]) {
          expected.push_back(i);
        }
        link_before.push_back(devices[static_cast<size_t>(i)].link->Stats());
        agent_before.push_back(devices[static_cast<size_t>(i)].agent->Stats());
      }
      progress(absl::StrCat("round ", round + 1, ": cloud jobs"));
      clock.Advance(kTriggerInterval);
      if (c.shared()) {
        std::vector<std::string> ids;
        for (int i : expected) ids.push_back(DeviceId(i));
        if (absl::Status s = TriggerJobs(c, ids); !s.ok()) return s;
      }
      std::map<std::string, cloud::JobReport> reports;
      auto jobs_done = [&] {
        absl::MutexLock lock(&c.jobs_mu);
        if (!c.failures.empty()) return true;
        for (int i : expected) {
          if (c.reports.count(DeviceId(i)) == 0) return false;
        }
        return true;
      };
      {
        const absl::Time give_up = absl::Now() + kRealWaitLimit;
        while (!jobs_done()) {
          if (absl::Now() > give_up) {
            return absl::DeadlineExceededError(
                absl::StrCat("timed out waiting for the jobs of round ", round + 1));
          }
          absl::SleepFor(absl::Milliseconds(5));
        }
        absl::MutexLock lock(&c.jobs_mu);
        if (!c.failures.empty()) return c.failures.front();
        reports.swap(c.reports);
      }
      progress(absl::StrCat("round ", round + 1, ": downlink and apply"));
      const absl::Time round_end = first_round + (round + 1) * kRoundSpan;
      auto applied = [&] {
        for (int i : expected) {
          const cloud::JobReport& job = reports[DeviceId(i)];
          const device::AgentStats st = devices[static_cast<size_t>(i)].agent->Stats();
          if (st.version != job.new_version || st.state_digest != job.state_digest) return false;
        }
        return true;
      };
      if (absl::Status s = AwaitDone(clock, absl::Milliseconds(50), round_end, applied,
                                     absl::StrCat("the updates of round ", round + 1));
          !s.ok()) {
        return s;
      }
      for (int i = 0; i < e.devices; ++i) {
        Device& d = devices[static_cast<size_t>(i)];
        DeviceRound& r = rows[static_cast<size_t>(i)];
        auto it = reports.find(DeviceId(i));
        if (it != reports.end()) {
          r.job_seconds = it->second.train_seconds;
          r.queue_seconds = it->second.queue_seconds;
          r.downlink_payload_bytes = it->second.payload_bytes;
          r.update_withheld = it->second.update_withheld;
          r.restored_base = it->second.restored_base;
          r.guard_pool = it->second.guard.pool;
          r.guard_before = it->second.guard.before;
          r.guard_after = it->second.guard.after;
          if (it->second.update_withheld) {
            withheld_states[static_cast<size_t>(i)] = std::move(it->second.withheld_state);
          }
        }
        const device::AgentStats st = d.agent->Stats();
        r.downlink_seconds =
            st.update_seconds - agent_before[static_cast<size_t>(i)].update_seconds;
        r.downlink_wire_bytes =
            d.link->Stats().bytes_down - link_before[static_cast<size_t>(i)].bytes_down;
        r.in_sync = st.state_digest == MirrorDigest(c, DeviceId(i), st.version);
      }
    }

    // 5. Evaluation, devices at once.
    if (absl::Status s = ForEachDevice(e.devices,
                                       [&](int i) {
                                         DeviceRound& r = rows[static_cast<size_t>(i)];
                                         if (absl::Status s = evaluate(i, round, r); !s.ok()) {
                                           return s;
                                         }
                                         const Device& d = devices[static_cast<size_t>(i)];
                                         r.version = d.runtime->version();
                                         r.state_digest = d.runtime->StateDigest();
                                         return MeasureWithheld(
                                             withheld_states[static_cast<size_t>(i)], *d.runtime,
                                             [&](DeviceRound& scratch) {
                                               scratch.round = r.round;
                                               return evaluate(i, round, scratch, /*step=*/false);
                                             },
                                             r);
                                       });
        !s.ok()) {
      return s;
    }
    for (DeviceRound& r : rows) result.rounds.push_back(std::move(r));
  }
  for (Device& d : devices) {
    if (d.agent) d.agent->Stop();
  }
  result.peak_devices_streaming = streaming.peak();
  if (c.scheduler() != nullptr) {
    result.peak_jobs_in_flight = c.scheduler()->peak_in_flight();
    result.peak_jobs_running = c.scheduler()->peak_running();
  }
  return result;
}

}  // namespace

absl::StatusOr<RunResult> RunExperiment(const Experiment& experiment,
                                        const HarnessOptions& options) {
  const auto start = SteadyClock::now();
  if (absl::Status s = CheckExperiment(experiment, experiment.name); !s.ok()) return s;
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

absl::StatusOr<std::string> RoundSettingsJson(const Experiment& e, const std::string& method) {
  absl::StatusOr<MethodPlan> plan = PlanFor(method, e);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<cloud::PerDeviceStrategyOptions> po = StrategyOptionsFor(e, *plan);
  if (!po.ok()) return po.status();
  const device::RuntimeOptions ro = RuntimeOptionsFor(e);
  absl::StatusOr<std::string> job = cloud::JobSettingsJson(*po);
  if (!job.ok()) return job.status();
  // Floats as their shortest decimal (0.1f prints 0.1), as a flag's value reads.
  const auto decimal = [](float f) { return std::stod(absl::StrCat(f)); };
  nlohmann::json j = {{"profile", e.profile},
                      {"uts_keep_fraction", decimal(plan->uts.keep_fraction)},
                      {"uts_token_ratio", decimal(plan->uts.token_ratio)},
                      {"uts_mc_passes", plan->uts.mc_passes},
                      {"uts_dropout", decimal(plan->uts.dropout_p)},
                      {"uts_random_share", decimal(plan->uts.random_share)},
                      {"uplink_precision", e.uts.precision},
                      {"student_precision", ro.precision},
                      {"lora_rank", ro.lora_rank},
                      {"lora_alpha", ro.lora_alpha},
                      {"lora_mlp", ro.lora_mlp},
                      {"lora_qformer", ro.lora_qformer},
                      {"lora_projector", ro.lora_projector},
                      {"lora_vision", ro.lora_vision},
                      {"bits_per_param", po->bits_per_param},
                      {"replay_capacity", po->replay_capacity},
                      {"pool_samples", po->pool_samples},
                      {"guard", po->guard.enabled},
                      {"guard_holdout_fraction", po->guard.holdout_fraction},
                      {"guard_pool", po->guard.pool_capacity},
                      {"guard_min_pool", po->guard.min_pool},
                      {"guard_z", po->guard.z},
                      {"guard_confident_fraction", po->guard.confident_fraction},
                      {"guard_restore_base", po->guard.restore_base},
                      {"guard_measure", e.job.guard_measure}};
  j.update(nlohmann::json::parse(*job));
  return j.dump(2);
}

}  // namespace cdcca::sim
