// How every unary call of the indexer services starts: authenticate the caller (the one place
// where that happens), admit it to the server's CallTracker (refused once shutdown has begun),
// then run the handler on the RequestExecutor and finish the call with the status it returns.
// Used by IndexerService and IndexerAdminService.
#pragma once

#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <optional>
#include <utility>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "server/access_control.h"
#include "server/call_tracker.h"
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

// A unary call's reactor that tells the CallTracker when the call is over: its status sent, or
// the call cancelled. Deletes itself then.
class TrackedUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit TrackedUnaryReactor(CallTracker* tracker) : tracker_(tracker) {}
  void OnDone() override {
    tracker_->Done();
    delete this;
  }

 private:
  CallTracker* tracker_;
};

// The status of a call refused because the server is shutting down (indexer.proto: UNAVAILABLE
// means exactly that; the client may retry elsewhere, nothing was applied).
inline grpc::Status ShuttingDownStatus() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
}

// An admitted unary call: its caller, and the reactor that finishes it (tracked until OnDone).
struct AdmittedCall {
  Caller caller;
  grpc::ServerUnaryReactor* reactor = nullptr;
};

// Authenticates the call and admits it to `tracker` (which may be null: in-process tests that
// drive handlers without gRPC's server). An unauthenticated call, or one arriving once `tracker`
// stops admitting (UNAVAILABLE), is finished here and counted under `rpc` (a string literal) in
// `metrics` (may be null): *refused is then its reactor, to return to gRPC, and the result empty.
inline std::optional<AdmittedCall> AdmitUnary(grpc::CallbackServerContext* ctx,
                                              const AccessControl& access, CallTracker* tracker,
                                              absl::string_view rpc, ServiceMetrics* metrics,
                                              absl::Time arrived,
                                              grpc::ServerUnaryReactor** refused) {
  const auto refuse = [&](const grpc::Status& status) {
    if (metrics != nullptr) {
      metrics->RecordRequest(rpc, status.error_code(), absl::Now() - arrived, absl::ZeroDuration());
    }
    *refused = ctx->DefaultReactor();
    (*refused)->Finish(status);
    return std::nullopt;
  };
  absl::StatusOr<Caller> caller = CallerOf(access, *ctx, rpc);
  if (!caller.ok()) return refuse(ToGrpcStatus(caller.status()));
  if (tracker != nullptr && !tracker->Admit()) return refuse(ShuttingDownStatus());
  grpc::ServerUnaryReactor* reactor =
      tracker != nullptr ? new TrackedUnaryReactor(tracker) : ctx->DefaultReactor();
  return AdmittedCall{*std::move(caller), reactor};
}

// Authenticates and admits the call (AdmitUnary), then runs `handler(const Caller&) ->
// grpc::Status` on `executor` and finishes the call with its status. With `metrics`, every call
// is counted under `rpc` (a string literal) with its status, latency and time queued.
template <typename Handler>
grpc::ServerUnaryReactor* RunAuthenticated(grpc::CallbackServerContext* ctx,
                                           const AccessControl& access, RequestExecutor& executor,
                                           CallTracker* tracker, absl::string_view rpc,
                                           Handler handler, ServiceMetrics* metrics = nullptr) {
  const absl::Time arrived = absl::Now();
  grpc::ServerUnaryReactor* refused = nullptr;
  std::optional<AdmittedCall> call = AdmitUnary(ctx, access, tracker, rpc, metrics, arrived, &refused);
  if (!call) return refused;
  grpc::ServerUnaryReactor* reactor = call->reactor;
  executor.Submit([reactor, rpc, arrived, metrics, caller = std::move(call->caller),
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
