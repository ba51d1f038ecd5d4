// Writing a harness run: report.md (tables in the paper's layout), results.json (every
// figure), results.csv (one row per method, device and round) and report.html (the report
// as HTML, tables as <table>, and the plots as inline SVG, sizes and times from 0: one
// self-contained page that works offline; sim/report_html.h renders it).
#ifndef CDCCA_SIM_REPORT_H_
#define CDCCA_SIM_REPORT_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "sim/harness.h"

namespace cdcca::sim {

// The main table as plain text: one row per method, DA (and MC) accuracy per round, and
// the bytes moved. What `cdcca-sim` prints at the end.
std::string SummaryTable(const RunResult& run);

// Markdown report.
std::string MarkdownReport(const RunResult& run);

// Writes report.md, results.json, results.csv and report.html into `dir` (created).
absl::Status WriteReport(const RunResult& run, const std::string& dir);

// Several seeds of one experiment (`cdcca-sim --seeds`): every method's gain over
// source-only and CD-CCA's difference against each method, paired on the same questions,
// per seed, with the mean, its standard error across seeds (training noise included) and
// the question-level one (evaluation noise only). Markdown; WriteSeedSummary writes it as
// seeds.md and the figures as seeds.json into `dir`.
std::string SeedSummaryMarkdown(const std::vector<RunResult>& runs);
absl::Status WriteSeedSummary(const std::vector<RunResult>& runs, const std::string& dir);

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_REPORT_H_
