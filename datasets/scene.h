// Scenes: 1-4 tinted Fashion-MNIST items on a small canvas with a varied background, plus
// the per-item ground truth (class, colour, grid cell, bounding box) the model's vision
// encoder is supervised on.
//
// Layout: the canvas is split into a 2x2 grid; every item sits in its own cell, scaled to
// 72-94 % of the cell and jittered inside it, so "where" has exactly one answer per item
// ("top left", "top right", "bottom left", "bottom right") and items never overlap. No
// two items of a scene share both class and colour, so "the red coat" is unambiguous.
#ifndef CDCCA_DATASETS_SCENE_H_
#define CDCCA_DATASETS_SCENE_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "datasets/fashion_mnist.h"
#include "datasets/image.h"
#include "datasets/random.h"

namespace cdcca::datasets {

// The palette: red, orange, yellow, green, cyan, blue, purple, white (index = colour id).
inline constexpr int kNumColors = 8;
std::string_view ColorName(int color);
int ColorFromName(std::string_view name);  // -1 if unknown
struct Rgb {
  uint8_t r, g, b;
};
Rgb ColorRgb(int color);

// Grid cells, row-major: 0 "top left", 1 "top right", 2 "bottom left", 3 "bottom right".
inline constexpr int kNumCells = 4;
std::string_view CellName(int cell);
int CellFromName(std::string_view name);  // -1 if unknown

enum class Background { kPlain, kGradient, kStripes, kChecker, kSpeckle };
inline constexpr int kNumBackgrounds = 5;
// "plain", "gradient", "striped", "checkered", "speckled" (as used in captions).
std::string_view BackgroundName(Background b);

struct SceneItem {
  int label = 0;        // Fashion-MNIST class, [0, kNumClasses)
  int color = 0;        // palette index, [0, kNumColors)
  int cell = 0;         // grid cell, [0, kNumCells)
  int image_index = 0;  // index into the ImageSet the scene was drawn from
  int x = 0, y = 0;     // bounding box top-left, pixels
  int w = 0, h = 0;     // bounding box size, pixels (the scaled 28x28 glyph)
};

struct Scene {
  Split split = Split::kTrain;
  Background background = Background::kPlain;
  std::vector<SceneItem> items;  // sorted by cell
  Image image;                   // the rendered (clean) scene
};

struct SceneOptions {
  int canvas = 64;  // square canvas side, pixels; >= 16
  int min_items = 1;
  int max_items = 4;                                       // <= kNumCells
  std::vector<int> classes;                                // allowed labels; empty = all
  std::vector<int> colors;                                 // allowed palette indices; empty = all
  Interpolation interpolation = Interpolation::kBilinear;  // glyph scaling
};

// Lays out and renders one scene from `images` using `rng` only (deterministic).
// Requires every allowed class to have images in `images` (the generator checks).
Scene RenderScene(const ImageSet& images, const SceneOptions& options, Rng& rng);

}  // namespace cdcca::datasets

#endif  // CDCCA_DATASETS_SCENE_H_
