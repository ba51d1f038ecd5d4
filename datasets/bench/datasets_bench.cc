// Scene generation throughput: scenes per second on one core (Google Benchmark runs each
// case on one thread; items_per_second = scenes/s/core). Clean scenes with and without
// text, and image-only scenes under each shift at severity 3.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>

#include "datasets/domain.h"

namespace cdcca::datasets {
namespace {

const ImageSet& TrainImages() {
  static const ImageSet set = [] {
    absl::StatusOr<ImageSet> s = LoadFashionMnist(Split::kTrain);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      std::exit(1);
    }
    return *std::move(s);
  }();
  return set;
}

// All classes and phrasings, no corruption: the widest clean distribution.
DomainSpec TeacherDomainClean() {
  DomainSpec spec = TeacherDomain();
  spec.shifts.clear();
  return spec;
}

void Run(benchmark::State& state, const DomainSpec& spec, bool with_text) {
  absl::StatusOr<SampleGenerator> gen = SampleGenerator::Create(&TrainImages(), spec, 1);
  if (!gen.ok()) {
    state.SkipWithError(gen.status().ToString().c_str());
    return;
  }
  uint64_t i = 0;
  for (auto _ : state) {
    Sample s = with_text ? gen->Generate(i++) : gen->GenerateImageOnly(i++);
    benchmark::DoNotOptimize(s.image.pixels.data());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
  state.counters["scenes/s/core"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_CleanSceneWithText(benchmark::State& state) { Run(state, TeacherDomainClean(), true); }
void BM_CleanSceneImageOnly(benchmark::State& state) { Run(state, TeacherDomainClean(), false); }

void BM_ShiftedScene(benchmark::State& state) {
  const ImageShift shift = AllImageShifts()[state.range(0)];
  state.SetLabel(std::string(ImageShiftName(shift)));
  DomainSpec spec = TeacherDomainClean();
  spec.shifts = {{shift, 3}};
  Run(state, spec, false);
}

BENCHMARK(BM_CleanSceneWithText);
BENCHMARK(BM_CleanSceneImageOnly);
BENCHMARK(BM_ShiftedScene)->DenseRange(0, 7);

}  // namespace
}  // namespace cdcca::datasets

BENCHMARK_MAIN();
