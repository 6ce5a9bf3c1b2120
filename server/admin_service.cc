#include "server/admin_service.h"

#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/authenticated_call.h"
#include "server/status_convert.h"
#include "server/wire_messages.h"

namespace indexer::server {

absl::StatusOr<std::string> SnapshotPath(absl::string_view dir, absl::string_view name) {
  std::string file(name);
  if (file.empty()) {
    file = absl::FormatTime("indexer-%Y%m%dT%H%M%SZ.snap", absl::Now(), absl::UTCTimeZone());
  }
  bool ok = file.size() <= 200 && file[0] != '.';
  for (char c : file) {
    const bool plain = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' ||
                       c == '_' || c == '-';
    ok = ok && plain;
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "name '", name, "' is not a plain file name: use 1 to 200 characters of [A-Za-z0-9._-], "
        "not starting with '.'"));
  }
  return absl::StrCat(dir, "/", file);
}

grpc::Status IndexerAdminService::WriteSnapshot(const Caller& caller,
                                                const v1::SnapshotRequest& request,
                                                v1::SnapshotResponse* response) {
  absl::Status status = AccessControl::RequireAdmin(caller, "IndexerAdmin.Snapshot");
  if (!status.ok()) return ToGrpcStatus(status);
  if (snapshot_dir_.empty()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "this server has no snapshot folder: start it with --snapshot_dir"));
  }
  absl::StatusOr<std::string> path = SnapshotPath(snapshot_dir_, request.name());
  if (!path.ok()) return ToGrpcStatus(path.status());
  const absl::Time start = absl::Now();
  engine::SnapshotStats stats;
  status = engine_->WriteSnapshot(*path, &stats);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!status.ok()) {
    spdlog::error("snapshot to {} failed: {}", *path, status.ToString());
    return ToGrpcStatus(status);
  }
  spdlog::info("snapshot: {} sequences, {} pages, {} bytes written to {} in {:.3f} s",
               stats.sequences, stats.pages, stats.bytes, *path, seconds);
  response->set_path(*path);
  response->set_bytes(static_cast<uint64_t>(stats.bytes));
  response->set_sequences(static_cast<uint64_t>(stats.sequences));
  response->set_pages(static_cast<uint64_t>(stats.pages));
  response->set_seconds(seconds);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* IndexerAdminService::Snapshot(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* req,
                                                        grpc::ByteBuffer* resp) {
  const auto handler = [this, req, resp](const Caller& caller) {
    v1::SnapshotRequest request;
    if (absl::Status parsed = ParseMessage(*req, &request); !parsed.ok()) {
      return ToGrpcStatus(parsed);
    }
    v1::SnapshotResponse response;
    const grpc::Status status = WriteSnapshot(caller, request, &response);
    if (status.ok()) SerializeMessage(response, resp);
    return status;
  };
  return RunAuthenticated(ctx, *access_, *executor_, tracker_, "Snapshot", handler);
}

}  // namespace indexer::server
