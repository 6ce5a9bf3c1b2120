#include "server/metrics_endpoint.h"

#include <CivetServer.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"

namespace indexer::server {

class MetricsEndpoint::Handler final : public CivetHandler {
 public:
  explicit Handler(Sources sources) : sources_(std::move(sources)) {}

  bool handleGet(CivetServer*, mg_connection* conn) override {
    const std::string body = Render(sources_);
    mg_printf(conn,
              "HTTP/1.1 200 OK\r\n"
              "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
              "Content-Length: %zu\r\n"
              "Connection: close\r\n\r\n",
              body.size());
    mg_write(conn, body.data(), body.size());
    return true;
  }

 private:
  const Sources sources_;
};

MetricsEndpoint::MetricsEndpoint() = default;

MetricsEndpoint::~MetricsEndpoint() {
  if (server_ != nullptr) server_->close();
}

std::string MetricsEndpoint::Render(const Sources& sources) {
  std::vector<prometheus::MetricFamily> families;
  for (const std::weak_ptr<prometheus::Collectable>& weak : sources) {
    const std::shared_ptr<prometheus::Collectable> source = weak.lock();
    if (source == nullptr) continue;
    for (prometheus::MetricFamily& f : source->Collect()) families.push_back(std::move(f));
  }
  return prometheus::TextSerializer().Serialize(families);
}

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& bind_address, Sources sources) {
  std::unique_ptr<MetricsEndpoint> endpoint(new MetricsEndpoint());
  endpoint->handler_ = std::make_unique<Handler>(std::move(sources));
  try {
    endpoint->server_ = std::make_unique<CivetServer>(
        std::vector<std::string>{"listening_ports", bind_address, "num_threads", "2"});
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot serve metrics on ", bind_address, ": ", e.what()));
  }
  endpoint->server_->addHandler("/metrics", endpoint->handler_.get());
  const std::vector<int> ports = endpoint->server_->getListeningPorts();
  endpoint->port_ = ports.empty() ? 0 : ports.front();
  return endpoint;
}

}  // namespace indexer::server
