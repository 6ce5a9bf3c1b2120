// IndexerAdminService: the administration API (indexer.v1.IndexerAdmin): snapshots on demand.
// Like IndexerService it only translates; the engine writes the file. Every call needs an admin
// caller (AccessControl); snapshots go only into the server's snapshot folder, under a plain
// file name, so that no caller can make the server write anywhere else.
#pragma once

#include <string>

#include "engine/engine.h"
#include "indexer/v1/indexer.grpc.pb.h"
#include "server/access_control.h"
#include "server/call_tracker.h"
#include "server/request_executor.h"

namespace indexer::server {

class IndexerAdminService final : public indexer::v1::IndexerAdmin::CallbackService {
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
                                     const v1::SnapshotRequest* req,
                                     v1::SnapshotResponse* resp) override;

 private:
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
