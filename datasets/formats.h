// Loaders for the real benchmark formats (VQAv2, A-OKVQA, COCO captions, nocaps), their
// result files, and OpenCV image decoding from a directory. Part of cdcca_datasets_io
// (needs OpenCV; not built with CDCCA_CORE_ONLY).
//
// Every loader returns NOT_FOUND for a missing file and INVALID_ARGUMENT for malformed
// content, with a message naming the file and the offending field
// ("A.json: annotations[3].answers: expected an array").
#ifndef CDCCA_DATASETS_FORMATS_H_
#define CDCCA_DATASETS_FORMATS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "datasets/image.h"

namespace cdcca::datasets {

// One VQAv2 question joined with its annotation.
struct VqaRecord {
  int64_t question_id = 0;
  int64_t image_id = 0;
  std::string question;
  std::string question_type;           // e.g. "what color is the"
  std::string answer_type;             // "yes/no", "number" or "other"
  std::string multiple_choice_answer;  // the most common answer
  std::vector<std::string> answers;    // the 10 annotators' answers
};

// One question of a VQAv2 questions file (test-dev and test have no annotations).
struct VqaQuestion {
  int64_t question_id = 0;
  int64_t image_id = 0;
  std::string question;
};
// {"questions": [{question_id, image_id, question}]}, in the file's order.
absl::StatusOr<std::vector<VqaQuestion>> LoadVqaQuestions(const std::string& path);

// Reads a VQAv2 questions file ({"questions": [{question_id, image_id, question}]}) and
// annotations file ({"annotations": [{question_id, image_id, question_type, answer_type,
// multiple_choice_answer, answers: [{answer, ...}]}]}), joined on question_id, in the
// annotation file's order. A question without annotation is an error.
absl::StatusOr<std::vector<VqaRecord>> LoadVqaV2(const std::string& questions_path,
                                                 const std::string& annotations_path);

// VQAv2 results: [{question_id, answer}] -> question_id -> answer.
absl::StatusOr<std::map<int64_t, std::string>> LoadVqaResults(const std::string& path);

// One A-OKVQA question (split files are JSON lists of these). The test split has no
// answers: correct_choice_idx is then -1 and direct_answers empty.
struct AokvqaRecord {
  std::string question_id;
  int64_t image_id = 0;
  std::string question;
  std::vector<std::string> choices;
  int correct_choice_idx = -1;
  std::vector<std::string> direct_answers;
  bool difficult_direct_answer = false;
};
absl::StatusOr<std::vector<AokvqaRecord>> LoadAokvqa(const std::string& path);

struct AokvqaPrediction {
  std::string multiple_choice;
  std::string direct_answer;
};
// {qid: {"multiple_choice": .., "direct_answer": ..}}; either field may be absent.
absl::StatusOr<std::map<std::string, AokvqaPrediction>> LoadAokvqaPredictions(
    const std::string& path);

// An image of a COCO-captions or nocaps annotation file with its reference captions.
struct CaptionImage {
  int64_t id = 0;
  std::string file_name;
  std::string domain;  // nocaps: "in-domain", "near-domain" or "out-domain"; COCO: empty
  std::vector<std::string> captions;
};
// {"images": [{id, file_name, [domain]}], "annotations": [{image_id, caption}]}; nocaps
// uses the same layout. Images keep the file's order.
absl::StatusOr<std::vector<CaptionImage>> LoadCaptionAnnotations(const std::string& path);

// Caption results: [{image_id, caption}] -> image_id -> caption. A repeated image_id is
// INVALID_ARGUMENT (COCO's evaluation requires one caption per image).
absl::StatusOr<std::map<int64_t, std::string>> LoadCaptionResults(const std::string& path);

// COCO's file name for an image id: "<prefix><12-digit id>.jpg", e.g.
// CocoFileName("COCO_val2014_", 42) == "COCO_val2014_000000000042.jpg".
std::string CocoFileName(const std::string& prefix, int64_t image_id);

// Decodes an image file with OpenCV into 8-bit RGB the way PIL's
// Image.open(path).convert("RGB") does, so pixels match what transformers' processors
// receive: grayscale is replicated to three channels, an alpha channel is dropped (not
// blended), palette images are expanded, and EXIF orientation is not applied (PIL's open and
// convert do not apply it either). NOT_FOUND if the file is missing, DATA_LOSS if OpenCV
// cannot decode it, INVALID_ARGUMENT for more than 8 bits per channel (16-bit PNG/TIFF:
// convert it to 8 bits first; PIL's own 16-bit conversions differ by mode). Every error
// names the file. Thread-safe.
absl::StatusOr<Image> LoadImageRgb(const std::string& path);
// LoadImageRgb(`dir`/`file_name`).
absl::StatusOr<Image> LoadImageFile(const std::string& dir, const std::string& file_name);
// LoadImageRgb for encoded bytes in memory (a frame a device uplinked); `source` names them in
// errors. DATA_LOSS if OpenCV cannot decode them. The caller bounds the size first (a JPEG's
// declared size: compress::ReadJpegSize): decoding allocates what the header declares.
absl::StatusOr<Image> DecodeImageRgb(absl::string_view bytes, const std::string& source);
// `image` as baseline JPEG at `quality` (1-100; OpenCV's libjpeg, 4:2:0 chroma).
// INVALID_ARGUMENT for an empty image or a quality outside 1-100.
absl::StatusOr<std::string> EncodeJpeg(const Image& image, int quality);
// Writes `image` as PNG. INTERNAL if OpenCV cannot write.
absl::Status WritePng(const Image& image, const std::string& path);

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_FORMATS_H_
