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

// Rows of row_table() each token's input sums (RowBatch).
inline constexpr int kRowsPerToken = 2;

// One step's batch of a source whose inputs are sums of rows of a fixed table: token t's input
// is row_ids[t * kRowsPerToken + j] of row_table() summed over j in order (float32, from zero;
// a negative id adds nothing). HostBatch::inputs holds exactly these sums; this form is what
// the trainer sends to the device (8 bytes a token instead of 4 * model_dim).
struct RowBatch {
  std::vector<int32_t> row_ids;  // [tokens, kRowsPerToken]
  std::vector<int32_t> labels;   // as HostBatch::labels
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

  // Sources whose inputs are sums of table rows: the table, [rows, model_dim] float32; null for
  // the others, which have no FillRows.
  virtual const std::vector<float>* row_table() const { return nullptr; }
  // The batch of step `step` as rows of row_table() (Fill's batch, inputs unsummed).
  virtual void FillRows(int64_t /*step*/, RowBatch* /*batch*/) {}
};

// The built-in tasks (training.proto's SyntheticTaskKind says what each asks). Embeddings are
// N(0, 1 / model_dim) rows drawn from the task seed.
class SyntheticTask final : public BatchSource {
 public:
  SyntheticTask(const TrainingSpec& spec);

  bool classification() const override { return true; }
  const std::vector<float>& class_embeddings() const override { return answers_; }
  void Fill(int64_t step, HostBatch* batch) override;
  const std::vector<float>* row_table() const override { return &table_; }
  void FillRows(int64_t step, RowBatch* batch) override;

 private:
  // One sequence's row ids ([seqlen, kRowsPerToken], preset to -1) and labels.
  void FillRecall(attn::layers::Random& random, int32_t* rows, int32_t* labels) const;
  void FillCopy(attn::layers::Random& random, int32_t* rows, int32_t* labels) const;

  const SyntheticTaskSpec task_;
  const int batch_size_, seqlen_, model_dim_;
  // The class embeddings: recall's values, copy's tokens.
  std::vector<float> answers_;
  // Every row an input sums, table by table. Recall: keys, answers (values), queries; copy:
  // answers (tokens), positions, marker (the answer positions' input beside their position).
  // The int32 members hold each table's first row in it.
  std::vector<float> table_;
  int32_t keys_ = 0, values_ = 0, queries_ = 0, tokens_ = 0, positions_ = 0, marker_ = 0;
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
