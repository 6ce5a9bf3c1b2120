// Calls IndexerService's unary handlers in-process exactly as gRPC would, without a network:
// gRPC's DefaultReactorTestPeer stands in for the call, the request goes in as bytes, the
// handler runs (authentication, parsing, translation, engine, answer) on whichever threads the
// service uses, and CallHandler waits until it has finished, parses the answer and returns the
// status it finished with. CallRawHandler sends any bytes (for requests that do not parse).
// Used by the service fuzzer and the service concurrency test. Thread-safe: any number of
// threads may call them at once.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/test/default_reactor_test_peer.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "server/indexer_service.h"
#include "server/wire_messages.h"

namespace indexer::testing {

using RawMethod = grpc::ServerUnaryReactor* (server::IndexerService::*)(
    grpc::CallbackServerContext*, const grpc::ByteBuffer*, grpc::ByteBuffer*);

// Sends `request` (bytes) to `method`; the status the call finished with, and its answer bytes.
inline grpc::Status CallRawHandler(server::IndexerService& service, RawMethod method,
                                   const grpc::ByteBuffer& request, grpc::ByteBuffer* answer) {
  grpc::CallbackServerContext ctx;
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  grpc::testing::DefaultReactorTestPeer peer(&ctx, [&](grpc::Status) {
    std::lock_guard<std::mutex> lock(mu);
    finished = true;
    cv.notify_all();
  });
  (service.*method)(&ctx, &request, answer);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return finished; });
  }
  // The peer records the status just after calling back: wait for that before the context goes.
  while (!peer.test_status_set()) std::this_thread::yield();
  return peer.test_status();
}

// `request` serialized, sent to `method`; on OK the answer parsed into *response (an answer that
// does not parse is INTERNAL here).
template <typename Request, typename Response>
grpc::Status CallHandler(server::IndexerService& service, RawMethod method, const Request& request,
                         Response* response) {
  grpc::ByteBuffer in, out;
  server::SerializeMessage(request, &in);
  const grpc::Status status = CallRawHandler(service, method, in, &out);
  if (status.ok() && !server::ParseMessage(out, response).ok()) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "the answer does not parse");
  }
  return status;
}

}  // namespace indexer::testing
