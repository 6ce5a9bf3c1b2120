// IndexerAdminService: the administration API (indexer.v1.IndexerAdmin): snapshots on demand.
// Like IndexerService it only translates; the engine writes the file. Every call needs an admin
// caller (AccessControl); snapshots go only into the server's snapshot folder, under a plain
// file name, so that no caller can make the server write anywhere else. Like IndexerService it
// takes its requests as raw bytes and parses them itself (wire_messages.h), so that a request
// that does not parse is answered INVALID_ARGUMENT saying so.
#pragma once

#include <string>

#include "engine/engine.h"
#include "indexer/v1/indexer.grpc.pb.h"
#include "server/access_control.h"
#include "server/call_tracker.h"
#include "server/request_executor.h"

namespace indexer::server {

// The generated service with Snapshot taking and answering raw bytes.
using RawIndexerAdminService =
    v1::IndexerAdmin::WithRawCallbackMethod_Snapshot<v1::IndexerAdmin::Service>;

class IndexerAdminService final : public RawIndexerAdminService {
 public:
  // `engine`, `executor`, `access` and `tracker` (see IndexerService) must outlive the service
  // and every call it serves. `snapshot_dir` empty: Snapshot is refused with FAILED_PRECONDITION.
  IndexerAdminService(engine::Engine* engine, RequestExecutor* executor,
                      const AccessControl* access, std::string snapshot_dir,
                      CallTracker* tracker = nullptr)
      : engine_(engine),
        executor_(executor),
        access_(access),
        tracker_(tracker),
        snapshot_dir_(std::move(snapshot_dir)) {}

  grpc::ServerUnaryReactor* Snapshot(grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* req, grpc::ByteBuffer* resp) override;

 private:
  grpc::Status WriteSnapshot(const Caller& caller, const v1::SnapshotRequest& request,
                             v1::SnapshotResponse* response);

  engine::Engine* engine_;
  RequestExecutor* executor_;
  const AccessControl* access_;
  CallTracker* tracker_;
  std::string snapshot_dir_;
};

// The path a snapshot called `name` gets in `dir`: INVALID_ARGUMENT unless `name` is 1 to 200
// characters of [A-Za-z0-9._-] not starting with '.'; an empty name becomes
// "indexer-<UTC time>.snap".
absl::StatusOr<std::string> SnapshotPath(absl::string_view dir, absl::string_view name);

}  // namespace indexer::server
