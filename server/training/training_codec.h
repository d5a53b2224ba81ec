// The protobuf edge of training jobs: the wire spec into a TrainingSpec (naming the field that is
// wrong), jobs and results into their messages, and jobs to and from their on-disk records.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "attnserve/v1/training.pb.h"
#include "server/training/checkpoint.pb.h"
#include "server/training/training_job.h"

namespace attnserve::training {

absl::StatusOr<TrainingSpec> SpecFromProto(const v1::TrainingJobSpec& wire);

// The spec less the uploaded tensors' bytes (kept apart, in inputs.bin and targets.bin).
v1::TrainingJobSpec WithoutData(const v1::TrainingJobSpec& wire);

// Bytes the uploaded tensors' declared shapes and dtypes take (spec.source == kUploaded).
int64_t InputsBytes(const TrainingSpec& spec);
int64_t TargetsBytes(const TrainingSpec& spec);

// Uploaded bytes as float32, after checking their length against the spec; `field` names the
// tensor in errors.
absl::StatusOr<std::vector<float>> UploadedValues(const std::string& bytes, attn::DType dtype,
                                                  int64_t expected_bytes, const char* field);

// Read under the registry's lock.
v1::TrainingJob JobToProto(const Job& job);
v1::TrainingResult ResultToProto(const Job& job);
v1::TrainingJobState StateToProto(JobState state);

// The job's record; `state` (null: none yet) supplies step, weights and, with `with_moments`,
// the optimiser's moments. Read under the registry's lock.
JobRecord RecordOf(const Job& job, const TrainerState* state, bool with_moments);
// A job from its record: unfinished jobs come back QUEUED with the record's state to resume
// from. A record whose spec no longer parses comes back FAILED, saying why.
std::shared_ptr<Job> JobFromRecord(const JobRecord& record);

}  // namespace attnserve::training
