// The pieces of report.html: the markdown report rendered as HTML (headings, paragraphs,
// lists, tables as <table>) and line charts as inline SVG. Torch-free and pure, so that
// the page can be tested without running an experiment. Thread-safe.
#ifndef CDCCA_SIM_REPORT_HTML_H_
#define CDCCA_SIM_REPORT_HTML_H_

#include <string>
#include <string_view>
#include <vector>

namespace cdcca::sim {

// `s` with & < > " escaped for HTML text and attribute values.
std::string HtmlEscape(std::string_view s);

// Renders the markdown the reports are written in: ATX headings (# .. ######), pipe
// tables (a header row, a |---| separator row, body rows) as <table> with numeric cells
// right-aligned, "- " / "* " bullet lists, fenced ``` blocks as <pre>, paragraphs of
// consecutive lines; inline `code` and **bold**. Everything else is escaped text.
std::string MarkdownToHtml(std::string_view markdown);

struct ChartSeries {
  std::string name;
  std::vector<double> y;
};

enum class YAxis {
  kFromZero,  // the axis starts at 0 (sizes, times: a bar of nothing is 0)
  kFitted,    // the axis spans the data (accuracies); the chart then says so in its title
};

// A line chart as a standalone <svg>: x = 0..n-1 labelled by `x_labels`, one polyline and
// legend entry per series, horizontal grid lines at round values (steps of 1, 2 or 5 x 10^k).
// With YAxis::kFitted and data that does not reach 0 the title gets "(y axis does not start
// at 0)".
std::string LineChartSvg(const std::string& title, const std::string& y_label,
                         const std::vector<std::string>& x_labels,
                         const std::vector<ChartSeries>& series, YAxis y_axis);

// report.html: a self-contained page titled `title` with `markdown` rendered by
// MarkdownToHtml, then a "Plots" heading and the `charts` (SVG) one under another.
std::string HtmlReportPage(std::string_view title, std::string_view markdown,
                           const std::vector<std::string>& charts);

}  // namespace cdcca::sim

#endif  // CDCCA_SIM_REPORT_HTML_H_
