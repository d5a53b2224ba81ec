#include "server/training/training_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "attn/status_macros.h"

namespace attnserve::training {
namespace {

absl::StatusOr<attn::DType> DTypeOf(v1::DType t, const char* field, bool unset_is_f32) {
  switch (t) {
    case v1::DTYPE_FLOAT32:
      return attn::DType::kF32;
    case v1::DTYPE_FLOAT16:
      return attn::DType::kF16;
    case v1::DTYPE_BFLOAT16:
      return attn::DType::kBF16;
    case v1::DTYPE_UNSPECIFIED:
      if (unset_is_f32) return attn::DType::kF32;
      break;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", v1::DType_Name(t).empty() ? std::to_string(t) : v1::DType_Name(t),
                   " (FLOAT32, FLOAT16 or BFLOAT16)"));
}

std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// An uploaded tensor's declaration: dtype, and shape [num_sequences, seqlen, model_dim].
absl::Status CheckUpload(const v1::Tensor& t, const char* field, const TrainingSpec& spec,
                         attn::DType* dtype, int64_t* sequences) {
  if (t.has_shared_memory()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field,
                     ".shared_memory: training data travels in the stream, not by "
                     "shared-memory reference"));
  }
  ATTN_ASSIGN_OR_RETURN(*dtype, DTypeOf(t.dtype(), absl::StrCat(field, ".dtype").c_str(), false));
  if (t.shape_size() != 3 || t.shape(0) < 1 || t.shape(1) != spec.seqlen ||
      t.shape(2) != spec.layer.model_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape: ", ShapeString(t.shape()), " (expected [num_sequences, seqlen ",
        spec.seqlen, ", model_dim ", spec.layer.model_dim, "])"));
  }
  *sequences = t.shape(0);
  return absl::OkStatus();
}

std::string Floats(const std::vector<float>& v) {
  if (v.empty()) return {};
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::vector<float> FloatsOf(const std::string& bytes) {
  std::vector<float> v(bytes.size() / sizeof(float));
  if (!v.empty()) std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

int64_t Micros(absl::Time t) { return t == absl::InfinitePast() ? 0 : absl::ToUnixMicros(t); }

absl::Time FromMicros(int64_t us) {
  return us == 0 ? absl::InfinitePast() : absl::FromUnixMicros(us);
}

v1::TrainingProgress ProgressToProto(const Progress& p) {
  v1::TrainingProgress out;
  out.set_step(p.step);
  out.set_total_steps(p.total_steps);
  out.set_loss(static_cast<float>(p.loss));
  out.set_eval_metric(static_cast<float>(p.metric));
  out.set_eval_metric_name(p.metric_name);
  out.set_tokens_per_second(p.tokens_per_second);
  out.set_eta_seconds(p.eta_seconds);
  out.set_learning_rate(p.learning_rate);
  out.set_loss_scale(p.loss_scale);
  return out;
}

Progress ProgressFromProto(const v1::TrainingProgress& p) {
  Progress out;
  out.step = p.step();
  out.total_steps = p.total_steps();
  out.loss = p.loss();
  out.metric = p.eval_metric();
  out.metric_name = p.eval_metric_name();
  out.learning_rate = p.learning_rate();
  out.loss_scale = p.loss_scale();
  return out;  // rates describe a run, and a restored job is not running
}

JobState StateFromProto(v1::TrainingJobState s) {
  switch (s) {
    case v1::TRAINING_JOB_SUCCEEDED:
      return JobState::kSucceeded;
    case v1::TRAINING_JOB_FAILED:
      return JobState::kFailed;
    case v1::TRAINING_JOB_CANCELLED:
      return JobState::kCancelled;
    case v1::TRAINING_JOB_RUNNING:
      return JobState::kRunning;
    default:
      return JobState::kQueued;
  }
}

}  // namespace

absl::StatusOr<TrainingSpec> SpecFromProto(const v1::TrainingJobSpec& wire) {
  TrainingSpec spec;
  spec.display_name = wire.display_name();
  const v1::AttentionLayerSpec& m = wire.model();
  spec.layer.model_dim = m.model_dim();
  spec.layer.num_heads = m.num_heads();
  spec.layer.num_kv_heads = m.num_kv_heads() == 0 ? m.num_heads() : m.num_kv_heads();
  spec.layer.head_dim = m.head_dim();
  spec.layer.causal = m.causal();
  spec.layer.window_left = m.has_window_left() ? m.window_left() : -1;
  spec.layer.window_right = m.has_window_right() ? m.window_right() : -1;
  if (m.has_window_left() && m.window_left() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.window_left: ", m.window_left(), " (leave it unset for unbounded)"));
  }
  if (m.has_window_right() && m.window_right() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.window_right: ", m.window_right(), " (leave it unset for unbounded)"));
  }
  spec.layer.residual = m.residual();
  spec.layer.layer_norm = m.layer_norm();
  ATTN_ASSIGN_OR_RETURN(spec.layer.dtype, DTypeOf(wire.dtype(), "dtype", true));
  spec.batch_size = wire.batch_size();
  spec.seqlen = wire.seqlen();
  spec.steps = wire.steps();
  spec.seed = wire.seed();
  spec.checkpoint_every = wire.checkpoint_every();
  spec.deterministic = wire.deterministic();
  switch (wire.path()) {
    case v1::PATH_AUTO:
      spec.path = EnginePath::kAuto;
      break;
    case v1::PATH_FUSED:
      spec.path = EnginePath::kFused;
      break;
    case v1::PATH_NAIVE:
      spec.path = EnginePath::kNaive;
      break;
    case v1::PATH_CPU:
      spec.path = EnginePath::kCpu;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("path: unknown value ", wire.path()));
  }

  const v1::OptimizerSpec& o = wire.optimizer();
  attn::layers::OptimizerConfig& opt = spec.optimizer;
  if (o.kind() == v1::OPTIMIZER_ADAMW) {
    opt.kind = attn::layers::OptimizerKind::kAdamW;
  } else if (o.kind() == v1::OPTIMIZER_SGD) {
    opt.kind = attn::layers::OptimizerKind::kSgd;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.kind: unknown value ", o.kind()));
  }
  opt.learning_rate = o.learning_rate();
  switch (o.schedule()) {
    case v1::LR_SCHEDULE_CONSTANT:
      opt.schedule = attn::layers::Schedule::kConstant;
      break;
    case v1::LR_SCHEDULE_COSINE:
      opt.schedule = attn::layers::Schedule::kCosine;
      break;
    case v1::LR_SCHEDULE_LINEAR:
      opt.schedule = attn::layers::Schedule::kLinear;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer.schedule: unknown value ", o.schedule()));
  }
  opt.warmup_steps = o.warmup_steps();
  opt.min_learning_rate = o.min_learning_rate();
  if (o.beta1() != 0) opt.beta1 = o.beta1();
  if (o.beta2() != 0) opt.beta2 = o.beta2();
  if (o.epsilon() != 0) opt.epsilon = o.epsilon();
  opt.weight_decay = o.weight_decay();
  opt.max_grad_norm = o.max_grad_norm();
  opt.total_steps = spec.steps;

  switch (wire.data().source_case()) {
    case v1::TrainingData::kSynthetic: {
      const v1::SyntheticTask& t = wire.data().synthetic();
      spec.source = DataSource::kSynthetic;
      if (t.kind() == v1::SYNTHETIC_TASK_ASSOCIATIVE_RECALL) {
        spec.synthetic.kind = TaskKind::kAssociativeRecall;
      } else if (t.kind() == v1::SYNTHETIC_TASK_COPY) {
        spec.synthetic.kind = TaskKind::kCopy;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "data.synthetic.kind: ", t.kind(), " (SYNTHETIC_TASK_ASSOCIATIVE_RECALL or COPY)"));
      }
      spec.synthetic.vocab_size = t.vocab_size() == 0 ? 16 : t.vocab_size();
      spec.synthetic.seed = t.seed();
      break;
    }
    case v1::TrainingData::kUploaded: {
      spec.source = DataSource::kUploaded;
      int64_t inputs = 0, targets = 0;
      ATTN_RETURN_IF_ERROR(CheckUpload(wire.data().uploaded().inputs(), "data.uploaded.inputs",
                                       spec, &spec.upload.inputs_dtype, &inputs));
      ATTN_RETURN_IF_ERROR(CheckUpload(wire.data().uploaded().targets(), "data.uploaded.targets",
                                       spec, &spec.upload.targets_dtype, &targets));
      if (inputs != targets) {
        return absl::InvalidArgumentError(absl::StrCat("data.uploaded.targets.shape: ", targets,
                                                       " sequences for ", inputs, " inputs"));
      }
      spec.upload.num_sequences = inputs;
      break;
    }
    default:
      return absl::InvalidArgumentError("data: set synthetic or uploaded");
  }

  int64_t total = 0;
  const std::vector<attn::layers::ParamSlot> slots = attn::layers::LayerParams(spec.layer, &total);
  for (const v1::NamedTensor& named : wire.initial_weights()) {
    const std::string field = absl::StrCat("initial_weights[", named.name(), "]");
    const attn::layers::ParamSlot* slot = nullptr;
    for (const attn::layers::ParamSlot& s : slots) slot = s.name == named.name() ? &s : slot;
    if (slot == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": not a weight of this layer (w_q, w_k, w_v, w_o",
                       spec.layer.layer_norm ? ", ln_gain, ln_bias)" : ")"));
    }
    const v1::Tensor& t = named.tensor();
    const bool vector = slot->rows == 1;
    const bool shape_ok =
        vector ? (t.shape_size() == 1 && t.shape(0) == slot->cols)
               : (t.shape_size() == 2 && t.shape(0) == slot->rows && t.shape(1) == slot->cols);
    if (!shape_ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape: ", ShapeString(t.shape()), " (expected ",
                       vector ? absl::StrCat("[", slot->cols, "]")
                              : absl::StrCat("[", slot->rows, ", ", slot->cols, "]"),
                       ")"));
    }
    ATTN_ASSIGN_OR_RETURN(const attn::DType dtype,
                          DTypeOf(t.dtype(), absl::StrCat(field, ".dtype").c_str(), false));
    ATTN_ASSIGN_OR_RETURN(
        spec.initial_weights[named.name()],
        UploadedValues(t.data(), dtype, slot->size() * attn::DTypeSize(dtype), field.c_str()));
  }
  ATTN_RETURN_IF_ERROR(ValidateSpec(spec));
  return spec;
}

v1::TrainingJobSpec WithoutData(const v1::TrainingJobSpec& wire) {
  v1::TrainingJobSpec out = wire;
  if (out.data().has_uploaded()) {
    out.mutable_data()->mutable_uploaded()->mutable_inputs()->clear_data();
    out.mutable_data()->mutable_uploaded()->mutable_targets()->clear_data();
  }
  return out;
}

int64_t InputsBytes(const TrainingSpec& spec) {
  return spec.upload.num_sequences * spec.seqlen * spec.layer.model_dim *
         attn::DTypeSize(spec.upload.inputs_dtype);
}

int64_t TargetsBytes(const TrainingSpec& spec) {
  return spec.upload.num_sequences * spec.seqlen * spec.layer.model_dim *
         attn::DTypeSize(spec.upload.targets_dtype);
}

absl::StatusOr<std::vector<float>> UploadedValues(const std::string& bytes, attn::DType dtype,
                                                  int64_t expected_bytes, const char* field) {
  if (static_cast<int64_t>(bytes.size()) != expected_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", bytes.size(), " bytes arrived; its shape and dtype (",
                     std::string(attn::DTypeName(dtype)), ") take ", expected_bytes));
  }
  const int64_t n = expected_bytes / attn::DTypeSize(dtype);
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = attn::LoadAsFloat(bytes.data(), dtype, i);
  return values;
}

v1::TrainingJobState StateToProto(JobState state) {
  switch (state) {
    case JobState::kQueued:
      return v1::TRAINING_JOB_QUEUED;
    case JobState::kRunning:
      return v1::TRAINING_JOB_RUNNING;
    case JobState::kSucceeded:
      return v1::TRAINING_JOB_SUCCEEDED;
    case JobState::kFailed:
      return v1::TRAINING_JOB_FAILED;
    case JobState::kCancelled:
      return v1::TRAINING_JOB_CANCELLED;
  }
  return v1::TRAINING_JOB_STATE_UNSPECIFIED;
}

v1::TrainingJob JobToProto(const Job& job) {
  v1::TrainingJob out;
  out.set_job_id(job.id);
  out.set_display_name(job.spec.display_name.empty() ? job.wire_spec.display_name()
                                                     : job.spec.display_name);
  out.set_state(StateToProto(job.state));
  *out.mutable_progress() = ProgressToProto(job.progress);
  out.set_error(job.error);
  out.set_create_time_unix_micros(Micros(job.created));
  out.set_start_time_unix_micros(Micros(job.started));
  out.set_end_time_unix_micros(Micros(job.ended));
  out.set_resumed_from_step(job.resumed_from_step);
  out.set_checkpoint_step(job.checkpoint_step);
  out.set_forward_engine(job.forward_engine);
  out.set_backward_engine(job.backward_engine);
  out.set_deterministic(job.deterministic);
  *out.mutable_spec() = job.wire_spec;
  out.mutable_spec()->clear_initial_weights();  // bulky, and the client has them
  return out;
}

v1::TrainingResult ResultToProto(const Job& job) {
  v1::TrainingResult out;
  out.set_job_id(job.id);
  out.set_state(StateToProto(job.state));
  *out.mutable_progress() = ProgressToProto(job.progress);
  std::vector<float> flat;
  if (!job.spec_valid) {
    // Nothing to return: the spec never described a layer.
  } else if (job.final_state.has_value()) {
    flat = job.final_state->weights;
  } else {
    flat = attn::layers::InitialWeights(job.spec.layer, job.spec.seed);
    for (const attn::layers::ParamSlot& slot : attn::layers::LayerParams(job.spec.layer)) {
      auto it = job.spec.initial_weights.find(slot.name);
      if (it != job.spec.initial_weights.end()) {
        std::copy(it->second.begin(), it->second.end(), flat.begin() + slot.offset);
      }
    }
  }
  for (const attn::layers::ParamSlot& slot : attn::layers::LayerParams(job.spec.layer)) {
    if (!job.spec_valid) break;
    v1::NamedTensor* named = out.add_weights();
    named->set_name(slot.name);
    v1::Tensor* t = named->mutable_tensor();
    t->set_dtype(v1::DTYPE_FLOAT32);
    if (slot.rows > 1) t->add_shape(slot.rows);
    t->add_shape(slot.cols);
    if (static_cast<int64_t>(flat.size()) >= slot.offset + slot.size()) {
      t->set_data(reinterpret_cast<const char*>(flat.data() + slot.offset),
                  slot.size() * sizeof(float));
    }
  }
  out.mutable_loss_curve_steps()->Add(job.curve.steps.begin(), job.curve.steps.end());
  out.mutable_loss_curve()->Add(job.curve.loss.begin(), job.curve.loss.end());
  out.mutable_eval_curve()->Add(job.curve.metric.begin(), job.curve.metric.end());
  return out;
}

JobRecord RecordOf(const Job& job, const TrainerState* state, bool with_moments) {
  JobRecord r;
  r.set_job_id(job.id);
  r.set_owner(job.owner.name);
  *r.mutable_spec() = job.wire_spec;
  r.set_state(StateToProto(job.state));
  r.set_error(job.error);
  r.set_create_time_unix_micros(Micros(job.created));
  r.set_start_time_unix_micros(Micros(job.started));
  r.set_end_time_unix_micros(Micros(job.ended));
  r.set_forward_engine(job.forward_engine);
  r.set_backward_engine(job.backward_engine);
  r.set_deterministic(job.deterministic);
  r.set_resumed_from_step(job.resumed_from_step);
  *r.mutable_progress() = ProgressToProto(job.progress);
  if (state != nullptr) {
    r.set_step(state->step);
    r.set_weights(Floats(state->weights));
    if (with_moments) {
      r.set_adam_m(Floats(state->optimizer.m));
      r.set_adam_v(Floats(state->optimizer.v));
    }
    r.set_optimizer_updates(state->optimizer.updates);
    r.set_loss_scale(state->optimizer.loss_scale);
    r.set_loss_scale_clean_steps(state->optimizer.clean_steps);
  }
  // The curve up to the state's step: a resumed run redoes the steps after it.
  const int64_t last = state != nullptr ? state->step : 0;
  for (size_t i = 0; i < job.curve.steps.size() && job.curve.steps[i] <= last; ++i) {
    r.add_curve_steps(job.curve.steps[i]);
    r.add_curve_loss(job.curve.loss[i]);
    r.add_curve_metric(job.curve.metric[i]);
  }
  r.set_curve_stride(job.curve.stride);
  return r;
}

std::shared_ptr<Job> JobFromRecord(const JobRecord& r) {
  auto job = std::make_shared<Job>();
  job->id = r.job_id();
  job->owner.name = r.owner();
  job->wire_spec = r.spec();
  job->uploaded = r.spec().data().has_uploaded();
  job->state = StateFromProto(r.state());
  job->error = r.error();
  job->created = FromMicros(r.create_time_unix_micros());
  job->started = FromMicros(r.start_time_unix_micros());
  job->ended = FromMicros(r.end_time_unix_micros());
  job->progress = ProgressFromProto(r.progress());
  job->forward_engine = r.forward_engine();
  job->backward_engine = r.backward_engine();
  job->deterministic = r.deterministic();
  job->resumed_from_step = r.resumed_from_step();
  job->curve.steps.assign(r.curve_steps().begin(), r.curve_steps().end());
  job->curve.loss.assign(r.curve_loss().begin(), r.curve_loss().end());
  job->curve.metric.assign(r.curve_metric().begin(), r.curve_metric().end());
  job->curve.stride = std::max<int64_t>(r.curve_stride(), 1);
  if (r.step() > 0 || !r.weights().empty()) {
    TrainerState state;
    state.step = r.step();
    state.weights = FloatsOf(r.weights());
    state.optimizer.m = FloatsOf(r.adam_m());
    state.optimizer.v = FloatsOf(r.adam_v());
    state.optimizer.updates = r.optimizer_updates();
    state.optimizer.loss_scale = r.loss_scale();
    state.optimizer.clean_steps = r.loss_scale_clean_steps();
    job->checkpoint_step = state.step;
    if (Finished(job->state)) {
      job->final_state = std::move(state);
    } else {
      job->state_on_disk = std::move(state);
    }
  }
  absl::StatusOr<TrainingSpec> spec = SpecFromProto(r.spec());
  if (spec.ok()) {
    job->spec = *std::move(spec);
    job->spec_valid = true;
  } else if (!Finished(job->state)) {
    job->state = JobState::kFailed;
    job->error = absl::StrCat("cannot resume after the restart: ", spec.status().message());
  }
  if (!Finished(job->state)) {
    job->state = JobState::kQueued;
    job->progress.step = job->checkpoint_step;
    job->progress.tokens_per_second = 0;
    job->progress.eta_seconds = 0;
  }
  return job;
}

}  // namespace attnserve::training
