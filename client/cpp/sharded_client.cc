#include "client/cpp/sharded_client.h"

#include <algorithm>
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"

namespace indexer::client {

std::vector<std::vector<int>> SplitByServer(const ShardedClient& client,
                                            const v1::BatchRequest& request) {
  std::vector<std::vector<int>> parts(client.size());
  for (int i = 0; i < request.items_size(); ++i) {
    parts[client.ServerIndex(ItemSequenceId(request.items(i)))].push_back(i);
  }
  return parts;
}

v1::BatchRequest SubRequest(const v1::BatchRequest& request, const std::vector<int>& items) {
  v1::BatchRequest sub;
  sub.set_request_id(request.request_id());
  sub.mutable_items()->Reserve(static_cast<int>(items.size()));
  for (int i : items) *sub.add_items() = request.items(i);
  return sub;
}

namespace {

// Copies one server's answer (or its failure) into the merged response.
void MergePart(const std::vector<int>& items, absl::StatusOr<v1::BatchResponse> answer,
               absl::string_view target, v1::BatchResponse* merged) {
  absl::Status failure;
  if (!answer.ok()) {
    failure =
        absl::Status(answer.status().code(), absl::StrCat(target, ": ", answer.status().message()));
  } else if (answer->results_size() != static_cast<int>(items.size())) {
    failure = absl::InternalError(absl::StrCat(target, " answered ", answer->results_size(),
                                               " results for ", items.size(), " items"));
  }
  for (size_t k = 0; k < items.size(); ++k) {
    v1::BatchItemResult* out = merged->mutable_results(items[k]);
    if (!failure.ok()) {
      out->set_code(static_cast<int>(failure.code()));
      out->set_message(std::string(failure.message()));
    } else {
      *out = std::move(*answer->mutable_results(static_cast<int>(k)));
    }
  }
}

v1::BatchResponse EmptyMerged(const v1::BatchRequest& request) {
  v1::BatchResponse merged;
  merged.set_request_id(request.request_id());
  for (int i = 0; i < request.items_size(); ++i) merged.add_results();
  return merged;
}

}  // namespace

absl::string_view ItemSequenceId(const v1::SelectBlocksRequest& item) {
  return item.sequence_id().empty() ? absl::string_view(item.append().sequence_id())
                                    : absl::string_view(item.sequence_id());
}

ShardedClient::ShardedClient(std::vector<std::string> targets,
                             std::vector<std::unique_ptr<IndexerClient>> clients, HashRing ring)
    : targets_(std::move(targets)), clients_(std::move(clients)), ring_(std::move(ring)) {}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::Connect(
    const std::vector<std::string>& targets, ShardedClientOptions options) {
  if (targets.empty()) return absl::InvalidArgumentError("the server list is empty");
  std::vector<std::unique_ptr<IndexerClient>> clients;
  for (const std::string& target : targets) {
    if (target.empty()) return absl::InvalidArgumentError("a server address is empty");
    if (options.client.UsesTls() || !options.own_connections) {
      // TLS channels are made by IndexerClient::Connect, the one place that builds credentials
      // (they share gRPC's connection pool).
      absl::StatusOr<std::unique_ptr<IndexerClient>> c =
          IndexerClient::Connect(target, options.client);
      if (!c.ok()) return c.status();
      clients.push_back(std::move(*c));
      continue;
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options.client.max_receive_message_bytes);
    args.SetMaxSendMessageSize(-1);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    std::shared_ptr<grpc::Channel> channel =
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    if (channel == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("cannot make a channel to '", target, "'"));
    }
    // The bearer token, if any, travels in the options.
    clients.push_back(std::make_unique<IndexerClient>(std::move(channel), options.client));
  }
  return FromClients(targets, std::move(clients), options.virtual_nodes);
}

absl::StatusOr<std::unique_ptr<ShardedClient>> ShardedClient::FromClients(
    const std::vector<std::string>& targets, std::vector<std::unique_ptr<IndexerClient>> clients,
    int virtual_nodes) {
  if (targets.empty()) return absl::InvalidArgumentError("the server list is empty");
  if (targets.size() != clients.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(targets.size(), " targets but ", clients.size(), " clients"));
  }
  absl::StatusOr<HashRing> ring = HashRing::Create(targets, virtual_nodes);
  if (!ring.ok()) return ring.status();
  return std::unique_ptr<ShardedClient>(
      new ShardedClient(targets, std::move(clients), std::move(*ring)));
}

absl::StatusOr<v1::AppendKeysResponse> ShardedClient::AppendKeys(
    const v1::AppendKeysRequest& request, const CallOptions& call) {
  return ClientFor(request.sequence_id()).AppendKeys(request, call);
}

absl::StatusOr<v1::SelectBlocksResponse> ShardedClient::SelectBlocks(
    const v1::SelectBlocksRequest& request, const CallOptions& call) {
  return ClientFor(ItemSequenceId(request)).SelectBlocks(request, call);
}

absl::StatusOr<Selection> ShardedClient::Select(const v1::SelectBlocksRequest& request,
                                                const CallOptions& call) {
  return ClientFor(ItemSequenceId(request)).Select(request, call);
}

absl::StatusOr<v1::ReleaseSequenceResponse> ShardedClient::ReleaseSequence(
    absl::string_view sequence_id, const CallOptions& call) {
  return ClientFor(sequence_id).ReleaseSequence(sequence_id, call);
}

absl::StatusOr<v1::TruncateSequenceResponse> ShardedClient::TruncateSequence(
    absl::string_view sequence_id, uint32_t length, const CallOptions& call) {
  return ClientFor(sequence_id).TruncateSequence(sequence_id, length, call);
}

absl::StatusOr<v1::ForkSequenceResponse> ShardedClient::ForkSequence(absl::string_view source_id,
                                                                     absl::string_view target_id,
                                                                     std::optional<uint32_t> length,
                                                                     const CallOptions& call) {
  const size_t source = ServerIndex(source_id);
  if (ServerIndex(target_id) != source) {
    return absl::FailedPreconditionError(
        absl::StrCat("fork source '", source_id, "' lives on ", targets_[source], " but target '",
                     target_id, "' hashes to ", TargetFor(target_id),
                     "; give both ids one hash tag (e.g. '{conv}.a' and '{conv}.b')"));
  }
  return clients_[source]->ForkSequence(source_id, target_id, length, call);
}

absl::StatusOr<v1::GetSequenceResponse> ShardedClient::GetSequence(absl::string_view sequence_id,
                                                                   const CallOptions& call) {
  return ClientFor(sequence_id).GetSequence(sequence_id, call);
}

v1::BatchResponse ShardedClient::Batch(const v1::BatchRequest& request, const CallOptions& call) {
  const std::vector<std::vector<int>> parts = SplitByServer(*this, request);
  v1::BatchResponse merged = EmptyMerged(request);
  std::vector<size_t> used;
  for (size_t s = 0; s < parts.size(); ++s) {
    if (!parts[s].empty()) used.push_back(s);
  }
  if (used.size() == 1 && static_cast<int>(parts[used[0]].size()) == request.items_size()) {
    MergePart(parts[used[0]], clients_[used[0]]->Batch(request, call), targets_[used[0]], &merged);
    return merged;
  }
  // Every part but the last runs on its own thread; the last runs here.
  std::vector<std::future<absl::StatusOr<v1::BatchResponse>>> pending;
  std::vector<v1::BatchRequest> subs;
  subs.reserve(used.size());
  for (size_t s : used) subs.push_back(SubRequest(request, parts[s]));
  for (size_t k = 0; k + 1 < used.size(); ++k) {
    pending.push_back(std::async(std::launch::async, [this, &subs, &used, &call, k] {
      return clients_[used[k]]->Batch(subs[k], call);
    }));
  }
  if (!used.empty()) {
    const size_t last = used.size() - 1;
    MergePart(parts[used[last]], clients_[used[last]]->Batch(subs[last], call),
              targets_[used[last]], &merged);
  }
  for (size_t k = 0; k < pending.size(); ++k) {
    MergePart(parts[used[k]], pending[k].get(), targets_[used[k]], &merged);
  }
  return merged;
}

absl::StatusOr<std::vector<v1::ServerInfoResponse>> ShardedClient::ServerInfoAll(
    const CallOptions& call) {
  std::vector<v1::ServerInfoResponse> infos;
  for (size_t s = 0; s < clients_.size(); ++s) {
    absl::StatusOr<v1::ServerInfoResponse> info = clients_[s]->ServerInfo(call);
    if (!info.ok()) {
      return absl::Status(info.status().code(),
                          absl::StrCat(targets_[s], ": ", info.status().message()));
    }
    infos.push_back(std::move(*info));
  }
  return infos;
}

absl::Status ShardedClient::WaitUntilServing(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t s = 0; s < clients_.size(); ++s) {
    absl::Status st =
        clients_[s]->WaitUntilServing(std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(targets_[s], ": ", st.message()));
  }
  return absl::OkStatus();
}

std::unique_ptr<ShardedBatchStream> ShardedClient::OpenBatchStream(const CallOptions& call) {
  return std::unique_ptr<ShardedBatchStream>(new ShardedBatchStream(*this, call));
}

// ---------------------------------------------------------------------------------------------

ShardedBatchStream::ShardedBatchStream(ShardedClient& client, CallOptions call)
    : client_(client), call_(std::move(call)), streams_(client.size()) {}

ShardedBatchStream::~ShardedBatchStream() = default;

v1::BatchResponse ShardedBatchStream::Step(const v1::BatchRequest& request) {
  const std::vector<std::vector<int>> parts = SplitByServer(client_, request);
  v1::BatchResponse merged = EmptyMerged(request);
  const bool whole = [&] {
    for (const auto& p : parts) {
      if (!p.empty()) return static_cast<int>(p.size()) == request.items_size();
    }
    return false;
  }();
  // Write every part first, then read: the servers work on their parts at the same time.
  std::vector<absl::Status> write_failed(parts.size());
  for (size_t s = 0; s < parts.size(); ++s) {
    if (parts[s].empty()) continue;
    if (streams_[s] == nullptr) streams_[s] = client_.client(s).OpenBatchStream(call_);
    const bool ok =
        whole ? streams_[s]->Write(request) : streams_[s]->Write(SubRequest(request, parts[s]));
    if (!ok) {
      absl::Status st = streams_[s]->Finish();
      write_failed[s] = st.ok() ? absl::UnavailableError("the stream closed") : st;
      streams_[s].reset();
    }
  }
  for (size_t s = 0; s < parts.size(); ++s) {
    if (parts[s].empty()) continue;
    if (!write_failed[s].ok()) {
      MergePart(parts[s], write_failed[s], client_.targets()[s], &merged);
      continue;
    }
    v1::BatchResponse answer;
    if (streams_[s]->Read(&answer)) {
      if (answer.request_id() != request.request_id()) {
        MergePart(parts[s],
                  absl::InternalError(absl::StrCat("answer ", answer.request_id(),
                                                   " came for request ", request.request_id())),
                  client_.targets()[s], &merged);
      } else {
        MergePart(parts[s], std::move(answer), client_.targets()[s], &merged);
      }
    } else {
      absl::Status st = streams_[s]->Finish();
      streams_[s].reset();
      MergePart(parts[s], st.ok() ? absl::UnavailableError("the server ended the stream") : st,
                client_.targets()[s], &merged);
    }
  }
  return merged;
}

absl::Status ShardedBatchStream::Finish() {
  absl::Status first;
  for (auto& stream : streams_) {
    if (stream == nullptr) continue;
    absl::Status st = stream->Finish();
    if (first.ok() && !st.ok()) first = st;
    stream.reset();
  }
  return first;
}

}  // namespace indexer::client
