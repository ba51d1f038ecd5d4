#include "datasets/scene.h"

#include <algorithm>
#include <array>

namespace cdcca::datasets {
namespace {

constexpr std::string_view kColorNames[kNumColors] = {"red",  "orange", "yellow", "green",
                                                      "cyan", "blue",   "purple", "white"};
constexpr Rgb kColorRgb[kNumColors] = {{225, 35, 35},  {250, 140, 25}, {240, 220, 40},
                                       {40, 185, 60},  {40, 215, 225}, {45, 85, 235},
                                       {160, 60, 210}, {245, 245, 245}};
constexpr std::string_view kCellNames[kNumCells] = {"top left", "top right", "bottom left",
                                                    "bottom right"};
constexpr std::string_view kBackgroundNames[kNumBackgrounds] = {"plain", "gradient", "striped",
                                                                "checkered", "speckled"};

// Dark, weakly tinted tones, so every palette colour stands out from every background and
// a colour question never depends on the background.
std::array<float, 3> BackgroundTone(Rng& rng, float lo, float hi) {
  const float base = static_cast<float>(rng.Uniform(lo, hi));
  std::array<float, 3> t{};
  for (float& c : t) c = std::clamp(base + static_cast<float>(rng.Uniform(-14, 14)), 0.f, 255.f);
  return t;
}

void PaintBackground(Background kind, Image& img, Rng& rng) {
  const std::array<float, 3> a = BackgroundTone(rng, 15, 75);
  const std::array<float, 3> b = BackgroundTone(rng, 35, 100);
  const int w = img.width, h = img.height;
  const int orientation = rng.UniformInt(0, 2);  // 0 horizontal, 1 vertical, 2 diagonal
  const int period = rng.UniformInt(6, 12);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      float t = 0;  // mix weight of tone b
      switch (kind) {
        case Background::kPlain:
          t = 0;
          break;
        case Background::kGradient:
          t = orientation == 0   ? static_cast<float>(x) / (w - 1)
              : orientation == 1 ? static_cast<float>(y) / (h - 1)
                                 : static_cast<float>(x + y) / (w + h - 2);
          break;
        case Background::kStripes: {
          const int coord = orientation == 0 ? y : orientation == 1 ? x : x + y;
          t = (coord / (period / 2)) % 2 == 0 ? 0.f : 1.f;
          break;
        }
        case Background::kChecker:
          t = ((x / period) + (y / period)) % 2 ? 1.f : 0.f;
          break;
        case Background::kSpeckle:
          t = static_cast<float>(rng.Uniform(0, 0.6));
          break;
      }
      uint8_t* p = img.at(x, y);
      for (int c = 0; c < 3; ++c) p[c] = ClampPixel(a[c] + t * (b[c] - a[c]));
    }
  }
}

}  // namespace

std::string_view ColorName(int color) {
  return color >= 0 && color < kNumColors ? kColorNames[color] : std::string_view("?");
}
int ColorFromName(std::string_view name) {
  for (int i = 0; i < kNumColors; ++i) {
    if (kColorNames[i] == name) return i;
  }
  return -1;
}
Rgb ColorRgb(int color) { return kColorRgb[std::clamp(color, 0, kNumColors - 1)]; }
std::string_view CellName(int cell) {
  return cell >= 0 && cell < kNumCells ? kCellNames[cell] : std::string_view("?");
}
int CellFromName(std::string_view name) {
  for (int i = 0; i < kNumCells; ++i) {
    if (kCellNames[i] == name) return i;
  }
  return -1;
}
std::string_view BackgroundName(Background b) { return kBackgroundNames[static_cast<int>(b)]; }

Scene RenderScene(const ImageSet& images, const SceneOptions& options, Rng& rng) {
  Scene scene;
  scene.split = images.split;
  scene.image = Image(options.canvas, options.canvas);
  scene.background = static_cast<Background>(rng.UniformInt(0, kNumBackgrounds - 1));
  PaintBackground(scene.background, scene.image, rng);

  std::vector<int> classes = options.classes, colors = options.colors;
  if (classes.empty()) {
    for (int i = 0; i < kNumClasses; ++i) classes.push_back(i);
  }
  if (colors.empty()) {
    for (int i = 0; i < kNumColors; ++i) colors.push_back(i);
  }
  const int max_items = std::clamp(options.max_items, 1, kNumCells);
  const int n = rng.UniformInt(std::clamp(options.min_items, 1, max_items), max_items);
  int cells[kNumCells] = {0, 1, 2, 3};
  Shuffle(cells, cells + kNumCells, rng);
  std::sort(cells, cells + n);

  const int cell_size = options.canvas / 2;
  for (int i = 0; i < n; ++i) {
    SceneItem item;
    // Redraw on a repeated (class, colour) pair; with >= 2 classes or colours this ends fast.
    for (int attempt = 0;; ++attempt) {
      item.label = classes[rng.UniformInt(0, static_cast<int>(classes.size()) - 1)];
      item.color = colors[rng.UniformInt(0, static_cast<int>(colors.size()) - 1)];
      const bool repeated = std::any_of(
          scene.items.begin(), scene.items.end(),
          [&](const SceneItem& o) { return o.label == item.label && o.color == item.color; });
      if (!repeated || attempt > 32) break;
    }
    const std::vector<int>& pool = images.by_class[item.label];
    item.image_index = pool[rng.UniformInt(0, static_cast<int>(pool.size()) - 1)];
    item.cell = cells[i];
    const int size = rng.UniformInt((cell_size * 72 + 50) / 100, (cell_size * 94 + 50) / 100);
    item.w = item.h = size;
    item.x = (item.cell % 2) * cell_size + rng.UniformInt(0, cell_size - size);
    item.y = (item.cell / 2) * cell_size + rng.UniformInt(0, cell_size - size);

    const std::vector<uint8_t> glyph = ResizeGray(images.image(item.image_index), images.cols,
                                                  images.rows, size, size, options.interpolation);
    const Rgb rgb = ColorRgb(item.color);
    const float color[3] = {static_cast<float>(rgb.r), static_cast<float>(rgb.g),
                            static_cast<float>(rgb.b)};
    for (int y = 0; y < size; ++y) {
      for (int x = 0; x < size; ++x) {
        const uint8_t m = glyph[y * size + x];
        if (m == 0) continue;
        // Fashion-MNIST intensity is both shape and texture: use it as coverage, slightly
        // boosted so thin garments keep a solid colour.
        const float alpha = std::min(1.f, m * (1.25f / 255.f));
        uint8_t* p = scene.image.at(item.x + x, item.y + y);
        for (int c = 0; c < 3; ++c) p[c] = ClampPixel(p[c] + alpha * (color[c] - p[c]));
      }
    }
    scene.items.push_back(item);
  }
  return scene;
}

}  // namespace cdcca::datasets
