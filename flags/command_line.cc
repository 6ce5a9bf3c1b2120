#include "flags/command_line.h"

#include <cstdio>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace indexer::flags {
namespace {

bool IsHelp(absl::string_view arg) {
  for (const char* help : {"-h", "-help", "--help", "-helpfull", "--helpfull", "-helpshort",
                           "--helpshort"}) {
    if (arg == help) return true;
  }
  return false;
}

// argv[*i] starts with '-'. Finds the flag, takes its value from the argument or, for a non-bool
// flag without '=', from argv[*i + 1] (advancing *i), and sets it. Returns the flag's name.
absl::StatusOr<std::string> SetFlag(int argc, char** argv, int* i, const FlagFilter& is_ours) {
  absl::string_view body = argv[*i];
  if (!absl::ConsumePrefix(&body, "--")) absl::ConsumePrefix(&body, "-");
  std::string name(body), value;
  bool has_value = false;
  if (const size_t eq = body.find('='); eq != absl::string_view::npos) {
    name = std::string(body.substr(0, eq));
    value = std::string(body.substr(eq + 1));
    has_value = true;
  }
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if ((flag == nullptr || !is_ours(*flag)) && !has_value && absl::StartsWith(name, "no")) {
    absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
    if (negated != nullptr && is_ours(*negated) && negated->IsOfType<bool>()) {
      flag = negated;
      name = name.substr(2);
      value = "false";
      has_value = true;
    }
  }
  if (flag == nullptr || !is_ours(*flag)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
  }
  if (!has_value) {
    if (flag->IsOfType<bool>()) {
      value = "true";
    } else if (*i + 1 < argc) {
      value = argv[++*i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
    }
  }
  std::string error;
  if (!flag->ParseFrom(value, &error)) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad value '", value, "' for --", name, ": ", error));
  }
  return name;
}

}  // namespace

absl::StatusOr<CommandLine> ParseCommandLine(int argc, char** argv, const FlagFilter& is_ours) {
  CommandLine cl;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") {
      for (++i; i < argc; ++i) cl.positional.emplace_back(argv[i]);
      break;
    }
    if (IsHelp(arg)) {
      cl.help = true;
    } else if (arg == "--version" || arg == "-version") {
      cl.version = true;
    } else if (!absl::StartsWith(arg, "-") || arg == "-") {
      cl.positional.emplace_back(arg);
    } else {
      absl::StatusOr<std::string> name = SetFlag(argc, argv, &i, is_ours);
      if (!name.ok()) return name.status();
      cl.set.push_back(*std::move(name));
    }
  }
  return cl;
}

int ReportUsageError(absl::string_view program, absl::string_view message) {
  std::fprintf(stderr, "%s\n", absl::StrCat(program, ": ", message, "\nRun '", program,
                                            " --help' for usage.").c_str());
  return kUsageExit;
}

std::string FlagList(const FlagFilter& is_ours) {
  std::map<std::string, const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (is_ours(*flag)) flags[std::string(name)] = flag;
  }
  std::string out;
  for (const auto& [name, flag] : flags) {
    const std::string def = flag->DefaultValue();
    absl::StrAppend(&out, "  --", name, " (default: ", def.empty() ? "''" : def, ")\n      ",
                    flag->Help(), "\n");
  }
  return out;
}

const char* ProgramVersion() { return INDEXER_VERSION; }

FlagFilter FlagsDefinedIn(std::string file_part) {
  return [part = std::move(file_part)](const absl::CommandLineFlag& flag) {
    return absl::StrContains(flag.Filename(), part);
  };
}

}  // namespace indexer::flags
