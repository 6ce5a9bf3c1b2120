// Server options for tests that run an IndexerServer in-process on a loopback port.
#pragma once

#include "server/server_options.h"

namespace indexer::testing {

// A CPU server on 127.0.0.1, port picked by the system, 4 handler threads, a 1 s drain, and an
// engine of head_dim 64 and two layers; every other field at its default.
server::ServerOptions LoopbackServerOptions();

// LoopbackServerOptions with TwoLayerEngineConfig (engine_config.h): 64 pages, topk <= 32, up
// to 512 query tokens and 16 items per batch; messages of at most 1 MiB.
server::ServerOptions SmallServerOptions();

}  // namespace indexer::testing
