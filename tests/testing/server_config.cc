#include "tests/testing/server_config.h"

#include "tests/testing/engine_config.h"

namespace indexer::testing {

server::ServerOptions LoopbackServerOptions() {
  server::ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.device = "cpu";
  o.handler_threads = 4;
  o.drain_seconds = 1;
  o.engine.head_dim = 64;
  o.engine.layers = 2;
  return o;
}

server::ServerOptions SmallServerOptions() {
  server::ServerOptions o = LoopbackServerOptions();
  o.max_message_bytes = 1 << 20;
  o.engine = TwoLayerEngineConfig();
  o.engine.max_query_tokens = 512;
  o.engine.max_batch_items = 16;
  return o;
}

}  // namespace indexer::testing
