// report.html as WriteReport writes it for a run (figures made up, no experiment run): the
// tables are HTML tables, headings are headings, no preformatted block holds the report,
// and the byte and latency charts start at 0.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sim/report.h"
#include "tests/testing/status_matchers.h"

namespace cdcca::sim {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

RunResult FakeRun() {
  RunResult run;
  absl::StatusOr<Experiment> e =
      LoadExperiment(std::string(CDCCA_SOURCE_DIR) + "/configs/experiments/quickstart.json");
  EXPECT_TRUE(e.ok()) << e.status();
  run.experiment = *e;
  run.seed = 1;
  for (const char* method : {"source-only", "cd-cca"}) {
    MethodResult m;
    m.method = method;
    m.raw_frame_bytes = 224 * 224 * 3;
    for (int r = 0; r <= run.experiment.rounds; ++r) {
      DeviceRound d;
      d.round = r;
      d.domain = r == 0 ? "clean" : "fog-4";
      d.da = 40 + 5 * r;
      d.mc = 50 + 4 * r;
      d.questions = 4;
      d.question_da = {0.4f, 0.5f, 0.3f, 0.6f};
      d.frames = 600;
      if (m.method == "cd-cca" && r > 0) {
        d.kept_samples = 300;
        d.kept_tokens = 300 * 16;
        d.uplink_payload_bytes = 100000 + 1000 * r;
        d.uplink_wire_bytes = 101000 + 1000 * r;
        d.downlink_payload_bytes = 50000;
        d.downlink_wire_bytes = 51000;
        d.uplink_seconds = 0.5;
        d.downlink_seconds = 0.1;
        d.version = r;
      }
      m.rounds.push_back(d);
    }
    run.methods.push_back(m);
  }
  return run;
}

TEST(ReportHtmlTest, TablesAreHtmlTablesAndPlotsStartAtZero) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / "cdcca_report_html_test").string();
  std::filesystem::remove_all(dir);
  ASSERT_OK(WriteReport(FakeRun(), dir));
  std::ifstream in(dir + "/report.html");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string html = ss.str();
  std::filesystem::remove_all(dir);

  EXPECT_THAT(html, HasSubstr("<h1>Quickstart: one device under image and text shift</h1>"));
  EXPECT_THAT(html, HasSubstr("<h2>"));
  EXPECT_THAT(html, HasSubstr("<table>"));
  EXPECT_THAT(html, HasSubstr("<th>method</th>"));
  EXPECT_THAT(html, HasSubstr("<td>cd-cca</td>"));
  EXPECT_THAT(html, Not(HasSubstr("<pre>")));   // the report is no longer one preformatted block
  EXPECT_THAT(html, Not(HasSubstr("|---|")));   // no markdown table syntax left over
  // Accuracy on a fitted axis says so; bytes and seconds start at 0.
  EXPECT_THAT(html, HasSubstr("VQA DA accuracy per round (y axis does not start at 0)"));
  for (const char* chart : {"Uplink payload per round", "Downlink payload per round",
                            "Transfer latency per round"}) {
    const size_t at = html.find(chart);
    ASSERT_NE(at, std::string::npos) << chart;
    EXPECT_THAT(html.substr(at, 300), Not(HasSubstr("does not start at 0"))) << chart;
    // The first grid label of the chart is its bottom: 0.
    const size_t label = html.find("text-anchor=\"end\">", at);
    ASSERT_NE(label, std::string::npos);
    EXPECT_EQ(html.substr(label + 18, 2), "0<") << chart;
  }
}

}  // namespace
}  // namespace cdcca::sim
