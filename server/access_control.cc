#include "server/access_control.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "server/server_options.h"

namespace indexer::server {
namespace {

constexpr size_t kMaxTenantBytes = 64;

bool ValidTenant(absl::string_view t) {
  if (t.empty() || t.size() > kMaxTenantBytes) return false;
  for (char c : t) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

bool ValidTokenBytes(absl::string_view t) {
  for (char c : t) {
    if (c < 0x21 || c > 0x7E) return false;  // printable ASCII, no spaces
  }
  return true;
}

}  // namespace

absl::StatusOr<AccessControl> AccessControl::FromTokenFile(const std::string& path,
                                                           int64_t bytes_per_page) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read the token file ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<AccessControl> access = Parse(text.str(), path, bytes_per_page);
  if (!access.ok()) return access.status();
  struct stat st {};
  if (stat(path.c_str(), &st) == 0 && (st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    access->warnings_.push_back(absl::StrFormat(
        "token file %s can be read or written by other users (mode %04o): chmod 600 it", path,
        st.st_mode & 07777));
  }
  return access;
}

absl::StatusOr<AccessControl> AccessControl::Parse(absl::string_view text,
                                                   absl::string_view source,
                                                   int64_t bytes_per_page) {
  AccessControl access;
  access.enabled_ = true;
  absl::flat_hash_map<std::string, int> token_line;   // token -> line, to refuse repeats
  absl::flat_hash_map<std::string, int> quota_line;   // tenant -> line that set its quota
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    const auto error = [&](const std::string& what) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file ", source, " line ", line_number, ": ", what));
    };
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() < 2) {
      return error("expected '<token> <tenant> [admin] [quota=<pages or size>]'");
    }
    const absl::string_view token = fields[0];
    if (token.size() < kMinTokenBytes || token.size() > kMaxTokenBytes) {
      return error(absl::StrCat("the token has ", token.size(), " characters; tokens have ",
                                kMinTokenBytes, " to ", kMaxTokenBytes,
                                " (make one with: openssl rand -hex 32)"));
    }
    if (!ValidTokenBytes(token)) {
      return error("the token holds a character that is not printable ASCII");
    }
    if (auto [it, inserted] = token_line.try_emplace(std::string(token), line_number); !inserted) {
      return error(absl::StrCat("the token is already on line ", it->second,
                                "; each token belongs to one tenant"));
    }
    Token t;
    std::copy(token.begin(), token.end(), t.bytes.begin());
    t.length = static_cast<uint32_t>(token.size());
    t.caller.tenant = std::string(fields[1]);
    if (!ValidTenant(t.caller.tenant)) {
      return error(absl::StrCat("tenant '", fields[1], "' is not 1 to ", kMaxTenantBytes,
                                " characters of [A-Za-z0-9._-]"));
    }
    for (size_t i = 2; i < fields.size(); ++i) {
      absl::string_view field = fields[i];
      if (field == "admin") {
        t.caller.admin = true;
        continue;
      }
      if (!absl::ConsumePrefix(&field, "quota=")) {
        return error(absl::StrCat("unknown field '", field,
                                  "'; expected admin or quota=<pages or size>"));
      }
      int64_t pages = 0;
      if (field != "none") {
        absl::StatusOr<int64_t> parsed = ParseCapacity(field, bytes_per_page);
        if (!parsed.ok()) {
          return error(absl::StrCat("quota '", field, "' is not none, a page count (1024) or a "
                                    "size (2GiB)"));
        }
        pages = *parsed;
      }
      auto [it, inserted] = access.quotas_.try_emplace(t.caller.tenant, pages);
      if (!inserted && it->second != pages) {
        return error(absl::StrCat("tenant '", t.caller.tenant,
                                  "' already has another quota on line ",
                                  quota_line[t.caller.tenant]));
      }
      quota_line.try_emplace(t.caller.tenant, line_number);
    }
    access.tokens_.push_back(std::move(t));
  }
  if (access.tokens_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", source, " holds no tokens: nobody could call the server"));
  }
  return access;
}

absl::StatusOr<Caller> AccessControl::Authenticate(
    std::optional<absl::string_view> authorization) const {
  if (!enabled_) return Caller{"", true};
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "this server requires a token: send the metadata 'authorization: Bearer <token>'");
  }
  absl::string_view value = absl::StripAsciiWhitespace(*authorization);
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) {
    return absl::UnauthenticatedError("the authorization metadata must be 'Bearer <token>'");
  }
  const absl::string_view presented = absl::StripLeadingAsciiWhitespace(value.substr(7));
  if (presented.empty() || presented.size() > kMaxTokenBytes) {
    return absl::UnauthenticatedError("the token is not valid");
  }
  std::array<uint8_t, kMaxTokenBytes> padded{};
  std::copy(presented.begin(), presented.end(), padded.begin());
  const uint32_t length = static_cast<uint32_t>(presented.size());
  // Constant time: every byte of every token is compared and nothing branches on the secret
  // bytes, so timing tells an attacker neither which token nor how much of one matched.
  uint32_t found = 0;
  size_t match = 0;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    uint32_t diff = tokens_[i].length ^ length;
    for (size_t j = 0; j < kMaxTokenBytes; ++j) diff |= tokens_[i].bytes[j] ^ padded[j];
    // 1 when diff == 0: (diff - 1) wraps to all ones in 64 bits only then.
    const uint32_t same = static_cast<uint32_t>((static_cast<uint64_t>(diff) - 1) >> 63);
    const size_t mask = static_cast<size_t>(0) - same;
    match = (match & ~mask) | (i & mask);
    found |= same;
  }
  if (found == 0) return absl::UnauthenticatedError("the token is not valid");
  return tokens_[match].caller;
}

absl::Status AccessControl::RequireAdmin(const Caller& caller, absl::string_view what) {
  if (caller.admin) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " needs an admin token; the token of tenant '", caller.tenant, "' is not one"));
}

}  // namespace indexer::server
