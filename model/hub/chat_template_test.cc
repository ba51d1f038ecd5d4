// A folder's chat template (chat_template.h): found where transformers' processor looks, and
// rendered as jinja2 renders it with transformers' settings (trim_blocks, lstrip_blocks).
// The expected strings are jinja2 3.1's output for the same template and conversation.
#include "model/hub/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/testing/status_matchers.h"

namespace cdcca::model {
namespace {

using ::testing::HasSubstr;

// llava-hf/llava-1.5-7b-hf's chat_template.json.
constexpr char kLlava15[] =
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ "
    "message['role'].upper() + ': '}}{% endif %}{# Render all images first #}{% for content in "
    "message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor "
    "%}{# Render all text next #}{% if message['role'] != 'assistant' %}{% for content in "
    "message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% "
    "endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', "
    "'text') %}{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif "
    "%}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}";

// The rendered text, or the error as text (so a failure shows it).
std::string Text(const absl::StatusOr<std::string>& s) {
  return s.ok() ? *s : "error: " + std::string(s.status().message());
}

absl::StatusOr<std::string> Render(const std::string& text, bool add_generation_prompt = true) {
  ChatTemplate t{"T.jinja", text, {{"bos_token", "<s>"}, {"eos_token", "</s>"}}};
  return RenderChatTemplate(t, OneImageUserTurn("What is shown?"), add_generation_prompt);
}

TEST(ChatTemplateTest, PublishedLlava15TemplateGivesTheLlavaPrompt) {
  EXPECT_EQ(Text(Render(kLlava15)), "USER: <image>\nWhat is shown? ASSISTANT:");
  EXPECT_EQ(Text(Render(kLlava15, false)), "USER: <image>\nWhat is shown? ");
}

TEST(ChatTemplateTest, BlockAndCommentLinesTrimmedAsTransformersRendersThem) {
  // Indented block tags on their own lines: lstrip_blocks and trim_blocks.
  const std::string chatml =
      "{% for message in messages %}\n    {{ '<|im_start|>' + message['role'] + '\\n' }}\n    {% "
      "if message['content'] is string %}\n        {{ message['content'] }}\n    {% else %}\n     "
      "   {% for c in message['content'] %}\n            {% if c['type'] == 'image' "
      "%}<image>\n{% elif c.type == 'text' %}{{ c.text | trim }}{% endif %}\n        {% endfor "
      "%}\n    {% endif %}\n{{ '<|im_end|>\\n' }}\n{% endfor %}\n{% if add_generation_prompt "
      "%}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  EXPECT_EQ(Text(Render(chatml)),
            "    <|im_start|>user\n\n<image>\nWhat is "
            "shown?<|im_end|>\n\n<|im_start|>assistant\n");
  EXPECT_EQ(Text(Render("a\n  {# c #}\n  {% if true %}\n    b\n  {% endif %}\nc {%+ if true %}d{% "
                        "endif +%}\ne")),
            "a\n    b\nc d\ne");
}

TEST(ChatTemplateTest, ExpressionsFiltersAndLoopsAsJinja) {
  const std::string t =
      "{{- bos_token -}}\n{%- set sys = 'A chat.' -%}\n{%- if messages[0]['role'] == 'system' "
      "-%}{%- set sys = messages[0]['content'] -%}{%- endif -%}\n{{ sys ~ ' ' }}\n{%- for m in "
      "messages if m.role != 'system' -%}\n  {%- if loop.first %}[{{ loop.index0 }}/{{ "
      "loop.length }}]{% endif -%}\n  {{- m.role | upper }}: {% for c in m.content -%}\n    {%- "
      "if c.type == 'image' %}<image>{{ '\\n' }}{% else %}{{ c.text }}{% endif -%}\n  {%- endfor "
      "%}{{ ' ' if not loop.last else '' }}\n{%- endfor -%}\n{%- if add_generation_prompt %} "
      "ASSISTANT:{% endif -%}\n{{ messages | length }}{{ 'x' in 'xyz' }}{{ 3 not in [1,2] }}{{ "
      "(7 // 2) ~ (7 % 3) ~ (-7 // 2) }}{{ messages[-1]['content'][1]['text'][:4] }}{{ "
      "'abc'[::-1] }}{{ none is none }}{{ undefined_var is defined }}{{ "
      "messages[0].get('missing', 'dflt') }}{{ 'a,b'.split(',') | join('+') }}{{ 'hello "
      "world'.title() }}{{ '  x  '.strip() }}|{{ 'x' if false }}|\n";
  EXPECT_EQ(Text(Render(t)),
            "<s>A chat. [0/1]USER: <image>\nWhat is shown? "
            "ASSISTANT:1TrueTrue31-4WhatcbaTrueFalsedflta+bHello Worldx||");
}

TEST(ChatTemplateTest, WhatItCannotRenderIsRefusedByName) {
  EXPECT_THAT(Render("{% macro f(x) %}{{ x }}{% endmacro %}{{ f(1) }}"),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("T.jinja: chat template: {% macro f(x) %}: 'macro' is "
                                          "not supported")));
  EXPECT_THAT(Render("{{ messages | tojson }}"),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("the filter 'tojson' is not supported")));
  EXPECT_THAT(Render("{% if true %}x"),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not closed")));
  EXPECT_THAT(
      Render("{{ raise_exception('roles must alternate') }}"),
      testing::StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("roles must alternate")));
}

class ChatTemplateFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) / "chat_template_folder";
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  std::filesystem::path dir_;
};

TEST_F(ChatTemplateFolderTest, FoundWhereTheProcessorLooksWithTheTokenizersSpecialTokens) {
  ASSERT_OK_AND_ASSIGN(std::optional<ChatTemplate> none, LoadChatTemplate(dir_.string()));
  EXPECT_FALSE(none.has_value());
  Write("tokenizer_config.json",
        R"({"chat_template": "T{{ bos_token }}", "bos_token": {"content": "<s>"},
            "eos_token": "</s>"})");
  ASSERT_OK_AND_ASSIGN(std::optional<ChatTemplate> t, LoadChatTemplate(dir_.string()));
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->text, "T{{ bos_token }}");
  EXPECT_EQ(Text(RenderChatTemplate(*t, OneImageUserTurn("q"), true)), "T<s>");
  Write("processor_config.json",
        R"({"chat_template": [{"name": "tool", "template": "no"},
                              {"name": "default", "template": "P"}]})");
  ASSERT_OK_AND_ASSIGN(t, LoadChatTemplate(dir_.string()));
  EXPECT_EQ(t->text, "P");
  Write("chat_template.json", R"({"chat_template": "J"})");
  ASSERT_OK_AND_ASSIGN(t, LoadChatTemplate(dir_.string()));
  EXPECT_EQ(t->text, "J");
  EXPECT_EQ(t->special_tokens["eos_token"], "</s>");
  Write("chat_template.jinja", "{{ eos_token }}");
  ASSERT_OK_AND_ASSIGN(t, LoadChatTemplate(dir_.string()));
  EXPECT_EQ(t->source, (dir_ / "chat_template.jinja").string());
  EXPECT_EQ(Text(RenderChatTemplate(*t, OneImageUserTurn("q"), true)), "</s>");
  Write("chat_template.jinja", "");
  std::filesystem::remove(dir_ / "chat_template.jinja");
  Write("chat_template.json", R"({"chat_template": 3})");
  EXPECT_THAT(LoadChatTemplate(dir_.string()).status(),
              testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr("chat_template.json: chat_template: not a string")));
}

}  // namespace
}  // namespace cdcca::model
