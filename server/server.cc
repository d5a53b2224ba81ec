#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attn/problem.h"
#include "attn/status_macros.h"
#include "grpc/health/v1/health.pb.h"
#include "proto/wire/channel_args.h"
#include "server/device_pool.h"
#include "server/logging.h"
#include "server/reflection_service.h"
#include "server/training/serving_activity.h"

namespace attnserve {
namespace {

constexpr char kServiceName[] = "attnserve.v1.AttentionService";
constexpr char kTrainingServiceName[] = "attnserve.v1.TrainingService";
constexpr char kVersion[] = ATTN_VERSION;  // CMake's project version

// Writes `port` to `path` atomically (a reader never sees a partial file).
absl::Status WritePortFile(const std::string& path, int port, const char* flag) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("--", flag, ": cannot write '", path, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("--", flag, ": cannot read '", path, "'"));
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

// The engine kinds this server runs, in AUTO's order of preference.
absl::StatusOr<std::vector<attn::EngineKind>> ChooseEngineKinds(const Config& config) {
  if (config.engine != "auto") {
    ATTN_ASSIGN_OR_RETURN(attn::EngineKind kind, attn::ParseEngineKind(config.engine));
    return std::vector<attn::EngineKind>{kind};
  }
  std::vector<attn::EngineKind> kinds;
  for (attn::EngineKind kind : {attn::EngineKind::kCudaFused, attn::EngineKind::kCudaNaive}) {
    attn::EngineOptions options;
    options.device = config.devices.front();
    if (const absl::Status available = attn::EngineAvailable(kind, options); available.ok()) {
      kinds.push_back(kind);
    } else {
      ATTN_LOG(kInfo) << EngineKindName(kind) << " not used: " << available.message();
    }
  }
  kinds.push_back(attn::EngineKind::kCpuTiled);
  return kinds;
}

bool IsDeviceKind(attn::EngineKind kind) {
  return kind == attn::EngineKind::kCudaFused || kind == attn::EngineKind::kCudaNaive;
}

v1::ServerInfo DescribeServer(const Config& config, const std::vector<attn::EngineKind>& kinds,
                              int lanes) {
  v1::ServerInfo info;
  info.set_version(kVersion);
  bool gpu = false;
  for (attn::EngineKind kind : kinds) {
    info.add_engines(std::string(attn::EngineKindName(kind)));
    gpu = gpu || IsDeviceKind(kind);
    const v1::Path path = kind == attn::EngineKind::kCudaFused   ? v1::PATH_FUSED
                          : kind == attn::EngineKind::kCudaNaive ? v1::PATH_NAIVE
                                                                 : v1::PATH_CPU;
    bool listed = false;
    for (int p : info.paths()) listed = listed || p == path;
    if (!listed) info.add_paths(path);
  }
  info.set_gpu(gpu);
  // Asked of the engine kinds, on a problem every engine with a backward pass takes.
  const attn::AttentionProblem sample =
      attn::DenseProblem(attn::DType::kF16, 1, 16, 16, 2, 1, 64, /*causal=*/false);
  for (attn::EngineKind kind : kinds) {
    if (attn::EngineSupports(kind, attn::Pass::kBackward, sample).ok()) {
      info.add_backward_engines(std::string(attn::EngineKindName(kind)));
    }
  }
  if (gpu) {
    for (int d : config.devices) {
      v1::Device* device = info.add_devices();
      device->set_name(absl::StrCat("cuda:", d));
      device->set_kind("cuda");
      device->set_memory_bytes(DevicePool::TotalMemoryBytes(attn::MemorySpace::kDevice, d));
    }
  }
  v1::Device* cpu = info.add_devices();
  cpu->set_name("cpu");
  cpu->set_kind("cpu");
  cpu->set_memory_bytes(DevicePool::TotalMemoryBytes(attn::MemorySpace::kHost, 0));
  for (v1::DType t : {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT16, v1::DTYPE_BFLOAT16}) {
    info.add_dtypes(t);
  }
  // The head dims the fused forward kernels are compiled for, from their table.
  for (const attn::FusedCapability& row : attn::FusedCapabilities()) {
    if (row.pass != attn::Pass::kForward) continue;
    const auto& dims = info.head_dims();
    if (std::find(dims.begin(), dims.end(), row.head_dim) == dims.end()) {
      info.add_head_dims(row.head_dim);
    }
  }
  v1::Limits* limits = info.mutable_limits();
  limits->set_max_message_bytes(config.max_message_bytes);
  limits->set_max_batch_tokens(config.max_batch_tokens);
  limits->set_max_batch_requests(config.max_batch_requests);
  limits->set_max_queue_delay_us(absl::ToInt64Microseconds(config.max_queue_delay));
  limits->set_queue_capacity(config.queue_capacity);
  limits->set_memory_limit_bytes(config.memory_limit_bytes);
  limits->set_max_head_dim(attn::kMaxHeadDim);
  limits->set_batch_lanes(lanes);
  limits->set_max_heads(config.max_heads);
  limits->set_max_sequences(config.max_sequences);
  limits->set_max_stream_buffer_bytes(config.max_stream_buffer_bytes);
  limits->set_max_shared_memory_regions(config.max_regions_per_identity);
  info.set_auth_required(!config.auth_token_file.empty());
  info.set_shared_memory(config.shared_memory);
  info.set_deterministic_backward(config.deterministic_backward);
  return info;
}

// Training jobs: one scheduler worker per training slot (each device's, or the CPU's), callers
// checked as AttentionService checks them, and the question that keeps training below Attend
// traffic. That question belongs to the batcher (its queue and its lanes); until it answers it,
// the request counters do (server/training/serving_activity.h).
absl::StatusOr<std::unique_ptr<training::TrainingService>> StartTraining(
    const Config& config, bool gpu, const AttentionService* attention, Metrics* metrics) {
  training::TrainingService::Options options;
  options.check_call = [attention](const grpc::ServerContextBase& context) {
    return attention->CheckCall(context);
  };
  options.dir = config.training_dir;
  options.disk_limit_bytes = config.training_disk_limit_bytes;
  options.checkpoint_every = config.training_checkpoint_every;
  options.max_unfinished_jobs = config.training_max_jobs;
  options.max_data_bytes = config.training_max_data_bytes;
  options.workers.clear();
  for (int device : gpu ? config.devices : std::vector<int>{0}) {
    for (int i = 0; i < config.training_jobs_per_device; ++i) {
      training::TrainerOptions worker;
      worker.space = gpu ? attn::MemorySpace::kDevice : attn::MemorySpace::kHost;
      worker.device = device;
      worker.cpu_threads = config.training_cpu_threads;
      worker.deterministic_backward = config.deterministic_backward;
      options.workers.push_back(worker);
    }
  }
  options.serving_busy = training::ServingBusyFromMetrics(metrics);
  return training::TrainingService::Create(std::move(options), &metrics->registry());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const Config& config) {
  ATTN_RETURN_IF_ERROR(config.Validate());
  ATTN_ASSIGN_OR_RETURN(const DeviceWait gpu_wait, ParseDeviceWait(config.gpu_wait));
  std::unique_ptr<Server> self(new Server(config));
  if (config.auth_token_file.empty()) {
    self->authenticator_ = std::make_shared<Authenticator>();
  } else {
    ATTN_ASSIGN_OR_RETURN(std::unique_ptr<Authenticator> auth,
                          Authenticator::FromFile(config.auth_token_file));
    self->authenticator_ = std::move(auth);
  }
  if (config.shared_memory) {
    DescriptorSocket::Options socket_options;
    socket_options.address = config.shared_memory_socket;
    ATTN_ASSIGN_OR_RETURN(self->descriptor_socket_, DescriptorSocket::Start(socket_options));
  }

  ATTN_ASSIGN_OR_RETURN(std::vector<attn::EngineKind> kinds, ChooseEngineKinds(config));
  bool any_device = false;
  for (attn::EngineKind kind : kinds) any_device = any_device || IsDeviceKind(kind);

  // Lanes: a set per device (with the CPU engine the devices are stand-ins: each gets its own
  // lanes and KV pool, so placement works the same way).
  const std::vector<int> lane_devices = config.devices;
  const int per_device = config.lanes_per_device > 0 ? config.lanes_per_device : any_device ? 2 : 1;
  if (config.kv_pool_bytes >= 0) {
    for (size_t slot = 0; slot < lane_devices.size(); ++slot) {
      const int device = lane_devices[slot];
      const attn::MemorySpace space =
          any_device ? attn::MemorySpace::kDevice : attn::MemorySpace::kHost;
      int64_t bytes = config.kv_pool_bytes;
      if (bytes == 0) {
        bytes = any_device ? DevicePool::TotalMemoryBytes(space, device) / 4 : int64_t{1} << 30;
      }
      const std::string label = any_device                 ? absl::StrCat("cuda:", device)
                                : lane_devices.size() == 1 ? "cpu"
                                                           : absl::StrCat("cpu:", slot);
      ATTN_ASSIGN_OR_RETURN(std::unique_ptr<KvPagePool> pool,
                            KvPagePool::Create(space, device, config.kv_page_bytes, bytes, label));
      self->kv_pools_.push_back(std::move(pool));
    }
  }
  std::vector<Lane::Parts> lane_parts;
  for (size_t slot = 0; slot < lane_devices.size(); ++slot) {
    const int device = lane_devices[slot];
    for (int i = 0; i < per_device; ++i) {
      attn::EngineOptions options;
      options.device = device;
      options.num_threads = config.cpu_threads;
      Lane::Parts parts;
      for (attn::EngineKind kind : kinds) {
        ATTN_ASSIGN_OR_RETURN(std::unique_ptr<attn::Engine> engine,
                              attn::CreateEngine(kind, options));
        parts.engines.push_back(std::move(engine));
      }
      ATTN_ASSIGN_OR_RETURN(parts.host_pool, DevicePool::Create(attn::MemorySpace::kHost, device,
                                                                config.memory_limit_bytes));
      parts.device_slot = static_cast<int>(slot);
      if (!self->kv_pools_.empty()) parts.kv_pool = self->kv_pools_[slot].get();
      if (any_device) {
        ATTN_ASSIGN_OR_RETURN(parts.device_pool,
                              DevicePool::Create(attn::MemorySpace::kDevice, device,
                                                 config.memory_limit_bytes, gpu_wait));
      }
      lane_parts.push_back(std::move(parts));
    }
  }
  const int lane_count = static_cast<int>(lane_parts.size());

  self->metrics_.SetBuildInfo(kVersion, any_device);
  if (!config.metrics_address.empty()) {
    if (absl::Status s = self->metrics_.StartExporter(config.metrics_address); !s.ok()) {
      if (config.metrics_required) return s;
      ATTN_LOG(kWarning) << "running without the metrics exporter: " << s.message();
    } else {
      ATTN_LOG(kInfo) << "metrics on port " << self->metrics_.exporter_port()
                      << " (/metrics, --metrics_address=" << config.metrics_address << ")";
      if (!config.metrics_port_file.empty()) {
        ATTN_RETURN_IF_ERROR(WritePortFile(config.metrics_port_file, self->metrics_.exporter_port(),
                                           "metrics_port_file"));
      }
    }
  }

  Batcher::Options batch_options;
  batch_options.max_batch_tokens = config.max_batch_tokens;
  batch_options.max_batch_requests = config.max_batch_requests;
  batch_options.max_queue_delay = config.max_queue_delay;
  batch_options.queue_capacity = config.queue_capacity;
  batch_options.memory_limit_bytes = config.memory_limit_bytes;
  self->batcher_ = std::make_unique<Batcher>(batch_options, &self->metrics_);
  const int copy_threads =
      config.lane_threads > 0
          ? config.lane_threads
          : std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / (2 * lane_count), 1,
                       4);
  for (int i = 0; i < lane_count; ++i) {
    self->lanes_.push_back(std::make_unique<Lane>(i, std::move(lane_parts[i]), copy_threads,
                                                  self->batcher_.get(), &self->metrics_));
  }

  if (!self->kv_pools_.empty()) {
    SessionStore::Options store_options;
    store_options.page_bytes = config.kv_page_bytes;
    store_options.max_tokens = config.session_max_tokens;
    store_options.default_ttl = config.session_ttl;
    store_options.max_sessions_per_identity = config.max_sessions_per_identity;
    std::vector<KvPagePool*> pools;
    for (const auto& pool : self->kv_pools_) pools.push_back(pool.get());
    Metrics* metrics = &self->metrics_;
    Server* server = self.get();
    SessionStore::Events events;
    auto count = [server] { return server->session_store_->open(); };
    events.created = [metrics, count](const Session&) {
      metrics->OnSession(Metrics::SessionEvent::kCreated, count());
    };
    events.deleted = [metrics, count](const Session&) {
      metrics->OnSession(Metrics::SessionEvent::kDeleted, count());
    };
    events.expired = [metrics, count](const Session& s) {
      metrics->OnSession(Metrics::SessionEvent::kExpired, count());
      ATTN_LOG(kInfo) << "session " << s.id() << " expired after " << absl::FormatDuration(s.ttl())
                      << " idle (" << s.tokens() << " tokens)";
    };
    events.tick = [metrics, pools] {
      for (KvPagePool* pool : pools) {
        metrics->OnKvPool(pool->label(), pool->num_pages() * pool->page_bytes(),
                          pool->free_pages() * pool->page_bytes(), pool->free_pages());
      }
    };
    events.tick();
    self->session_store_ = std::make_unique<SessionStore>(store_options, pools, std::move(events));
  }

  AttentionService::Options service_options;
  service_options.authenticator = self->authenticator_;
  service_options.limits.memory_limit_bytes = config.memory_limit_bytes;
  service_options.limits.max_heads = config.max_heads;
  service_options.limits.max_sequences = config.max_sequences;
  service_options.deterministic_backward = config.deterministic_backward;
  service_options.descriptor_socket = self->descriptor_socket_.get();
  service_options.shared_memory_limits.max_regions_per_owner = config.max_regions_per_identity;
  if (any_device) {  // lanes DMA page-locked regions to and from the device
    service_options.shared_memory_pinning = {DevicePool::PinHostMemory,
                                             DevicePool::UnpinHostMemory};
  }
  v1::ServerInfo info = DescribeServer(config, kinds, lane_count);
  if (!self->kv_pools_.empty()) {
    v1::SessionLimits* sessions = info.mutable_sessions();
    sessions->set_page_bytes(config.kv_page_bytes);
    sessions->set_pool_bytes(self->kv_pools_.front()->num_pages() * config.kv_page_bytes);
    sessions->set_max_tokens(config.session_max_tokens);
    sessions->set_default_ttl_seconds(absl::ToInt64Seconds(config.session_ttl));
    sessions->set_max_sessions(config.max_sessions_per_identity);
  }
  if (self->descriptor_socket_ != nullptr) {
    info.set_shared_memory_socket(self->descriptor_socket_->address());
  }
  self->service_ = std::make_unique<AttentionService>(service_options, kinds, self->batcher_.get(),
                                                      &self->metrics_, std::move(info));
  if (self->session_store_ != nullptr) {
    self->session_service_ = std::make_unique<SessionService>(
        self->service_.get(), self->session_store_.get(), self->batcher_.get(), &self->metrics_);
    self->service_->AttachSessions(self->session_service_.get());
  }
  ATTN_ASSIGN_OR_RETURN(self->training_,
                        StartTraining(config, any_device, self->service_.get(), &self->metrics_));

  std::shared_ptr<grpc::ServerCredentials> credentials;
  if (!config.tls_cert_file.empty()) {
    ATTN_ASSIGN_OR_RETURN(std::string cert, ReadFile(config.tls_cert_file, "tls_cert_file"));
    ATTN_ASSIGN_OR_RETURN(std::string key, ReadFile(config.tls_key_file, "tls_key_file"));
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({key, cert});
    credentials = grpc::SslServerCredentials(ssl);
  } else {
    credentials = grpc::InsecureServerCredentials();
  }

  grpc::EnableDefaultHealthCheckService(true);
  // gRPC's health service runs on messages of its own, so nothing would link our generated
  // health.proto: referring to it puts its descriptor in the pool reflection describes from.
  grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();  // grpc.reflection.v1alpha
  grpc::ServerBuilder builder;
  AddReflectionService(&builder);  // grpc.reflection.v1
  builder.AddListeningPort(config.listen, credentials, &self->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  ATTN_ASSIGN_OR_RETURN(std::vector<ChannelArg> channel_args,
                        ParseChannelArgs(config.grpc_args, "grpc_arg"));
  for (const ChannelArg& arg : channel_args) {
    if (const int* number = std::get_if<int>(&arg.value)) {
      builder.AddChannelArgument(arg.name, *number);
    } else {
      builder.AddChannelArgument(arg.name, std::get<std::string>(arg.value));
    }
  }
  builder.RegisterService(self->service_.get());
  builder.RegisterService(self->training_.get());
  StreamFrontend::Options stream_options;
  stream_options.threads =
      config.stream_threads > 0
          ? config.stream_threads
          : std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 2, 1, 8);
  stream_options.max_buffered_bytes = config.max_stream_buffer_bytes;
  self->stream_frontend_ = std::make_unique<StreamFrontend>(self->service_.get(), stream_options);
  self->stream_frontend_->AddQueues(&builder);
  self->server_ = builder.BuildAndStart();
  if (self->server_ == nullptr || self->port_ == 0) {
    self->StopLanes();
    return absl::UnavailableError(
        absl::StrCat("--listen=", config.listen, ": cannot listen there"));
  }
  self->stream_frontend_->Start();
  grpc::HealthCheckServiceInterface* health = self->server_->GetHealthCheckService();
  health->SetServingStatus(kServiceName, true);
  health->SetServingStatus(kTrainingServiceName, true);
  health->SetServingStatus(true);

  if (!config.port_file.empty()) {
    ATTN_RETURN_IF_ERROR(WritePortFile(config.port_file, self->port_, "port_file"));
  }
  std::string engines;
  for (attn::EngineKind kind : kinds)
    absl::StrAppend(&engines, " ", std::string(attn::EngineKindName(kind)));
  ATTN_LOG(kInfo) << "attnserve " << kVersion << " listening on "
                  << (absl::StartsWith(config.listen, "unix") ? config.listen
                                                              : absl::StrCat("port ", self->port_))
                  << " (engines:" << engines << "; lanes: " << lane_count
                  << (any_device ? absl::StrCat("; gpu_wait: ", config.gpu_wait) : "")
                  << (config.tls_cert_file.empty() ? "; plaintext" : "; TLS")
                  << (config.auth_token_file.empty() ? "" : "; bearer token required")
                  << (self->descriptor_socket_ != nullptr
                          ? absl::StrCat("; shared memory at ", self->descriptor_socket_->address())
                          : "")
                  << ")";
  return self;
}

Server::~Server() { Drain(); }

void Server::Drain() {
  if (drained_) return;
  drained_ = true;
  if (server_ == nullptr) {  // Start failed half-way (the stream queues never started)
    StopLanes();
    return;
  }
  const absl::Time deadline = absl::Now() + config_.drain_timeout;
  ATTN_LOG(kInfo) << "draining: NOT_SERVING, refusing new calls, up to "
                  << absl::FormatDuration(config_.drain_timeout) << " for accepted calls";
  server_->GetHealthCheckService()->SetServingStatus(false);
  service_->StartDraining();
  training_->Shutdown();  // running jobs checkpoint now and resume after the restart
  stream_frontend_->StartDraining();
  // The batcher keeps running meanwhile, so accepted requests complete (or are dropped quickly
  // once cancelled). gRPC's own Shutdown would also wait for idle connections to close, which a
  // client may never do: it starts once no call is left, and its short grace lets calls that
  // were arriving be refused UNAVAILABLE (rather than cut off) and clients act on GOAWAY; then it
  // closes every connection.
  const bool idle = service_->AwaitNoCalls(deadline);
  if (!idle) {
    ATTN_LOG(kWarning) << "drain timeout: cancelling the calls still in progress";
  }
  constexpr absl::Duration kShutdownGrace = absl::Milliseconds(250);
  server_->Shutdown(absl::ToChronoTime(std::min(absl::Now() + kShutdownGrace, deadline)));
  StopLanes();
  server_->Wait();
  stream_frontend_->Stop();  // every stream is over; its queues drain empty
  const v1::Stats stats = metrics_.Snapshot();
  ATTN_LOG(kInfo) << "drained: " << stats.requests_accepted() << " accepted, "
                  << stats.requests_completed() << " completed, " << stats.requests_failed()
                  << " failed, " << stats.requests_rejected() << " rejected, " << stats.batches()
                  << " batches";
}

void Server::StopLanes() {
  if (batcher_ != nullptr) batcher_->Stop();
  lanes_.clear();  // each runs what is queued, then joins; its completion threads finish last
}

void Server::ReloadTokens() {
  if (config_.auth_token_file.empty()) {
    ATTN_LOG(kInfo) << "SIGHUP: no --auth_token_file to re-read";
    return;
  }
  absl::StatusOr<int> loaded = authenticator_->Reload();
  if (loaded.ok()) {
    ATTN_LOG(kInfo) << "SIGHUP: " << *loaded << " tokens loaded from " << config_.auth_token_file;
  } else {
    ATTN_LOG(kWarning) << "SIGHUP: the tokens in force stay: " << loaded.status().message();
  }
}

}  // namespace attnserve
