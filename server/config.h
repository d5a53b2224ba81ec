// Everything the server is configured with. main.cc fills it from flags; tests fill it directly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace attnserve {

struct Config {
  std::string listen = "0.0.0.0:50051";  // port 0 picks a free port
  std::string port_file;                 // when set, the bound port is written here
  // auto, cpu_tiled, cpu_reference, cuda_fused, cuda_naive. auto prefers the CUDA engines and
  // falls back to the CPU when there is no usable GPU.
  std::string engine = "auto";
  std::vector<int> devices = {0};  // CUDA ordinals; one set of lanes each
  int lanes_per_device = 0;        // 0: 2 for a GPU (copies overlap compute), 1 for the CPU
  int cpu_threads = 0;             // CPU engine threads; 0 = hardware concurrency
  // Threads per lane (its own included) sharing a batch's host copies once they pass 1 MiB;
  // 0: cores / (2 x lanes), between 1 and 4.
  int lane_threads = 0;
  // How a lane waits for its batch on the GPU: spin, yield or block (server/device_pool.h).
  // yield: as quick as spinning, and the core goes to gRPC's threads when they need it.
  std::string gpu_wait = "yield";
  // Completion queues (one polling thread each) serving AttendStream; 0: cores / 2, between 1
  // and 8.
  int stream_threads = 0;

  int64_t max_batch_tokens = 16384;
  int max_batch_requests = 32;
  absl::Duration max_queue_delay = absl::ZeroDuration();  // 0: a free lane never waits
  int queue_capacity = 256;
  int64_t memory_limit_bytes = int64_t{2} << 30;  // per lane
  int64_t max_message_bytes = int64_t{256} << 20;

  // Extra gRPC channel arguments, "name=value" (see server/channel_args.h).
  std::vector<std::string> grpc_args;

  std::string tls_cert_file;
  std::string tls_key_file;
  // Lines of "identity token" (server/authenticator.h), re-read on SIGHUP; empty: no
  // authentication, every caller is one identity.
  std::string auth_token_file;
  // RegisterSharedMemory for same-host peers (server/shared_memory.h), with descriptors passed
  // through a unix socket at shared_memory_socket (a path, or "@name" in the abstract
  // namespace; empty: an abstract name of the server's choosing).
  bool shared_memory = true;
  std::string shared_memory_socket;
  int max_regions_per_identity = 64;

  // Per request: query heads and sequences (proto/wire/request_decoder.h).
  int max_heads = 1024;
  int max_sequences = 65536;
  // Per AttendStream call: bytes of responses waiting for the client before reading pauses.
  int64_t max_stream_buffer_bytes = int64_t{64} << 20;
  // Every backward pass (AttendBackward and training jobs) adds its partial sums in a fixed
  // order, for bit-identical gradients, whether or not the request asks.
  bool deterministic_backward = false;

  // KV sessions (server/session_store.h). kv_pool_bytes per device; 0: a quarter of the
  // device's free memory on a GPU, 1 GiB of host memory on the CPU; negative: no sessions.
  int64_t kv_pool_bytes = 0;
  int64_t kv_page_bytes = 512 << 10;
  int64_t session_max_tokens = 1 << 20;
  absl::Duration session_ttl = absl::Minutes(10);
  int max_sessions_per_identity = 1024;

  absl::Duration drain_timeout = absl::Seconds(30);

  // Prometheus exporter: http://metrics_address/metrics. Port 0 picks a free port; empty
  // disables it. When not `metrics_required` (main.cc: the flag holds its default), an
  // address that cannot be bound is a warning and the server runs without the exporter.
  std::string metrics_address = "0.0.0.0:9464";
  std::string metrics_port_file;  // when set, the bound metrics port is written here
  bool metrics_required = true;

  // Training jobs (docs/training.md): where their records live (empty: in memory only, no
  // checkpoints, nothing survives a restart), steps between checkpoints, jobs queued or running
  // at once, jobs run side by side per device, CPU threads of a job on the CPU, uploaded bytes
  // per job, and bytes the training directory may hold (0: the disk's own limit).
  std::string training_dir;
  int training_checkpoint_every = 100;
  int training_max_jobs = 16;
  int training_jobs_per_device = 1;
  int training_cpu_threads = 1;
  int64_t training_max_data_bytes = int64_t{1} << 30;
  int64_t training_disk_limit_bytes = 0;

  // Names the first flag that is out of range.
  absl::Status Validate() const;
};

}  // namespace attnserve
