// Early-return helpers for absl::Status / absl::StatusOr (Abseil 20220623 ships none).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTN_STATUS_CONCAT_INNER(a, b) a##b
#define ATTN_STATUS_CONCAT(a, b) ATTN_STATUS_CONCAT_INNER(a, b)

#define ATTN_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status attn_status_ = (expr);        \
    if (!attn_status_.ok()) return attn_status_; \
  } while (0)

#define ATTN_ASSIGN_OR_RETURN(lhs, expr) \
  ATTN_ASSIGN_OR_RETURN_IMPL(ATTN_STATUS_CONCAT(attn_statusor_, __LINE__), lhs, expr)

#define ATTN_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
