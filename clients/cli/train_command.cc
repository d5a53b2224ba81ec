#include "clients/cli/train_command.h"

#include <google/protobuf/util/json_util.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "attnserve/v1/training.grpc.pb.h"
#include "clients/cli/load_generator.h"
#include "clients/cli/npy_file.h"

// Shared with attend (attnserve_client.cc).
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(absl::Duration, timeout);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(int, head_dim);
ABSL_DECLARE_FLAG(bool, causal);
ABSL_DECLARE_FLAG(int, window_left);
ABSL_DECLARE_FLAG(int, window_right);
ABSL_DECLARE_FLAG(std::string, path);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(bool, deterministic);

ABSL_FLAG(std::string, job, "", "train watch/status/cancel/result: the job id");
ABSL_FLAG(std::string, name, "", "train submit: the job's display name");
ABSL_FLAG(int64_t, steps, 300, "train submit: optimiser steps");
ABSL_FLAG(int, batch_size, 16, "train submit: sequences per step");
ABSL_FLAG(int, num_heads, 4, "train submit: query heads");
ABSL_FLAG(int, num_kv_heads, 0,
          "train submit: key/value heads, dividing --num_heads (0: --num_heads)");
ABSL_FLAG(int, seqlen, 32, "train submit: tokens per sequence");
ABSL_FLAG(int, model_dim, 64, "train submit: the layer's width (inputs and outputs)");
ABSL_FLAG(bool, residual, true, "train submit: out = x + attention(x)");
ABSL_FLAG(bool, layer_norm, true, "train submit: LayerNorm after the (residual) sum");
ABSL_FLAG(std::string, task, "recall",
          "train submit: synthetic task, recall (associative recall) or copy; ignored with "
          "--inputs_npy");
ABSL_FLAG(int, vocab_size, 16, "train submit: the synthetic task's keys and values (tokens)");
ABSL_FLAG(uint64_t, task_seed, 1, "train submit: the synthetic task's seed");
ABSL_FLAG(std::string, inputs_npy, "",
          "train submit: upload inputs [num_sequences, seqlen, model_dim] from this .npy (with "
          "--targets_npy; the loss is then the mean squared error)");
ABSL_FLAG(std::string, targets_npy, "", "train submit: upload targets from this .npy");
ABSL_FLAG(int64_t, chunk_bytes, int64_t{4} << 20,
          "train submit: uploads larger than this go in chunks of this size");
ABSL_FLAG(std::string, optimizer, "adamw", "train submit: adamw or sgd");
ABSL_FLAG(double, lr, 1e-2, "train submit: learning rate");
ABSL_FLAG(std::string, lr_schedule, "constant", "train submit: constant, cosine or linear");
ABSL_FLAG(int, warmup_steps, 0, "train submit: linear warmup steps");
ABSL_FLAG(double, min_lr, 0, "train submit: the schedule's final learning rate");
ABSL_FLAG(double, weight_decay, 0, "train submit: AdamW's decoupled weight decay");
ABSL_FLAG(double, max_grad_norm, 0, "train submit: clip the gradient norm to this (0: never)");
ABSL_FLAG(int, checkpoint_every, 0, "train submit: steps between checkpoints (0: the server's)");
ABSL_FLAG(bool, follow, false, "train submit: watch the job after submitting it");
ABSL_FLAG(std::string, weights_dir, "", "train result: write each weight as DIR/<name>.npy");
ABSL_FLAG(std::string, curve_csv, "", "train result: write the loss curve (step,loss,metric)");

namespace attnserve::client {
namespace {

constexpr int kUsage = 2;

int Usage(const std::string& message) {
  std::fprintf(stderr, "train: %s\n", message.c_str());
  return kUsage;
}

int Failed(const char* what, const grpc::Status& status) {
  std::fprintf(stderr, "%s failed: %s: %s\n", what, StatusCodeName(status.error_code()).c_str(),
               status.error_message().c_str());
  return 1;
}

std::string Json(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

std::string StateName(v1::TrainingJobState state) {
  std::string name = v1::TrainingJobState_Name(state);
  const std::string prefix = "TRAINING_JOB_";
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

std::string Rate(double tokens_per_second) {
  if (tokens_per_second >= 1e6) return absl::StrFormat("%.2fM", tokens_per_second / 1e6);
  if (tokens_per_second >= 1e3) return absl::StrFormat("%.1fk", tokens_per_second / 1e3);
  return absl::StrFormat("%.0f", tokens_per_second);
}

std::string Eta(double seconds) {
  if (seconds <= 0) return "-";
  const int64_t s = static_cast<int64_t>(std::ceil(seconds));
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

// "step 120/300  loss 0.0412  accuracy 1.000  152.3k tokens/s  ETA 4s  RUNNING"
std::string ProgressLine(const v1::TrainingJob& job) {
  const v1::TrainingProgress& p = job.progress();
  std::string line = absl::StrFormat("%s  step %d/%d", job.job_id(), p.step(), p.total_steps());
  if (p.step() > 0) {
    absl::StrAppendFormat(&line, "  loss %.4f", p.loss());
    if (!p.eval_metric_name().empty()) {
      absl::StrAppendFormat(&line, "  %s %.3f", p.eval_metric_name(), p.eval_metric());
    }
  }
  if (job.state() == v1::TRAINING_JOB_RUNNING && p.tokens_per_second() > 0) {
    absl::StrAppend(&line, "  ", Rate(p.tokens_per_second()), " tokens/s  ETA ",
                    Eta(p.eta_seconds()));
  }
  absl::StrAppend(&line, "  ", StateName(job.state()));
  if (!job.error().empty()) absl::StrAppend(&line, ": ", job.error());
  return line;
}

absl::StatusOr<v1::DType> WireDType(const std::string& name) {
  if (name == "float32" || name == "fp32" || name == "f32") return v1::DTYPE_FLOAT32;
  if (name == "float16" || name == "fp16" || name == "f16" || name == "half") {
    return v1::DTYPE_FLOAT16;
  }
  if (name == "bfloat16" || name == "bf16") return v1::DTYPE_BFLOAT16;
  return absl::InvalidArgumentError(absl::StrCat("--dtype: unknown '", name, "'"));
}

absl::Status SpecFromFlags(v1::TrainingJobSpec* spec, v1::Tensor* inputs, v1::Tensor* targets) {
  spec->set_display_name(absl::GetFlag(FLAGS_name));
  v1::AttentionLayerSpec* m = spec->mutable_model();
  m->set_model_dim(absl::GetFlag(FLAGS_model_dim));
  m->set_num_heads(absl::GetFlag(FLAGS_num_heads));
  m->set_num_kv_heads(absl::GetFlag(FLAGS_num_kv_heads));
  m->set_head_dim(absl::GetFlag(FLAGS_head_dim));
  m->set_causal(absl::GetFlag(FLAGS_causal));
  if (absl::GetFlag(FLAGS_window_left) >= 0) m->set_window_left(absl::GetFlag(FLAGS_window_left));
  if (absl::GetFlag(FLAGS_window_right) >= 0) {
    m->set_window_right(absl::GetFlag(FLAGS_window_right));
  }
  m->set_residual(absl::GetFlag(FLAGS_residual));
  m->set_layer_norm(absl::GetFlag(FLAGS_layer_norm));
  spec->set_batch_size(absl::GetFlag(FLAGS_batch_size));
  spec->set_seqlen(absl::GetFlag(FLAGS_seqlen));
  spec->set_steps(absl::GetFlag(FLAGS_steps));
  spec->set_seed(absl::GetFlag(FLAGS_seed));
  spec->set_checkpoint_every(absl::GetFlag(FLAGS_checkpoint_every));
  spec->set_deterministic(absl::GetFlag(FLAGS_deterministic));
  absl::StatusOr<v1::DType> dtype = WireDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return dtype.status();
  spec->set_dtype(*dtype);
  const std::string path = absl::GetFlag(FLAGS_path);
  if (path == "auto") {
    spec->set_path(v1::PATH_AUTO);
  } else if (path == "fused") {
    spec->set_path(v1::PATH_FUSED);
  } else if (path == "naive") {
    spec->set_path(v1::PATH_NAIVE);
  } else if (path == "cpu") {
    spec->set_path(v1::PATH_CPU);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--path: unknown '", path, "'"));
  }

  v1::OptimizerSpec* o = spec->mutable_optimizer();
  const std::string optimizer = absl::GetFlag(FLAGS_optimizer);
  if (optimizer == "adamw") {
    o->set_kind(v1::OPTIMIZER_ADAMW);
  } else if (optimizer == "sgd") {
    o->set_kind(v1::OPTIMIZER_SGD);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--optimizer: unknown '", optimizer, "'"));
  }
  o->set_learning_rate(static_cast<float>(absl::GetFlag(FLAGS_lr)));
  const std::string schedule = absl::GetFlag(FLAGS_lr_schedule);
  if (schedule == "constant") {
    o->set_schedule(v1::LR_SCHEDULE_CONSTANT);
  } else if (schedule == "cosine") {
    o->set_schedule(v1::LR_SCHEDULE_COSINE);
  } else if (schedule == "linear") {
    o->set_schedule(v1::LR_SCHEDULE_LINEAR);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--lr_schedule: unknown '", schedule, "'"));
  }
  o->set_warmup_steps(absl::GetFlag(FLAGS_warmup_steps));
  o->set_min_learning_rate(static_cast<float>(absl::GetFlag(FLAGS_min_lr)));
  o->set_weight_decay(static_cast<float>(absl::GetFlag(FLAGS_weight_decay)));
  o->set_max_grad_norm(static_cast<float>(absl::GetFlag(FLAGS_max_grad_norm)));

  const std::string inputs_npy = absl::GetFlag(FLAGS_inputs_npy);
  const std::string targets_npy = absl::GetFlag(FLAGS_targets_npy);
  if (inputs_npy.empty() != targets_npy.empty()) {
    return absl::InvalidArgumentError("--inputs_npy, --targets_npy: give both or neither");
  }
  if (inputs_npy.empty()) {
    v1::SyntheticTask* t = spec->mutable_data()->mutable_synthetic();
    const std::string task = absl::GetFlag(FLAGS_task);
    if (task == "recall") {
      t->set_kind(v1::SYNTHETIC_TASK_ASSOCIATIVE_RECALL);
    } else if (task == "copy") {
      t->set_kind(v1::SYNTHETIC_TASK_COPY);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--task: unknown '", task, "'"));
    }
    t->set_vocab_size(absl::GetFlag(FLAGS_vocab_size));
    t->set_seed(absl::GetFlag(FLAGS_task_seed));
    return absl::OkStatus();
  }
  absl::StatusOr<v1::Tensor> x = ReadNpy(inputs_npy, false);
  if (!x.ok()) return x.status();
  absl::StatusOr<v1::Tensor> y = ReadNpy(targets_npy, false);
  if (!y.ok()) return y.status();
  *inputs = *std::move(x);
  *targets = *std::move(y);
  if (inputs->shape_size() == 3) {  // the data says what seqlen and model_dim are
    spec->set_seqlen(static_cast<int>(inputs->shape(1)));
    m->set_model_dim(static_cast<int>(inputs->shape(2)));
  }
  v1::UploadedData* uploaded = spec->mutable_data()->mutable_uploaded();
  for (auto [from, to] : {std::pair{inputs, uploaded->mutable_inputs()},
                          std::pair{targets, uploaded->mutable_targets()}}) {
    to->set_dtype(from->dtype());
    *to->mutable_shape() = from->shape();
  }
  return absl::OkStatus();
}

int Watch(const ChannelFactory& factory, v1::TrainingService::Stub* stub,
          const std::string& job_id) {
  grpc::ClientContext context;
  factory.Prepare(&context);  // as long as the job takes
  v1::WatchTrainingJobRequest request;
  request.set_job_id(job_id);
  std::unique_ptr<grpc::ClientReader<v1::TrainingJobEvent>> reader =
      stub->WatchTrainingJob(&context, request);
  const bool terminal = isatty(STDOUT_FILENO) != 0 && !absl::GetFlag(FLAGS_json);
  v1::TrainingJobEvent event;
  v1::TrainingJobState last = v1::TRAINING_JOB_STATE_UNSPECIFIED;
  while (reader->Read(&event)) {
    last = event.job().state();
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("%s\n", Json(event).c_str());
    } else if (terminal) {
      std::printf("\r\033[K%s", ProgressLine(event.job()).c_str());
    } else {
      std::printf("%s\n", ProgressLine(event.job()).c_str());
    }
    std::fflush(stdout);
  }
  if (terminal) std::printf("\n");
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return Failed("WatchTrainingJob", status);
  return last == v1::TRAINING_JOB_SUCCEEDED ? 0 : 1;
}

int Submit(const ChannelFactory& factory, v1::TrainingService::Stub* stub) {
  v1::SubmitTrainingJobRequest first;
  v1::Tensor inputs, targets;
  if (absl::Status s = SpecFromFlags(first.mutable_spec(), &inputs, &targets); !s.ok()) {
    return Usage(std::string(s.message()));
  }
  const int64_t chunk = std::max<int64_t>(absl::GetFlag(FLAGS_chunk_bytes), 1);
  const bool chunked = static_cast<int64_t>(inputs.data().size() + targets.data().size()) > chunk;
  if (first.spec().data().has_uploaded() && !chunked) {
    first.mutable_spec()->mutable_data()->mutable_uploaded()->mutable_inputs()->set_data(
        inputs.data());
    first.mutable_spec()->mutable_data()->mutable_uploaded()->mutable_targets()->set_data(
        targets.data());
  }
  grpc::ClientContext context;
  factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
  v1::TrainingJob job;
  std::unique_ptr<grpc::ClientWriter<v1::SubmitTrainingJobRequest>> writer =
      stub->SubmitTrainingJob(&context, &job);
  bool sent = writer->Write(first);
  if (chunked) {
    for (auto [field, tensor] : {std::pair{v1::DataChunk::FIELD_INPUTS, &inputs},
                                 std::pair{v1::DataChunk::FIELD_TARGETS, &targets}}) {
      const std::string& bytes = tensor->data();
      for (size_t offset = 0; sent && offset < bytes.size(); offset += chunk) {
        v1::SubmitTrainingJobRequest part;
        part.mutable_chunk()->set_field(field);
        part.mutable_chunk()->set_offset(offset);
        part.mutable_chunk()->set_data(bytes.substr(offset, chunk));
        sent = writer->Write(part);
      }
    }
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return Failed("SubmitTrainingJob", status);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", Json(job).c_str());
  } else {
    std::printf("%s %s%s%s\n", job.job_id().c_str(), StateName(job.state()).c_str(),
                job.error().empty() ? "" : ": ", job.error().c_str());
  }
  if (job.state() == v1::TRAINING_JOB_FAILED) return 1;
  return absl::GetFlag(FLAGS_follow) ? Watch(factory, stub, job.job_id()) : 0;
}

int Status(const ChannelFactory& factory, v1::TrainingService::Stub* stub,
           const std::string& job_id) {
  grpc::ClientContext context;
  factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
  if (job_id.empty()) {
    v1::ListTrainingJobsResponse jobs;
    const grpc::Status status = stub->ListTrainingJobs(&context, {}, &jobs);
    if (!status.ok()) return Failed("ListTrainingJobs", status);
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("%s\n", Json(jobs).c_str());
    } else {
      for (const v1::TrainingJob& job : jobs.jobs()) std::printf("%s\n", ProgressLine(job).c_str());
    }
    return 0;
  }
  v1::GetTrainingJobRequest request;
  request.set_job_id(job_id);
  v1::TrainingJob job;
  const grpc::Status status = stub->GetTrainingJob(&context, request, &job);
  if (!status.ok()) return Failed("GetTrainingJob", status);
  std::printf("%s\n", absl::GetFlag(FLAGS_json) ? Json(job).c_str() : ProgressLine(job).c_str());
  return 0;
}

int Cancel(const ChannelFactory& factory, v1::TrainingService::Stub* stub,
           const std::string& job_id) {
  grpc::ClientContext context;
  factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
  v1::CancelTrainingJobRequest request;
  request.set_job_id(job_id);
  v1::TrainingJob job;
  const grpc::Status status = stub->CancelTrainingJob(&context, request, &job);
  if (!status.ok()) return Failed("CancelTrainingJob", status);
  std::printf("%s\n", absl::GetFlag(FLAGS_json) ? Json(job).c_str() : ProgressLine(job).c_str());
  return 0;
}

int Result(const ChannelFactory& factory, v1::TrainingService::Stub* stub,
           const std::string& job_id) {
  grpc::ClientContext context;
  factory.Prepare(&context, absl::GetFlag(FLAGS_timeout));
  v1::GetTrainingResultRequest request;
  request.set_job_id(job_id);
  v1::TrainingResult result;
  const grpc::Status status = stub->GetTrainingResult(&context, request, &result);
  if (!status.ok()) return Failed("GetTrainingResult", status);
  const std::string dir = absl::GetFlag(FLAGS_weights_dir);
  if (!dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    for (const v1::NamedTensor& w : result.weights()) {
      const std::string file = absl::StrCat(dir, "/", w.name(), ".npy");
      if (absl::Status s = WriteNpy(file, w.tensor()); !s.ok()) {
        std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
        return 1;
      }
    }
  }
  const std::string csv = absl::GetFlag(FLAGS_curve_csv);
  if (!csv.empty()) {
    std::ofstream out(csv);
    out << "step,loss," << result.progress().eval_metric_name() << "\n";
    for (int i = 0; i < result.loss_curve_size(); ++i) {
      out << result.loss_curve_steps(i) << "," << result.loss_curve(i) << ","
          << (i < result.eval_curve_size() ? result.eval_curve(i) : 0.f) << "\n";
    }
    if (!out) {
      std::fprintf(stderr, "--curve_csv: cannot write '%s'\n", csv.c_str());
      return 1;
    }
  }
  if (absl::GetFlag(FLAGS_json)) {
    for (v1::NamedTensor& w : *result.mutable_weights()) w.mutable_tensor()->clear_data();
    std::printf("%s\n", Json(result).c_str());
  } else {
    std::printf("%s %s: %d steps, final loss %.4f", result.job_id().c_str(),
                StateName(result.state()).c_str(), static_cast<int>(result.progress().step()),
                result.progress().loss());
    for (const v1::NamedTensor& w : result.weights()) {
      std::printf("  %s[%s]", w.name().c_str(), absl::StrJoin(w.tensor().shape(), "x").c_str());
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

int RunTrainCommand(const std::vector<std::string>& args, const ChannelFactory& factory,
                    const std::shared_ptr<grpc::Channel>& channel) {
  if (args.size() != 1) {
    return Usage("expected one of: submit, watch, status, cancel, result (train --help)");
  }
  const std::string& command = args[0];
  const std::string job = absl::GetFlag(FLAGS_job);
  auto stub = v1::TrainingService::NewStub(channel);
  if (command == "submit") return Submit(factory, stub.get());
  if (command == "status") return Status(factory, stub.get(), job);
  if (job.empty()) return Usage(absl::StrCat(command, ": --job=ID is required"));
  if (command == "watch") return Watch(factory, stub.get(), job);
  if (command == "cancel") return Cancel(factory, stub.get(), job);
  if (command == "result") return Result(factory, stub.get(), job);
  return Usage(absl::StrCat("unknown command '", command, "'"));
}

}  // namespace attnserve::client
