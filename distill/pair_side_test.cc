// A pair's side formats prompts as the other programs do on the same folder
// (model::ResolvePromptFormat): the folder's chat template where it has one, else the
// architecture's default. The cloud's Hub mirror trainer, `cdcca adapt` and the device
// (device/internal/student.cc) all resolve it so, which keeps the prompt the device encodes and the
// one the cloud's student side rebuilds the same.
#include "distill/pair_side.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "model/arch/answerer.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace cdcca::distill {
namespace {

namespace fs = std::filesystem;

TEST(PairSideTest, FormatsPromptsWithTheFoldersChatTemplateElseTheDefault) {
  const std::string fixture =
      std::string(CDCCA_SOURCE_DIR) + "/tests/fixtures/hf/models/llava_clip_llama";
  testing::TempDir temp;
  const fs::path dir = fs::path(temp.path()) / "with_chat";
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(fixture))
    fs::copy(e.path(), dir / e.path().filename());
  std::ofstream(dir / "chat_template.jinja")
      << "{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', "
         "'text') %}Q: {{ c['text'] }} A:{% endfor %}{% endfor %}\n";

  for (const bool chat : {false, true}) {
    const std::string folder = chat ? dir.string() : fixture;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<model::Answerer> answerer,
                         model::Answerer::Load(folder, "fp32", "cpu"));
    ASSERT_OK_AND_ASSIGN(model::PromptFormat format,
                         model::ResolvePromptFormat("auto", answerer->model_type(), folder));
    const PairSide side = PairSideOf(*answerer, folder, format);
    ASSERT_OK_AND_ASSIGN(std::string prompt, side.format_prompt("what is it?"));
    EXPECT_EQ(prompt, chat ? "Q: what is it? A:" : "USER: <image>\nwhat is it? ASSISTANT:");
  }
}

}  // namespace
}  // namespace cdcca::distill
