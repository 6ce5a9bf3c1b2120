// How every unary call of the indexer services starts: authenticate the caller (the one place
// where that happens), then run the handler on the RequestExecutor and finish the call with the
// status it returns. Used by IndexerService and IndexerAdminService.
#pragma once

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <optional>
#include <utility>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "server/access_control.h"
#include "server/metrics.h"
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
// With `metrics`, every call is counted under `rpc` (a string literal) with its status, latency
// and time queued.
template <typename Handler>
grpc::ServerUnaryReactor* RunAuthenticated(grpc::CallbackServerContext* ctx,
                                           const AccessControl& access, RequestExecutor& executor,
                                           absl::string_view rpc, Handler handler,
                                           ServiceMetrics* metrics = nullptr) {
  const absl::Time arrived = absl::Now();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = CallerOf(access, *ctx, rpc);
  if (!caller.ok()) {
    const grpc::Status status = ToGrpcStatus(caller.status());
    if (metrics != nullptr) {
      metrics->RecordRequest(rpc, status.error_code(), absl::Now() - arrived, absl::ZeroDuration());
    }
    reactor->Finish(status);
    return reactor;
  }
  executor.Submit([reactor, rpc, arrived, metrics, caller = *std::move(caller),
                   handler = std::move(handler)]() mutable {
    const absl::Time started = absl::Now();
    const grpc::Status status = handler(caller);
    if (metrics != nullptr) {
      metrics->RecordRequest(rpc, status.error_code(), absl::Now() - arrived, started - arrived);
    }
    reactor->Finish(status);
  });
  return reactor;
}

}  // namespace indexer::server
