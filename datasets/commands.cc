#include "datasets/commands.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <opencv2/imgproc.hpp>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "datasets/domain.h"
#include "datasets/formats.h"
#include "datasets/metrics.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, out, "",
          "output: the directory (render), the checkpoint directory (pretrain), the results file "
          "(answer), the adapted state (adapt), the PEFT adapter folder (export-adapter), the "
          "report OUT.md and OUT.json (adapt-eval)");
ABSL_FLAG(std::string, questions, "",
          "VQAv2 questions JSON (cdcca eval vqa, cdcca answer; answer --task aokvqa: an A-OKVQA "
          "split)");
ABSL_FLAG(std::string, annotations, "",
          "annotations JSON: VQAv2 annotations, A-OKVQA split file or COCO/nocaps captions");
ABSL_FLAG(std::string, results, "", "results JSON (cdcca eval vqa|caption)");
ABSL_FLAG(std::string, predictions, "", "A-OKVQA predictions JSON (cdcca eval aokvqa)");
ABSL_FLAG(std::string, fashion_mnist_dir, cdcca::datasets::kFashionMnistDir,
          "directory of the Fashion-MNIST IDX files (package dataset-fashion-mnist)");
ABSL_FLAG(uint64_t, render_seed, 1, "seed of the rendered scenes (cdcca render)");
ABSL_FLAG(int, render_scenes, 2, "scenes (rows) per shift grid (cdcca render)");
ABSL_FLAG(int, render_scale, 2, "pixel upscale of each 64x64 scene (cdcca render)");

namespace cdcca::datasets {
namespace {

using Json = nlohmann::json;

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "cdcca: %s\n", s.ToString().c_str());
  return 1;
}

absl::Status RequireFlag(const std::string& value, const char* name) {
  if (value.empty()) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  return absl::OkStatus();
}

int EvalVqa() {
  const std::string q = absl::GetFlag(FLAGS_questions), a = absl::GetFlag(FLAGS_annotations),
                    r = absl::GetFlag(FLAGS_results);
  for (auto [v, n] : {std::pair{q, "questions"}, {a, "annotations"}, {r, "results"}}) {
    if (absl::Status s = RequireFlag(v, n); !s.ok()) return Fail(s);
  }
  absl::StatusOr<std::vector<VqaRecord>> records = LoadVqaV2(q, a);
  if (!records.ok()) return Fail(records.status());
  absl::StatusOr<std::map<int64_t, std::string>> results = LoadVqaResults(r);
  if (!results.ok()) return Fail(results.status());
  VqaAccumulator acc;
  for (const VqaRecord& rec : *records) {
    auto it = results->find(rec.question_id);
    if (it == results->end()) {
      // The official code refuses results that do not cover the annotated questions.
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(r, ": no answer for question_id ", rec.question_id)));
    }
    acc.Add(VqaAccuracy(it->second, rec.answers), rec.answer_type, rec.question_type);
  }
  // The keys of vqaEval.accuracy.
  Json out;
  out["overall"] = acc.Overall();
  out["perQuestionType"] = acc.PerQuestionType();
  out["perAnswerType"] = acc.PerAnswerType();
  std::fprintf(stderr, "VQA accuracy over %d questions\n  %-10s %6.2f\n", acc.count(), "overall",
               acc.Overall());
  for (const auto& [type, v] : acc.PerAnswerType()) {
    std::fprintf(stderr, "  %-10s %6.2f\n", type.c_str(), v);
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int EvalAokvqa() {
  const std::string a = absl::GetFlag(FLAGS_annotations), p = absl::GetFlag(FLAGS_predictions);
  for (auto [v, n] : {std::pair{a, "annotations"}, {p, "predictions"}}) {
    if (absl::Status s = RequireFlag(v, n); !s.ok()) return Fail(s);
  }
  absl::StatusOr<std::vector<AokvqaRecord>> records = LoadAokvqa(a);
  if (!records.ok()) return Fail(records.status());
  absl::StatusOr<std::map<std::string, AokvqaPrediction>> preds = LoadAokvqaPredictions(p);
  if (!preds.ok()) return Fail(preds.status());
  double mc = 0, da = 0;
  int n_mc = 0, n_da = 0;
  for (const AokvqaRecord& rec : *records) {
    auto it = preds->find(rec.question_id);
    // Strict mode of the official evaluation: every question needs a prediction.
    if (it == preds->end()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(p, ": no prediction for question_id ", rec.question_id)));
    }
    if (rec.correct_choice_idx >= 0) {
      if (std::find(rec.choices.begin(), rec.choices.end(), it->second.multiple_choice) ==
          rec.choices.end()) {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat(p, ": ", rec.question_id, ".multiple_choice: '",
                         it->second.multiple_choice, "' is not one of the choices")));
      }
      mc += AokvqaMcAccuracy(it->second.multiple_choice, rec.choices, rec.correct_choice_idx);
      ++n_mc;
    }
    // DA excludes the questions marked difficult_direct_answer, as the official code does.
    if (!rec.difficult_direct_answer && !rec.direct_answers.empty()) {
      da += AokvqaDaAccuracy(it->second.direct_answer, rec.direct_answers);
      ++n_da;
    }
  }
  // Unrounded, as eval_aokvqa returns them (sum / len * 100); the table on stderr rounds.
  Json out;
  out["MC"] = n_mc ? mc / n_mc * 100.0 : 0.0;
  out["DA"] = n_da ? da / n_da * 100.0 : 0.0;
  std::fprintf(stderr, "A-OKVQA\n  MC %6.2f  (%d questions)\n  DA %6.2f  (%d questions)\n",
               out["MC"].get<double>(), n_mc, out["DA"].get<double>(), n_da);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int EvalCaption() {
  const std::string a = absl::GetFlag(FLAGS_annotations), r = absl::GetFlag(FLAGS_results);
  for (auto [v, n] : {std::pair{a, "annotations"}, {r, "results"}}) {
    if (absl::Status s = RequireFlag(v, n); !s.ok()) return Fail(s);
  }
  absl::StatusOr<std::vector<CaptionImage>> images = LoadCaptionAnnotations(a);
  if (!images.ok()) return Fail(images.status());
  absl::StatusOr<std::map<int64_t, std::string>> results = LoadCaptionResults(r);
  if (!results.ok()) return Fail(results.status());
  std::map<int64_t, const CaptionImage*> by_id;
  for (const CaptionImage& img : *images) by_id[img.id] = &img;
  std::vector<std::string> cands;
  std::vector<std::vector<std::string>> refs;
  // COCO evaluates the images of the results file.
  for (const auto& [id, caption] : *results) {
    auto it = by_id.find(id);
    if (it == by_id.end() || it->second->captions.empty()) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(r, ": image_id ", id, " has no reference captions in ", a)));
    }
    cands.push_back(caption);
    refs.push_back(it->second->captions);
  }
  const CaptionScores s = ScoreCaptions(cands, refs);
  Json out;
  for (int k = 0; k < 4; ++k) out[absl::StrCat("BLEU-", k + 1)] = s.bleu[k];
  out["CIDEr"] = s.cider;
  std::fprintf(stderr, "captions: %zu images\n", cands.size());
  for (int k = 0; k < 4; ++k) std::fprintf(stderr, "  BLEU-%d %.3f\n", k + 1, s.bleu[k]);
  std::fprintf(stderr, "  CIDEr  %.3f\n", s.cider);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

// Pastes `src` scaled by `scale` (nearest) into `dst` at (x0, y0).
void Paste(const Image& src, int scale, int x0, int y0, cv::Mat& dst) {
  for (int y = 0; y < src.height * scale; ++y) {
    for (int x = 0; x < src.width * scale; ++x) {
      const uint8_t* p = src.at(x / scale, y / scale);
      dst.at<cv::Vec3b>(y0 + y, x0 + x) = cv::Vec3b(p[0], p[1], p[2]);
    }
  }
}

}  // namespace

const char* const kEvalFlags[] = {"questions", "annotations", "results", "predictions", nullptr};

const char* const kRenderFlags[] = {"out",           "fashion_mnist_dir", "render_seed",
                                    "render_scenes", "render_scale",      nullptr};

int EvalCommand(const std::vector<std::string>& args) {
  if (args.size() != 1) {
    std::fprintf(stderr, "usage: cdcca eval vqa|aokvqa|caption [flags]\n");
    return 2;
  }
  if (args[0] == "vqa") return EvalVqa();
  if (args[0] == "aokvqa") return EvalAokvqa();
  if (args[0] == "caption") return EvalCaption();
  std::fprintf(stderr, "cdcca eval: unknown benchmark '%s' (vqa, aokvqa, caption)\n",
               args[0].c_str());
  return 2;
}

int RenderCommand(const std::vector<std::string>& args) {
  const std::string out_dir = absl::GetFlag(FLAGS_out);
  if (out_dir.empty() || !args.empty()) {
    std::fprintf(stderr, "usage: cdcca render --out DIR [--render_seed N --render_scenes N]\n");
    return 2;
  }
  absl::StatusOr<ImageSet> test =
      LoadFashionMnist(Split::kTest, absl::GetFlag(FLAGS_fashion_mnist_dir));
  if (!test.ok()) return Fail(test.status());
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return Fail(absl::InternalError(absl::StrCat("cannot create ", out_dir)));
  const int rows = std::max(1, absl::GetFlag(FLAGS_render_scenes));
  const int scale = std::clamp(absl::GetFlag(FLAGS_render_scale), 1, 8);
  const int severities[] = {0, 1, 3, 5};
  const int header = 14, gap = 2;
  for (ImageShift shift : AllImageShifts()) {
    // The same scenes for every shift (text shift phrasing, so all templates show up).
    absl::StatusOr<SampleGenerator> gen = SampleGenerator::Create(
        &*test, TextShiftDomain(Split::kTest), absl::GetFlag(FLAGS_render_seed));
    if (!gen.ok()) return Fail(gen.status());
    const int cell = gen->spec().scene.canvas * scale;
    cv::Mat grid(header + rows * (cell + gap), 4 * (cell + gap), CV_8UC3,
                 cv::Scalar(255, 255, 255));
    for (int c = 0; c < 4; ++c) {
      const std::string label =
          severities[c] == 0 ? "clean" : absl::StrCat("severity ", severities[c]);
      cv::putText(grid, label, cv::Point(c * (cell + gap) + 2, header - 3), cv::FONT_HERSHEY_PLAIN,
                  0.8, cv::Scalar(0, 0, 0), 1, cv::LINE_AA);
    }
    std::ofstream text(absl::StrCat(out_dir, "/", std::string(ImageShiftName(shift)), ".txt"));
    text << "# " << ImageShiftName(shift) << ": rows = scenes; columns = clean, severity 1, 3, 5\n";
    for (int r = 0; r < rows; ++r) {
      const Sample s = gen->Generate(static_cast<uint64_t>(r));
      for (int c = 0; c < 4; ++c) {
        Image img = s.scene.image;
        if (absl::Status st = ApplyShift(shift, severities[c], 1000 + r, img); !st.ok()) {
          return Fail(st);
        }
        Paste(img, scale, c * (cell + gap), header + r * (cell + gap), grid);
      }
      text << "\nscene " << r << "\n  captions:\n";
      for (const std::string& cap : s.captions) text << "    " << cap << "\n";
      text << "  questions (answer | MC choices):\n";
      for (const VqaItem& q : s.questions) {
        text << "    [" << PhrasingName(q.phrasing) << "] " << q.question << " -> " << q.answer
             << " |";
        for (const std::string& ch : q.choices) text << " " << ch << ";";
        text << "\n";
      }
    }
    Image out(grid.cols, grid.rows);
    for (int y = 0; y < grid.rows; ++y) {
      std::memcpy(out.at(0, y), grid.ptr<uint8_t>(y), static_cast<size_t>(grid.cols) * 3);
    }
    const std::string png = absl::StrCat(out_dir, "/", std::string(ImageShiftName(shift)), ".png");
    if (absl::Status st = WritePng(out, png); !st.ok()) return Fail(st);
    std::fprintf(stderr, "wrote %s\n", png.c_str());
  }
  return 0;
}

}  // namespace cdcca::datasets
