// `cdcca`: the offline tool. One sub-command per task; each lives in the module that owns
// it and reads its own absl flags (`cdcca COMMAND --help` lists them).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cli/flags_help.h"
#include "cli/print_config.h"
#ifdef CDCCA_HAVE_PRETRAIN
#include "model/family/commands.h"
#endif
#ifdef CDCCA_HAVE_MODEL_COMMANDS
#include "model/arch/generate_command.h"
#endif
#ifdef CDCCA_HAVE_ADAPT
#include "sim/adapt_command.h"
#endif
#ifdef CDCCA_HAVE_COMPRESS
#include "compress/inspect_command.h"
#endif
#ifdef CDCCA_HAVE_DATASETS_IO
#include "datasets/commands.h"
#endif
#ifdef CDCCA_HAVE_TOKENIZERS
#include "model/tokenizer/tokenize_command.h"
#endif

namespace {

// A sub-command gets the positional arguments after its name (flags already parsed) and
// returns the process exit code.
using CommandFn = int (*)(const std::vector<std::string>& args);

struct Command {
  const char* name;
  const char* summary;
  CommandFn run;
  // The flags the command reads, nullptr-terminated (declared beside the command): its --help
  // lists these, and any other flag of the binary on its command line is an error.
  const char* const* flags;
};

// `cdcca help` reads none.
const char* const kHelpFlags[] = {nullptr};

// Filled as modules gain commands (eval, render, inspect, pretrain, ...).
const Command kCommands[] = {
    {"help", "list the sub-commands", nullptr, kHelpFlags},
#ifdef CDCCA_HAVE_DATASETS_IO
    {"eval", "score results: eval vqa|aokvqa|caption (official metrics)",
     cdcca::datasets::EvalCommand, cdcca::datasets::kEvalFlags},
    {"render", "write PNG grids of benchmark scenes under every shift",
     cdcca::datasets::RenderCommand, cdcca::datasets::kRenderFlags},
#endif
#ifdef CDCCA_HAVE_PRETRAIN
    {"pretrain", "train encoder, teacher and student: --config FILE --out DIR",
     cdcca::model::PretrainCommand, cdcca::model::kPretrainFlags},
    {"model-eval", "VQA accuracy table of a checkpoint: --checkpoint_dir DIR",
     cdcca::model::ModelEvalCommand, cdcca::model::kModelEvalFlags},
#endif
#ifdef CDCCA_HAVE_ADAPT
    {"adapt-eval",
     "AKD vs PL and UTS vs random tokens on a shifted stream: --shift fog, on a family "
     "(--checkpoint_dir DIR, read as its pair) or a pair (--teacher DIR --student_base DIR)",
     cdcca::sim::AdaptEvalAnyPairCommand, cdcca::sim::kAdaptEvalFlags},
#endif
#ifdef CDCCA_HAVE_TOKENIZERS
    {"tokenize", "ids of a text as transformers gives them: --model DIR --text TEXT",
     cdcca::tokenizer::TokenizeCommand, cdcca::tokenizer::kTokenizeFlags},
#endif
#ifdef CDCCA_HAVE_MODEL_COMMANDS
    {"generate", "greedy answer of a Hugging Face model folder: --model DIR --image F --prompt T",
     cdcca::model::GenerateCommand, cdcca::model::kGenerateFlags},
    {"answer",
     "a VQAv2 / A-OKVQA / COCO captions file answered into its official results file: --model "
     "DIR --task vqa|aokvqa|caption --questions F (caption: --annotations F) --images DIR --out F",
     cdcca::model::AnswerCommand, cdcca::model::kAnswerFlags},
    {"pack",
     "store a folder's weights quantized once, so later loads read them packed: --model DIR "
     "--precision int8|int4",
     cdcca::model::PackCommand, cdcca::model::kPackFlags},
#endif
#ifdef CDCCA_HAVE_ADAPT
    {"adapt",
     "one CD-CCA round on a Hugging Face pair: --teacher DIR --student_base DIR --images DIR "
     "--prompt T --out STATE",
     cdcca::sim::AdaptCommand, cdcca::sim::kAdaptFlags},
    {"export-adapter", "an adapted state as a PEFT LoRA adapter: --state STATE --out DIR",
     cdcca::sim::ExportAdapterCommand, cdcca::sim::kExportAdapterFlags},
#endif
#ifdef CDCCA_HAVE_COMPRESS
    {"inspect", "print what DWC update payloads hold: inspect UPDATE...",
     cdcca::compress::InspectCommand, cdcca::compress::kInspectFlags},
#endif
};

// On stdout when asked for (help, --help), on stderr after a usage error.
void PrintCommands(std::FILE* out) {
  std::fprintf(out, "usage: cdcca <command> [flags] [args]\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(out, "\n`cdcca <command> --help` lists the flags.\n");
}

// A command with --profile: its profile's defaults (cli::ApplyProfile) for the student it
// reads (--student_base, else --checkpoint_dir).
absl::Status ApplyProfile(const cdcca::cli::FlagFilter& own, int argc, char** argv) {
  absl::CommandLineFlag* profile = absl::FindCommandLineFlag("profile");
  if (profile == nullptr || !own(*profile)) return absl::OkStatus();
  std::string student;
  for (const char* name : {"student_base", "checkpoint_dir"}) {
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag != nullptr && own(*flag) && !flag->CurrentValue().empty()) {
      student = flag->CurrentValue();
      break;
    }
  }
  return cdcca::cli::ApplyProfile(profile->CurrentValue(), cdcca::cli::FolderModelType(student),
                                  cdcca::cli::CommandLineNames(argc, argv));
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("cdcca <command> [flags] [args]; `cdcca help` lists commands");
  if (argc < 2) {
    PrintCommands(stderr);
    return 2;
  }
  if (cdcca::cli::HelpRequested(2, argv) || std::strcmp(argv[1], "help") == 0) {
    PrintCommands(stdout);
    return 0;
  }
  const std::string name = argv[1];
  for (const Command& c : kCommands) {
    if (name != c.name || c.run == nullptr) continue;
    // Drop the command name so absl sees "cdcca --flag ... args".
    std::vector<char*> rest{argv[0]};
    for (int i = 2; i < argc; ++i) rest.push_back(argv[i]);
    const cdcca::cli::FlagFilter own = [&c](const absl::CommandLineFlag& flag) {
      for (const char* const* f = c.flags; *f != nullptr; ++f) {
        if (flag.Name() == *f) return true;
      }
      return false;
    };
    std::vector<char*> positional = cdcca::cli::ParseFlagsOrHelp(
        static_cast<int>(rest.size()), rest.data(), own,
        absl::StrCat("usage: cdcca ", c.name, " [flags] [args]\n  ", c.summary));
    if (absl::Status s = ApplyProfile(own, static_cast<int>(rest.size()), rest.data()); !s.ok()) {
      std::fprintf(stderr, "cdcca %s: %s\n", c.name, std::string(s.message()).c_str());
      return 2;
    }
    std::vector<std::string> args(positional.begin() + 1, positional.end());
    return c.run(args);
  }
  std::fprintf(stderr, "cdcca: unknown command '%s'\n\n", name.c_str());
  PrintCommands(stderr);
  return 2;
}
