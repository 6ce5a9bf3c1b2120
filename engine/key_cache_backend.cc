#include "engine/key_cache_backend.h"

#include <future>
#include <utility>

namespace indexer::engine {

void KeyCacheBackend::Run(const BackendStep& step, const kernels::PageTableParams& page_table,
                          StepDone done) {
  StepStatus status;
  if (!step.writes.empty()) status.writes = WriteKeysBatch(step.writes);
  if (!status.writes.ok()) {
    status.selects = status.writes;
  } else if (!step.selects.empty()) {
    status.selects = Select(step.selects, page_table);
  }
  std::move(done)(std::move(status));
}

StepStatus RunAndWait(KeyCacheBackend& backend, const BackendStep& step,
                      const kernels::PageTableParams& page_table) {
  std::promise<StepStatus> ended;
  std::future<StepStatus> result = ended.get_future();
  backend.Run(step, page_table, [&ended](StepStatus s) { ended.set_value(std::move(s)); });
  return result.get();
}

}  // namespace indexer::engine
