#include "datasets/formats.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#include <set>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace cdcca::datasets {
namespace {

using Json = nlohmann::json;

absl::StatusOr<Json> ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  Json j = Json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON"));
  return j;
}

// Field access that names the file and the JSON path on error.
class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  absl::Status Error(const std::string& where, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", where, ": ", what));
  }
  absl::StatusOr<const Json*> Get(const Json& obj, const std::string& where, const char* key,
                                  Json::value_t type) const {
    const std::string field = where.empty() ? key : absl::StrCat(where, ".", key);
    if (!obj.is_object()) return Error(where.empty() ? "(top level)" : where, "expected an object");
    auto it = obj.find(key);
    if (it == obj.end()) return Error(field, "missing");
    const bool ok =
        type == Json::value_t::number_integer
            ? it->is_number_integer()
            : (type == Json::value_t::number_float ? it->is_number() : it->type() == type);
    if (!ok) return Error(field, absl::StrCat("expected ", TypeName(type)));
    return &*it;
  }
  absl::StatusOr<std::string> String(const Json& obj, const std::string& where,
                                     const char* key) const {
    absl::StatusOr<const Json*> v = Get(obj, where, key, Json::value_t::string);
    if (!v.ok()) return v.status();
    return (*v)->get<std::string>();
  }
  absl::StatusOr<int64_t> Int(const Json& obj, const std::string& where, const char* key) const {
    absl::StatusOr<const Json*> v = Get(obj, where, key, Json::value_t::number_integer);
    if (!v.ok()) return v.status();
    return (*v)->get<int64_t>();
  }
  absl::StatusOr<std::vector<std::string>> Strings(const Json& obj, const std::string& where,
                                                   const char* key) const {
    absl::StatusOr<const Json*> v = Get(obj, where, key, Json::value_t::array);
    if (!v.ok()) return v.status();
    std::vector<std::string> out;
    for (size_t i = 0; i < (*v)->size(); ++i) {
      const Json& e = (**v)[i];
      if (!e.is_string())
        return Error(absl::StrCat(where, ".", key, "[", i, "]"), "expected a string");
      out.push_back(e.get<std::string>());
    }
    return out;
  }
  const std::string& path() const { return path_; }

 private:
  static const char* TypeName(Json::value_t t) {
    switch (t) {
      case Json::value_t::string:
        return "a string";
      case Json::value_t::array:
        return "an array";
      case Json::value_t::object:
        return "an object";
      case Json::value_t::boolean:
        return "a boolean";
      default:
        return "a number";
    }
  }
  std::string path_;
};

#define CDCCA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(*tmp)
#define CDCCA_CONCAT2(a, b) a##b
#define CDCCA_CONCAT(a, b) CDCCA_CONCAT2(a, b)
#define ASSIGN_OR_RETURN(lhs, expr) \
  CDCCA_ASSIGN_OR_RETURN_IMPL(CDCCA_CONCAT(_status_or_, __LINE__), lhs, expr)

absl::StatusOr<const Json*> TopArray(const Reader& r, const Json& j, const char* key) {
  if (key == nullptr) {
    if (!j.is_array()) return r.Error("(top level)", "expected an array");
    return &j;
  }
  return r.Get(j, "", key, Json::value_t::array);
}

}  // namespace

absl::StatusOr<std::vector<VqaQuestion>> LoadVqaQuestions(const std::string& path) {
  ASSIGN_OR_RETURN(Json j, ReadJson(path));
  Reader r(path);
  ASSIGN_OR_RETURN(const Json* questions, TopArray(r, j, "questions"));
  std::vector<VqaQuestion> out;
  for (size_t i = 0; i < questions->size(); ++i) {
    const std::string where = absl::StrCat("questions[", i, "]");
    VqaQuestion q;
    ASSIGN_OR_RETURN(q.question_id, r.Int((*questions)[i], where, "question_id"));
    ASSIGN_OR_RETURN(q.image_id, r.Int((*questions)[i], where, "image_id"));
    ASSIGN_OR_RETURN(q.question, r.String((*questions)[i], where, "question"));
    out.push_back(std::move(q));
  }
  return out;
}

absl::StatusOr<std::vector<VqaRecord>> LoadVqaV2(const std::string& questions_path,
                                                 const std::string& annotations_path) {
  ASSIGN_OR_RETURN(std::vector<VqaQuestion> questions, LoadVqaQuestions(questions_path));
  ASSIGN_OR_RETURN(Json aj, ReadJson(annotations_path));
  Reader ar(annotations_path);
  ASSIGN_OR_RETURN(const Json* annotations, TopArray(ar, aj, "annotations"));
  std::map<int64_t, std::string> text;
  for (const VqaQuestion& q : questions) text[q.question_id] = q.question;
  std::vector<VqaRecord> out;
  for (size_t i = 0; i < annotations->size(); ++i) {
    const Json& a = (*annotations)[i];
    const std::string where = absl::StrCat("annotations[", i, "]");
    VqaRecord rec;
    ASSIGN_OR_RETURN(rec.question_id, ar.Int(a, where, "question_id"));
    ASSIGN_OR_RETURN(rec.image_id, ar.Int(a, where, "image_id"));
    ASSIGN_OR_RETURN(rec.answer_type, ar.String(a, where, "answer_type"));
    ASSIGN_OR_RETURN(rec.question_type, ar.String(a, where, "question_type"));
    ASSIGN_OR_RETURN(rec.multiple_choice_answer, ar.String(a, where, "multiple_choice_answer"));
    ASSIGN_OR_RETURN(const Json* answers, ar.Get(a, where, "answers", Json::value_t::array));
    for (size_t k = 0; k < answers->size(); ++k) {
      ASSIGN_OR_RETURN(
          std::string ans,
          ar.String((*answers)[k], absl::StrCat(where, ".answers[", k, "]"), "answer"));
      rec.answers.push_back(std::move(ans));
    }
    auto it = text.find(rec.question_id);
    if (it == text.end()) {
      return ar.Error(absl::StrCat(where, ".question_id"),
                      absl::StrCat(rec.question_id, " is not in ", questions_path));
    }
    rec.question = it->second;
    out.push_back(std::move(rec));
  }
  return out;
}

absl::StatusOr<std::map<int64_t, std::string>> LoadVqaResults(const std::string& path) {
  ASSIGN_OR_RETURN(Json j, ReadJson(path));
  Reader r(path);
  ASSIGN_OR_RETURN(const Json* list, TopArray(r, j, nullptr));
  std::map<int64_t, std::string> out;
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string where = absl::StrCat("[", i, "]");
    ASSIGN_OR_RETURN(int64_t id, r.Int((*list)[i], where, "question_id"));
    ASSIGN_OR_RETURN(out[id], r.String((*list)[i], where, "answer"));
  }
  return out;
}

absl::StatusOr<std::vector<AokvqaRecord>> LoadAokvqa(const std::string& path) {
  ASSIGN_OR_RETURN(Json j, ReadJson(path));
  Reader r(path);
  ASSIGN_OR_RETURN(const Json* list, TopArray(r, j, nullptr));
  std::vector<AokvqaRecord> out;
  for (size_t i = 0; i < list->size(); ++i) {
    const Json& e = (*list)[i];
    const std::string where = absl::StrCat("[", i, "]");
    AokvqaRecord rec;
    ASSIGN_OR_RETURN(rec.question_id, r.String(e, where, "question_id"));
    ASSIGN_OR_RETURN(rec.image_id, r.Int(e, where, "image_id"));
    ASSIGN_OR_RETURN(rec.question, r.String(e, where, "question"));
    ASSIGN_OR_RETURN(rec.choices, r.Strings(e, where, "choices"));
    if (e.contains("correct_choice_idx")) {
      ASSIGN_OR_RETURN(int64_t idx, r.Int(e, where, "correct_choice_idx"));
      if (idx < 0 || idx >= static_cast<int64_t>(rec.choices.size())) {
        return r.Error(absl::StrCat(where, ".correct_choice_idx"),
                       absl::StrCat(idx, " is not an index into choices"));
      }
      rec.correct_choice_idx = static_cast<int>(idx);
    }
    if (e.contains("direct_answers")) {
      ASSIGN_OR_RETURN(rec.direct_answers, r.Strings(e, where, "direct_answers"));
    }
    if (e.contains("difficult_direct_answer")) {
      ASSIGN_OR_RETURN(const Json* d,
                       r.Get(e, where, "difficult_direct_answer", Json::value_t::boolean));
      rec.difficult_direct_answer = d->get<bool>();
    }
    out.push_back(std::move(rec));
  }
  return out;
}

absl::StatusOr<std::map<std::string, AokvqaPrediction>> LoadAokvqaPredictions(
    const std::string& path) {
  ASSIGN_OR_RETURN(Json j, ReadJson(path));
  Reader r(path);
  if (!j.is_object()) return r.Error("(top level)", "expected an object {question_id: {...}}");
  std::map<std::string, AokvqaPrediction> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    AokvqaPrediction p;
    if (!it.value().is_object()) return r.Error(it.key(), "expected an object");
    if (it.value().contains("multiple_choice")) {
      ASSIGN_OR_RETURN(p.multiple_choice, r.String(it.value(), it.key(), "multiple_choice"));
    }
    if (it.value().contains("direct_answer")) {
      ASSIGN_OR_RETURN(p.direct_answer, r.String(it.value(), it.key(), "direct_answer"));
    }
    out[it.key()] = std::move(p);
  }
  return out;
}

absl::StatusOr<std::vector<CaptionImage>> LoadCaptionAnnotations(const std::string& path) {
  ASSIGN_OR_RETURN(Json j, ReadJson(path));
  Reader r(path);
  ASSIGN_OR_RETURN(const Json* images, TopArray(r, j, "images"));
  ASSIGN_OR_RETURN(const Json* annotations, TopArray(r, j, "annotations"));
  std::vector<CaptionImage> out;
  std::map<int64_t, size_t> index;
  for (size_t i = 0; i < images->size(); ++i) {
    const Json& e = (*images)[i];
    const std::string where = absl::StrCat("images[", i, "]");
    CaptionImage img;
    ASSIGN_OR_RETURN(img.id, r.Int(e, where, "id"));
    ASSIGN_OR_RETURN(img.file_name, r.String(e, where, "file_name"));
    if (e.contains("domain")) {
      ASSIGN_OR_RETURN(img.domain, r.String(e, where, "domain"));
    }
    if (!index.emplace(img.id, out.size()).second) {
      return r.Error(absl::StrCat(where, ".id"), absl::StrCat("duplicate image id ", img.id));
    }
    out.push_back(std::move(img));
  }
  for (size_t i = 0; i < annotations->size(); ++i) {
    const Json& e = (*annotations)[i];
    const std::string where = absl::StrCat("annotations[", i, "]");
    ASSIGN_OR_RETURN(int64_t image_id, r.Int(e, where, "image_id"));
    ASSIGN_OR_RETURN(std::string caption, r.String(e, where, "caption"));
    auto it = index.find(image_id);
    if (it == index.end()) {
      return r.Error(absl::StrCat(where, ".image_id"), absl::StrCat(image_id, " is not in images"));
    }
    out[it->second].captions.push_back(std::move(caption));
  }
  return out;
}

absl::StatusOr<std::map<int64_t, std::string>> LoadCaptionResults(const std::string& path) {
  ASSIGN_OR_RETURN(Json j, ReadJson(path));
  Reader r(path);
  ASSIGN_OR_RETURN(const Json* list, TopArray(r, j, nullptr));
  std::map<int64_t, std::string> out;
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string where = absl::StrCat("[", i, "]");
    ASSIGN_OR_RETURN(int64_t id, r.Int((*list)[i], where, "image_id"));
    ASSIGN_OR_RETURN(std::string caption, r.String((*list)[i], where, "caption"));
    if (!out.emplace(id, std::move(caption)).second) {
      return r.Error(absl::StrCat(where, ".image_id"),
                     absl::StrCat("image ", id, " has more than one caption"));
    }
  }
  return out;
}

std::string CocoFileName(const std::string& prefix, int64_t image_id) {
  return absl::StrFormat("%s%012d.jpg", prefix, image_id);
}

namespace {

// A decoded OpenCV image (any of 1-4 channels, BGR order) as 8-bit RGB, PIL's convert("RGB").
absl::StatusOr<Image> RgbFromDecoded(const cv::Mat& raw, const std::string& path) {
  try {
    if (raw.empty()) return absl::DataLossError(absl::StrCat("cannot decode image ", path));
    if (raw.depth() != CV_8U) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", raw.elemSize1() * 8,
                       "-bit samples; only 8-bit images are supported (convert it first)"));
    }
    cv::Mat rgb;
    switch (raw.channels()) {
      case 1:
        cv::cvtColor(raw, rgb, cv::COLOR_GRAY2RGB);
        break;
      case 2: {  // gray + alpha: keep the gray
        cv::Mat gray;
        cv::extractChannel(raw, gray, 0);
        cv::cvtColor(gray, rgb, cv::COLOR_GRAY2RGB);
        break;
      }
      case 3:
        cv::cvtColor(raw, rgb, cv::COLOR_BGR2RGB);
        break;
      case 4:
        cv::cvtColor(raw, rgb, cv::COLOR_BGRA2RGB);
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": ", raw.channels(), " channels; expected 1 to 4"));
    }
    Image img(rgb.cols, rgb.rows);
    for (int y = 0; y < rgb.rows; ++y) {
      std::memcpy(img.at(0, y), rgb.ptr<uint8_t>(y), static_cast<size_t>(rgb.cols) * 3);
    }
    return img;
  } catch (const cv::Exception& e) {
    return absl::DataLossError(absl::StrCat("cannot decode image ", path, ": ", e.what()));
  }
}

}  // namespace

absl::StatusOr<Image> LoadImageRgb(const std::string& path) {
  if (!std::filesystem::exists(path)) return absl::NotFoundError(absl::StrCat("no image ", path));
  try {
    return RgbFromDecoded(cv::imread(path, cv::IMREAD_UNCHANGED), path);
  } catch (const cv::Exception& e) {
    return absl::DataLossError(absl::StrCat("cannot decode image ", path, ": ", e.what()));
  }
}

absl::StatusOr<Image> DecodeImageRgb(absl::string_view bytes, const std::string& source) {
  if (bytes.empty()) return absl::DataLossError(absl::StrCat("cannot decode image ", source));
  try {
    const cv::Mat buffer(1, static_cast<int>(bytes.size()), CV_8UC1,
                         const_cast<char*>(bytes.data()));
    return RgbFromDecoded(cv::imdecode(buffer, cv::IMREAD_UNCHANGED), source);
  } catch (const cv::Exception& e) {
    return absl::DataLossError(absl::StrCat("cannot decode image ", source, ": ", e.what()));
  }
}

absl::StatusOr<std::string> EncodeJpeg(const Image& image, int quality) {
  if (image.width <= 0 || image.height <= 0) {
    return absl::InvalidArgumentError("cannot encode an empty image");
  }
  if (quality < 1 || quality > 100) {
    return absl::InvalidArgumentError(absl::StrCat("JPEG quality ", quality, " is not in 1-100"));
  }
  try {
    cv::Mat rgb(image.height, image.width, CV_8UC3, const_cast<uint8_t*>(image.pixels.data()));
    cv::Mat bgr;
    cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
    std::vector<uint8_t> out;
    if (!cv::imencode(".jpg", bgr, out, {cv::IMWRITE_JPEG_QUALITY, quality})) {
      return absl::InternalError("OpenCV could not encode the JPEG");
    }
    return std::string(out.begin(), out.end());
  } catch (const cv::Exception& e) {
    return absl::InternalError(absl::StrCat("cannot encode JPEG: ", e.what()));
  }
}

absl::StatusOr<Image> LoadImageFile(const std::string& dir, const std::string& file_name) {
  return LoadImageRgb((std::filesystem::path(dir) / file_name).string());
}

absl::Status WritePng(const Image& image, const std::string& path) {
  try {
    cv::Mat rgb(image.height, image.width, CV_8UC3, const_cast<uint8_t*>(image.pixels.data()));
    cv::Mat bgr;
    cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
    if (!cv::imwrite(path, bgr, {cv::IMWRITE_PNG_COMPRESSION, 9})) {
      return absl::InternalError(absl::StrCat("cannot write ", path));
    }
  } catch (const cv::Exception& e) {
    return absl::InternalError(absl::StrCat("cannot write ", path, ": ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace cdcca::datasets
