// RawUnary: one unary gRPC call carrying raw request bytes, for tests that send what no typed
// stub would (unparsable messages, methods of another service). Blocks until the answer.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

namespace indexer::testing {

// A unary call of `method` (e.g. "/indexer.v1.Indexer/ServerInfo") on `channel` carrying
// `bytes`, with a deadline of `timeout`; its status.
inline grpc::Status RawUnary(grpc::Channel* channel, const std::string& method,
                             const std::string& bytes,
                             std::chrono::seconds timeout = std::chrono::seconds(10)) {
  grpc::GenericStub stub(channel->shared_from_this());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::Status status;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    status = s;
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  return status;
}

}  // namespace indexer::testing
