// Small engine configurations for tests on the CPU backend: few pages, so that pool exhaustion is
// reached quickly, and head_dim 64, so that reference selections are cheap. Tests change the
// fields they test from one of these. Header-only.
#pragma once

#include "engine/config.h"
#include "kernels/select_types.h"

namespace indexer::testing {

// head_dim 64, one layer, 64 pages, up to 4 heads and topk 32 (default 8, no init blocks, one
// local block), 2 CPU threads.
inline engine::EngineConfig SmallEngineConfig() {
  engine::EngineConfig c;
  c.head_dim = 64;
  c.layers = 1;
  c.capacity_pages = 64;
  c.max_index_heads = 4;
  c.max_topk = 32;
  c.defaults = kernels::SelectParams{8, 0, 1};
  c.cpu_threads = 2;
  return c;
}

// SmallEngineConfig with two layers, page tables of 4 pages per block (stride 8) and sequences
// of at most 4096 tokens.
inline engine::EngineConfig TwoLayerEngineConfig() {
  engine::EngineConfig c = SmallEngineConfig();
  c.layers = 2;
  c.page_table = kernels::PageTableParams{4, 8};
  c.max_tokens_per_sequence = 4096;
  return c;
}

}  // namespace indexer::testing
