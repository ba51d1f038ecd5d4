#include "sim/report_html.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace cdcca::sim {
namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// (This absl may have its own string_view, so the std::string_view helpers are local.)
bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  for (size_t start = 0;;) {
    const size_t end = s.find(sep, start);
    parts.push_back(s.substr(start, end == std::string_view::npos ? end : end - start));
    if (end == std::string_view::npos) return parts;
    start = end + 1;
  }
}

// Inline markup: `code` and **bold**; the rest escaped.
std::string Inline(std::string_view s) {
  std::string out;
  bool bold = false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '`') {
      const size_t end = s.find('`', i + 1);
      if (end != std::string_view::npos) {
        absl::StrAppend(&out, "<code>", HtmlEscape(s.substr(i + 1, end - i - 1)), "</code>");
        i = end;
        continue;
      }
    }
    if (s.compare(i, 2, "**") == 0 && (bold || s.find("**", i + 2) != std::string_view::npos)) {
      out += bold ? "</strong>" : "<strong>";
      bold = !bold;
      ++i;
      continue;
    }
    out += HtmlEscape(s.substr(i, 1));
  }
  return out;
}

bool IsTableRow(std::string_view line) { return StartsWith(Trim(line), "|"); }

// "|---|:--:|" and the like.
bool IsSeparatorRow(std::string_view line) {
  line = Trim(line);
  if (!StartsWith(line, "|")) return false;
  for (char c : line) {
    if (c != '|' && c != '-' && c != ':' && c != ' ') return false;
  }
  return line.find('-') != std::string_view::npos;
}

std::vector<std::string> Cells(std::string_view line) {
  line = Trim(line);
  if (StartsWith(line, "|")) line.remove_prefix(1);
  if (!line.empty() && line.back() == '|') line.remove_suffix(1);
  std::vector<std::string> cells;
  for (std::string_view c : Split(line, '|')) cells.emplace_back(Trim(c));
  return cells;
}

// A cell that reads as a number (with sign, %, or "a / b" pairs): right-aligned.
bool IsNumeric(std::string_view cell) {
  if (cell.empty() || cell == "-") return false;
  bool digit = false;
  for (char c : cell) {
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digit = true;
    } else if (std::string_view("+-.,% /eE").find(c) == std::string_view::npos) {
      return false;
    }
  }
  return digit;
}

// Header cells wrap so that wide tables fit the page (a table still wider scrolls inside
// its own box); numbers are right-aligned.
constexpr char kReportCss[] =
    "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0 1.5em;font-size:13px;display:block;"
    "overflow-x:auto;max-width:100%}"
    "th,td{border:1px solid #ccc;padding:3px 8px;white-space:nowrap}"
    "th{background:#f0f0f0;text-align:left;vertical-align:bottom;white-space:normal}"
    "td.num{text-align:right;"
    "font-variant-numeric:tabular-nums}tbody tr:nth-child(even){background:#fafafa}"
    "code{background:#f3f3f3;padding:0 3px}pre{background:#f6f6f6;padding:1em;overflow-x:auto}"
    "svg{display:block;margin:1em 0}";

}  // namespace

std::string HtmlEscape(std::string_view s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string MarkdownToHtml(std::string_view markdown) {
  const std::vector<std::string_view> lines = Split(markdown, '\n');
  std::string html;
  std::string paragraph;
  auto flush_paragraph = [&] {
    if (!paragraph.empty()) absl::StrAppend(&html, "<p>", paragraph, "</p>\n");
    paragraph.clear();
  };
  for (size_t i = 0; i < lines.size(); ++i) {
    const std::string_view line = lines[i];
    const std::string_view t = Trim(line);
    if (t.empty()) {
      flush_paragraph();
      continue;
    }
    if (StartsWith(t, "```")) {
      flush_paragraph();
      html += "<pre>";
      for (++i; i < lines.size() && !StartsWith(Trim(lines[i]), "```"); ++i) {
        absl::StrAppend(&html, HtmlEscape(lines[i]), "\n");
      }
      html += "</pre>\n";
      continue;
    }
    if (t[0] == '#') {
      const size_t level = std::min<size_t>(t.find_first_not_of('#'), 6);
      if (level < t.size() && t[level] == ' ') {
        flush_paragraph();
        absl::StrAppendFormat(&html, "<h%d>%s</h%d>\n", level, Inline(Trim(t.substr(level))),
                              level);
        continue;
      }
    }
    if (IsTableRow(t) && i + 1 < lines.size() && IsSeparatorRow(lines[i + 1])) {
      flush_paragraph();
      html += "<table>\n<thead><tr>";
      for (const std::string& c : Cells(t)) absl::StrAppend(&html, "<th>", Inline(c), "</th>");
      html += "</tr></thead>\n<tbody>\n";
      for (i += 2; i < lines.size() && IsTableRow(lines[i]); ++i) {
        html += "<tr>";
        for (const std::string& c : Cells(lines[i])) {
          absl::StrAppend(&html, IsNumeric(c) ? "<td class=\"num\">" : "<td>", Inline(c),
                          "</td>");
        }
        html += "</tr>\n";
      }
      --i;
      html += "</tbody>\n</table>\n";
      continue;
    }
    if (StartsWith(t, "- ") || StartsWith(t, "* ")) {
      flush_paragraph();
      html += "<ul>\n";
      for (; i < lines.size(); ++i) {
        const std::string_view item = Trim(lines[i]);
        if (!StartsWith(item, "- ") && !StartsWith(item, "* ")) break;
        absl::StrAppend(&html, "<li>", Inline(item.substr(2)), "</li>\n");
      }
      --i;
      html += "</ul>\n";
      continue;
    }
    if (!paragraph.empty()) paragraph += ' ';
    paragraph += Inline(t);
  }
  flush_paragraph();
  return html;
}

std::string HtmlReportPage(std::string_view title, std::string_view markdown,
                           const std::vector<std::string>& charts) {
  std::string html = absl::StrCat(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>", HtmlEscape(title),
      "</title><style>", kReportCss, "</style></head><body>\n", MarkdownToHtml(markdown));
  if (!charts.empty()) html += "<h2>Plots</h2>\n";
  for (const std::string& c : charts) html += c;
  html += "</body></html>\n";
  return html;
}

std::string LineChartSvg(const std::string& title, const std::string& y_label,
                         const std::vector<std::string>& x_labels,
                         const std::vector<ChartSeries>& series, YAxis y_axis) {
  static const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                        "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                                        "#bcbd22", "#17becf", "#000000"};
  const double w = 640, h = 320, left = 60, right = 170, top = 30, bottom = 40;
  double lo = 1e300, hi = -1e300;
  for (const ChartSeries& s : series) {
    for (double v : s.y) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  if (lo > hi) lo = 0, hi = 1;
  std::string shown_title = title;
  if (y_axis == YAxis::kFromZero) lo = std::min(lo, 0.0);
  if (hi - lo < 1e-9) hi = lo + 1;
  // Grid lines at round values: a step of 1, 2 or 5 x 10^k giving at most four intervals;
  // the axis starts and ends on grid lines.
  const double raw_step = (hi - lo) / 4;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw_step)));
  double step = 10 * magnitude;
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * magnitude >= raw_step) {
      step = m * magnitude;
      break;
    }
  }
  lo = y_axis == YAxis::kFromZero && lo == 0 ? 0 : std::floor(lo / step) * step;
  hi = std::ceil(hi / step - 1e-9) * step;
  if (y_axis == YAxis::kFitted && lo > 0) {
    absl::StrAppend(&shown_title, " (y axis does not start at 0)");
  }
  const int intervals = static_cast<int>(std::lround((hi - lo) / step));
  const size_t n = std::max<size_t>(2, x_labels.size());
  auto X = [&](size_t i) {
    return left + (w - left - right) * static_cast<double>(i) / static_cast<double>(n - 1);
  };
  auto Y = [&](double v) { return top + (h - top - bottom) * (1 - (v - lo) / (hi - lo)); };
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<text x=\"%.0f\" y=\"18\" "
      "font-size=\"14\">%s</text>\n",
      w, h, left, HtmlEscape(shown_title));
  for (int k = 0; k <= intervals; ++k) {
    const double v = lo + step * k;
    absl::StrAppendFormat(&svg,
                          "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\"/>"
                          "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%.4g</text>\n",
                          left, w - right, Y(v), Y(v), k == 0 ? "#888" : "#ddd", left - 4,
                          Y(v) + 4, v);
  }
  for (size_t i = 0; i < x_labels.size(); ++i) {
    absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%s</text>\n",
                          X(i), h - bottom + 16, HtmlEscape(x_labels[i]));
  }
  absl::StrAppendFormat(&svg,
                        "<text x=\"14\" y=\"%.0f\" transform=\"rotate(-90 14 %.0f)\" "
                        "text-anchor=\"middle\">%s</text>\n",
                        (top + h - bottom) / 2, (top + h - bottom) / 2, HtmlEscape(y_label));
  for (size_t s = 0; s < series.size(); ++s) {
    const char* color = kColors[s % (sizeof(kColors) / sizeof(kColors[0]))];
    std::string points;
    for (size_t i = 0; i < series[s].y.size(); ++i) {
      absl::StrAppendFormat(&points, "%.1f,%.1f ", X(i), Y(series[s].y[i]));
    }
    absl::StrAppendFormat(&svg,
                          "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" "
                          "points=\"%s\"/>\n",
                          color, points);
    for (size_t i = 0; i < series[s].y.size(); ++i) {
      absl::StrAppendFormat(&svg, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", X(i),
                            Y(series[s].y[i]), color);
    }
    const double ly = top + 14.0 * static_cast<double>(s);
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%.0f\" y=\"%.0f\" width=\"10\" height=\"10\" fill=\"%s\"/>"
                          "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                          w - right + 10, ly, color, w - right + 24, ly + 9,
                          HtmlEscape(series[s].name));
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace cdcca::sim
