// attnserve: the gRPC attention server. Parses flags, builds the Config, runs until SIGTERM or
// SIGINT (re-reading the token file on SIGHUP), then drains.
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/wire/process_tuning.h"
#include "server/config.h"
#include "server/logging.h"
#include "server/server.h"
#include "server/termination_signal.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "Address to listen on; port 0 picks a free one");
ABSL_FLAG(std::string, port_file, "", "Write the bound port to this file once listening");
ABSL_FLAG(std::string, engine, "auto",
          "auto (CUDA fused, then naive, then CPU), cpu_tiled, cpu_reference, cuda_fused or "
          "cuda_naive");
ABSL_FLAG(std::vector<std::string>, devices, {"0"}, "CUDA device ordinals to serve on");
ABSL_FLAG(int, lanes_per_device, 0,
          "Batch lanes (threads, each with its own engines, stream and pool) per device; "
          "0 = 2 on a GPU, 1 on the CPU");
ABSL_FLAG(int, lane_threads, 0,
          "Threads per lane, its own included, that share a batch's host copies (requests into "
          "the staging region, outputs into the responses) once they pass 1 MiB; "
          "0 = cores / (2 x lanes), between 1 and 4");
ABSL_FLAG(std::string, gpu_wait, "yield",
          "How a lane waits for its batch on the GPU: yield (polls, giving the core to other "
          "runnable threads), spin (polls without yielding) or block (sleeps until the GPU's "
          "interrupt: ~35 us more per batch on the H200 machine)");
ABSL_FLAG(int, stream_threads, 0,
          "Threads serving AttendStream, each polling its own gRPC completion queue; "
          "0 = cores / 2, between 1 and 8");
ABSL_FLAG(int, cpu_threads, 0, "CPU engine threads; 0 = all cores");
ABSL_FLAG(int64_t, max_batch_tokens, 16384,
          "A batch closes when its query + key tokens reach this");
ABSL_FLAG(int, max_batch_requests, 32, "A batch closes when it holds this many requests");
ABSL_FLAG(absl::Duration, max_queue_delay, absl::ZeroDuration(),
          "0: a free lane runs what is queued at once (batches grow under load); > 0: a free "
          "lane holds a batch that is not full up to this long after its oldest request");
ABSL_FLAG(int, queue_capacity, 256, "Queued requests; beyond it RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, memory_limit_bytes, int64_t{2} << 30,
          "Per lane: bytes of Q, K, V, O and LSE one batch may use (pinned staging and device "
          "pool grow up to it); larger requests get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{256} << 20, "Largest gRPC message, each way");
ABSL_FLAG(std::vector<std::string>, grpc_arg, {},
          "Extra gRPC server channel arguments, name=value[,name=value...] (integers are passed "
          "as integers), e.g. grpc.http2.max_frame_size=1048576");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM certificate chain; enables TLS with --tls_key_file");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key for --tls_cert_file");
ABSL_FLAG(std::string, auth_token_file, "",
          "File of 'identity token' lines (or one bare token): every AttentionService call must "
          "present one (authorization: Bearer <token>) and acts as its identity; SIGHUP re-reads "
          "the file. Health and reflection stay open");
ABSL_FLAG(bool, shared_memory, true,
          "Let clients on this host (loopback or unix-socket peers) register memory objects they "
          "pass by descriptor and send tensors by reference instead of in the message");
ABSL_FLAG(std::string, shared_memory_socket, "",
          "Unix socket where clients pass shared-memory descriptors: a path, or @name for the "
          "abstract namespace; empty = an abstract name of the server's choosing (GetServerInfo "
          "tells it)");
ABSL_FLAG(int, max_regions_per_identity, 64, "Shared-memory regions one identity may hold");
ABSL_FLAG(int, max_heads, 1024, "Query heads a request may have");
ABSL_FLAG(int, max_sequences, 65536, "Sequences a request may have (dense batch or cu_seqlens)");
ABSL_FLAG(int64_t, max_stream_buffer_bytes, int64_t{64} << 20,
          "Per AttendStream call: bytes of responses waiting for the client to read before the "
          "server stops reading its requests");
ABSL_FLAG(bool, deterministic_backward, false,
          "Run every backward pass (AttendBackward, training jobs) in deterministic mode: "
          "bit-identical gradients across runs, at some cost in speed, whatever the request asks");
ABSL_FLAG(int64_t, kv_pool_bytes, 0,
          "KV session pages per device: bytes; 0 = a quarter of the GPU's free memory (1 GiB of "
          "host memory on the CPU engine); negative = no KV sessions");
ABSL_FLAG(int64_t, kv_page_bytes, 512 << 10,
          "Bytes of one KV page (a block of K and V rows; its tokens follow from the session's "
          "heads and head_dim)");
ABSL_FLAG(int64_t, session_max_tokens, 1 << 20, "Longest a KV session may grow, in tokens");
ABSL_FLAG(absl::Duration, session_ttl, absl::Minutes(10),
          "Idle KV sessions expire after this (CreateSession may ask for another)");
ABSL_FLAG(int, max_sessions_per_identity, 1024, "KV sessions one identity may hold");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "On SIGTERM/SIGINT, how long accepted calls get to finish");
constexpr char kDefaultMetricsAddress[] = "0.0.0.0:9464";
ABSL_FLAG(std::string, metrics_address, kDefaultMetricsAddress,
          "Prometheus /metrics listen address; port 0 picks a free one; empty disables it");
ABSL_FLAG(std::string, metrics_port_file, "",
          "Write the bound metrics port to this file once listening");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");
ABSL_FLAG(std::string, training_dir, "",
          "Training jobs' records and checkpoints (one folder per job); unfinished jobs resume "
          "from here after a restart. Empty: jobs live in memory only");
ABSL_FLAG(int, training_checkpoint_every, 100,
          "Steps between a training job's checkpoints (a job's spec may set its own)");
ABSL_FLAG(int, training_max_jobs, 16, "Training jobs queued or running at once");
ABSL_FLAG(int, training_jobs_per_device, 1, "Training jobs run side by side on each device");
ABSL_FLAG(int, training_cpu_threads, 1, "Threads of a training job that runs on the CPU");
ABSL_FLAG(int64_t, training_max_data_bytes, int64_t{1} << 30,
          "Bytes a training job may upload (inputs and targets together)");
ABSL_FLAG(int64_t, training_disk_limit_bytes, 0,
          "Bytes --training_dir may hold; a checkpoint beyond it fails its job as a full disk "
          "would. 0: the disk's own limit");

namespace {

absl::StatusOr<attnserve::Config> ConfigFromFlags() {
  attnserve::Config c;
  c.listen = absl::GetFlag(FLAGS_listen);
  c.port_file = absl::GetFlag(FLAGS_port_file);
  c.engine = absl::GetFlag(FLAGS_engine);
  c.devices.clear();
  for (const std::string& d : absl::GetFlag(FLAGS_devices)) {
    int ordinal = 0;
    if (!absl::SimpleAtoi(d, &ordinal) || ordinal < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--devices: '", d, "' is not an ordinal"));
    }
    c.devices.push_back(ordinal);
  }
  c.lanes_per_device = absl::GetFlag(FLAGS_lanes_per_device);
  c.lane_threads = absl::GetFlag(FLAGS_lane_threads);
  c.gpu_wait = absl::GetFlag(FLAGS_gpu_wait);
  c.stream_threads = absl::GetFlag(FLAGS_stream_threads);
  c.grpc_args = absl::GetFlag(FLAGS_grpc_arg);
  c.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  c.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  c.max_batch_requests = absl::GetFlag(FLAGS_max_batch_requests);
  c.max_queue_delay = absl::GetFlag(FLAGS_max_queue_delay);
  c.queue_capacity = absl::GetFlag(FLAGS_queue_capacity);
  c.memory_limit_bytes = absl::GetFlag(FLAGS_memory_limit_bytes);
  c.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  c.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  c.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  c.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  c.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  c.shared_memory_socket = absl::GetFlag(FLAGS_shared_memory_socket);
  c.max_regions_per_identity = absl::GetFlag(FLAGS_max_regions_per_identity);
  c.max_heads = absl::GetFlag(FLAGS_max_heads);
  c.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  c.max_stream_buffer_bytes = absl::GetFlag(FLAGS_max_stream_buffer_bytes);
  c.deterministic_backward = absl::GetFlag(FLAGS_deterministic_backward);
  c.kv_pool_bytes = absl::GetFlag(FLAGS_kv_pool_bytes);
  c.kv_page_bytes = absl::GetFlag(FLAGS_kv_page_bytes);
  c.session_max_tokens = absl::GetFlag(FLAGS_session_max_tokens);
  c.session_ttl = absl::GetFlag(FLAGS_session_ttl);
  c.max_sessions_per_identity = absl::GetFlag(FLAGS_max_sessions_per_identity);
  c.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  c.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  c.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  c.training_dir = absl::GetFlag(FLAGS_training_dir);
  c.training_checkpoint_every = absl::GetFlag(FLAGS_training_checkpoint_every);
  c.training_max_jobs = absl::GetFlag(FLAGS_training_max_jobs);
  c.training_jobs_per_device = absl::GetFlag(FLAGS_training_jobs_per_device);
  c.training_cpu_threads = absl::GetFlag(FLAGS_training_cpu_threads);
  c.training_max_data_bytes = absl::GetFlag(FLAGS_training_max_data_bytes);
  c.training_disk_limit_bytes = absl::GetFlag(FLAGS_training_disk_limit_bytes);
  // Servers started side by side (tests, a second instance) must not fail over the default
  // port; an address someone chose must work.
  c.metrics_required = c.metrics_address != kDefaultMetricsAddress;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  attnserve::KeepFreedMemoryInTheHeap();
  attnserve::SkipMutexDeadlockDetectionInOptimizedBuilds();
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::EndsWith(path, "server/main.cc");
  };
  usage.version_string = [] {
#if defined(ATTN_HAVE_CUDA)
    constexpr char kEngines[] = "CUDA and CPU engines";
#else
    constexpr char kEngines[] = "CPU engines only";
#endif
    return absl::StrCat("attnserve ", ATTN_VERSION, " (", ATTN_BUILD_TYPE, " build, ", kEngines,
                        ")\n");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage("The attnserve gRPC attention server. Flags:");
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<attnserve::LogLevel> level =
      attnserve::ParseLogLevel(absl::GetFlag(FLAGS_log_level));
  if (!level.ok()) {
    std::fprintf(stderr, "%s\n", std::string(level.status().message()).c_str());
    return 2;
  }
  attnserve::SetLogLevel(*level);
  absl::StatusOr<attnserve::Config> config = ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", std::string(config.status().message()).c_str());
    return 2;
  }

  attnserve::TerminationSignal::Block();  // before any thread starts
  absl::StatusOr<std::unique_ptr<attnserve::Server>> server = attnserve::Server::Start(*config);
  if (!server.ok()) {
    ATTN_LOG(kError) << "cannot start: " << server.status();
    return 1;
  }
  while (true) {
    const int signal_number = attnserve::TerminationSignal::Wait();
    if (signal_number == SIGHUP) {
      (*server)->ReloadTokens();
      continue;
    }
    ATTN_LOG(kInfo) << "signal " << signal_number << " received";
    break;
  }
  (*server)->Drain();
  return 0;
}
