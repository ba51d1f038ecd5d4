// Post-processors of tokenizer.json (single sequences): TemplateProcessing,
// BertProcessing, RobertaProcessing, ByteLevel (offsets only: no ids change), Sequence.
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "model/tokenizer/components.h"

namespace cdcca::tokenizer {
namespace {

// The single-sequence template flattened: ids before and after the sequence.
class WrapProcessor : public PostProcessor {
 public:
  WrapProcessor(std::vector<int32_t> before, std::vector<int32_t> after)
      : before_(std::move(before)), after_(std::move(after)) {}
  void Process(std::vector<int32_t>* ids) const override {
    ids->insert(ids->begin(), before_.begin(), before_.end());
    ids->insert(ids->end(), after_.begin(), after_.end());
  }

 private:
  std::vector<int32_t> before_, after_;
};

class SequenceProcessor : public PostProcessor {
 public:
  explicit SequenceProcessor(std::vector<std::unique_ptr<PostProcessor>> steps)
      : steps_(std::move(steps)) {}
  void Process(std::vector<int32_t>* ids) const override {
    for (const auto& s : steps_) s->Process(ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

class NoOpProcessor : public PostProcessor {
 public:
  void Process(std::vector<int32_t>*) const override {}
};

absl::StatusOr<int32_t> TokenPairId(const JsonAt& json) {
  // ["[CLS]", 101]
  if (!json.value.is_array() || json.value.size() != 2 || !json.value[0].is_string()) {
    return json.Error("must be [token, id]");
  }
  absl::StatusOr<int64_t> id = json.Index(1).Int();
  if (!id.ok()) return id.status();
  if (*id < 0 || *id > INT32_MAX) return json.Error("id out of range");
  return static_cast<int32_t>(*id);
}

absl::StatusOr<std::unique_ptr<PostProcessor>> ParseTemplate(const JsonAt& json) {
  JsonAt specials = json.Field("special_tokens");
  if (!specials.IsNullOrAbsent()) {
    if (absl::Status st = specials.ExpectObject(); !st.ok()) return st;
  }
  auto special_ids = [&](const std::string& name,
                         const JsonAt& where) -> absl::StatusOr<std::vector<int32_t>> {
    JsonAt entry = specials.Field(name);
    if (entry.IsNullOrAbsent())
      return where.Error(Concat("names special token '", name, "' missing from special_tokens"));
    JsonAt ids = entry.Field("ids");
    if (absl::Status st = ids.ExpectArray(); !st.ok()) return st;
    std::vector<int32_t> out;
    for (size_t i = 0; i < ids.value.size(); ++i) {
      absl::StatusOr<int64_t> id = ids.Index(i).Int();
      if (!id.ok()) return id.status();
      if (*id < 0 || *id > INT32_MAX) return ids.Index(i).Error("id out of range");
      out.push_back(static_cast<int32_t>(*id));
    }
    return out;
  };
  JsonAt single = json.Field("single");
  std::vector<int32_t> before, after;
  bool seen_sequence = false;
  auto add_special = [&](const std::string& name, const JsonAt& where) -> absl::Status {
    absl::StatusOr<std::vector<int32_t>> ids = special_ids(name, where);
    if (!ids.ok()) return ids.status();
    std::vector<int32_t>& dst = seen_sequence ? after : before;
    dst.insert(dst.end(), ids->begin(), ids->end());
    return absl::OkStatus();
  };
  if (single.value.is_string()) {
    // "[CLS] $A [SEP]" (the Python constructor's form; type ids after ':' are ignored).
    for (absl::string_view part :
         absl::StrSplit(single.value.get<std::string>(), ' ', absl::SkipEmpty())) {
      absl::string_view name = part.substr(0, part.find(':'));
      if (!name.empty() && name[0] == '$') {
        if (name != "$" && name != "$A" && name != "$0") {
          return single.Error(Concat("'", part, "' is not the first sequence"));
        }
        seen_sequence = true;
      } else if (absl::Status st = add_special(std::string(name), single); !st.ok()) {
        return st;
      }
    }
  } else {
    if (absl::Status st = single.ExpectArray(); !st.ok()) return st;
    for (size_t i = 0; i < single.value.size(); ++i) {
      JsonAt piece = single.Index(i);
      if (JsonAt seq = piece.Field("Sequence"); !seq.IsNullOrAbsent()) {
        absl::StatusOr<std::string> id = seq.StringOr("id", "A");
        if (!id.ok()) return id.status();
        if (*id != "A") return seq.Field("id").Error("must be \"A\" in the single template");
        seen_sequence = true;
      } else if (JsonAt sp = piece.Field("SpecialToken"); !sp.IsNullOrAbsent()) {
        absl::StatusOr<std::string> name = sp.Field("id").String();
        if (!name.ok()) return name.status();
        if (absl::Status st = add_special(*name, sp); !st.ok()) return st;
      } else {
        return piece.Error("must hold \"Sequence\" or \"SpecialToken\"");
      }
    }
  }
  return std::make_unique<WrapProcessor>(std::move(before), std::move(after));
}

}  // namespace

std::unique_ptr<PostProcessor> MakeWrapProcessor(std::vector<int32_t> before,
                                                 std::vector<int32_t> after) {
  return std::make_unique<WrapProcessor>(std::move(before), std::move(after));
}

absl::StatusOr<std::unique_ptr<PostProcessor>> ParsePostProcessor(const JsonAt& json) {
  absl::StatusOr<std::string> type = json.Type();
  if (!type.ok()) return type.status();
  if (*type == "TemplateProcessing") return ParseTemplate(json);
  if (*type == "ByteLevel") return std::make_unique<NoOpProcessor>();
  if (*type == "BertProcessing" || *type == "RobertaProcessing") {
    absl::StatusOr<int32_t> cls = TokenPairId(json.Field("cls"));
    if (!cls.ok()) return cls.status();
    absl::StatusOr<int32_t> sep = TokenPairId(json.Field("sep"));
    if (!sep.ok()) return sep.status();
    return std::make_unique<WrapProcessor>(std::vector<int32_t>{*cls}, std::vector<int32_t>{*sep});
  }
  if (*type == "Sequence") {
    JsonAt list = json.Field("processors");
    if (absl::Status st = list.ExpectArray(); !st.ok()) return st;
    std::vector<std::unique_ptr<PostProcessor>> steps;
    for (size_t i = 0; i < list.value.size(); ++i) {
      absl::StatusOr<std::unique_ptr<PostProcessor>> p = ParsePostProcessor(list.Index(i));
      if (!p.ok()) return p.status();
      steps.push_back(*std::move(p));
    }
    return std::make_unique<SequenceProcessor>(std::move(steps));
  }
  return json.Unsupported(*type);
}

}  // namespace cdcca::tokenizer
