// How every unary call of the indexer services starts: authenticate the caller (the one place
// where that happens), then run the handler on the RequestExecutor and finish the call with the
// status it returns. Used by IndexerService and IndexerAdminService.
#pragma once

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <optional>
#include <utility>

#include "absl/strings/string_view.h"
#include "server/access_control.h"
#include "server/request_executor.h"
#include "server/status_convert.h"

namespace indexer::server {

// The caller of `ctx`'s call, from its "authorization" metadata. Refusals are logged (without
// the token) with the peer's address.
inline absl::StatusOr<Caller> CallerOf(const AccessControl& access,
                                       const grpc::CallbackServerContext& ctx,
                                       absl::string_view rpc) {
  std::optional<absl::string_view> authorization;
  const auto& metadata = ctx.client_metadata();
  if (auto it = metadata.find("authorization"); it != metadata.end()) {
    authorization = absl::string_view(it->second.data(), it->second.size());
  }
  absl::StatusOr<Caller> caller = access.Authenticate(authorization);
  if (!caller.ok()) {
    spdlog::warn("{} from {} refused: {}", std::string(rpc), ctx.peer(),
                 std::string(caller.status().message()));
  }
  return caller;
}

// Authenticates the call, then runs `handler(const Caller&) -> grpc::Status` on `executor` and
// finishes the call with its status. An unauthenticated call finishes at once, running nothing.
template <typename Handler>
grpc::ServerUnaryReactor* RunAuthenticated(grpc::CallbackServerContext* ctx,
                                           const AccessControl& access, RequestExecutor& executor,
                                           absl::string_view rpc, Handler handler) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = CallerOf(access, *ctx, rpc);
  if (!caller.ok()) {
    reactor->Finish(ToGrpcStatus(caller.status()));
    return reactor;
  }
  executor.Submit([reactor, caller = *std::move(caller), handler = std::move(handler)]() mutable {
    reactor->Finish(handler(caller));
  });
  return reactor;
}

}  // namespace indexer::server
