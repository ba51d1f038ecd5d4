#include "sim/report.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "sim/report_html.h"
#include "storage/env.h"

namespace cdcca::sim {

namespace {

using json = nlohmann::json;

// Per method and round (0 = before adaptation): the figures averaged over devices and the
// bytes summed over them.
struct RoundSummary {
  int round = 0;
  std::string domain;  // of device 0 (devices may differ when staggered)
  double da = 0, mc = 0;
  double uplink_payload = 0, uplink_wire = 0, downlink_payload = 0, downlink_wire = 0;
  double uplink_seconds = 0, downlink_seconds = 0, job_seconds = 0;
  double queue_seconds = 0, queue_max = 0;  // scheduler: sum and max over the round's jobs
  double frames = 0, kept_samples = 0, kept_tokens = 0;
  double updates = 0;   // devices that received an update this round
  double withheld = 0;  // devices whose update the cloud's guard withheld this round
  double restored = 0;  // of those, devices the guard returned to the pretrained base
  bool in_sync = true;
};

std::vector<RoundSummary> Summarize(const MethodResult& m, int devices) {
  std::map<int, RoundSummary> by_round;
  for (const DeviceRound& r : m.rounds) {
    RoundSummary& s = by_round[r.round];
    s.round = r.round;
    if (r.device == 0) s.domain = r.domain;
    s.da += r.da / devices;
    s.mc += r.mc / devices;
    s.uplink_payload += static_cast<double>(r.uplink_payload_bytes);
    s.uplink_wire += static_cast<double>(r.uplink_wire_bytes);
    s.downlink_payload += static_cast<double>(r.downlink_payload_bytes);
    s.downlink_wire += static_cast<double>(r.downlink_wire_bytes);
    s.uplink_seconds = std::max(s.uplink_seconds, r.uplink_seconds);
    s.downlink_seconds = std::max(s.downlink_seconds, r.downlink_seconds);
    s.job_seconds += r.job_seconds;
    s.queue_seconds += r.queue_seconds;
    s.queue_max = std::max(s.queue_max, r.queue_seconds);
    s.frames += static_cast<double>(r.frames);
    s.kept_samples += static_cast<double>(r.kept_samples);
    s.kept_tokens += static_cast<double>(r.kept_tokens);
    s.updates += r.downlink_payload_bytes > 0 ? 1 : 0;
    s.withheld += r.update_withheld ? 1 : 0;
    s.restored += r.restored_base ? 1 : 0;
    s.in_sync = s.in_sync && r.in_sync;
  }
  std::vector<RoundSummary> out;
  for (auto& [round, s] : by_round) out.push_back(s);
  return out;
}

bool UsesCloud(const MethodResult& m) {
  for (const DeviceRound& r : m.rounds) {
    if (r.uplink_wire_bytes > 0) return true;
  }
  return false;
}

// Whether MC accuracy is worth a column: text-shift rounds ask multiple-choice questions.
// (Caption runs always show their second figure, BLEU-4.)
bool ShowMc(const RunResult& run) {
  if (run.experiment.captioning()) return true;
  for (const RoundDomain& d : run.experiment.schedule) {
    if (d.text || d.continual) return true;
  }
  return false;
}

// What da / mc hold (DeviceRound): the VQA accuracies, or a caption run's CIDEr-D and
// BLEU-4 over all categories.
std::string MetricName(const RunResult& run, bool mc) {
  if (run.experiment.captioning()) return "CIDEr-D / BLEU-4 (all categories)";
  return mc ? "DA / MC" : "DA";
}
std::string PointName(const RunResult& run) {
  return run.experiment.captioning() ? "CIDEr-D points" : "DA points";
}

// The paper's Table 2 layout: per method, after the last round (mean over devices), BLEU-4
// and CIDEr-D per caption category and over all, and the gain over source-only on "all".
std::string CaptionTableMarkdown(const RunResult& run) {
  const Experiment& e = run.experiment;
  struct Row {
    std::string method;
    std::vector<DeviceRound::CaptionScore> scores;
  };
  std::vector<Row> rows;
  for (const MethodResult& m : run.methods) {
    Row row{m.method, {}};
    for (const DeviceRound& r : m.rounds) {
      if (r.round != e.rounds) continue;
      if (row.scores.empty()) row.scores.resize(r.captions.size());
      for (size_t c = 0; c < r.captions.size() && c < row.scores.size(); ++c) {
        row.scores[c].category = r.captions[c].category;
        row.scores[c].bleu4 += r.captions[c].bleu4 / e.devices;
        row.scores[c].cider += r.captions[c].cider / e.devices;
        row.scores[c].images += r.captions[c].images;
      }
    }
    rows.push_back(std::move(row));
  }
  if (rows.empty() || rows.front().scores.empty()) return "";
  std::string md = absl::StrCat("## Captions after round ", e.rounds,
                                " (BLEU-4 / CIDEr-D, %; the paper's Table 2 layout)\n\n| method |");
  for (const auto& c : rows.front().scores) absl::StrAppend(&md, " ", c.category, " |");
  md += " gain BLEU-4 | gain CIDEr-D |\n|---|";
  for (size_t c = 0; c < rows.front().scores.size() + 2; ++c) md += "---|";
  md += "\n";
  const Row* source = nullptr;
  for (const Row& r : rows) {
    if (r.method == "source-only") source = &r;
  }
  for (const Row& r : rows) {
    absl::StrAppend(&md, "| ", r.method, " |");
    for (const auto& c : r.scores) absl::StrAppendFormat(&md, " %.2f / %.2f |", c.bleu4, c.cider);
    if (source != nullptr && !r.scores.empty() && source->scores.size() == r.scores.size()) {
      absl::StrAppendFormat(&md, " %+.2f | %+.2f |\n",
                            r.scores.back().bleu4 - source->scores.back().bleu4,
                            r.scores.back().cider - source->scores.back().cider);
    } else {
      md += " | |\n";
    }
  }
  return md + "\n";
}

std::string Kb(double bytes) { return absl::StrFormat("%.1f", bytes / 1000.0); }

// Transmission figures of a cloud method, totalled over rounds and devices.
struct Transmission {
  double frames = 0, kept = 0, up_payload = 0, up_wire = 0, down_payload = 0, down_wire = 0;
  double up_seconds = 0, down_seconds = 0, updates = 0;
};
Transmission Totals(const std::vector<RoundSummary>& rounds) {
  Transmission t;
  for (const RoundSummary& r : rounds) {
    if (r.round == 0) continue;
    t.frames += r.frames;
    t.kept += r.kept_samples;
    t.up_payload += r.uplink_payload;
    t.up_wire += r.uplink_wire;
    t.down_payload += r.downlink_payload;
    t.down_wire += r.downlink_wire;
    t.up_seconds += r.uplink_seconds;
    t.down_seconds += r.downlink_seconds;
    t.updates += r.updates;
  }
  return t;
}

// CD-CCA against another method on the same evaluation questions: the mean over adapted
// rounds (and devices) of the per-question DA difference, in points, and its standard
// error from the per-question differences. Paired, so it is far tighter than the error of
// either accuracy alone. Absent when the two runs did not score the same questions.
struct Paired {
  std::string reference, method;
  double diff = 0, se = 0;
  int64_t questions = 0;
};

// The paired difference over the adapted device rounds whose round number `take` accepts.
template <typename Take>
std::optional<Paired> PairWhere(const MethodResult& ref, const MethodResult& m, Take take) {
  if (m.rounds.size() != ref.rounds.size()) return std::nullopt;
  double sum = 0, sum2 = 0;
  int64_t n = 0;
  for (size_t k = 0; k < m.rounds.size(); ++k) {
    const DeviceRound& a = ref.rounds[k];
    const DeviceRound& b = m.rounds[k];
    if (a.round == 0 || !take(a.round)) continue;
    if (a.round != b.round || a.device != b.device || a.domain != b.domain ||
        a.question_da.size() != b.question_da.size()) {
      return std::nullopt;
    }
    for (size_t q = 0; q < a.question_da.size(); ++q) {
      const double d = static_cast<double>(a.question_da[q]) - b.question_da[q];
      sum += d;
      sum2 += d * d;
      ++n;
    }
  }
  if (n < 2) return std::nullopt;
  const double mean = sum / static_cast<double>(n);
  const double var = (sum2 - static_cast<double>(n) * mean * mean) / static_cast<double>(n - 1);
  return Paired{ref.method, m.method, 100 * mean,
                100 * std::sqrt(std::max(0.0, var) / static_cast<double>(n)), n};
}

std::optional<Paired> Pair(const MethodResult& ref, const MethodResult& m) {
  return PairWhere(ref, m, [](int) { return true; });
}

// One adapted round of a method against source-only on that round's questions (all devices).
struct RoundPaired {
  int round = 0;
  Paired paired;
  // Below source-only beyond evaluation noise: z < -2 (every question worse when SE is 0).
  bool below() const { return paired.diff < 0 && (paired.se == 0 || paired.diff / paired.se < -2); }
  std::string Cell() const {
    return paired.se > 0 ? absl::StrFormat("%+.2f (z %+.1f)", paired.diff, paired.diff / paired.se)
                         : absl::StrFormat("%+.2f", paired.diff);
  }
};

// Every adapted round of `m` against `source`; empty where they did not score the same
// questions.
std::vector<RoundPaired> RoundsAgainst(const MethodResult& m, const MethodResult& source,
                                       int rounds) {
  std::vector<RoundPaired> out;
  for (int r = 1; r <= rounds; ++r) {
    std::optional<Paired> p = PairWhere(m, source, [r](int round) { return round == r; });
    if (!p) return {};
    out.push_back({r, *p});
  }
  return out;
}

// Every CD-CCA run of the experiment against the methods it is meant to beat: plain
// "cd-cca" against every other method; "cd-cca@r" against source-only and the other
// methods at the same token ratio (the paper's Table 4 pairs).
std::vector<Paired> PairedComparisons(const RunResult& run) {
  std::vector<Paired> out;
  for (const MethodResult& ref : run.methods) {
    const MethodName r = ParseMethodName(ref.method);
    if (r.base != "cd-cca") continue;
    for (const MethodResult& m : run.methods) {
      const MethodName n = ParseMethodName(m.method);
      if (n.base == "cd-cca") continue;
      if (r.token_ratio != 0 && n.base != "source-only" && n.token_ratio != r.token_ratio) continue;
      if (std::optional<Paired> p = Pair(ref, m)) out.push_back(*p);
    }
  }
  return out;
}

// Writes `text` to `path` through the one durable-file layer: a reader never sees half a
// file, and a crash leaves the old report or the new one.
absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  return storage::WriteFileAtomically(*storage::Env::Default(), path, text);
}

// One comparison followed over several seeds: per seed the paired difference and its
// question-level standard error (NaN where that seed could not pair them).
struct SeedRow {
  std::string reference, method;
  std::vector<double> diff, se;
};

const MethodResult* FindMethod(const RunResult& run, const std::string& name) {
  for (const MethodResult& m : run.methods) {
    if (m.method == name) return &m;
  }
  return nullptr;
}

// Rows: every method's gain over source-only (where the runs have source-only), then CD-CCA
// against each method.
std::vector<SeedRow> SeedRows(const std::vector<RunResult>& runs) {
  std::vector<std::pair<std::string, std::string>> pairs;
  if (FindMethod(runs.front(), "source-only") != nullptr) {
    for (const MethodResult& m : runs.front().methods) {
      if (m.method != "source-only") pairs.emplace_back(m.method, "source-only");
    }
  }
  for (const Paired& p : PairedComparisons(runs.front())) {
    if (p.method != "source-only") pairs.emplace_back(p.reference, p.method);
  }
  std::vector<SeedRow> rows;
  for (const auto& [reference, method] : pairs) {
    SeedRow row{reference, method, {}, {}};
    for (const RunResult& run : runs) {
      const MethodResult* a = FindMethod(run, reference);
      const MethodResult* b = FindMethod(run, method);
      std::optional<Paired> p;
      if (a != nullptr && b != nullptr) p = Pair(*a, *b);
      row.diff.push_back(p ? p->diff : std::nan(""));
      row.se.push_back(p ? p->se : std::nan(""));
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

// Mean over the seeds that have a value, the standard error of that mean across seeds
// (sample SD / sqrt(k); NaN below two seeds) and the question-level SE of the mean
// (sqrt(sum se^2) / k: evaluation noise only, no training noise).
struct SeedStats {
  int seeds = 0;
  double mean = 0, se_across = std::nan(""), se_questions = 0;
};
SeedStats Across(const SeedRow& row) {
  SeedStats s;
  double sum = 0, se2 = 0;
  for (size_t i = 0; i < row.diff.size(); ++i) {
    if (std::isnan(row.diff[i])) continue;
    ++s.seeds;
    sum += row.diff[i];
    se2 += row.se[i] * row.se[i];
  }
  if (s.seeds == 0) return s;
  s.mean = sum / s.seeds;
  s.se_questions = std::sqrt(se2) / s.seeds;
  if (s.seeds >= 2) {
    double ss = 0;
    for (double d : row.diff) {
      if (!std::isnan(d)) ss += (d - s.mean) * (d - s.mean);
    }
    s.se_across = std::sqrt(ss / (s.seeds - 1) / s.seeds);
  }
  return s;
}

constexpr double kHdFrameBytes = 1920.0 * 1080 * 3;

// The cloud scheduler's queueing delay (trigger to job start) per adapted round: mean / max
// over the round's jobs, seconds.
std::vector<std::string> QueueDelays(const std::vector<RoundSummary>& rounds) {
  std::vector<std::string> out;
  for (const RoundSummary& r : rounds) {
    if (r.round == 0) continue;
    out.push_back(r.updates > 0
                      ? absl::StrFormat("%.2f / %.2f", r.queue_seconds / r.updates, r.queue_max)
                      : std::string("-"));
  }
  return out;
}

}  // namespace

std::string SummaryTable(const RunResult& run) {
  const Experiment& e = run.experiment;
  const bool mc = ShowMc(run);
  std::string header = absl::StrFormat("%-16s", "method");
  for (int r = 0; r <= e.rounds; ++r) {
    absl::StrAppendFormat(&header, " %9s",
                          r == 0 ? std::string("before") : absl::StrCat("round ", r));
  }
  absl::StrAppend(&header, "  uplink KB  downlink KB");
  std::string out = absl::StrCat(e.name, ": ", e.captioning() ? "captions " : "VQA ",
                                 MetricName(run, mc), e.captioning() ? " (%)" : " accuracy (%)",
                                 ", mean over ", e.devices, " device(s)\n", header, "\n");
  for (const MethodResult& m : run.methods) {
    std::vector<RoundSummary> rounds = Summarize(m, e.devices);
    absl::StrAppendFormat(&out, "%-16s", m.method);
    for (const RoundSummary& r : rounds) {
      if (mc) {
        absl::StrAppendFormat(&out, " %4.1f/%4.1f", r.da, r.mc);
      } else {
        absl::StrAppendFormat(&out, " %9.2f", r.da);
      }
    }
    const Transmission t = Totals(rounds);
    if (UsesCloud(m)) {
      absl::StrAppendFormat(&out, "  %9s  %11s", Kb(t.up_payload), Kb(t.down_payload));
    } else {
      absl::StrAppendFormat(&out, "  %9s  %11s", "-", "-");
    }
    out += "\n";
  }
  for (const Paired& p : PairedComparisons(run)) {
    absl::StrAppendFormat(&out, "%s minus %s: %+.2f %s (paired SE %.2f)\n", p.reference, p.method,
                          p.diff, PointName(run), p.se);
  }
  for (const MethodResult& m : run.methods) {
    if (!UsesCloud(m)) continue;
    absl::StrAppend(&out, m.method, " scheduler queueing delay per round (mean / max s): ",
                    absl::StrJoin(QueueDelays(Summarize(m, e.devices)), ", "), "\n");
  }
  if (e.captioning()) absl::StrAppend(&out, "\n", CaptionTableMarkdown(run));
  return out;
}

namespace {

// Where the devices' LoRA sits beyond the LM's q and v.
std::string AdapterExtras(const Experiment& e) {
  return absl::StrCat(e.lora_mlp ? ", MLP too" : "", e.lora_qformer ? ", Q-Former too" : "",
                      e.lora_projector ? ", projector too" : "",
                      e.lora_vision ? ", vision tower too" : "");
}

}  // namespace

std::string MarkdownReport(const RunResult& run) {
  const Experiment& e = run.experiment;
  const bool mc = ShowMc(run);
  std::string md = absl::StrCat("# ", e.title.empty() ? e.name : e.title, "\n\n");
  if (!e.paper_table.empty()) absl::StrAppend(&md, "Reproduces the paper's ", e.paper_table, ". ");
  absl::StrAppend(&md, e.description, "\n\n");
  const std::string models =
      e.hub()
          ? absl::StrFormat("Teacher `%s`, student `%s` (LoRA r %d, alpha %g%s on the devices)",
                            e.teacher, e.student_base, e.lora_rank, e.lora_alpha, AdapterExtras(e))
          : absl::StrFormat(
                "Models `%s` (teacher `%s/teacher`, student `%s`; LoRA r %d, alpha %g%s on the "
                "devices)",
                e.checkpoint, e.checkpoint, e.checkpoint, e.lora_rank, e.lora_alpha,
                AdapterExtras(e));
  absl::StrAppendFormat(&md,
                        "%s (%s student base), %d device(s), %d round(s) of %d frames, "
                        "evaluation on %d held-out scenes per round, seed %d, %.0f s.\n\n",
                        models, e.precision, e.devices, e.rounds, e.stream_frames, e.eval_scenes,
                        static_cast<int>(run.seed), run.seconds);
  // What the cloud methods uplink (NAME@R and the UTS ablations override parts of it).
  const std::string stage1 =
      e.uts.keep_fraction >= 1
          ? std::string("every frame")
          : absl::StrFormat("about %.0f%% of the frames (answer entropy above a running quantile)",
                            100 * e.uts.keep_fraction);
  absl::StrAppendFormat(
      &md,
      "UTS uplink of the cloud methods (`NAME@R` and the UTS ablations change it): stage 1 keeps "
      "%s, stage 2 %.0f%% of each kept frame's visual tokens by `%s` (%d dropout passes at "
      "p = %.2f); %s.\n\n",
      stage1, 100 * e.uts.token_ratio, e.uts.score, e.uts.mc_passes, e.uts.dropout_p,
      e.uts.precision == "jpeg"
          ? std::string("the device sends the frame as JPEG (quality 90, at the tower's input "
                        "size) with the kept indices, and the cloud recomputes the tokens")
          : absl::StrCat("features in ", e.uts.precision));
  if (e.captioning()) absl::StrAppend(&md, CaptionTableMarkdown(run));
  // Accuracy table.
  absl::StrAppend(&md, e.captioning() ? "## Per round (" : "## Accuracy (", MetricName(run, mc),
                  ", %)\n\n| method |");
  for (int r = 0; r <= e.rounds; ++r) {
    absl::StrAppend(&md, r == 0 ? std::string(" before |") : absl::StrCat(" round ", r, " |"));
  }
  absl::StrAppend(&md, " mean over rounds | vs source-only |\n|---|");
  for (int r = 0; r <= e.rounds + 2; ++r) md += "---|";
  md += "\n";
  std::vector<RoundSummary> first = Summarize(run.methods.front(), e.devices);
  absl::StrAppend(&md, "| domain |");
  for (const RoundSummary& r : first) absl::StrAppend(&md, " ", r.domain, " |");
  md += " | |\n";
  const std::vector<RoundSummary>* source = nullptr;
  std::vector<RoundSummary> source_rounds;
  for (const MethodResult& m : run.methods) {
    if (m.method == "source-only") {
      source_rounds = Summarize(m, e.devices);
      source = &source_rounds;
    }
  }
  for (const MethodResult& m : run.methods) {
    std::vector<RoundSummary> rounds = Summarize(m, e.devices);
    absl::StrAppend(&md, "| ", m.method, " |");
    double sum = 0;
    for (const RoundSummary& r : rounds) {
      if (mc) {
        absl::StrAppendFormat(&md, " %.2f / %.2f |", r.da, r.mc);
      } else {
        absl::StrAppendFormat(&md, " %.2f |", r.da);
      }
      if (r.round > 0) sum += r.da;
    }
    const double mean = sum / e.rounds;
    if (source != nullptr) {
      // Mean over rounds of the difference to the un-adapted student on the same domain.
      double base = 0;
      for (const RoundSummary& r : *source) base += r.round > 0 ? r.da : 0;
      absl::StrAppendFormat(&md, " %.2f | %+.2f |\n", mean, mean - base / e.rounds);
    } else {
      absl::StrAppendFormat(&md, " %.2f | |\n", mean);
    }
  }
  // Transmission table (the paper's Table 5 layout).
  md +=
      "\n## Transmission (all rounds and devices)\n\n"
      "| method | frames | uplinked samples | uplink payload KB | per frame B | vs 1080p frames | "
      "vs model-input frames | uplink on the wire KB | updates | downlink payload KB | "
      "per update KB | bits/param | uplink s | downlink s | in sync |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const MethodResult& m : run.methods) {
    if (!UsesCloud(m)) continue;
    std::vector<RoundSummary> rounds = Summarize(m, e.devices);
    const Transmission t = Totals(rounds);
    bool sync = true;
    for (const RoundSummary& r : rounds) sync = sync && r.in_sync;
    const double per_update = t.updates > 0 ? t.down_payload / t.updates : 0;
    absl::StrAppendFormat(
        &md,
        "| %s | %.0f | %.0f | %s | %.0f | %.4f%% | %.2f%% | %s | %.0f | %s | %s | %.2f | %.2f | "
        "%.2f | %s |\n",
        m.method, t.frames, t.kept, Kb(t.up_payload), t.up_payload / std::max(1.0, t.frames),
        100 * t.up_payload / (t.frames * kHdFrameBytes),
        100 * t.up_payload / (t.frames * static_cast<double>(m.raw_frame_bytes)), Kb(t.up_wire),
        t.updates, Kb(t.down_payload), Kb(per_update),
        per_update * 8 / std::max<double>(1, static_cast<double>(m.trainable_parameters)),
        t.up_seconds, t.down_seconds, sync ? "yes" : "NO");
  }
  md +=
      "\nPaper (Table 5): 65.54 KB uplinked for five 1920x1080 frames (0.21% of 31.10 MB); "
      "1.65M parameters downlinked in 0.791 MB (3.8 bits/param).\n"
      "Per-frame uplink is the UTS payload divided by every frame the devices saw (kept or "
      "not). Transfer seconds are measured over the emulated link (";
  absl::StrAppendFormat(&md, "%.0f/%.0f Mbit/s up/down, %.0f ms one way, %.2f%% segment loss).\n",
                        e.link.up_mbit_s, e.link.down_mbit_s, e.link.latency_ms, 100 * e.link.loss);
  // The cloud scheduler: how long each round's jobs waited for a worker.
  bool scheduler_header = false;
  for (const MethodResult& m : run.methods) {
    if (!UsesCloud(m)) continue;
    if (!scheduler_header) {
      absl::StrAppendFormat(&md,
                            "\n## Cloud scheduler\n\nQueueing delay of the round's jobs, from "
                            "the trigger to the job's start (%d worker(s); measured seconds, "
                            "mean / max over devices), and the most jobs triggered and not "
                            "finished at once.\n\n| method |",
                            e.job.workers);
      for (int r = 1; r <= e.rounds; ++r) absl::StrAppend(&md, " round ", r, " |");
      md += " jobs in flight |\n|---|";
      for (int r = 0; r <= e.rounds; ++r) md += "---|";
      md += "\n";
      scheduler_header = true;
    }
    absl::StrAppend(&md, "| ", m.method, " | ",
                    absl::StrJoin(QueueDelays(Summarize(m, e.devices)), " | "), " | ",
                    m.peak_jobs_in_flight, " |\n");
  }
  // The cloud's update guard: updates withheld per round.
  bool guard_header = false;
  for (const MethodResult& m : run.methods) {
    if (!UsesCloud(m)) continue;
    if (!guard_header) {
      absl::StrAppend(&md,
                      "\n## Update guard\n\nUpdates the cloud withheld per round (of the "
                      "devices' jobs) because they did not raise ",
                      e.job.guard_measure == "teacher_probability"
                          ? "the teacher's probability of the student's answers"
                      : e.job.guard_measure == "teacher_and_base"
                          ? "the mean of the teacher's and the pretrained student's probability "
                            "of the student's answers"
                          : "the student's agreement with the teacher",
                      " on the device's held-out samples beyond noise; such a device "
                      "stays at its version, or returns to the pretrained base (\"N to base\") "
                      "where the base beat its version on the same samples by the same "
                      "rule.\n\n| method |");
      for (int r = 1; r <= e.rounds; ++r) absl::StrAppend(&md, " round ", r, " |");
      md += " total |\n|---|";
      for (int r = 0; r < e.rounds + 1; ++r) md += "---|";
      md += "\n";
      guard_header = true;
    }
    absl::StrAppend(&md, "| ", m.method, " |");
    double total = 0, restored = 0;
    for (const RoundSummary& r : Summarize(m, e.devices)) {
      if (r.round == 0) continue;
      absl::StrAppendFormat(&md, " %.0f", r.withheld);
      if (r.restored > 0) absl::StrAppendFormat(&md, " (%.0f to base)", r.restored);
      md += " |";
      total += r.withheld;
      restored += r.restored;
    }
    absl::StrAppendFormat(&md, " %.0f", total);
    if (restored > 0) absl::StrAppendFormat(&md, " (%.0f to base)", restored);
    md += " |\n";
  }
  // Each adapted round against source-only: is any round below it beyond noise?
  if (const MethodResult* source = FindMethod(run, "source-only")) {
    std::string rows;
    for (const MethodResult& m : run.methods) {
      if (&m == source) continue;
      const std::vector<RoundPaired> rounds = RoundsAgainst(m, *source, e.rounds);
      if (rounds.empty()) continue;
      absl::StrAppend(&rows, "| ", m.method, " |");
      int below = 0;
      for (const RoundPaired& r : rounds) {
        absl::StrAppend(&rows, " ", r.Cell(), " |");
        below += r.below() ? 1 : 0;
      }
      absl::StrAppend(&rows, " ", below, " of ", rounds.size(), " |\n");
    }
    if (!rows.empty()) {
      absl::StrAppend(
          &md, "\n## Each round against source-only\n\nPer adapted round, the method's ",
          e.captioning() ? "CIDEr-D" : "DA", " minus source-only's on the round's ",
          e.captioning() ? "images" : "questions", " (paired, all devices), in ", PointName(run),
          ", and z = difference / paired SE. A round with z < -2 is below source-only "
          "beyond evaluation noise.\n\n| method |");
      for (int r = 1; r <= e.rounds; ++r) absl::StrAppend(&md, " round ", r, " |");
      md += " rounds below beyond noise |\n|---|";
      for (int r = 0; r <= e.rounds; ++r) md += "---|";
      absl::StrAppend(&md, "\n", rows);
    }
  }
  // Paired comparison of CD-CCA with every other method.
  const std::vector<Paired> paired = PairedComparisons(run);
  if (!paired.empty()) {
    md += absl::StrCat(
        "\n## CD-CCA against each method, paired on the same ",
        e.captioning() ? "images" : "questions", "\n\nMean over the adapted rounds of the per-",
        e.captioning() ? "image CIDEr-D" : "question DA",
        " difference (CD-CCA minus the method), with the standard error of that mean over "
        "the ",
        e.captioning() ? "images" : "questions",
        ". |z| > 2 is a difference beyond evaluation noise.\n\n"
        "| CD-CCA | method | CD-CCA minus method, ",
        PointName(run), " | paired SE | z | ", e.captioning() ? "images" : "questions",
        " |\n|---|---|---|---|---|---|\n");
    for (const Paired& p : paired) {
      absl::StrAppendFormat(&md, "| %s | %s | %+.2f | %.2f | %+.1f | %d |\n", p.reference, p.method,
                            p.diff, p.se, p.se > 0 ? p.diff / p.se : 0.0, p.questions);
    }
  }
  md += "\nPlots: `report.html` (accuracy per round, bytes per round, transfer latency).\n";
  return md;
}

absl::Status WriteReport(const RunResult& run, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  const Experiment& e = run.experiment;
  auto write = [&](const std::string& name, const std::string& text) {
    return WriteFileAtomically(dir + "/" + name, text);
  };
  // results.json and results.csv: every device and round.
  json j;
  j["experiment"] = e.name;
  j["paper_table"] = e.paper_table;
  j["seed"] = run.seed;
  j["seconds"] = run.seconds;
  j["devices"] = e.devices;
  j["rounds"] = e.rounds;
  j["job_workers"] = e.job.workers;
  j["task"] = e.task;
  if (e.hub()) {
    j["teacher"] = e.teacher;
    j["student_base"] = e.student_base;
  } else {
    j["checkpoint"] = e.checkpoint;
  }
  j["precision"] = e.precision;
  // The round's settings under the programs' names, as `cdcca-sim --print_config` prints
  // them: what `cdcca-cloud` and `cdcca-device` must be given to run what this run measured.
  if (absl::StatusOr<std::string> settings = RoundSettingsJson(e); settings.ok()) {
    j["settings"] = json::parse(*settings);
  }
  // What "da" and "mc" hold: VQA accuracies, or a caption run's CIDEr-D and BLEU-4 (all).
  j["metrics"] = e.captioning() ? json{"cider_all", "bleu4_all"} : json{"da", "mc"};
  std::string csv =
      "method,device,round,domain,da,mc,questions,frames,kept_samples,kept_tokens,"
      "uplink_payload_bytes,uplink_wire_bytes,downlink_payload_bytes,downlink_wire_bytes,"
      "uplink_seconds,downlink_seconds,job_seconds,version,in_sync,answer_ms,queue_seconds,"
      "update_withheld\n";
  for (const MethodResult& m : run.methods) {
    json jm;
    jm["method"] = m.method;
    jm["trainable_parameters"] = m.trainable_parameters;
    jm["raw_frame_bytes"] = m.raw_frame_bytes;
    jm["peak_devices_streaming"] = m.peak_devices_streaming;
    jm["peak_jobs_in_flight"] = m.peak_jobs_in_flight;
    jm["peak_jobs_running"] = m.peak_jobs_running;
    // Per round (1, 2, ...): the devices whose update the cloud's guard withheld.
    jm["updates_withheld_per_round"] = json::array();
    for (const RoundSummary& r : Summarize(m, e.devices)) {
      if (r.round > 0) jm["updates_withheld_per_round"].push_back(r.withheld);
    }
    // Per adapted round: the method minus source-only on the round's questions.
    if (const MethodResult* source = FindMethod(run, "source-only");
        source != nullptr && source != &m) {
      for (const RoundPaired& r : RoundsAgainst(m, *source, e.rounds)) {
        jm["rounds_vs_source_only"].push_back({{"round", r.round},
                                               {"difference", r.paired.diff},
                                               {"standard_error", r.paired.se},
                                               {"questions", r.paired.questions},
                                               {"below_beyond_noise", r.below()}});
      }
    }
    for (const DeviceRound& r : m.rounds) {
      jm["rounds"].push_back(
          {{"device", r.device},
           {"round", r.round},
           {"domain", r.domain},
           {"da", r.da},
           {"mc", r.mc},
           {"questions", r.questions},
           {"frames", r.frames},
           {"kept_samples", r.kept_samples},
           {"kept_tokens", r.kept_tokens},
           {"uplink_payload_bytes", r.uplink_payload_bytes},
           {"uplink_wire_bytes", r.uplink_wire_bytes},
           {"downlink_payload_bytes", r.downlink_payload_bytes},
           {"downlink_wire_bytes", r.downlink_wire_bytes},
           {"uplink_seconds", r.uplink_seconds},
           {"downlink_seconds", r.downlink_seconds},
           {"job_seconds", r.job_seconds},
           {"queue_seconds", r.queue_seconds},
           {"version", r.version},
           {"state_digest", absl::StrFormat("%016x", r.state_digest)},
           {"in_sync", r.in_sync},
           {"answer_ms", r.answer_ms},
           {"update_withheld", r.update_withheld},
           {"restored_base", r.restored_base},
           {"withheld_measured", r.withheld_measured},
           {"withheld_da", r.withheld_da},
           {"withheld_gain", r.withheld_gain},
           {"withheld_gain_se", r.withheld_gain_se},
           {"guard",
            {{"pool", r.guard_pool}, {"before", r.guard_before}, {"after", r.guard_after}}}});
      if (!r.captions.empty()) {
        json& jr = jm["rounds"].back();
        for (const DeviceRound::CaptionScore& c : r.captions) {
          jr["captions"].push_back({{"category", c.category},
                                    {"bleu4", c.bleu4},
                                    {"cider", c.cider},
                                    {"images", c.images}});
        }
      }
      absl::StrAppendFormat(
          &csv, "%s,%d,%d,%s,%.4f,%.4f,%d,%d,%d,%d,%d,%d,%d,%d,%.4f,%.4f,%.4f,%d,%d,%.3f,%.4f,%d\n",
          m.method, r.device, r.round, r.domain, r.da, r.mc, r.questions, r.frames, r.kept_samples,
          r.kept_tokens, r.uplink_payload_bytes, r.uplink_wire_bytes, r.downlink_payload_bytes,
          r.downlink_wire_bytes, r.uplink_seconds, r.downlink_seconds, r.job_seconds, r.version,
          r.in_sync ? 1 : 0, r.answer_ms, r.queue_seconds, r.update_withheld ? 1 : 0);
    }
    j["methods"].push_back(jm);
  }
  for (const Paired& p : PairedComparisons(run)) {
    j["cd_cca_paired"].push_back({{"reference", p.reference},
                                  {"method", p.method},
                                  {"da_difference", p.diff},
                                  {"standard_error", p.se},
                                  {"questions", p.questions}});
  }
  // report.html: the markdown report as HTML (tables as <table>) plus the plots; sizes and
  // times are plotted from 0, accuracies on a fitted axis that the chart's title flags.
  std::vector<std::string> x;
  for (int r = 0; r <= e.rounds; ++r) x.push_back(r == 0 ? "before" : absl::StrCat("round ", r));
  std::vector<ChartSeries> acc, up, down, latency;
  for (const MethodResult& m : run.methods) {
    std::vector<RoundSummary> rounds = Summarize(m, e.devices);
    ChartSeries a{m.method, {}}, u{m.method, {}}, d{m.method, {}}, l{m.method, {}};
    for (const RoundSummary& r : rounds) {
      a.y.push_back(r.da);
      if (r.round == 0) continue;
      u.y.push_back(r.uplink_payload / 1000);
      d.y.push_back(r.downlink_payload / 1000);
      l.y.push_back(r.uplink_seconds + r.downlink_seconds);
    }
    acc.push_back(a);
    if (UsesCloud(m)) {
      up.push_back(u);
      down.push_back(d);
      latency.push_back(l);
    }
  }
  std::vector<std::string> xr(x.begin() + 1, x.end());
  const std::string chart_title =
      e.captioning() ? "Caption CIDEr-D (all categories) per round" : "VQA DA accuracy per round";
  const std::string chart_unit = e.captioning() ? "CIDEr-D %" : "accuracy %";
  const std::string acc_chart = LineChartSvg(chart_title, chart_unit, x, acc, YAxis::kFitted);
  std::vector<std::string> charts = {acc_chart};
  if (!up.empty()) {
    charts.push_back(
        LineChartSvg("Uplink payload per round (all devices)", "KB", xr, up, YAxis::kFromZero));
    charts.push_back(
        LineChartSvg("Downlink payload per round (all devices)", "KB", xr, down, YAxis::kFromZero));
    charts.push_back(LineChartSvg("Transfer latency per round (uplink + downlink)", "seconds", xr,
                                  latency, YAxis::kFromZero));
  }
  const std::string html = HtmlReportPage(e.name, MarkdownReport(run), charts);
  if (absl::Status s = write("results.json", j.dump(2) + "\n"); !s.ok()) return s;
  if (absl::Status s = write("results.csv", csv); !s.ok()) return s;
  if (absl::Status s = write("report.md", MarkdownReport(run)); !s.ok()) return s;
  if (absl::Status s = write("accuracy.svg", acc_chart); !s.ok()) {
    return s;
  }
  return write("report.html", html);
}

// Per method (not source-only, not the teacher), per seed: its paired gain over source-only
// as a share of the teacher's, (M - source-only) / (teacher - source-only); NaN where a seed
// lacks either or the teacher is not ahead. Empty unless the runs have a "teacher" method.
struct GapRow {
  std::string method;
  std::vector<double> share;
};
std::vector<GapRow> GapRecoveredRows(const std::vector<RunResult>& runs) {
  std::vector<GapRow> rows;
  if (runs.empty() || FindMethod(runs.front(), "teacher") == nullptr ||
      FindMethod(runs.front(), "source-only") == nullptr) {
    return rows;
  }
  for (const MethodResult& m : runs.front().methods) {
    if (m.method == "source-only" || m.method == "teacher") continue;
    GapRow row{m.method, {}};
    for (const RunResult& run : runs) {
      const MethodResult* so = FindMethod(run, "source-only");
      const MethodResult* t = FindMethod(run, "teacher");
      const MethodResult* a = FindMethod(run, m.method);
      std::optional<Paired> lead, gain;
      if (so != nullptr && t != nullptr && a != nullptr) {
        lead = Pair(*t, *so);
        gain = Pair(*a, *so);
      }
      row.share.push_back(lead && gain && lead->diff > 0 ? gain->diff / lead->diff : std::nan(""));
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

// A per-seed series' mean and SE across seeds, as Across computes a comparison's (the mean
// NaN where no seed has a value).
std::pair<double, double> MeanAndSe(const std::vector<double>& v) {
  const SeedStats s = Across(SeedRow{"", "", v, std::vector<double>(v.size(), 0.0)});
  return {s.seeds == 0 ? std::nan("") : s.mean, s.se_across};
}

// Per method (not source-only), per seed: its lowest adapted round against source-only
// (nullopt where that seed could not pair them), and how many of the paired rounds of all
// seeds were below source-only beyond noise.
struct LowestRow {
  std::string method;
  std::vector<std::optional<RoundPaired>> lowest;
  int below = 0, rounds = 0;
};
std::vector<LowestRow> LowestRoundRows(const std::vector<RunResult>& runs) {
  std::vector<LowestRow> rows;
  if (runs.empty() || FindMethod(runs.front(), "source-only") == nullptr) return rows;
  for (const MethodResult& m : runs.front().methods) {
    if (m.method == "source-only") continue;
    LowestRow row{m.method, {}, 0, 0};
    for (const RunResult& run : runs) {
      const MethodResult* so = FindMethod(run, "source-only");
      const MethodResult* a = FindMethod(run, m.method);
      std::optional<RoundPaired> lowest;
      if (so != nullptr && a != nullptr) {
        for (const RoundPaired& r : RoundsAgainst(*a, *so, run.experiment.rounds)) {
          ++row.rounds;
          row.below += r.below() ? 1 : 0;
          if (!lowest || r.paired.diff < lowest->paired.diff) lowest = r;
        }
      }
      row.lowest.push_back(lowest);
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

// A per-seed table's header: the first column, one column per seed, then `after` (each
// " name |"), and the markdown rule under it.
std::string SeedTableHeader(const std::vector<RunResult>& runs, const std::string& first,
                            const std::vector<std::string>& after) {
  std::string h = absl::StrCat("| ", first, " |");
  for (const RunResult& run : runs) absl::StrAppend(&h, " seed ", run.seed, " |");
  for (const std::string& a : after) absl::StrAppend(&h, " ", a, " |");
  h += "\n|---|";
  for (size_t i = 0; i < runs.size() + after.size(); ++i) h += "---|";
  return h + "\n";
}

std::string SeedSummaryMarkdown(const std::vector<RunResult>& runs) {
  if (runs.empty()) return "";
  const Experiment& e = runs.front().experiment;
  std::string md =
      absl::StrCat("# ", e.title.empty() ? e.name : e.title, ": ", runs.size(), " seeds\n\n");
  const std::vector<SeedRow> rows = SeedRows(runs);
  if (rows.empty()) {
    absl::StrAppend(&md,
                    "No paired comparison: the runs have neither source-only nor a second "
                    "method to pair CD-CCA with (each seed's full report is in seed-N/).\n");
    return md;
  }
  absl::StrAppend(
      &md,
      "Each row is a paired difference on the same evaluation questions (images for "
      "captions), mean over the adapted rounds, in ",
      PointName(runs.front()),
      ", per seed (each seed's full report is in "
      "seed-N/). \"SE across seeds\" is the sample standard deviation of the "
      "per-seed values over sqrt(seeds): it carries the training noise. \"question SE\" "
      "is the evaluation noise alone, sqrt(sum of the per-seed paired SEs squared) / "
      "seeds.\n\n",
      SeedTableHeader(runs, "comparison", {"mean", "SE across seeds", "question SE"}));
  for (const SeedRow& row : rows) {
    absl::StrAppend(&md, "| ", row.reference, " minus ", row.method, " |");
    for (double d : row.diff) {
      absl::StrAppend(&md, std::isnan(d) ? std::string(" - |") : absl::StrFormat(" %+.2f |", d));
    }
    const SeedStats s = Across(row);
    absl::StrAppend(
        &md, absl::StrFormat(" **%+.2f** |", s.mean),
        std::isnan(s.se_across) ? std::string(" - |") : absl::StrFormat(" %.2f |", s.se_across),
        absl::StrFormat(" %.2f |\n", s.se_questions));
  }
  const std::vector<LowestRow> lowest = LowestRoundRows(runs);
  if (!lowest.empty()) {
    absl::StrAppend(&md,
                    "\nEach method's lowest adapted round against source-only, per seed: the "
                    "paired difference on that round's ",
                    runs.front().experiment.captioning() ? "images" : "questions",
                    ", the round, and z = difference / paired SE; a round with z < -2 is below "
                    "source-only beyond evaluation noise.\n\n",
                    SeedTableHeader(runs, "method", {"rounds below beyond noise"}));
    for (const LowestRow& row : lowest) {
      absl::StrAppend(&md, "| ", row.method, " |");
      for (const std::optional<RoundPaired>& r : row.lowest) {
        absl::StrAppend(&md, r ? absl::StrCat(" ", r->Cell(), ", round ", r->round, " |")
                               : std::string(" - |"));
      }
      absl::StrAppend(&md, " ", row.below, " of ", row.rounds, " |\n");
    }
  }
  const std::vector<GapRow> gaps = GapRecoveredRows(runs);
  if (!gaps.empty()) {
    absl::StrAppend(&md,
                    "\nShare of the teacher's lead recovered: per seed, a method's gain over "
                    "source-only divided by the teacher's (\"teacher minus source-only\" above), "
                    "in %; \"-\" where the teacher is not ahead.\n\n",
                    SeedTableHeader(runs, "method", {"mean", "SE across seeds"}));
    for (const GapRow& row : gaps) {
      absl::StrAppend(&md, "| ", row.method, " |");
      for (double x : row.share) {
        absl::StrAppend(&md,
                        std::isnan(x) ? std::string(" - |") : absl::StrFormat(" %.0f |", 100 * x));
      }
      const auto [mean, se] = MeanAndSe(row.share);
      absl::StrAppend(
          &md, std::isnan(mean) ? std::string(" - |") : absl::StrFormat(" **%.0f** |", 100 * mean),
          std::isnan(se) ? std::string(" - |\n") : absl::StrFormat(" %.0f |\n", 100 * se));
    }
  }
  return md;
}

absl::Status WriteSeedSummary(const std::vector<RunResult>& runs, const std::string& dir) {
  if (runs.empty()) return absl::InvalidArgumentError("no runs to summarize");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  json j;
  j["experiment"] = runs.front().experiment.name;
  for (const RunResult& run : runs) j["seeds"].push_back(run.seed);
  for (const SeedRow& row : SeedRows(runs)) {
    const SeedStats s = Across(row);
    json r = {{"reference", row.reference},
              {"method", row.method},
              {"seeds_paired", s.seeds},
              {"mean", s.mean},
              {"question_standard_error", s.se_questions}};
    // JSON has no NaN: a missing value is null.
    r["se_across_seeds"] = std::isnan(s.se_across) ? json(nullptr) : json(s.se_across);
    for (double d : row.diff) r["per_seed"].push_back(std::isnan(d) ? json(nullptr) : json(d));
    j["comparisons"].push_back(r);
  }
  for (const GapRow& row : GapRecoveredRows(runs)) {
    const auto [mean, se] = MeanAndSe(row.share);
    json r = {{"method", row.method}};
    r["mean"] = std::isnan(mean) ? json(nullptr) : json(mean);
    r["se_across_seeds"] = std::isnan(se) ? json(nullptr) : json(se);
    for (double x : row.share) r["per_seed"].push_back(std::isnan(x) ? json(nullptr) : json(x));
    j["teacher_lead_recovered"].push_back(r);
  }
  for (const LowestRow& row : LowestRoundRows(runs)) {
    json r = {
        {"method", row.method}, {"rounds_below_beyond_noise", row.below}, {"rounds", row.rounds}};
    for (const std::optional<RoundPaired>& l : row.lowest) {
      r["per_seed"].push_back(l ? json{{"round", l->round},
                                       {"difference", l->paired.diff},
                                       {"standard_error", l->paired.se}}
                                : json(nullptr));
    }
    j["lowest_round_vs_source_only"].push_back(r);
  }
  if (absl::Status s = WriteFileAtomically(dir + "/seeds.json", j.dump(2) + "\n"); !s.ok()) {
    return s;
  }
  return WriteFileAtomically(dir + "/seeds.md", SeedSummaryMarkdown(runs));
}

}  // namespace cdcca::sim
