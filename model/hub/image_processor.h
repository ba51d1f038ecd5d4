// Image preprocessing as a Hugging Face checkpoint's image processor settings say
// (CLIPImageProcessor, SiglipImageProcessor, BlipImageProcessor and their *Fast / *Pil
// names): resize with the named resampling filter, center crop, rescale, normalize,
// optionally pad; the result is the `pixel_values` tensor transformers produces for the same
// RGB image, with either of its backends (ImageBackend: PIL, the 4.x slow processors and
// transformers 5's *ImageProcessorPil; or torchvision, transformers 5's default).
//
// The resize reimplements Pillow's Image.resize for 8-bit images (libImaging/Resample.c):
// separable convolution, horizontal pass first, with a filter whose support widens with the
// downscale factor (antialiasing), coefficients normalised to sum 1 and then to 22-bit fixed
// point, and the result rounded and clamped to uint8 after each pass. LibTorch's uint8
// antialiased interpolate (what torchvision runs) is the same but for int16 coefficients.
// Both are reproduced bit for bit: tests compare against hashes of Pillow's output and
// against transformers' pixel_values under tests/fixtures/hf (every value identical).
//
// Torch-free and OpenCV-free (Abseil and nlohmann_json only): it builds on the GPU machine
// in the core build. Decoding an image file into RGB is datasets::LoadImageRgb
// (datasets/formats.h, OpenCV).
//
// Thread-safety: all functions are pure; a config is a plain value.
#ifndef CDCCA_MODEL_HUB_IMAGE_PROCESSOR_H_
#define CDCCA_MODEL_HUB_IMAGE_PROCESSOR_H_

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cdcca::model {

// Pillow's resampling filters, numbered as PIL.Image.Resampling (the integers transformers
// writes as `resample`).
enum class PilResample {
  kNearest = 0,
  kLanczos = 1,   // Lanczos-3 (windowed sinc, support 3)
  kBilinear = 2,  // triangle, support 1
  kBicubic = 3,   // Keys cubic with a = -0.5, support 2
  kBox = 4,
  kHamming = 5,
};

// The filter's name as Pillow spells it ("bicubic", ...).
absl::string_view PilResampleName(PilResample filter);

// Resizes an 8-bit image with interleaved channels (row-major, `channels` bytes per pixel,
// no row padding) to out_width x out_height exactly as Pillow's Image.resize does for modes
// L and RGB (channels are filtered independently; Pillow's alpha premultiplication for RGBA
// is not done). `channels` in 1..4; all sizes >= 1. Returns out_height * out_width *
// channels bytes.
std::vector<uint8_t> PilResize(const uint8_t* src, int width, int height, int channels,
                               int out_width, int out_height, PilResample filter);

// Resizes as transformers' torchvision backend does for uint8 images on the CPU (LibTorch's
// antialiased interpolate on uint8, the default backend of transformers 5): the same windows
// and weights as Pillow, but int16 fixed-point weights with a per-axis precision, so values
// can differ from PilResize by one step. Bilinear and bicubic (Lanczos becomes bicubic, as
// transformers substitutes it); other filters are InvalidArgument. Same layout as PilResize.
absl::StatusOr<std::vector<uint8_t>> TorchvisionResize(const uint8_t* src, int width, int height,
                                                       int channels, int out_width, int out_height,
                                                       PilResample filter);

// Which of transformers' two image processor backends to reproduce. They differ by at most
// one 8-bit step per value (the resize's fixed point), in where center_crop's odd padding
// pixel goes, and in float rounding of the normalisation.
enum class ImageBackend {
  // *ImageProcessorPil (transformers 5) / the slow *ImageProcessor (4.x): PIL resize, numpy.
  kPil,
  // The default of transformers 5 (AutoImageProcessor, the model processors) and the
  // *ImageProcessorFast classes of 4.x: torchvision on uint8 tensors.
  kTorchvision,
};

// The `size` setting. Exactly one form is set, as transformers' size dicts allow:
// {height, width}; {shortest_edge}; {shortest_edge, longest_edge}; {max_height, max_width}.
// 0 = absent.
struct ResizeSpec {
  int height = 0;
  int width = 0;
  int shortest_edge = 0;
  int longest_edge = 0;  // only together with shortest_edge
  int max_height = 0;
  int max_width = 0;
};

// The output (height, width) transformers computes for an input of height x width under
// `spec` (image_transforms.get_resize_output_image_size with default_to_square=False for
// shortest_edge, get_size_with_aspect_ratio for shortest+longest edge,
// image_utils.get_image_size_for_max_height_width), including Python's int() truncation
// and round-half-even. InvalidArgument when the spec is empty or the result is < 1 pixel.
absl::StatusOr<std::pair<int, int>> ResizeOutputSize(const ResizeSpec& spec, int height, int width);

// The largest pixel size a setting may give (size, crop_size, pad_size entries): 8192.
// Published processors use at most ~1.5k; the bound keeps one preprocessed image (8-bit
// resize output and float pixel_values) under 1 GiB whatever the file says.
inline constexpr int kMaxImageProcessorSide = 8192;

// Settings of one image processor, with the defaults of its class filled in for fields the
// file leaves out.
struct ImageProcessorConfig {
  std::string processor_type;  // as the file names it, e.g. "CLIPImageProcessor"
  // Whether the checkpoint converts its input to RGB. Informational: PreprocessImage takes
  // RGB, and LoadImageRgb always converts (as PIL's convert("RGB") does).
  bool do_convert_rgb = true;
  bool do_resize = true;
  ResizeSpec size;
  PilResample resample = PilResample::kBicubic;
  bool do_center_crop = false;
  int crop_height = 0;  // pixels; set when do_center_crop
  int crop_width = 0;
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = true;
  // Per channel (R, G, B), float32 as transformers' numpy normalisation uses them.
  std::array<float, 3> image_mean = {0.f, 0.f, 0.f};
  std::array<float, 3> image_std = {1.f, 1.f, 1.f};
  // transformers 5: pad bottom/right with 0 (after normalisation) to pad_height x
  // pad_width. 0 = pad to the image's own size (a no-op for a single image).
  bool do_pad = false;
  int pad_height = 0;
  int pad_width = 0;
  // Not read from the file (transformers picks it at load time): the caller chooses.
  // Default: kPil.
  ImageBackend backend = ImageBackend::kPil;
};

// Parses an image processor's JSON settings. `json_text` is either a
// preprocessor_config.json (the settings at top level) or a processor_config.json whose
// "image_processor" entry holds them (transformers 5); `file_name` names the file in
// errors. Accepted types: CLIPImageProcessor, SiglipImageProcessor, BlipImageProcessor (with
// or without a Fast / Pil suffix; also the legacy "feature_extractor_type":
// "CLIPFeatureExtractor"). Understood fields: do_convert_rgb, do_resize, size (dict, int or
// [h, w]), default_to_square, use_square_size, resample (PIL integer or filter name),
// do_center_crop, crop_size, do_rescale, rescale_factor, do_normalize, image_mean,
// image_std, do_pad, pad_size. Fields that do not change pixels (types, processor_class,
// auto_map, names starting with "_", return/format options) are ignored. Any other field
// whose value is not null or false is InvalidArgument naming the file and the field, since
// it may change pixels in a way this code does not reproduce. A JSON null for a boolean
// means false (transformers tests the attribute's truth); for other fields, the class
// default. Size, nesting (folder_json.h) and every pixel size (kMaxImageProcessorSide) are
// bounded: an error, not an allocation.
absl::StatusOr<ImageProcessorConfig> ParseImageProcessorConfig(absl::string_view json_text,
                                                               absl::string_view file_name);

// Reads the image processor settings of a model folder: the "image_processor" entry of
// processor_config.json when there is one (transformers 5 gives it priority), else
// preprocessor_config.json. NotFound when neither has settings; otherwise as
// ParseImageProcessorConfig.
absl::StatusOr<ImageProcessorConfig> LoadImageProcessorConfig(const std::string& model_dir);

// An 8-bit RGB image, interleaved (HWC), rows top to bottom, no padding.
struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;  // height * width * 3
};

// A float image, channels first (CHW): value (c, y, x) is data[(c * height + y) * width + x].
struct PixelValues {
  int channels = 0;
  int height = 0;
  int width = 0;
  std::vector<float> data;
};

// The geometric steps on the 8-bit image: resize (PilResize or TorchvisionResize, by
// config.backend) and center crop (zero padding where the crop is larger than the image:
// the odd pixel goes before the image with kPil, after it with kTorchvision, as each backend
// places it). `rgb` holds height * width * 3 bytes. InvalidArgument for an empty image or a
// config whose sizes cannot be applied.
absl::StatusOr<RgbImage> ResizeAndCrop(const ImageProcessorConfig& config, const uint8_t* rgb,
                                       int width, int height);

// The value steps: rescale and normalize and pad. kPil: rescale in float64, cast to
// float32, then (x - mean) / std in float32 (numpy). kTorchvision: rescale and normalize
// fused, (x - mean * 255) / (std * 255) in float32 (with the rescale factor's inverse in
// place of 255). Returns [3, H, W].
absl::StatusOr<PixelValues> RescaleNormalizePad(const ImageProcessorConfig& config,
                                                const RgbImage& image);

// ResizeAndCrop then RescaleNormalizePad: the pixel_values (one image, [3, H, W]) that
// transformers' image processor (of config.backend) returns for this RGB image.
absl::StatusOr<PixelValues> PreprocessImage(const ImageProcessorConfig& config, const uint8_t* rgb,
                                            int width, int height);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_IMAGE_PROCESSOR_H_
