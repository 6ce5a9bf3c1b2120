// A synthetic BenchReport (no server needed) for the report tests: a sweep of `stages` stages
// with log-normal latencies that grow stage by stage, a timeline with a warm-up, a few errors of
// two status codes, correctness totals, the servers' figures with the phases of a step, and a
// stability verdict per stage (the last stage's windows disagree, with a warning).
#pragma once

#include "client/bench/report.h"

namespace indexer::bench {

BenchReport SampleReport(int stages);

}  // namespace indexer::bench
