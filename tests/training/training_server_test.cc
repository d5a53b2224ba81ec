// Training jobs through the real attnserve binary on an ephemeral loopback port: a synthetic job
// learns, kill -9 and a restart resume it at the right step with the same weights, cancel,
// ownership between two identities, every bad job ending FAILED with its message (the server
// staying up), gradients through the server against float64 finite differences, and Attend
// latency while a job runs. Each test prints one "[training] ..." line of what it measured.
// Servers use one CPU thread for Attend and one for training: the build machine has two cores.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "attnserve/v1/training.grpc.pb.h"
#include "clients/cli/channel_factory.h"
#include "clients/cli/request_factory.h"
#include "layers/random.h"
#include "server/training/batch_source.h"
#include "tests/server/server_process.h"
#include "tests/training/layer_reference.h"

namespace attnserve {
namespace {

using client::ChannelFactory;
using client::ChannelOptions;
using test_support::ServerProcess;

void Report(const std::string& test, const std::string& figures) {
  std::printf("[training] %s: %s\n", test.c_str(), figures.c_str());
  std::fflush(stdout);
}

std::unique_ptr<ServerProcess> StartServer(const std::vector<std::string>& extra) {
  std::vector<std::string> flags = {"--cpu_threads=1", "--training_cpu_threads=1",
                                    "--metrics_address=", "--log_level=info"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  auto server = std::make_unique<ServerProcess>();
  EXPECT_TRUE(server->Start(ATTN_SERVER_BINARY, flags)) << server->log();
  return server;
}

// A client of one server, as one identity.
struct Client {
  std::unique_ptr<ChannelFactory> factory;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::TrainingService::Stub> training;
  std::unique_ptr<v1::AttentionService::Stub> attention;

  Client(const ServerProcess& server, const std::string& token = "") {
    ChannelOptions options;
    options.target = server.target();
    options.auth_token = token;
    factory = std::make_unique<ChannelFactory>(options);
    channel = *factory->Connect();
    training = v1::TrainingService::NewStub(channel);
    attention = v1::AttentionService::NewStub(channel);
  }

  // The spec, then each chunk, on one SubmitTrainingJob stream.
  grpc::Status Submit(const v1::TrainingJobSpec& spec, v1::TrainingJob* job,
                      const std::vector<v1::DataChunk>& chunks = {}) const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(30));
    auto writer = training->SubmitTrainingJob(&context, job);
    v1::SubmitTrainingJobRequest first;
    *first.mutable_spec() = spec;
    writer->Write(first);
    for (const v1::DataChunk& chunk : chunks) {
      v1::SubmitTrainingJobRequest part;
      *part.mutable_chunk() = chunk;
      writer->Write(part);
    }
    writer->WritesDone();
    return writer->Finish();
  }
  v1::TrainingJob SubmitOk(const v1::TrainingJobSpec& spec,
                           const std::vector<v1::DataChunk>& chunks = {}) const {
    v1::TrainingJob job;
    const grpc::Status status = Submit(spec, &job, chunks);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return job;
  }
  grpc::Status Get(const std::string& id, v1::TrainingJob* job) const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(10));
    v1::GetTrainingJobRequest request;
    request.set_job_id(id);
    return training->GetTrainingJob(&context, request, job);
  }
  grpc::Status Cancel(const std::string& id, v1::TrainingJob* job) const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(10));
    v1::CancelTrainingJobRequest request;
    request.set_job_id(id);
    return training->CancelTrainingJob(&context, request, job);
  }
  grpc::Status Result(const std::string& id, v1::TrainingResult* result) const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(10));
    v1::GetTrainingResultRequest request;
    request.set_job_id(id);
    return training->GetTrainingResult(&context, request, result);
  }
  grpc::Status List(v1::ListTrainingJobsResponse* jobs) const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(10));
    return training->ListTrainingJobs(&context, {}, jobs);
  }
  // Polls the job until `done` holds (or the timeout passes); returns the last state seen.
  v1::TrainingJob WaitFor(const std::string& id,
                          const std::function<bool(const v1::TrainingJob&)>& done,
                          absl::Duration timeout = absl::Seconds(60)) const {
    v1::TrainingJob job;
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      const grpc::Status status = Get(id, &job);
      EXPECT_TRUE(status.ok()) << status.error_message();
      if (!status.ok() || done(job)) return job;
      absl::SleepFor(absl::Milliseconds(10));
    }
    ADD_FAILURE() << "job " << id << " still " << v1::TrainingJobState_Name(job.state())
                  << " at step " << job.progress().step();
    return job;
  }
  v1::TrainingJob WaitFinished(const std::string& id,
                               absl::Duration timeout = absl::Seconds(60)) const {
    return WaitFor(
        id, [](const v1::TrainingJob& j) { return Ended(j.state()); }, timeout);
  }
  absl::Duration AttendOnce(const v1::AttendRequest& request) const {
    grpc::ClientContext context;
    factory->Prepare(&context, absl::Seconds(30));
    v1::AttendResponse response;
    const absl::Time start = absl::Now();
    const grpc::Status status = attention->Attend(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return absl::Now() - start;
  }

  static bool Ended(v1::TrainingJobState s) {
    return s == v1::TRAINING_JOB_SUCCEEDED || s == v1::TRAINING_JOB_FAILED ||
           s == v1::TRAINING_JOB_CANCELLED;
  }
};

// The associative-recall job of docs/training.md: learns to loss < 0.1 in 150 steps.
v1::TrainingJobSpec RecallSpec(int64_t steps) {
  v1::TrainingJobSpec spec;
  spec.set_display_name("recall");
  v1::AttentionLayerSpec* m = spec.mutable_model();
  m->set_model_dim(64);
  m->set_num_heads(4);
  m->set_num_kv_heads(2);
  m->set_head_dim(16);
  m->set_causal(true);
  m->set_residual(true);
  m->set_layer_norm(true);
  v1::SyntheticTask* task = spec.mutable_data()->mutable_synthetic();
  task->set_kind(v1::SYNTHETIC_TASK_ASSOCIATIVE_RECALL);
  task->set_vocab_size(16);
  spec.mutable_optimizer()->set_learning_rate(1e-2f);
  spec.set_batch_size(16);
  spec.set_seqlen(32);
  spec.set_steps(steps);
  spec.set_path(v1::PATH_CPU);
  return spec;
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

std::string Bytes(const std::vector<float>& v) {
  return v.empty() ? std::string()
                   : std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

// The body of GET http://127.0.0.1:port/metrics (HTTP/1.0: the exporter closes after it).
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = recv(fd, buffer, sizeof(buffer), 0)) > 0;) response.append(buffer, n);
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// The value of the sample named exactly `series` (name and labels), or -1.
double Sample(const std::string& text, const std::string& series) {
  const std::string prefix = series + " ";
  for (size_t at = 0; at < text.size();) {
    const size_t end = std::min(text.find('\n', at), text.size());
    if (text.compare(at, prefix.size(), prefix) == 0) {
      return std::strtod(text.c_str() + at + prefix.size(), nullptr);
    }
    at = end + 1;
  }
  return -1;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

TEST(TrainingServer, RecallLossFallsBelowThresholdAndWatchShowsProgress) {
  auto server = StartServer({});
  const Client c(*server);
  const v1::TrainingJob submitted = c.SubmitOk(RecallSpec(150));
  // A free worker may take the job before the answer to its submission is written.
  ASSERT_TRUE(submitted.state() == v1::TRAINING_JOB_QUEUED ||
              submitted.state() == v1::TRAINING_JOB_RUNNING)
      << v1::TrainingJobState_Name(submitted.state()) << ": " << submitted.error();

  grpc::ClientContext context;
  c.factory->Prepare(&context, absl::Seconds(60));
  v1::WatchTrainingJobRequest request;
  request.set_job_id(submitted.job_id());
  auto reader = c.training->WatchTrainingJob(&context, request);
  v1::TrainingJobEvent event;
  int events = 0;
  int64_t last_step = -1;
  bool monotonic = true;
  while (reader->Read(&event)) {
    ++events;
    monotonic = monotonic && event.job().progress().step() >= last_step;
    last_step = event.job().progress().step();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(event.job().state(), v1::TRAINING_JOB_SUCCEEDED) << event.job().error();
  EXPECT_TRUE(monotonic);
  EXPECT_GE(events, 3);  // queued, progress, the end
  EXPECT_EQ(last_step, 150);

  v1::TrainingResult result;
  ASSERT_TRUE(c.Result(submitted.job_id(), &result).ok());
  ASSERT_EQ(result.loss_curve_size(), 150);
  const double first = result.loss_curve(0);
  const double last10 =
      std::accumulate(result.loss_curve().end() - 10, result.loss_curve().end(), 0.0) / 10;
  EXPECT_GT(first, 2.0);   // chance level is ln 16 = 2.77
  EXPECT_LT(last10, 0.1);  // a broken backward (dQ = 0) is still at ~1.8 here
  ASSERT_EQ(result.weights_size(), 6);
  EXPECT_EQ(result.weights(0).name(), "w_q");
  EXPECT_EQ(result.weights(0).tensor().data().size(), 64u * 64 * 4);
  Report("recall", absl::StrCat("loss ", first, " -> ", last10, " (mean of steps 141-150), ",
                                events, " watch events, ",
                                static_cast<int>(event.job().progress().tokens_per_second()),
                                " tokens/s at the end"));
  EXPECT_EQ(server->Stop(SIGTERM), 0);
}

TEST(TrainingServer, KillNineThenRestartResumesAtTheCheckpointWithTheSameWeights) {
  v1::TrainingJobSpec spec = RecallSpec(300);
  spec.set_checkpoint_every(50);
  spec.mutable_optimizer()->set_schedule(v1::LR_SCHEDULE_COSINE);
  spec.mutable_optimizer()->set_warmup_steps(20);
  spec.mutable_optimizer()->set_weight_decay(0.01f);
  spec.mutable_optimizer()->set_max_grad_norm(1.f);

  // The same job without an interruption, for its final weights.
  std::vector<std::string> reference_weights;
  {
    auto server = StartServer({});
    const Client c(*server);
    const v1::TrainingJob job = c.SubmitOk(spec);
    ASSERT_EQ(c.WaitFinished(job.job_id(), absl::Seconds(120)).state(), v1::TRAINING_JOB_SUCCEEDED);
    v1::TrainingResult result;
    ASSERT_TRUE(c.Result(job.job_id(), &result).ok());
    for (const v1::NamedTensor& w : result.weights())
      reference_weights.push_back(w.tensor().data());
  }

  char dir_template[] = "/tmp/attnserve_training_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::vector<std::string> flags = {"--training_dir=" + dir};
  auto server = StartServer(flags);
  std::string id;
  int64_t checkpoint_before_kill = 0, step_at_kill = 0;
  {
    const Client c(*server);
    id = c.SubmitOk(spec).job_id();
    // Between two checkpoints, so that the restart loses steps.
    const v1::TrainingJob running = c.WaitFor(id, [](const v1::TrainingJob& j) {
      return j.progress().step() >= 120 || Client::Ended(j.state());
    });
    ASSERT_EQ(running.state(), v1::TRAINING_JOB_RUNNING);
    checkpoint_before_kill = running.checkpoint_step();
    step_at_kill = running.progress().step();
    server->Signal(SIGKILL);
    EXPECT_EQ(server->Wait(absl::Seconds(10)), 128 + SIGKILL);
  }

  server = StartServer(flags);
  const Client c(*server);
  v1::TrainingJob resumed;
  ASSERT_TRUE(c.Get(id, &resumed).ok());
  EXPECT_FALSE(Client::Ended(resumed.state()));
  // The last checkpoint on disk: the one seen before the kill, or one written just after.
  EXPECT_GE(resumed.resumed_from_step(), checkpoint_before_kill);
  EXPECT_LE(resumed.resumed_from_step(), step_at_kill + 50);
  EXPECT_EQ(resumed.resumed_from_step() % 50, 0);
  const v1::TrainingJob done = c.WaitFinished(id, absl::Seconds(120));
  ASSERT_EQ(done.state(), v1::TRAINING_JOB_SUCCEEDED) << done.error();
  EXPECT_EQ(done.resumed_from_step(), resumed.resumed_from_step());
  v1::TrainingResult result;
  ASSERT_TRUE(c.Result(id, &result).ok());
  ASSERT_EQ(result.weights_size(), static_cast<int>(reference_weights.size()));
  for (int i = 0; i < result.weights_size(); ++i) {
    EXPECT_TRUE(result.weights(i).tensor().data() == reference_weights[i])
        << result.weights(i).name() << " differs from the uninterrupted run's";
  }
  EXPECT_EQ(result.loss_curve_size(), 300);  // the steps redone after the checkpoint count once
  Report("kill -9",
         absl::StrCat("killed after step ", step_at_kill, " (checkpoint ", checkpoint_before_kill,
                      "), resumed from step ", resumed.resumed_from_step(),
                      ", final weights identical to the uninterrupted run's"));

  // SIGTERM checkpoints a running job where it stands.
  const std::string second = c.SubmitOk(RecallSpec(100000)).job_id();
  const int64_t seen =
      c.WaitFor(second, [](const v1::TrainingJob& j) { return j.progress().step() >= 20; })
          .progress()
          .step();
  EXPECT_EQ(server->Stop(SIGTERM), 0);
  server = StartServer(flags);
  const Client again(*server);
  v1::TrainingJob after_term;
  ASSERT_TRUE(again.Get(second, &after_term).ok());
  EXPECT_GE(after_term.resumed_from_step(), seen);
  Report("SIGTERM", absl::StrCat("step ", seen, " seen before SIGTERM, resumed from step ",
                                 after_term.resumed_from_step()));
  v1::TrainingJob cancelled;
  ASSERT_TRUE(again.Cancel(second, &cancelled).ok());
  EXPECT_EQ(server->Stop(SIGTERM), 0);
  std::filesystem::remove_all(dir);
}

// spec.deterministic comes back in the job's spec and as the job's own deterministic (what its
// run did), both survive a restart from the training directory, and --deterministic_backward
// makes a job whose spec does not ask run deterministic.
TEST(TrainingServer, JobsSayWhetherTheirBackwardRanDeterministic) {
  char dir_template[] = "/tmp/attnserve_training_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string dir_flag = "--training_dir=" + dir;
  v1::TrainingJobSpec asking = RecallSpec(5);
  asking.set_deterministic(true);
  const v1::TrainingJobSpec plain = RecallSpec(5);
  std::string asked, not_asked;
  {
    auto server = StartServer({dir_flag});
    const Client c(*server);
    const v1::TrainingJob submitted = c.SubmitOk(asking);
    EXPECT_TRUE(submitted.spec().deterministic());
    asked = submitted.job_id();
    not_asked = c.SubmitOk(plain).job_id();
    const v1::TrainingJob a = c.WaitFinished(asked);
    ASSERT_EQ(a.state(), v1::TRAINING_JOB_SUCCEEDED) << a.error();
    EXPECT_TRUE(a.deterministic());
    EXPECT_TRUE(a.spec().deterministic());
    const v1::TrainingJob b = c.WaitFinished(not_asked);
    ASSERT_EQ(b.state(), v1::TRAINING_JOB_SUCCEEDED) << b.error();
    EXPECT_FALSE(b.deterministic());
    EXPECT_FALSE(b.spec().deterministic());
    EXPECT_EQ(server->Stop(SIGTERM), 0);
  }

  auto server = StartServer({dir_flag, "--deterministic_backward"});
  const Client c(*server);
  v1::TrainingJob job;
  ASSERT_TRUE(c.Get(asked, &job).ok());
  EXPECT_TRUE(job.deterministic());
  EXPECT_TRUE(job.spec().deterministic());
  ASSERT_TRUE(c.Get(not_asked, &job).ok());
  EXPECT_FALSE(job.deterministic()) << "its run, before the flag, was not";
  EXPECT_FALSE(job.spec().deterministic());
  const v1::TrainingJob forced = c.WaitFinished(c.SubmitOk(plain).job_id());
  ASSERT_EQ(forced.state(), v1::TRAINING_JOB_SUCCEEDED) << forced.error();
  EXPECT_TRUE(forced.deterministic());
  EXPECT_FALSE(forced.spec().deterministic());
  EXPECT_EQ(server->Stop(SIGTERM), 0);
  std::filesystem::remove_all(dir);
}

TEST(TrainingServer, CancelEndsRunningAndQueuedJobs) {
  auto server = StartServer({});
  const Client c(*server);
  const std::string running = c.SubmitOk(RecallSpec(1000000)).job_id();
  const std::string queued = c.SubmitOk(RecallSpec(1000)).job_id();
  c.WaitFor(running, [](const v1::TrainingJob& j) { return j.progress().step() >= 5; });

  v1::TrainingJob job;
  ASSERT_TRUE(c.Cancel(queued, &job).ok());
  EXPECT_EQ(job.state(), v1::TRAINING_JOB_CANCELLED);  // at once: it never ran
  EXPECT_EQ(job.start_time_unix_micros(), 0);

  const absl::Time asked = absl::Now();
  ASSERT_TRUE(c.Cancel(running, &job).ok());
  job = c.WaitFinished(running, absl::Seconds(10));
  const absl::Duration took = absl::Now() - asked;
  EXPECT_EQ(job.state(), v1::TRAINING_JOB_CANCELLED);
  EXPECT_LT(job.progress().step(), 1000000);
  EXPECT_LT(took, absl::Seconds(2));
  v1::TrainingResult result;
  ASSERT_TRUE(c.Result(running, &result).ok());
  EXPECT_EQ(result.loss_curve_size(), job.progress().step());
  ASSERT_TRUE(c.Cancel(running, &job).ok());  // again: the job as it is
  EXPECT_EQ(job.state(), v1::TRAINING_JOB_CANCELLED);
  Report("cancel", absl::StrCat("running job ended ", absl::FormatDuration(took),
                                " after the cancel, at step ", job.progress().step()));
  EXPECT_EQ(server->Stop(SIGTERM), 0);
}

TEST(TrainingServer, JobsBelongToTheIdentityThatSubmittedThem) {
  char dir_template[] = "/tmp/attnserve_tokens_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string tokens = dir + "/tokens";
  std::ofstream(tokens) << "alice tok-alice-0001\nbob tok-bob-00001\n";
  auto server = StartServer({"--auth_token_file=" + tokens});
  const Client alice(*server, "tok-alice-0001"), bob(*server, "tok-bob-00001"), nobody(*server);
  const std::string id = alice.SubmitOk(RecallSpec(20)).job_id();

  v1::TrainingJob job;
  EXPECT_EQ(bob.Get(id, &job).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(bob.Cancel(id, &job).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::TrainingResult result;
  EXPECT_EQ(bob.Result(id, &result).error_code(), grpc::StatusCode::NOT_FOUND);
  {
    grpc::ClientContext context;
    bob.factory->Prepare(&context, absl::Seconds(10));
    v1::WatchTrainingJobRequest request;
    request.set_job_id(id);
    auto reader = bob.training->WatchTrainingJob(&context, request);
    v1::TrainingJobEvent event;
    EXPECT_FALSE(reader->Read(&event));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  v1::ListTrainingJobsResponse listed;
  ASSERT_TRUE(bob.List(&listed).ok());
  EXPECT_EQ(listed.jobs_size(), 0);
  ASSERT_TRUE(alice.List(&listed).ok());
  ASSERT_EQ(listed.jobs_size(), 1);
  EXPECT_EQ(listed.jobs(0).job_id(), id);
  EXPECT_EQ(nobody.Get(id, &job).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(nobody.Submit(RecallSpec(5), &job).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(alice.WaitFinished(id).state(), v1::TRAINING_JOB_SUCCEEDED);
  EXPECT_TRUE(alice.Result(id, &result).ok());
  Report("ownership",
         "bob: NOT_FOUND on get, cancel, result and watch, an empty list; "
         "no token: UNAUTHENTICATED");
  EXPECT_EQ(server->Stop(SIGTERM), 0);
  std::filesystem::remove_all(dir);
}

// An uploaded-data spec: `sequences` of seqlen x model_dim, float32, bytes inline.
v1::TrainingJobSpec UploadSpec(int sequences, int seqlen, int model_dim, uint64_t seed) {
  v1::TrainingJobSpec spec;
  v1::AttentionLayerSpec* m = spec.mutable_model();
  m->set_model_dim(model_dim);
  m->set_num_heads(2);
  m->set_num_kv_heads(1);
  m->set_head_dim(4);
  spec.set_batch_size(sequences);
  spec.set_seqlen(seqlen);
  spec.set_steps(1);
  spec.set_path(v1::PATH_CPU);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  spec.mutable_optimizer()->set_learning_rate(1.f);
  attn::layers::Random random(seed);
  std::vector<float> x(int64_t{sequences} * seqlen * model_dim), y(x.size());
  for (float& v : x) v = static_cast<float>(random.Normal());
  for (float& v : y) v = static_cast<float>(random.Normal());
  for (auto [tensor, values] :
       {std::pair{spec.mutable_data()->mutable_uploaded()->mutable_inputs(), &x},
        std::pair{spec.mutable_data()->mutable_uploaded()->mutable_targets(), &y}}) {
    tensor->set_dtype(v1::DTYPE_FLOAT32);
    tensor->add_shape(sequences);
    tensor->add_shape(seqlen);
    tensor->add_shape(model_dim);
    tensor->set_data(Bytes(*values));
  }
  return spec;
}

TEST(TrainingServer, BadJobsEndFailedWithTheirMessageAndTheServerStaysUp) {
  char dir_template[] = "/tmp/attnserve_training_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  // Room for a job's first record (the spec) but not for a checkpoint with weights and moments.
  auto server = StartServer({"--training_dir=" + dir, "--training_disk_limit_bytes=60000"});
  const Client c(*server);
  struct Case {
    std::string what;
    v1::TrainingJobSpec spec;
    std::vector<v1::DataChunk> chunks;
    std::string message;  // a part of the job's error
  };
  std::vector<Case> cases;
  {
    v1::TrainingJobSpec s = RecallSpec(10);
    s.mutable_model()->set_num_heads(3);
    cases.push_back({"shapes", s, {}, "model.num_kv_heads: 2 does not divide num_heads 3"});
  }
  {
    v1::TrainingJobSpec s = RecallSpec(10);
    s.mutable_model()->set_head_dim(300);
    cases.push_back({"head_dim", s, {}, "model.head_dim: 300"});
  }
  {
    v1::TrainingJobSpec s = RecallSpec(10);
    s.set_seqlen(64);  // 32 pairs from 16 keys
    cases.push_back({"vocab", s, {}, "data.synthetic.vocab_size: 16 keys cannot fill 32 pairs"});
  }
  cases.push_back({"zero steps", RecallSpec(0), {}, "steps: 0"});
  {
    v1::TrainingJobSpec s = RecallSpec(50);
    s.mutable_model()->set_layer_norm(false);
    s.mutable_optimizer()->set_learning_rate(1e20f);
    cases.push_back({"NaN loss", s, {}, "the loss is NaN; training stopped"});
  }
  {
    v1::TrainingJobSpec s = UploadSpec(4, 8, 16, 1);
    std::string* data = s.mutable_data()->mutable_uploaded()->mutable_inputs()->mutable_data();
    data->resize(data->size() - 4);
    cases.push_back({"upload size",
                     s,
                     {},
                     "data.uploaded.inputs: 2044 bytes arrived; its shape and dtype (float32) "
                     "take 2048"});
  }
  {
    // Targets in chunks, one of them missing.
    v1::TrainingJobSpec s = UploadSpec(4, 8, 16, 2);
    const std::string targets = s.data().uploaded().targets().data();
    s.mutable_data()->mutable_uploaded()->mutable_targets()->clear_data();
    v1::DataChunk first, third;
    first.set_field(v1::DataChunk::FIELD_TARGETS);
    first.set_data(targets.substr(0, 1024));
    third.set_field(v1::DataChunk::FIELD_TARGETS);
    third.set_offset(1536);
    third.set_data(targets.substr(1536));
    cases.push_back({"upload chunks",
                     s,
                     {first, third},
                     "data.uploaded.targets: a chunk at offset 1536 after 1024 bytes"});
  }
  {
    v1::TrainingJobSpec s = RecallSpec(100);
    s.set_checkpoint_every(10);
    cases.push_back({"full disk", s, {}, "the training disk is full"});
  }
  std::string figures;
  for (const Case& bad : cases) {
    const v1::TrainingJob submitted = c.SubmitOk(bad.spec, bad.chunks);
    const v1::TrainingJob job = c.WaitFinished(submitted.job_id());
    EXPECT_EQ(job.state(), v1::TRAINING_JOB_FAILED) << bad.what;
    EXPECT_TRUE(absl::StrContains(job.error(), bad.message))
        << bad.what << ": '" << job.error() << "' lacks '" << bad.message << "'";
    absl::StrAppend(&figures, "\n  ", bad.what, ": ", job.error());
  }
  // Still serving both services.
  client::ShapeSpec shape;
  shape.seqlen_q = shape.seqlen_k = 16;
  shape.num_heads = shape.num_kv_heads = 2;
  shape.head_dim = 32;
  c.AttendOnce(client::MakeRandomRequest(shape, 1));
  v1::ListTrainingJobsResponse listed;
  ASSERT_TRUE(c.List(&listed).ok());
  EXPECT_EQ(listed.jobs_size(), static_cast<int>(cases.size()));
  Report("bad jobs", figures);
  EXPECT_EQ(server->Stop(SIGTERM), 0);
  std::filesystem::remove_all(dir);
}

// Runs `command`, returns its exit status and what it printed.
int RunCommand(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  for (size_t n; (n = fread(buffer, 1, sizeof(buffer), pipe)) > 0;) output->append(buffer, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(TrainingServer, CommandLineClientSubmitsWatchesAndCollects) {
  auto server = StartServer({});
  char dir_template[] = "/tmp/attnserve_cli_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  const std::string client =
      absl::StrCat(test_support::BinaryFromEnv("ATTNSERVE_CLIENT_BINARY", ATTN_CLIENT_BINARY),
                   " --target=", server->target());
  std::string submitted;
  ASSERT_EQ(
      RunCommand(client + " train submit --head_dim=16 --causal --steps=60 --follow", &submitted),
      0)
      << submitted;
  EXPECT_TRUE(absl::StrContains(submitted, "step 60/60")) << submitted;
  EXPECT_TRUE(absl::StrContains(submitted, "SUCCEEDED")) << submitted;
  EXPECT_TRUE(absl::StrContains(submitted, "tokens/s  ETA")) << submitted;  // while it ran
  const std::string id = submitted.substr(0, submitted.find(' '));
  std::string listed, result, refused;
  ASSERT_EQ(RunCommand(client + " train status", &listed), 0) << listed;
  EXPECT_TRUE(absl::StartsWith(listed, id)) << listed;
  ASSERT_EQ(RunCommand(absl::StrCat(client, " train result --job=", id, " --weights_dir=", dir,
                                    "/w --curve_csv=", dir, "/loss.csv"),
                       &result),
            0)
      << result;
  EXPECT_TRUE(absl::StrContains(result, "w_q[64x64]")) << result;
  EXPECT_TRUE(std::filesystem::exists(dir + "/w/w_q.npy"));
  std::ifstream curve(dir + "/loss.csv");
  int lines = 0;
  for (std::string line; std::getline(curve, line);) ++lines;
  EXPECT_EQ(lines, 61);  // the header and one line per step
  EXPECT_EQ(RunCommand(client + " train submit --steps=0", &refused), 1);
  EXPECT_TRUE(absl::StrContains(refused, "FAILED: steps: 0")) << refused;
  EXPECT_EQ(RunCommand(client + " train watch", &refused), 2);  // no --job
  Report("cli", absl::StrCat("submit --follow, status, result (", lines - 1,
                             " curve points, six .npy weights)"));
  EXPECT_EQ(server->Stop(SIGTERM), 0);
  std::filesystem::remove_all(dir);
}

TEST(TrainingServer, MetricsFollowTheJobs) {
  char dir_template[] = "/tmp/attnserve_training_XXXXXX";
  const std::string dir = mkdtemp(dir_template);
  auto server = StartServer({"--training_dir=" + dir, "--metrics_address=127.0.0.1:0",
                             "--metrics_port_file=" + dir + "/metrics_port"});
  int port = 0;
  std::ifstream(dir + "/metrics_port") >> port;
  ASSERT_GT(port, 0);
  const Client c(*server);
  v1::TrainingJobSpec spec = RecallSpec(120);
  spec.set_checkpoint_every(50);
  const std::string done = c.SubmitOk(spec).job_id();
  ASSERT_EQ(c.WaitFinished(done).state(), v1::TRAINING_JOB_SUCCEEDED);
  const std::string running = c.SubmitOk(RecallSpec(1000000)).job_id();
  c.WaitFor(running, [](const v1::TrainingJob& j) { return j.progress().step() >= 3; });
  const std::string during = Scrape(port);
  EXPECT_EQ(Sample(during, "attnserve_training_jobs{state=\"succeeded\"}"), 1);
  EXPECT_EQ(Sample(during, "attnserve_training_jobs{state=\"running\"}"), 1);
  EXPECT_GT(Sample(during, "attnserve_training_loss{worker=\"0\"}"), 0);
  EXPECT_GT(Sample(during, "attnserve_training_tokens_per_second{worker=\"0\"}"), 0);
  EXPECT_GE(Sample(during, "attnserve_training_steps_total"), 123);
  EXPECT_GE(Sample(during, "attnserve_training_tokens_total"), 123 * 512);
  // The first job: submission, steps 50 and 100, its end; the second: its submission.
  EXPECT_GE(Sample(during, "attnserve_training_checkpoint_writes_total{result=\"ok\"}"), 5);
  EXPECT_GE(Sample(during, "attnserve_training_checkpoint_duration_seconds_count"), 5);
  v1::TrainingJob job;
  ASSERT_TRUE(c.Cancel(running, &job).ok());
  c.WaitFinished(running);
  const std::string after = Scrape(port);
  EXPECT_EQ(Sample(after, "attnserve_training_jobs{state=\"cancelled\"}"), 1);
  EXPECT_EQ(Sample(after, "attnserve_training_jobs{state=\"running\"}"), 0);
  EXPECT_EQ(Sample(after, "attnserve_training_loss{worker=\"0\"}"), -1);  // gone with its job
  Report("metrics",
         absl::StrCat(Sample(after, "attnserve_training_steps_total"), " steps, ",
                      Sample(after,
                             "attnserve_training_checkpoint_writes_total"
                             "{result=\"ok\"}"),
                      " records written in ",
                      Sample(after, "attnserve_training_checkpoint_duration_seconds_sum"), " s"));
  EXPECT_EQ(server->Stop(SIGTERM), 0);
  std::filesystem::remove_all(dir);
}

// One SGD step of learning rate 1 from given weights returns w0 - g: the server's gradient, to
// hold against float64 finite differences of the layer's loss on the same batch.
void ExpectServerGradientsMatch(const Client& c, v1::TrainingJobSpec spec,
                                const training::testing::ReferenceProblem& problem,
                                const std::string& what) {
  attn::layers::Random random(17);
  int64_t total = 0;
  const std::vector<attn::layers::ParamSlot> slots =
      attn::layers::LayerParams(problem.layer, &total);
  std::vector<double> w0(total, 0.0);
  for (const attn::layers::ParamSlot& slot : slots) {
    std::vector<float> values(slot.size());
    for (float& v : values) {
      v = static_cast<float>(slot.name == "ln_gain" ? 1.0 + 0.2 * random.Normal()
                                                    : 0.4 * random.Normal());
    }
    for (int64_t i = 0; i < slot.size(); ++i) w0[slot.offset + i] = values[i];
    v1::NamedTensor* named = spec.add_initial_weights();
    named->set_name(slot.name);
    named->mutable_tensor()->set_dtype(v1::DTYPE_FLOAT32);
    if (slot.rows > 1) named->mutable_tensor()->add_shape(slot.rows);
    named->mutable_tensor()->add_shape(slot.cols);
    named->mutable_tensor()->set_data(Bytes(values));
  }
  const v1::TrainingJob job = c.WaitFinished(c.SubmitOk(spec).job_id());
  ASSERT_EQ(job.state(), v1::TRAINING_JOB_SUCCEEDED) << job.error();
  v1::TrainingResult result;
  ASSERT_TRUE(c.Result(job.job_id(), &result).ok());
  EXPECT_NEAR(result.loss_curve(0), training::testing::ReferenceLoss(problem, w0),
              1e-5 * std::abs(result.loss_curve(0)));

  const std::vector<int64_t> indices = training::testing::ParameterIndices(problem.layer);
  const std::vector<double> expected = training::testing::FiniteDifferences(problem, w0, indices);
  double scale = 0, worst = 0;
  for (double g : expected) scale = std::max(scale, std::abs(g));
  size_t at = 0;
  for (const v1::NamedTensor& named : result.weights()) {
    const std::vector<float> w1 = Floats(named.tensor().data());
    const attn::layers::ParamSlot* slot = nullptr;
    for (const auto& s : slots) slot = s.name == named.name() ? &s : slot;
    ASSERT_NE(slot, nullptr) << named.name();
    for (int64_t i = 0; i < slot->size(); ++i, ++at) {
      const double got = w0[slot->offset + i] - w1[i];
      worst = std::max(worst, std::abs(got - expected[at]));
    }
  }
  EXPECT_EQ(at, indices.size());
  EXPECT_LT(worst, 1e-4 * scale) << what;
  Report("gradients", absl::StrCat(what, ": ", indices.size(), " weights, max |server - finite ",
                                   "difference| = ", worst, " (largest slope ", scale, ")"));
}

TEST(TrainingServer, GradientsThroughTheServerMatchFiniteDifferences) {
  auto server = StartServer({});
  const Client c(*server);

  // Regression on uploaded data: the whole dataset is the step's batch (in a shuffled order,
  // which a mean over every element does not see).
  {
    v1::TrainingJobSpec spec = UploadSpec(3, 5, 8, 4);
    spec.mutable_model()->set_window_left(2);
    spec.mutable_model()->set_window_right(1);
    training::testing::ReferenceProblem problem;
    problem.layer.model_dim = 8;
    problem.layer.num_heads = 2;
    problem.layer.num_kv_heads = 1;
    problem.layer.head_dim = 4;
    problem.layer.window_left = 2;
    problem.layer.window_right = 1;
    problem.batch = 3;
    problem.seqlen = 5;
    for (const float v : Floats(spec.data().uploaded().inputs().data()))
      problem.inputs.push_back(v);
    for (const float v : Floats(spec.data().uploaded().targets().data()))
      problem.targets.push_back(v);
    ExpectServerGradientsMatch(c, spec, problem, "windowed regression");
  }
  // Copy task with residual and layer norm: the task's own batch and embeddings, drawn here.
  {
    v1::TrainingJobSpec spec = RecallSpec(1);
    v1::AttentionLayerSpec* m = spec.mutable_model();
    m->set_model_dim(8);
    m->set_num_heads(2);
    m->set_num_kv_heads(1);
    m->set_head_dim(4);
    spec.mutable_data()->mutable_synthetic()->set_kind(v1::SYNTHETIC_TASK_COPY);
    spec.mutable_data()->mutable_synthetic()->set_vocab_size(5);
    spec.mutable_data()->mutable_synthetic()->set_seed(3);
    spec.set_batch_size(2);
    spec.set_seqlen(7);
    spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
    spec.mutable_optimizer()->set_learning_rate(1.f);
    training::TrainingSpec local;
    local.layer.model_dim = 8;
    local.layer.num_heads = 2;
    local.layer.num_kv_heads = 1;
    local.layer.head_dim = 4;
    local.layer.causal = true;
    local.layer.residual = true;
    local.layer.layer_norm = true;
    local.synthetic.kind = training::TaskKind::kCopy;
    local.synthetic.vocab_size = 5;
    local.synthetic.seed = 3;
    local.batch_size = 2;
    local.seqlen = 7;
    training::SyntheticTask task(local);
    training::HostBatch batch;
    task.Fill(1, &batch);
    training::testing::ReferenceProblem problem;
    problem.layer = local.layer;
    problem.batch = 2;
    problem.seqlen = 7;
    problem.inputs.assign(batch.inputs.begin(), batch.inputs.end());
    problem.labels = batch.labels;
    problem.class_embeddings.assign(task.class_embeddings().begin(), task.class_embeddings().end());
    ExpectServerGradientsMatch(c, spec, problem, "causal copy, residual + layer norm");
  }
  EXPECT_EQ(server->Stop(SIGTERM), 0);
}

// Attend and the job each get every core (two threads on the build machine's two), so a job that
// did not step aside would compete with every request; it trains in the client's pauses.
TEST(TrainingServer, AttendLatencyWhileAJobRunsStaysNearIdle) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "timing under AddressSanitizer says nothing about the server's";
#endif
  const int cores = std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  auto server = StartServer(
      {absl::StrCat("--cpu_threads=", cores), absl::StrCat("--training_cpu_threads=", cores)});
  const Client c(*server);
  client::ShapeSpec shape;
  shape.seqlen_q = shape.seqlen_k = 256;
  shape.num_heads = shape.num_kv_heads = 4;
  shape.head_dim = 64;
  const v1::AttendRequest request = client::MakeRandomRequest(shape, 7);
  constexpr int kCalls = 150;
  auto measure = [&] {
    std::vector<double> ms;
    for (int i = 0; i < kCalls; ++i) {
      ms.push_back(absl::ToDoubleMilliseconds(c.AttendOnce(request)));
      absl::SleepFor(absl::Milliseconds(i % 3 == 0 ? 30 : 1));  // pauses let training resume
    }
    return ms;
  };
  for (int i = 0; i < 20; ++i) c.AttendOnce(request);  // warm-up
  const std::vector<double> idle = measure();

  const std::string id = c.SubmitOk(RecallSpec(1000000)).job_id();
  c.WaitFor(id, [](const v1::TrainingJob& j) { return j.progress().step() >= 10; });
  const int64_t steps_before =
      c.WaitFor(id, [](const v1::TrainingJob&) { return true; }).progress().step();
  const std::vector<double> busy = measure();
  v1::TrainingJob job;
  ASSERT_TRUE(c.Get(id, &job).ok());
  const int64_t steps_during = job.progress().step() - steps_before;
  ASSERT_TRUE(c.Cancel(id, &job).ok());

  const double idle_median = Median(idle), busy_median = Median(busy);
  const double idle_p90 = Quantile(idle, 0.9), busy_p90 = Quantile(busy, 0.9);
  Report("latency",
         absl::StrFormat("Attend 1x256x4x64 fp32, %d calls each: idle median %.2f ms "
                         "p90 %.2f ms; with a job running median %.2f ms (x%.2f) p90 "
                         "%.2f ms (x%.2f); the job ran %d steps meanwhile",
                         kCalls, idle_median, idle_p90, busy_median, busy_median / idle_median,
                         busy_p90, busy_p90 / idle_p90, steps_during));
  EXPECT_GT(steps_during, 0);  // it trains in the gaps
  EXPECT_LT(busy_median, 1.5 * idle_median);
  EXPECT_LT(busy_p90, 2.0 * idle_p90);
  EXPECT_EQ(server->Stop(SIGTERM), 0);
}

}  // namespace
}  // namespace attnserve
