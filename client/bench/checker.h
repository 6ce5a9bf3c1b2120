// Correctness mode of indexer-bench: a host copy of every key the tester appended to a sequence
// (HostKeys) and a check of each selection the server answered against the CPU reference
// (kernels::SelectSpan) recomputed here, in-process.
//
// Exact mode (integer values: every dot product is exact in fp32, whatever the summation order)
// requires identical block ids, page-table rows and context lengths. Tolerance mode (real-valued
// keys, where a GPU may sum in another order) accepts a different choice among blocks whose
// scores are within `tolerance` (relative) of the reference's k-th score, and counts it as
// "tolerated" rather than as a mismatch.
//
// Threads: HostKeys is a plain value owned by one scheduler; CheckSelection is pure.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "client/cpp/indexer_client.h"
#include "kernels/select_types.h"

namespace indexer::bench {

// The keys of one sequence for the layers a workload selects, stored as the server stores them
// (kernels/numeric.h's StoreKey: bf16 bits, fp8 e4m3 bytes, or fp4 codes and scales), padded
// with zeros to whole blocks so that the reference can read it as a key pool whose page b is
// block b.
class HostKeys {
 public:
  HostKeys(int checked_layers, int head_dim, kernels::KeyStorage storage);

  // Appends `tokens` tokens from an all-layers append: bf16 bits [tokens][server_layers][d].
  void AppendAllLayers(const uint16_t* bits, int64_t tokens, int server_layers);
  // Keeps the first `length` tokens.
  void Truncate(int64_t length);
  int64_t length() const { return length_; }
  int checked_layers() const { return static_cast<int>(layers_.size()); }

  kernels::KeyPoolView View(int layer) const;

 private:
  int head_dim_;
  kernels::KeyStorage storage_;
  int64_t length_ = 0;
  std::vector<std::vector<uint8_t>> layers_;  // per layer, `blocks` pages as the server's pool
};

struct CheckParams {
  kernels::SelectParams select;
  kernels::PageTableParams page_table;
  bool exact = true;
  double tolerance = 1e-2;  // tolerance mode: relative to max(1, |k-th reference score|)
};

struct CheckOutcome {
  int64_t rows = 0;       // (token, head) rows compared
  int64_t tolerated = 0;  // rows that differ from the reference within tolerance
  std::string mismatch;   // empty when the answer is right (exactly or within tolerance)
};

// Checks one answer for queries `query_bits` ([n][H][head_dim] bf16 bits) of `layer`, given the
// sequence's keys and attention pages (empty when it has none) as they were when the server
// answered.
CheckOutcome CheckSelection(const HostKeys& keys, int layer, std::span<const int32_t> attn_pages,
                            const uint16_t* query_bits, const client::Selection& got,
                            const CheckParams& params);

}  // namespace indexer::bench
