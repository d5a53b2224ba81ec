// What a training job is, in the server's own terms (the service converts from the protobuf
// spec at its edge): the layer, the data, the optimiser, the sizes. Validation names the field
// that is wrong, in the protobuf's spelling, so a FAILED job says what to change.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "attn/dtype.h"
#include "layers/attention_layer.h"
#include "layers/optimizer.h"

namespace attnserve::training {

enum class TaskKind : uint8_t { kAssociativeRecall, kCopy };

struct SyntheticTaskSpec {
  TaskKind kind = TaskKind::kAssociativeRecall;
  int vocab_size = 16;
  uint64_t seed = 0;
};

// Uploaded sequences: shapes and dtypes as declared (the bytes live in an UploadedDataset).
struct UploadSpec {
  attn::DType inputs_dtype = attn::DType::kF32;
  attn::DType targets_dtype = attn::DType::kF32;
  int64_t num_sequences = 0;
};

enum class DataSource : uint8_t { kSynthetic, kUploaded };

// Which engines run attention (the protobuf's Path).
enum class EnginePath : uint8_t { kAuto, kFused, kNaive, kCpu };

struct TrainingSpec {
  std::string display_name;
  attn::layers::LayerConfig layer;  // layer.dtype is the compute dtype
  DataSource source = DataSource::kSynthetic;
  SyntheticTaskSpec synthetic;
  UploadSpec upload;
  attn::layers::OptimizerConfig optimizer;  // optimizer.total_steps = steps
  int batch_size = 8;
  int seqlen = 32;
  int64_t steps = 100;
  uint64_t seed = 0;
  EnginePath path = EnginePath::kAuto;
  int checkpoint_every = 0;    // 0: the server's default
  bool deterministic = false;  // every backward pass bit-identical across runs
  // Named float32 tensors replacing the seeded initialisation (w_q, ..., ln_bias).
  std::map<std::string, std::vector<float>> initial_weights;
};

inline constexpr int64_t kMaxSteps = int64_t{1} << 40;
inline constexpr int kMaxVocab = 1 << 16;

// Everything about the spec that does not need the data's bytes.
absl::Status ValidateSpec(const TrainingSpec& spec);

std::string_view TaskName(TaskKind kind);
std::string_view EnginePathName(EnginePath path);

}  // namespace attnserve::training
