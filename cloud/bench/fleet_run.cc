#include "cloud/bench/fleet_run.h"

#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "cloud/pg/connection.h"
#include "cloud/sample_store.h"
#include "cloud/trainer.h"
#include "cloud/update_store.h"
#include "tests/testing/child_process.h"
#include "tests/testing/cloud_processes.h"
#include "tests/testing/nginx_server.h"
#include "tests/testing/postgres_server.h"
#include "tests/testing/proc_stats.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/tiny_family.h"
#include "tests/testing/transport_fixture.h"

namespace cdcca::fleet {
namespace {

using testing::Child;

// The device side of the model: what Register and ReportApplied carry, and the shape of
// the samples the fronts accept. Read by loading the model as a trainer does.
absl::Status ReadModel(const std::string& checkpoint, const std::string& scratch,
                       FleetOptions& fleet) {
  auto files = cloud::SampleStore::Open({scratch + "/samples"});
  auto updates = cloud::UpdateStore::Open({scratch + "/updates", 16});
  if (!files.ok()) return files.status();
  if (!updates.ok()) return updates.status();
  cloud::PerDeviceStrategyOptions o;
  o.checkpoint_dir = checkpoint;
  o.state_dir = scratch + "/trainer";
  auto strategy = cloud::PerDeviceStrategy::Create(o, files->get(), updates->get());
  if (!strategy.ok()) return strategy.status();
  fleet.spec = (*strategy)->Spec();
  fleet.model_fingerprint = (*strategy)->BaseFingerprint();
  fleet.vision_fingerprint = (*strategy)->VisionFingerprint();
  fleet.base_digest = (*strategy)->BaseDigest();
  return absl::OkStatus();
}

// Devices fleet-0 .. fleet-<n-1> with fresh random tokens, and the tokens file the fronts
// read.
absl::StatusOr<std::vector<FleetDevice>> MakeDevices(int n, const std::string& tokens_path) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<FleetDevice> devices;
  std::ofstream out(tokens_path, std::ios::trunc);
  for (int i = 0; i < n; ++i) {
    devices.push_back({absl::StrCat("fleet-", i), testing::RandomToken(rng)});
    out << devices.back().id << " " << devices.back().token << "\n";
  }
  if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", tokens_path));
  return devices;
}

// The programs and servers of one run.
struct Servers {
  std::unique_ptr<testing::PostgresServer> postgres;
  std::string conninfo;
  std::optional<testing::CloudProcesses> launcher;
  std::vector<std::unique_ptr<Child>> fronts;
  std::vector<int> front_ports;
  std::vector<std::unique_ptr<Child>> trainers;
  std::unique_ptr<testing::NginxServer> nginx;

  std::vector<std::string> Backends() const {
    std::vector<std::string> out;
    for (int p : front_ports) out.push_back(absl::StrCat("127.0.0.1:", p));
    return out;
  }
  uint64_t JobsDone(int trainer) const {
    return testing::ReadJson(launcher->StatusPath(absl::StrCat("trainer-", trainer)))
        .value("jobs_done", 0ull);
  }
};

absl::Status StartServers(const FleetRunOptions& o, const std::string& dir,
                          const std::string& checkpoint, Servers& s) {
  absl::StatusOr<std::unique_ptr<testing::PostgresServer>> pg =
      testing::PostgresServer::Start(absl::Seconds(60), o.postgres_settings);
  if (!pg.ok()) return pg.status();
  s.postgres = *std::move(pg);
  absl::StatusOr<std::string> conninfo = s.postgres->CreateDatabase();
  if (!conninfo.ok()) return conninfo.status();
  s.conninfo = *conninfo;
  testing::CloudProcessOptions launch{o.cloud_binary,  dir,          s.conninfo, checkpoint,
                                      dir + "/tokens", o.cloud_flags};
  launch.trainer_nice = o.trainer_nice;
  s.launcher.emplace(launch);
  for (int i = 0; i < o.fronts; ++i) {
    const std::string name = absl::StrCat("front-", i);
    int port = 0;
    s.fronts.push_back(s.launcher->Start("front", name, &port));
    if (port == 0) {
      return absl::InternalError(
          absl::StrCat(name, " did not serve: ", testing::ReadText(s.launcher->Log(name))));
    }
    s.front_ports.push_back(port);
  }
  testing::NginxProxyOptions no;
  no.backends = s.Backends();
  // One connection per device and one per open call, with room to spare.
  no.worker_connections = 1024 + 2 * o.devices;
  absl::StatusOr<std::unique_ptr<testing::NginxServer>> nginx = testing::NginxServer::Start(no);
  if (!nginx.ok()) return nginx.status();
  s.nginx = *std::move(nginx);
  for (int i = 0; i < o.trainers; ++i) {
    s.trainers.push_back(s.launcher->Start("trainer", absl::StrCat("trainer-", i)));
  }
  return absl::OkStatus();
}

// ---- processes' memory and CPU ----------------------------------------------------------------

struct ProcessSeries {
  std::vector<double> t_s;
  std::vector<double> rss_mib;
  double cpu_s = 0;     // summed over restarts
  double last_cpu = 0;  // of the running instance
  int restarts = 0;
};

// Samples the run's processes; the postgres figure is the private memory of all its
// processes plus the shared buffers once (RSS summed would count those once per process).
class ProcessSampler {
 public:
  void Sample(const Servers& s, double t_s) {
    for (size_t i = 0; i < s.fronts.size(); ++i) {
      Add(absl::StrCat("front-", i), {s.fronts[i]->pid()}, t_s);
    }
    for (size_t i = 0; i < s.trainers.size(); ++i) {
      Add(absl::StrCat("trainer-", i), {s.trainers[i]->pid()}, t_s);
    }
    Add("nginx", s.nginx->Pids(), t_s);
    Add("postgres", PostgresPids(*s.postgres), t_s);
    Add("bench", {::getpid()}, t_s);
  }

  // Per process: first, peak and last RSS, growth after warm-up and whether that is flat
  // (the last quarter's mean within max(4 MiB, 5 %) of the mean of the quarter after
  // warm-up), CPU seconds.
  nlohmann::json Summary(double warmup_s, double run_s) const {
    nlohmann::json out = nlohmann::json::object();
    for (const auto& [name, p] : series_) {
      std::vector<double> warm, late;
      const double quarter = (run_s - warmup_s) / 4;
      for (size_t i = 0; i < p.t_s.size(); ++i) {
        if (p.t_s[i] >= warmup_s && p.t_s[i] < warmup_s + quarter) warm.push_back(p.rss_mib[i]);
        if (p.t_s[i] >= run_s - quarter && p.t_s[i] <= run_s) late.push_back(p.rss_mib[i]);
      }
      const auto mean = [](const std::vector<double>& v) {
        double sum = 0;
        for (double x : v) sum += x;
        return v.empty() ? 0.0 : sum / v.size();
      };
      const double growth = mean(late) - mean(warm);
      nlohmann::json j = {
          {"rss_first_mib", p.rss_mib.empty() ? 0 : p.rss_mib.front()},
          {"rss_peak_mib",
           p.rss_mib.empty() ? 0 : *std::max_element(p.rss_mib.begin(), p.rss_mib.end())},
          {"rss_last_mib", p.rss_mib.empty() ? 0 : p.rss_mib.back()},
          {"rss_after_warmup_mib", mean(warm)},
          {"rss_last_quarter_mib", mean(late)},
          {"growth_after_warmup_mib", growth},
          {"flat_after_warmup", growth <= std::max(4.0, 0.05 * mean(warm))},
          {"cpu_s", p.cpu_s},
          {"restarts", p.restarts},
          {"samples", p.t_s.size()}};
      out[name] = j;
    }
    return out;
  }

  double CpuSeconds(const std::string& name) const {
    auto it = series_.find(name);
    return it == series_.end() ? 0 : it->second.cpu_s;
  }

 private:
  static std::vector<pid_t> PostgresPids(const testing::PostgresServer& pg) {
    int master = 0;
    const std::string pidfile = testing::ReadText(pg.dir() + "/data/postmaster.pid");
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(pidfile.substr(0, pidfile.find('\n'))),
                          &master)) {
      return {};
    }
    std::vector<pid_t> pids = {master};
    for (pid_t c : testing::ChildrenOf(master)) pids.push_back(c);
    return pids;
  }

  void Add(const std::string& name, const std::vector<pid_t>& pids, double t_s) {
    ProcessSeries& p = series_[name];
    uint64_t kib = 0, shared = 0;
    double cpu = 0;
    for (pid_t pid : pids) {
      if (pid <= 0) continue;
      if (pids.size() == 1) {
        kib += testing::StatusKib(pid, "VmRSS");
      } else {
        kib += testing::StatusKib(pid, "RssAnon");
        shared = std::max(shared, testing::StatusKib(pid, "RssShmem"));
      }
      cpu += testing::CpuSeconds(pid);
    }
    if (kib == 0) return;  // gone (being restarted)
    p.t_s.push_back(t_s);
    p.rss_mib.push_back(static_cast<double>(kib + shared) / 1024);
    // A restarted process counts its CPU from zero again.
    if (cpu + 0.5 < p.last_cpu) {
      ++p.restarts;
      p.last_cpu = 0;
    }
    p.cpu_s += std::max(0.0, cpu - p.last_cpu);
    p.last_cpu = cpu;
  }

  std::map<std::string, ProcessSeries> series_;
};

// ---- faults ------------------------------------------------------------------------------------

// One fault on the timetable. Its window runs from its start to the next fault's (the last
// one's to the end of the drain); its recovery is judged in that window.
struct Fault {
  std::string name;
  enum Kind { kCalls, kTrainer, kDrop } kind = kCalls;
  absl::Time at;
  double action_s = 0;
  absl::Status status;
  uint64_t jobs_before = 0;                // kTrainer: jobs the other trainers had done
  std::optional<absl::Time> recovered_at;  // kTrainer, kDrop
};

// Kills `child` with SIGKILL and starts it again under the same name (a front on the same
// port, so nginx keeps its address).
absl::Status KillAndRestart(Servers& s, const std::string& role, int index) {
  const std::string name = absl::StrCat(role, "-", index);
  if (role == "front") {
    s.fronts[index]->Kill();
    int port = 0;
    s.fronts[index] = s.launcher->Start("front", name, &port, "", {},
                                        absl::StrCat("127.0.0.1:", s.front_ports[index]));
    if (port != s.front_ports[index]) {
      return absl::InternalError(
          absl::StrCat(name, " did not serve again: ", testing::ReadText(s.launcher->Log(name))));
    }
    return absl::OkStatus();
  }
  s.trainers[index]->Kill();
  // The dead process's status file would count its jobs as the new one's.
  std::filesystem::remove(s.launcher->StatusPath(name));
  s.trainers[index] = s.launcher->Start("trainer", name);
  return absl::OkStatus();
}

void RunFault(const FleetRunOptions& o, Servers& s, Fleet& fleet, Fault& f) {
  f.at = absl::Now();
  if (f.name == "front_kill") {
    f.status = KillAndRestart(s, "front", 0);
  } else if (f.name == "trainer_kill") {
    for (size_t i = 1; i < s.trainers.size(); ++i) f.jobs_before += s.JobsDone(i);
    f.status = KillAndRestart(s, "trainer", 0);
  } else if (f.name == "postgres_restart") {
    f.status = s.postgres->Stop();
    absl::SleepFor(o.postgres_down);
    if (f.status.ok()) f.status = s.postgres->Restart();
  } else if (f.name == "nginx_reload") {
    f.status = s.nginx->Reload(s.Backends());
  } else if (f.name == "device_drop") {
    const int n = fleet.Drop(o.drop_fraction, o.drop_offline);
    if (n == 0) f.status = absl::InternalError("no device was online to drop");
  }
  f.action_s = absl::ToDoubleSeconds(absl::Now() - f.at);
}

// Notes when a trainer fault and a drop have recovered (called as the run goes on).
void WatchRecoveries(const Servers& s, const Fleet& fleet, std::vector<Fault>& faults) {
  for (Fault& f : faults) {
    if (f.recovered_at.has_value() || f.at == absl::InfinitePast()) continue;
    if (f.kind == Fault::kTrainer) {
      uint64_t others = 0;
      for (size_t i = 1; i < s.trainers.size(); ++i) others += s.JobsDone(i);
      if (s.JobsDone(0) > 0 || others > f.jobs_before) f.recovered_at = absl::Now();
    } else if (f.kind == Fault::kDrop) {
      f.recovered_at = fleet.DroppedRecoveredAt();
    }
  }
}

std::vector<Fault> FaultTimetable(const FleetRunOptions& o) {
  if (!o.faults) return {};
  std::vector<Fault> faults = {{"front_kill"},
                               {"trainer_kill", Fault::kTrainer},
                               {"postgres_restart"},
                               {"nginx_reload"},
                               {"device_drop", Fault::kDrop}};
  for (Fault& f : faults) f.at = absl::InfinitePast();  // not begun
  return faults;
}

FaultOutcome Judge(const Fault& f, absl::Time window_end, absl::Time fleet_start,
                   const Fleet& fleet) {
  FaultOutcome out;
  out.name = f.name;
  out.at_s = absl::ToDoubleSeconds(f.at - fleet_start);
  out.action_s = f.action_s;
  std::vector<absl::Time> failures;
  for (absl::Time t : fleet.FailuresSince(f.at)) {
    if (t < window_end) failures.push_back(t);
  }
  out.failed_calls = failures.size();
  if (!f.status.ok()) return out;
  if (f.kind != Fault::kCalls) {
    out.recovered = f.recovered_at.has_value() && *f.recovered_at <= window_end;
    if (out.recovered) out.recovered_s = absl::ToDoubleSeconds(*f.recovered_at - f.at);
    return out;
  }
  const absl::Time last = failures.empty() ? f.at + absl::Seconds(f.action_s)
                                           : *std::max_element(failures.begin(), failures.end());
  out.recovered_s = absl::ToDoubleSeconds(last - f.at);
  // Recovered: calls succeeded after the last failure, and none failed for a while before
  // the window closed.
  const absl::Duration quiet = std::min(absl::Seconds(5), (window_end - f.at) / 4);
  out.recovered = fleet.SuccessesSince(last) > 0 && window_end - last >= quiet;
  return out;
}

// ---- the store afterwards -----------------------------------------------------------------------

// Acked batches (sequence <= a device's acked) that are neither in the sample log nor behind
// the device's committed cursor.
absl::Status CheckStore(const std::string& conninfo, const std::vector<DeviceOutcome>& devices,
                        FleetRunResult& r) {
  absl::StatusOr<std::unique_ptr<cloud::pg::Connection>> conn =
      cloud::pg::Connection::Open(conninfo);
  if (!conn.ok()) return conn.status();
  std::map<std::string, std::set<int64_t>> stored;
  std::map<std::string, int64_t> consumed;
  absl::StatusOr<cloud::pg::Result> rows =
      (*conn)->Exec("SELECT device_id::bytea, sequence FROM samples");
  if (!rows.ok()) return rows.status();
  for (int i = 0; i < rows->rows(); ++i) {
    stored[rows->Bytes(i, 0).value_or("")].insert(rows->Int64(i, 1).value_or(0));
  }
  rows = (*conn)->Exec("SELECT device_id::bytea, consumed_sequence FROM mirror_states");
  if (!rows.ok()) return rows.status();
  for (int i = 0; i < rows->rows(); ++i) {
    consumed[rows->Bytes(i, 0).value_or("")] = rows->Int64(i, 1).value_or(0);
  }
  for (const DeviceOutcome& d : devices) {
    const int64_t cursor = consumed.count(d.id) ? consumed[d.id] : 0;
    const std::set<int64_t>& held = stored[d.id];
    for (int64_t seq = 1; seq <= static_cast<int64_t>(d.acked_sequence); ++seq) {
      ++r.checked_batches;
      if (seq > cursor && held.count(seq) == 0) ++r.lost_batches;
    }
  }
  return absl::OkStatus();
}

// ---- the run
// ---------------------------------------------------------------------------------------

// The fleet's time under load, with the faults at their times, then the drain. Returns
// when the drain ended.
absl::Time Drive(const FleetRunOptions& o, Servers& s, Fleet& fleet, ProcessSampler& sampler,
                 std::vector<Fault>& faults, absl::Time start) {
  const absl::Time end = start + o.duration;
  absl::Time next_sample = start;
  size_t next_fault = 0;
  const auto tick = [&] {
    const absl::Time now = absl::Now();
    if (now >= next_sample) {
      sampler.Sample(s, absl::ToDoubleSeconds(now - start));
      next_sample += o.sample_interval;
    }
    WatchRecoveries(s, fleet, faults);
  };
  while (absl::Now() < end) {
    tick();
    const absl::Time due = start + o.duration * static_cast<double>(next_fault + 1) /
                                       static_cast<double>(faults.size() + 1);
    if (next_fault < faults.size() && absl::Now() >= due) {
      RunFault(o, s, fleet, faults[next_fault++]);
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  fleet.StopProducing();
  const absl::Time drain_deadline = absl::Now() + o.drain_timeout;
  while (absl::Now() < drain_deadline) {
    tick();
    const bool dropped_back = fleet.DroppedRecoveredAt().has_value();
    if (fleet.Queued().first == 0 && dropped_back) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return absl::Now();
}

nlohmann::json FaultsJson(const std::vector<FaultOutcome>& faults) {
  nlohmann::json out = nlohmann::json::array();
  for (const FaultOutcome& f : faults) {
    out.push_back({{"fault", f.name},
                   {"at_s", f.at_s},
                   {"action_s", f.action_s},
                   {"recovered_s", f.recovered_s},
                   {"failed_calls", f.failed_calls},
                   {"recovered", f.recovered}});
  }
  return out;
}

// Calls, batches and jobs per second, and the CPU each process spent per call or batch.
nlohmann::json Rates(const nlohmann::json& fleet_report, const ProcessSampler& sampler,
                     const Servers& s, double run_s) {
  const double calls =
      fleet_report.value("calls_ok", 0.0) + fleet_report.value("calls_refused", 0.0);
  const double batches = fleet_report.value("batches_acked", 0.0);
  uint64_t jobs = 0;
  for (size_t i = 0; i < s.trainers.size(); ++i) jobs += s.JobsDone(i);
  double front_cpu = 0, trainer_cpu = 0;
  for (size_t i = 0; i < s.fronts.size(); ++i)
    front_cpu += sampler.CpuSeconds(absl::StrCat("front-", i));
  for (size_t i = 0; i < s.trainers.size(); ++i) {
    trainer_cpu += sampler.CpuSeconds(absl::StrCat("trainer-", i));
  }
  const auto per = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  return {{"calls_per_s", per(calls, run_s)},
          {"acked_batches_per_s", per(batches, run_s)},
          {"jobs_done_since_last_start", jobs},
          {"trainer_jobs_per_hour", per(static_cast<double>(jobs) * 3600, run_s)},
          {"front_cpu_ms_per_call", per(1000 * front_cpu, calls)},
          {"nginx_cpu_ms_per_call", per(1000 * sampler.CpuSeconds("nginx"), calls)},
          {"postgres_cpu_ms_per_call", per(1000 * sampler.CpuSeconds("postgres"), calls)},
          {"postgres_cpu_ms_per_acked_batch", per(1000 * sampler.CpuSeconds("postgres"), batches)},
          {"trainer_cpu_s_per_job", per(trainer_cpu, static_cast<double>(jobs))},
          {"bench_cpu_ms_per_call", per(1000 * sampler.CpuSeconds("bench"), calls)}};
}

void StopServers(Servers& s) {
  for (auto* group : {&s.fronts, &s.trainers}) {
    for (auto& c : *group) c->Signal(SIGTERM);
    for (auto& c : *group) c->Wait(absl::Seconds(60));
  }
  if (s.nginx) (void)s.nginx->Stop();
}

}  // namespace

absl::StatusOr<FleetRunResult> RunFleet(const FleetRunOptions& options) {
  std::optional<testing::TempDir> temp;
  std::string dir = options.work_dir;
  if (dir.empty()) dir = temp.emplace().path();
  std::filesystem::create_directories(dir);
  std::string checkpoint = options.checkpoint_dir;
  if (checkpoint.empty()) {
    checkpoint = dir + "/family";
    if (absl::Status st = testing::WriteTinyFamily(checkpoint); !st.ok()) return st;
  }
  FleetOptions fo = options.fleet;
  if (absl::Status st = ReadModel(checkpoint, dir + "/model-scratch", fo); !st.ok()) return st;
  absl::StatusOr<std::vector<FleetDevice>> devices = MakeDevices(options.devices, dir + "/tokens");
  if (!devices.ok()) return devices.status();
  fo.devices = *std::move(devices);

  Servers s;
  if (absl::Status st = StartServers(options, dir, checkpoint, s); !st.ok()) return st;
  fo.target = s.nginx->address();
  absl::StatusOr<std::unique_ptr<Fleet>> fleet = Fleet::Create(fo);
  if (!fleet.ok()) return fleet.status();
  ProcessSampler sampler;
  std::vector<Fault> faults = FaultTimetable(options);
  const absl::Time start = absl::Now();
  (*fleet)->Start();
  const absl::Time drained = Drive(options, s, **fleet, sampler, faults, start);
  const double run_s = absl::ToDoubleSeconds(options.duration);

  FleetRunResult r;
  const auto [stuck, queued] = (*fleet)->Queued();
  r.stuck_devices = stuck;
  for (size_t k = 0; k < faults.size(); ++k) {
    const absl::Time window_end = k + 1 < faults.size() ? faults[k + 1].at : drained;
    r.faults.push_back(Judge(faults[k], window_end, start, **fleet));
  }
  const absl::Time quiet_until = faults.empty() ? drained : faults.front().at;
  for (absl::Time t : (*fleet)->FailuresSince(start)) r.errors_outside_faults += t < quiet_until;
  nlohmann::json stuck_list = nlohmann::json::array();
  nlohmann::json hung_list = nlohmann::json::array();
  for (const DeviceOutcome& d : (*fleet)->Outcomes()) {
    if (d.hung) {
      ++r.hung_calls;
      if (hung_list.size() < 10) hung_list.push_back(d.id + ": " + d.call);
    }
    if (d.queued_batches == 0 || stuck_list.size() >= 10) continue;
    stuck_list.push_back({{"id", d.id},
                          {"queued", d.queued_batches},
                          {"first_queued", d.first_queued},
                          {"acked", d.acked_sequence},
                          {"online", d.online},
                          {"registered", d.registered},
                          {"in_call", d.in_call},
                          {"call", d.call},
                          {"failures", d.failures}});
  }
  (*fleet)->Stop();
  nlohmann::json fleet_report = (*fleet)->Report();
  r.ack_regressions = fleet_report.value("ack_regressions", 0ull);
  const nlohmann::json rates = Rates(fleet_report, sampler, s, run_s);
  StopServers(s);
  if (absl::Status st = CheckStore(s.conninfo, (*fleet)->Outcomes(), r); !st.ok()) return st;

  r.report = {{"devices", options.devices},
              {"trainer_nice", options.trainer_nice},
              {"postgres_settings", options.postgres_settings},
              {"fronts", options.fronts},
              {"trainers", options.trainers},
              {"duration_s", run_s},
              {"poll_interval_s", absl::ToDoubleSeconds(fo.poll_interval)},
              {"batch_interval_s", absl::ToDoubleSeconds(fo.batch_interval)},
              {"connections", fleet_report["connections"]},
              {"faults", FaultsJson(r.faults)},
              {"drain_s", absl::ToDoubleSeconds(drained - (start + options.duration))},
              {"stuck_devices", r.stuck_devices},
              {"batches_still_queued", queued},
              {"stuck", stuck_list},
              {"hung_calls", r.hung_calls},
              {"hung", hung_list},
              {"acked_batches_checked", r.checked_batches},
              {"acked_batches_lost", r.lost_batches},
              {"errors_outside_faults", r.errors_outside_faults},
              {"fleet", fleet_report},
              {"rates", rates},
              {"processes", sampler.Summary(options.warmup_fraction * run_s, run_s)}};
  return r;
}

}  // namespace cdcca::fleet
