// Where a step's batch comes from: a synthetic task drawn from (seed, step), or uploaded
// sequences in a seeded order. Either way a step's batch depends only on the spec and the step
// number, so a job resumed from a checkpoint sees exactly the batches it would have seen.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "layers/random.h"
#include "server/training/training_spec.h"

namespace attnserve::training {

// One step's batch on the host, batch_size * seqlen tokens.
struct HostBatch {
  std::vector<float> inputs;    // [tokens, model_dim]
  std::vector<int32_t> labels;  // classification: the answer per token, -1 where unscored
  std::vector<float> targets;   // regression: [tokens, model_dim]
};

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Classification against class_embeddings() (a synthetic task), or regression.
  virtual bool classification() const = 0;
  // [classes, model_dim]; empty for regression.
  virtual const std::vector<float>& class_embeddings() const = 0;
  // The batch of step `step` (1-based). Thread-compatible.
  virtual void Fill(int64_t step, HostBatch* batch) = 0;
};

// The built-in tasks (training.proto's SyntheticTaskKind says what each asks). Embeddings are
// N(0, 1 / model_dim) rows drawn from the task seed.
class SyntheticTask final : public BatchSource {
 public:
  SyntheticTask(const TrainingSpec& spec);

  bool classification() const override { return true; }
  const std::vector<float>& class_embeddings() const override { return answers_; }
  void Fill(int64_t step, HostBatch* batch) override;

 private:
  void FillRecall(attn::layers::Random& random, float* x, int32_t* labels) const;
  void FillCopy(attn::layers::Random& random, float* x, int32_t* labels) const;
  void Add(const std::vector<float>& table, int64_t row, float* x) const;

  const SyntheticTaskSpec task_;
  const int batch_size_, seqlen_, model_dim_;
  // Recall: keys_, answers_ (values) and queries_; copy: answers_ (tokens), positions_ and
  // marker_ (the answer positions' input beside their position).
  std::vector<float> keys_, answers_, queries_, positions_, marker_;
};

// Uploaded sequences, held as float32 [num_sequences, seqlen, model_dim] for inputs and targets.
// Step s takes sequences (s - 1) * batch_size ... s * batch_size - 1 of an endless stream of
// epochs, each a permutation of every sequence drawn from (seed, epoch).
class UploadedDataset final : public BatchSource {
 public:
  UploadedDataset(const TrainingSpec& spec, std::vector<float> inputs, std::vector<float> targets);

  bool classification() const override { return false; }
  const std::vector<float>& class_embeddings() const override { return none_; }
  void Fill(int64_t step, HostBatch* batch) override;

 private:
  const std::vector<int64_t>& Epoch(int64_t epoch);

  const int batch_size_;
  const int64_t sequence_values_;  // seqlen * model_dim
  const int64_t num_sequences_;
  const uint64_t seed_;
  const std::vector<float> inputs_, targets_, none_;
  int64_t epoch_ = -1;
  std::vector<int64_t> order_;
};

}  // namespace attnserve::training
