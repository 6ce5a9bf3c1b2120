#include "client/cpp/flag_args.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace indexer::client {

absl::StatusOr<std::string> ParseFlagArgument(
    int argc, char** argv, int* i,
    const std::function<bool(const absl::CommandLineFlag&)>& is_ours) {
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
    return absl::InvalidArgumentError(absl::StrCat("bad value '", value, "' for --", name, ": ", error));
  }
  return name;
}

}  // namespace indexer::client
