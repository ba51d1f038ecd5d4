#include "sim/report_html.h"

#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cdcca::sim {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

int Count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t i = s.find(what); i != std::string::npos; i = s.find(what, i + 1)) ++n;
  return n;
}

TEST(MarkdownToHtmlTest, HeadingsTablesListsParagraphs) {
  const std::string html = MarkdownToHtml(
      "# Quick <start>\n\nReproduces `Table 6`. Two\nlines.\n\n"
      "## Accuracy (DA %)\n\n"
      "| method | before | round 1 |\n|---|---|---|\n"
      "| source-only | 41.20 | -0.50 |\n| CD-CCA | 41.20 / 50.1 | 55.00 |\n\n"
      "- one **bold** item\n- two\n\nafter\n");
  EXPECT_THAT(html, HasSubstr("<h1>Quick &lt;start&gt;</h1>"));
  EXPECT_THAT(html, HasSubstr("<h2>Accuracy (DA %)</h2>"));
  EXPECT_THAT(html, HasSubstr("<p>Reproduces <code>Table 6</code>. Two lines.</p>"));
  EXPECT_THAT(html, HasSubstr("<thead><tr><th>method</th><th>before</th><th>round 1</th>"));
  EXPECT_THAT(html, HasSubstr("<tr><td>source-only</td><td class=\"num\">41.20</td>"
                              "<td class=\"num\">-0.50</td></tr>"));
  EXPECT_THAT(html, HasSubstr("<td class=\"num\">41.20 / 50.1</td>"));
  EXPECT_EQ(Count(html, "<table>"), 1);
  EXPECT_EQ(Count(html, "<tr>"), 3);  // header + 2 rows; the separator is no row
  EXPECT_THAT(html, HasSubstr("<ul>\n<li>one <strong>bold</strong> item</li>\n<li>two</li>"));
  EXPECT_THAT(html, HasSubstr("<p>after</p>"));
  EXPECT_THAT(html, Not(HasSubstr("|---|")));
  EXPECT_THAT(html, Not(HasSubstr("<pre>")));
}

TEST(MarkdownToHtmlTest, TablesBackToBackAndFencedBlocks) {
  const std::string html = MarkdownToHtml(
      "| a | b |\n|---|---|\n| 1 | 2 |\n\n| c |\n|:-:|\n| x |\n```\nraw | text <\n```\n");
  EXPECT_EQ(Count(html, "<table>"), 2);
  EXPECT_THAT(html, HasSubstr("<pre>raw | text &lt;\n</pre>"));
  // A line with pipes but no separator row is text, not a table.
  EXPECT_THAT(MarkdownToHtml("| not a table |\n"), HasSubstr("<p>| not a table |</p>"));
}

// The y value of every grid line label, in drawing order (bottom first).
std::vector<double> AxisLabels(const std::string& svg) {
  std::vector<double> v;
  const std::regex label("text-anchor=\"end\">([-0-9.e+]+)</text>");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), label);
       it != std::sregex_iterator(); ++it) {
    v.push_back(std::stod((*it)[1].str()));
  }
  return v;
}

TEST(LineChartSvgTest, SizesStartAtZeroAccuraciesSaySoWhenNot) {
  const std::vector<std::string> x = {"round 1", "round 2"};
  const std::string bytes =
      LineChartSvg("Uplink", "KB", x, {{"CD-CCA", {120, 130}}}, YAxis::kFromZero);
  std::vector<double> axis = AxisLabels(bytes);
  // Round grid values from 0: 0, 50, 100, 150.
  EXPECT_THAT(axis, ::testing::ElementsAre(0, 50, 100, 150));
  EXPECT_THAT(bytes, Not(HasSubstr("does not start at 0")));

  const std::string acc =
      LineChartSvg("Accuracy", "%", x, {{"a", {40, 55}}, {"b <x>", {42, 50}}}, YAxis::kFitted);
  axis = AxisLabels(acc);
  EXPECT_THAT(axis, ::testing::ElementsAre(40, 45, 50, 55));  // fitted: 40..55 in steps of 5
  EXPECT_THAT(acc, HasSubstr("Accuracy (y axis does not start at 0)"));
  EXPECT_THAT(acc, HasSubstr("b &lt;x&gt;"));
  EXPECT_EQ(Count(acc, "<polyline"), 2);
  // A fitted axis that reaches 0 needs no note.
  EXPECT_THAT(LineChartSvg("A", "%", x, {{"a", {0, 5}}}, YAxis::kFitted),
              Not(HasSubstr("does not start")));
}

// Reports cdcca-sim wrote (committed under docs/results/): every markdown table becomes a
// <table>, every heading a heading, nothing is left preformatted.
TEST(HtmlReportPageTest, CommittedReportsRenderAsTables) {
  for (const char* name : {"quickstart", "captioning", "fleet"}) {
    SCOPED_TRACE(name);
    std::ifstream in(std::string(CDCCA_SOURCE_DIR) + "/docs/results/" + name + ".md");
    ASSERT_TRUE(in.good());
    std::stringstream md;
    md << in.rdbuf();
    const std::string html = HtmlReportPage(name, md.str(), {"<svg>chart</svg>\n"});
    EXPECT_EQ(Count(html, "<table>"), Count(md.str(), "\n|---"));
    EXPECT_EQ(Count(html, "<h2>"), Count(md.str(), "\n## ") + 1);  // + "Plots"
    EXPECT_EQ(Count(html, "<h1>"), 1);
    EXPECT_THAT(html, Not(HasSubstr("<pre>")));
    EXPECT_THAT(html, Not(HasSubstr("|---")));
    EXPECT_THAT(html, HasSubstr("<title>" + std::string(name) + "</title>"));
    EXPECT_THAT(html, HasSubstr("<h2>Plots</h2>\n<svg>chart</svg>\n</body></html>"));
  }
}

}  // namespace
}  // namespace cdcca::sim
