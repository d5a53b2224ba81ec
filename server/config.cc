#include "server/config.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "server/device_pool.h"

namespace attnserve {

absl::Status Config::Validate() const {
  auto bad = [](const char* flag, auto value, const char* rule) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": ", rule));
  };
  if (listen.empty()) return absl::InvalidArgumentError("--listen: must not be empty");
  if (devices.empty()) return absl::InvalidArgumentError("--devices: needs at least one");
  if (lane_threads < 0 || lane_threads > 64) {
    return bad("lane_threads", lane_threads, "must be in [0, 64]");
  }
  if (lanes_per_device < 0 || lanes_per_device > 16) {
    return bad("lanes_per_device", lanes_per_device, "must be in [0, 16]");
  }
  if (absl::Status s = ParseDeviceWait(gpu_wait).status(); !s.ok()) return s;
  if (stream_threads < 0 || stream_threads > 64) {
    return bad("stream_threads", stream_threads, "must be in [0, 64]");
  }
  if (cpu_threads < 0) return bad("cpu_threads", cpu_threads, "must be >= 0");
  if (max_batch_tokens < 1) return bad("max_batch_tokens", max_batch_tokens, "must be >= 1");
  if (max_batch_requests < 1) {
    return bad("max_batch_requests", max_batch_requests, "must be >= 1");
  }
  if (max_queue_delay < absl::ZeroDuration()) {
    return bad("max_queue_delay", absl::FormatDuration(max_queue_delay), "must be >= 0");
  }
  if (queue_capacity < 1) return bad("queue_capacity", queue_capacity, "must be >= 1");
  if (memory_limit_bytes < (int64_t{1} << 20)) {
    return bad("memory_limit_bytes", memory_limit_bytes, "must be >= 1 MiB");
  }
  if (max_message_bytes < (int64_t{1} << 10) ||
      max_message_bytes > std::numeric_limits<int32_t>::max()) {
    return bad("max_message_bytes", max_message_bytes, "must be in [1 KiB, 2 GiB)");
  }
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file and --tls_key_file: give both or neither");
  }
  if (max_regions_per_identity < 1 || max_regions_per_identity > 4096) {
    return bad("max_regions_per_identity", max_regions_per_identity, "must be in [1, 4096]");
  }
  if (max_heads < 1 || max_heads > 65536)
    return bad("max_heads", max_heads, "must be in [1, 65536]");
  if (max_sequences < 1 || max_sequences > (1 << 24)) {
    return bad("max_sequences", max_sequences, "must be in [1, 16777216]");
  }
  if (max_stream_buffer_bytes < (int64_t{1} << 16)) {
    return bad("max_stream_buffer_bytes", max_stream_buffer_bytes, "must be >= 64 KiB");
  }
  if (kv_page_bytes < 256 || kv_page_bytes % 256 != 0 || kv_page_bytes > (int64_t{64} << 20)) {
    return bad("kv_page_bytes", kv_page_bytes, "must be a multiple of 256 in [256, 64 MiB]");
  }
  if (kv_pool_bytes > 0 && kv_pool_bytes < kv_page_bytes) {
    return bad("kv_pool_bytes", kv_pool_bytes, "must hold at least one page (--kv_page_bytes)");
  }
  if (session_max_tokens < 1 || session_max_tokens > std::numeric_limits<int32_t>::max()) {
    return bad("session_max_tokens", session_max_tokens, "must be in [1, 2^31)");
  }
  if (session_ttl <= absl::ZeroDuration()) {
    return bad("session_ttl", absl::FormatDuration(session_ttl), "must be > 0");
  }
  if (max_sessions_per_identity < 1) {
    return bad("max_sessions_per_identity", max_sessions_per_identity, "must be >= 1");
  }
  if (drain_timeout < absl::ZeroDuration()) {
    return bad("drain_timeout", absl::FormatDuration(drain_timeout), "must be >= 0");
  }
  if (training_checkpoint_every < 1) {
    return bad("training_checkpoint_every", training_checkpoint_every, "must be >= 1");
  }
  if (training_max_jobs < 1) return bad("training_max_jobs", training_max_jobs, "must be >= 1");
  if (training_jobs_per_device < 1 || training_jobs_per_device > 16) {
    return bad("training_jobs_per_device", training_jobs_per_device, "must be in [1, 16]");
  }
  if (training_cpu_threads < 1 || training_cpu_threads > 256) {
    return bad("training_cpu_threads", training_cpu_threads, "must be in [1, 256]");
  }
  if (training_max_data_bytes < 0) {
    return bad("training_max_data_bytes", training_max_data_bytes, "must be >= 0");
  }
  if (training_disk_limit_bytes < 0) {
    return bad("training_disk_limit_bytes", training_disk_limit_bytes, "must be >= 0");
  }
  return absl::OkStatus();
}

}  // namespace attnserve
