// AccessControl: who may call the server. Without a token file every caller is the default
// tenant with admin rights (the quick start, unchanged). With one, every call of the indexer
// services must carry "authorization: Bearer <token>" naming one of the file's tokens, which
// decides the caller's tenant and whether it is an admin.
//
// Token file format (docs/SECURITY.md): one token per line,
//
//   <token> <tenant> [admin] [quota=<pages or size>|quota=none]
//
// fields separated by spaces or tabs; blank lines and lines starting with '#' are ignored.
// Tokens are 16 to 256 printable ASCII characters without spaces, each on one line only; tenant
// names are 1 to 64 of [A-Za-z0-9._-]. Several tokens may share a tenant (rotation); a quota
// given on several of its lines must agree. `quota=` sets the tenant's page quota (a page count
// or a size such as 2GiB, like --capacity); `quota=none` exempts it from --tenant_quota.
//
// Thread-safe after construction: Authenticate may be called from any thread. Tokens are
// compared in constant time (every byte of every token, whatever matches), and never appear in
// messages or logs.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace indexer::server {

// The authenticated caller of one call.
struct Caller {
  std::string tenant;  // engine::kDefaultTenant without authentication
  bool admin = false;
};

class AccessControl {
 public:
  // No authentication: every caller is the default tenant, with admin rights.
  AccessControl() = default;

  // Reads a token file. `bytes_per_page` converts quota sizes to pages. INVALID_ARGUMENT naming
  // the file and line for a malformed line; NOT_FOUND etc. when the file cannot be read.
  static absl::StatusOr<AccessControl> FromTokenFile(const std::string& path,
                                                     int64_t bytes_per_page);
  // The same from the file's text; `source` names it in messages.
  static absl::StatusOr<AccessControl> Parse(absl::string_view text, absl::string_view source,
                                             int64_t bytes_per_page);

  bool enabled() const { return enabled_; }

  // The caller presenting `authorization` (the value of the "authorization" metadata, nullopt
  // when absent). UNAUTHENTICATED when authentication is on and the value is missing, is not
  // "Bearer <token>", or names no token of the file.
  absl::StatusOr<Caller> Authenticate(std::optional<absl::string_view> authorization) const;

  // PERMISSION_DENIED, naming `what`, unless the caller is an admin.
  static absl::Status RequireAdmin(const Caller& caller, absl::string_view what);

  // Page quotas the file sets, by tenant (0 = exempt from the default quota).
  const absl::flat_hash_map<std::string, int64_t>& quotas() const { return quotas_; }
  // Things worth a warning at start (a token file others may read).
  const std::vector<std::string>& warnings() const { return warnings_; }
  size_t num_tokens() const { return tokens_.size(); }

  static constexpr size_t kMinTokenBytes = 16;
  static constexpr size_t kMaxTokenBytes = 256;

 private:
  struct Token {
    std::array<uint8_t, kMaxTokenBytes> bytes{};  // zero padded
    uint32_t length = 0;
    Caller caller;
  };

  bool enabled_ = false;
  std::vector<Token> tokens_;
  absl::flat_hash_map<std::string, int64_t> quotas_;
  std::vector<std::string> warnings_;
};

}  // namespace indexer::server
