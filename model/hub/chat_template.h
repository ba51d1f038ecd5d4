// A Hugging Face folder's chat template: the Jinja text transformers' processor renders in
// apply_chat_template, read from where the processor reads it and rendered for one user turn
// (an image and a text) as jinja2 does with transformers' settings (trim_blocks,
// lstrip_blocks).
//
// The renderer covers the Jinja that chat templates use, and so every template of the
// published LLaVA-1.5 folders (llava-hf), those written in the style of transformers'
// documentation (ChatML, Llama-2/Vicuna, typed content parts filtered with selectattr) and the
// project's families:
//   {{ expr }}, {# comment #}, {%- -%} / {{- -}} whitespace control,
//   {% if / elif / else / endif %}, {% for x in expr [if cond] %} ... {% else %} {% endfor %}
//   with loop.index, index0, first, last, length, {% set name = expr %},
//   {% generation %} ... {% endgeneration %} (transformers' tag: renders its body);
//   literals (strings with Python escapes, integers, true/false/none, lists), names, a.b, a[i],
//   a[i:j], a if c else b, + - * / // % ~, == != < <= > >=, in, not in, and, or, not;
//   tests: defined, undefined, none, string, number, integer, boolean, mapping, sequence,
//   iterable, true, false, equalto / eq / ==, ne / !=;
//   filters: trim, upper, lower, capitalize, title, length / count, first, last, string, join,
//   default / d, list, selectattr, rejectattr;
//   string methods upper, lower, strip, lstrip, rstrip, title, capitalize, startswith, endswith,
//   replace, split; mapping methods get, keys, values; raise_exception(msg).
// Anything else (macros, includes, other filters, tojson, ...) is InvalidArgument naming the
// construct and the file, never rendered approximately.
//
// Torch-free (Abseil and nlohmann_json only). Plain values; functions are thread-safe.
#ifndef CDCCA_MODEL_HUB_CHAT_TEMPLATE_H_
#define CDCCA_MODEL_HUB_CHAT_TEMPLATE_H_

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cdcca::model {

struct ChatTemplate {
  std::string source;  // the file it came from, for errors: "DIR/chat_template.jinja"
  std::string text;    // the Jinja template
  // The tokenizer's special tokens by role ("bos_token" -> "<s>"), from tokenizer_config.json:
  // transformers passes them to the template.
  std::map<std::string, std::string> special_tokens;
};

// The folder's chat template, looked for where transformers' processor looks, in order:
// chat_template.jinja (the text), chat_template.json ({"chat_template": TEXT}),
// processor_config.json's "chat_template"; then tokenizer_config.json's "chat_template" (the
// language model's own, for a folder whose processor has none). A template given as a list of
// named templates ({"name", "template"}) uses the one named "default". nullopt when the folder
// has none. InvalidArgument naming the file and field for a malformed one; a file the folder
// does not have is not an error.
absl::StatusOr<std::optional<ChatTemplate>> LoadChatTemplate(const std::string& dir);

// `tmpl` rendered with messages = `messages` (a JSON array of {"role", "content"}),
// add_generation_prompt and the special tokens. InvalidArgument naming the construct and
// tmpl.source for Jinja outside the subset above or a template error; a template's own
// raise_exception(msg) is InvalidArgument with msg.
absl::StatusOr<std::string> RenderChatTemplate(const ChatTemplate& tmpl,
                                               const nlohmann::json& messages,
                                               bool add_generation_prompt);

// The conversation transformers' processors get for one question about one image: a user turn
// whose content is [{"type": "image"}, {"type": "text", "text": text}].
nlohmann::json OneImageUserTurn(const std::string& text);

}  // namespace cdcca::model

#endif  // CDCCA_MODEL_HUB_CHAT_TEMPLATE_H_
