// ShardedClient: one IndexerClient per server of a list, with every call routed to the server
// that owns its sequence id on a HashRing (client/cpp/hash_ring.h). A scheduler spreading its
// sequences over many indexer servers uses it exactly like an IndexerClient; indexer-bench's
// --servers uses it.
//
// Routing: calls naming one sequence go to HashRing::LookupIndex(id). A Batch is split by
// server, the parts run in parallel, and the answers are merged back into item order. Unlike
// IndexerClient::Batch, ShardedClient::Batch never fails as a whole: when one server's part of
// the batch fails (say that server is down), each of that part's items carries the call's status
// (code and message) and the other items keep their results, so a caller can tell exactly what
// was applied where. ForkSequence needs source and target on one server: give related ids a
// hash tag ("{conv7}.a", "{conv7}.b"); otherwise it fails with FAILED_PRECONDITION.
//
// Threads: a ShardedClient is thread-safe like IndexerClient. A ShardedBatchStream belongs to one
// thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/cpp/hash_ring.h"
#include "client/cpp/indexer_client.h"

namespace indexer::client {

struct ShardedClientOptions {
  ClientOptions client;  // for every server: deadlines, message size, TLS, bearer token
  int virtual_nodes = HashRing::kDefaultVirtualNodes;
  // Give this client's channels connections of their own instead of sharing gRPC's process-wide
  // pool, so that several ShardedClients to the same servers use several TCP connections.
  // Insecure channels only: TLS channels come from IndexerClient::Connect and share the pool.
  bool own_connections = true;
};

// The sequence id a Batch item is routed by: its sequence_id, else its append's.
absl::string_view ItemSequenceId(const v1::SelectBlocksRequest& item);

class ShardedBatchStream;
class ShardedClient;

// A Batch's item indices grouped by the server that owns each item's sequence (one list per
// server, in the items' order).
std::vector<std::vector<int>> SplitByServer(const ShardedClient& client,
                                            const v1::BatchRequest& request);
// The Batch of `request`'s items at `items`, with its request_id.
v1::BatchRequest SubRequest(const v1::BatchRequest& request, const std::vector<int>& items);

class ShardedClient {
 public:
  // Channels to `targets` ("host:port" each), insecure or TLS per options.client, connected
  // lazily. INVALID_ARGUMENT when the list is empty or an address is empty or repeated, or
  // IndexerClient::Connect's errors.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> Connect(
      const std::vector<std::string>& targets, ShardedClientOptions options = {});
  // Wraps clients made elsewhere (custom channels or credentials): clients[i] talks to
  // targets[i]; the ring is built over `targets`.
  static absl::StatusOr<std::unique_ptr<ShardedClient>> FromClients(
      const std::vector<std::string>& targets, std::vector<std::unique_ptr<IndexerClient>> clients,
      int virtual_nodes = HashRing::kDefaultVirtualNodes);

  ShardedClient(const ShardedClient&) = delete;
  ShardedClient& operator=(const ShardedClient&) = delete;

  // Routing.
  size_t ServerIndex(absl::string_view sequence_id) const { return ring_.LookupIndex(sequence_id); }
  const std::string& TargetFor(absl::string_view sequence_id) const {
    return targets_[ServerIndex(sequence_id)];
  }
  IndexerClient& ClientFor(absl::string_view sequence_id) {
    return *clients_[ServerIndex(sequence_id)];
  }
  IndexerClient& client(size_t server) { return *clients_[server]; }
  const std::vector<std::string>& targets() const { return targets_; }
  size_t size() const { return targets_.size(); }
  const HashRing& ring() const { return ring_; }

  // The RPCs of one sequence, routed by its id (SelectBlocks: the request's sequence_id, else its
  // append's). Errors are the owning server's, as IndexerClient returns them.
  absl::StatusOr<v1::AppendKeysResponse> AppendKeys(const v1::AppendKeysRequest& request,
                                                    const CallOptions& call = {});
  absl::StatusOr<v1::SelectBlocksResponse> SelectBlocks(const v1::SelectBlocksRequest& request,
                                                        const CallOptions& call = {});
  absl::StatusOr<Selection> Select(const v1::SelectBlocksRequest& request,
                                   const CallOptions& call = {});
  absl::StatusOr<v1::ReleaseSequenceResponse> ReleaseSequence(absl::string_view sequence_id,
                                                              const CallOptions& call = {});
  absl::StatusOr<v1::TruncateSequenceResponse> TruncateSequence(absl::string_view sequence_id,
                                                                uint32_t length,
                                                                const CallOptions& call = {});
  absl::StatusOr<v1::ForkSequenceResponse> ForkSequence(absl::string_view source_id,
                                                        absl::string_view target_id,
                                                        std::optional<uint32_t> length = {},
                                                        const CallOptions& call = {});
  absl::StatusOr<v1::GetSequenceResponse> GetSequence(absl::string_view sequence_id,
                                                      const CallOptions& call = {});

  // A Batch split by server and run in parallel; one result per item, in item order (see the
  // header comment for failures).
  v1::BatchResponse Batch(const v1::BatchRequest& request, const CallOptions& call = {});

  // ServerInfo of every server, in targets() order; the first failure fails the call, its
  // message naming the server.
  absl::StatusOr<std::vector<v1::ServerInfoResponse>> ServerInfoAll(const CallOptions& call = {});
  // Waits until every server's health is SERVING (IndexerClient::WaitUntilServing each).
  absl::Status WaitUntilServing(absl::Duration timeout);

  // A BatchStream per server, opened lazily. The stream options are those of
  // IndexerClient::OpenBatchStream.
  std::unique_ptr<ShardedBatchStream> OpenBatchStream(const CallOptions& call = {});

 private:
  ShardedClient(std::vector<std::string> targets,
                std::vector<std::unique_ptr<IndexerClient>> clients, HashRing ring);

  std::vector<std::string> targets_;
  std::vector<std::unique_ptr<IndexerClient>> clients_;
  HashRing ring_;
};

// Batches over one BatchStream per server: Step() splits a request by server, writes every part
// before reading any answer (so the servers work in parallel), and merges the answers in item
// order. A part whose stream broke carries the stream's status in each of its items; that stream
// is reopened by the next Step. One thread at a time.
class ShardedBatchStream {
 public:
  ~ShardedBatchStream();  // finishes (cancels) every open stream
  ShardedBatchStream(const ShardedBatchStream&) = delete;
  ShardedBatchStream& operator=(const ShardedBatchStream&) = delete;

  v1::BatchResponse Step(const v1::BatchRequest& request);
  // Half-closes every open stream and returns the first non-OK final status.
  absl::Status Finish();

 private:
  friend class ShardedClient;
  ShardedBatchStream(ShardedClient& client, CallOptions call);

  ShardedClient& client_;
  CallOptions call_;
  std::vector<std::unique_ptr<BatchStream>> streams_;  // per server; null until used
};

}  // namespace indexer::client
