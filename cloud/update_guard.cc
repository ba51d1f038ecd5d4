#include "cloud/update_guard.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"

namespace cdcca::cloud {

std::string_view GuardMeasureName(GuardMeasure measure) {
  switch (measure) {
    case GuardMeasure::kAgreement:
      return "agreement";
    case GuardMeasure::kTeacherProbability:
      return "teacher_probability";
    case GuardMeasure::kTeacherAndBase:
      return "teacher_and_base";
  }
  return "agreement";
}

absl::StatusOr<GuardMeasure> ParseGuardMeasure(std::string_view name) {
  for (GuardMeasure m : {GuardMeasure::kAgreement, GuardMeasure::kTeacherProbability,
                         GuardMeasure::kTeacherAndBase}) {
    if (name == GuardMeasureName(m)) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("guard measure '", std::string(name),
                   "': not agreement, teacher_probability or teacher_and_base"));
}

std::vector<size_t> ConfidentSamples(const std::vector<double>& entropies, double fraction) {
  std::vector<size_t> order(entropies.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (fraction >= 1) return order;
  const size_t keep = static_cast<size_t>(
      std::ceil(std::max(0.0, fraction) * static_cast<double>(entropies.size())));
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return entropies[a] < entropies[b]; });
  order.resize(std::min(keep, order.size()));
  std::sort(order.begin(), order.end());
  return order;
}

double AnswerAgreement(std::string_view student, std::string_view teacher) {
  if (student == teacher) return 1.0;
  auto words = [](std::string_view text) {
    std::map<std::string_view, int> counts;
    int total = 0;
    size_t i = 0;
    while (i < text.size()) {
      while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
      size_t j = i;
      while (j < text.size() && !std::isspace(static_cast<unsigned char>(text[j]))) ++j;
      if (j > i) {
        ++counts[text.substr(i, j - i)];
        ++total;
      }
      i = j;
    }
    return std::pair{counts, total};
  };
  const auto [s, s_total] = words(student);
  const auto [t, t_total] = words(teacher);
  if (s_total == 0 || t_total == 0) return s_total == t_total ? 1.0 : 0.0;
  int shared = 0;
  for (const auto& [w, n] : s) {
    if (auto it = t.find(w); it != t.end()) shared += std::min(n, it->second);
  }
  if (shared == 0) return 0.0;
  const double precision = static_cast<double>(shared) / s_total;
  const double recall = static_cast<double>(shared) / t_total;
  return 2 * precision * recall / (precision + recall);
}

GuardVerdict JudgeUpdate(const std::vector<double>& before, const std::vector<double>& after,
                         const UpdateGuardOptions& options) {
  GuardVerdict v;
  const size_t n = std::min(before.size(), after.size());
  v.pool = static_cast<int64_t>(n);
  if (n == 0) {
    v.decision = "empty";
    return v;
  }
  double sum = 0, sum_sq = 0, agree_before = 0, agree_after = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = after[i] - before[i];
    sum += d;
    sum_sq += d * d;
    agree_before += before[i];
    agree_after += after[i];
  }
  const double count = static_cast<double>(n);
  v.before = agree_before / count;
  v.after = agree_after / count;
  v.gain = sum / count;
  if (n >= 2) {
    const double variance = std::max(0.0, (sum_sq - count * v.gain * v.gain) / (count - 1));
    v.se = std::sqrt(variance / count);
  }
  if (n < options.min_pool) {
    v.ship = !(v.gain < -options.z / std::sqrt(count));
    v.decision = v.ship ? "small_pool" : "small_pool_worse";
    return v;
  }
  v.ship = v.gain > options.z * v.se;
  v.decision = v.ship ? "helps" : "not_beyond_noise";
  return v;
}

}  // namespace cdcca::cloud
