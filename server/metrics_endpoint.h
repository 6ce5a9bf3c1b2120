// MetricsEndpoint: serves GET /metrics in Prometheus' text format (version 0.0.4) on one
// host:port, collecting from a list of sources at every scrape. Only the sources' families are
// served: no metrics of the endpoint itself. Other paths answer 404.
//
// Start binds and starts the endpoint's threads; the destructor stops them. The sources are
// held weakly: one that is gone is skipped. Collect() may run on several endpoint threads at
// once, so every source's Collect must be thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <prometheus/collectable.h>

#include "absl/status/statusor.h"

class CivetServer;

namespace indexer::server {

class MetricsEndpoint {
 public:
  using Sources = std::vector<std::weak_ptr<prometheus::Collectable>>;

  // `bind_address` is host:port (port 0 picks one). FAILED_PRECONDITION when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& bind_address,
                                                                Sources sources);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // The bound port.
  int port() const { return port_; }

  // Every source's families, in the text format: what a scrape answers.
  static std::string Render(const Sources& sources);

 private:
  class Handler;
  MetricsEndpoint();

  std::unique_ptr<Handler> handler_;
  std::unique_ptr<CivetServer> server_;  // after handler_: stopped before it goes
  int port_ = 0;
};

}  // namespace indexer::server
