// Calls IndexerService's unary handlers in-process exactly as gRPC would, without a network:
// gRPC's DefaultReactorTestPeer stands in for the call, the handler runs on the service's
// RequestExecutor (authentication, translation, engine, answer), and CallHandler waits until it
// has finished and returns the status it finished with. Used by the service fuzzer and the
// service concurrency test. Thread-safe: any number of threads may call it at once.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/test/default_reactor_test_peer.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "server/indexer_service.h"

namespace indexer::testing {

template <typename Request, typename Response>
grpc::Status CallHandler(server::IndexerService& service,
                         grpc::ServerUnaryReactor* (server::IndexerService::*method)(
                             grpc::CallbackServerContext*, const Request*, Response*),
                         const Request& request, Response* response) {
  grpc::CallbackServerContext ctx;
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  grpc::testing::DefaultReactorTestPeer peer(&ctx, [&](grpc::Status) {
    std::lock_guard<std::mutex> lock(mu);
    finished = true;
    cv.notify_all();
  });
  (service.*method)(&ctx, &request, response);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return finished; });
  }
  // The peer records the status just after calling back: wait for that before the context goes.
  while (!peer.test_status_set()) std::this_thread::yield();
  return peer.test_status();
}

}  // namespace indexer::testing
