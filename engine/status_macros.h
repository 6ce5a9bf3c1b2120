// The project's one early-return macro for absl::Status.
#pragma once

#include "absl/status/status.h"

// Evaluates `expr` (an absl::Status); returns it from the enclosing function unless ok().
#define INDEXER_RETURN_IF_ERROR(expr)                 \
  do {                                                \
    ::absl::Status indexer_status_ = (expr);          \
    if (!indexer_status_.ok()) return indexer_status_; \
  } while (0)
