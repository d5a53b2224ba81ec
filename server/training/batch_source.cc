#include "server/training/batch_source.h"

#include <cmath>
#include <numeric>

namespace attnserve::training {
namespace {

using attn::layers::Random;

// Streams of the task seed, one per table, and the stream base of the steps.
enum Stream : uint64_t { kKeys = 1, kAnswers, kQueries, kPositions, kMarker, kSteps = 1 << 20 };

std::vector<float> Table(uint64_t seed, uint64_t stream, int64_t rows, int dim) {
  Random random(seed, stream);
  std::vector<float> t(rows * dim);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  for (float& v : t) v = static_cast<float>(scale * random.Normal());
  return t;
}

}  // namespace

SyntheticTask::SyntheticTask(const TrainingSpec& spec)
    : task_(spec.synthetic),
      batch_size_(spec.batch_size),
      seqlen_(spec.seqlen),
      model_dim_(spec.layer.model_dim) {
  const int d = model_dim_, v = task_.vocab_size;
  answers_ = Table(task_.seed, kAnswers, v, d);
  const auto append = [&](const std::vector<float>& rows) {
    const auto first = static_cast<int32_t>(table_.size() / d);
    table_.insert(table_.end(), rows.begin(), rows.end());
    return first;
  };
  if (task_.kind == TaskKind::kAssociativeRecall) {
    keys_ = append(Table(task_.seed, kKeys, v, d));
    values_ = append(answers_);
    queries_ = append(Table(task_.seed, kQueries, v, d));
  } else {
    tokens_ = append(answers_);
    positions_ = append(Table(task_.seed, kPositions, seqlen_, d));
    marker_ = append(Table(task_.seed, kMarker, 1, d));
  }
}

void SyntheticTask::FillRows(int64_t step, RowBatch* batch) {
  const int64_t tokens = int64_t{batch_size_} * seqlen_;
  batch->row_ids.assign(tokens * kRowsPerToken, -1);
  batch->labels.assign(tokens, -1);
  for (int b = 0; b < batch_size_; ++b) {
    Random random(task_.seed, kSteps + static_cast<uint64_t>(step) * batch_size_ + b);
    int32_t* rows = batch->row_ids.data() + int64_t{b} * seqlen_ * kRowsPerToken;
    int32_t* labels = batch->labels.data() + int64_t{b} * seqlen_;
    if (task_.kind == TaskKind::kAssociativeRecall) {
      FillRecall(random, rows, labels);
    } else {
      FillCopy(random, rows, labels);
    }
  }
}

void SyntheticTask::Fill(int64_t step, HostBatch* batch) {
  RowBatch rows;
  FillRows(step, &rows);
  const int64_t tokens = int64_t{batch_size_} * seqlen_;
  batch->inputs.assign(tokens * model_dim_, 0.f);
  for (int64_t t = 0; t < tokens; ++t) {
    float* x = batch->inputs.data() + t * model_dim_;
    for (int j = 0; j < kRowsPerToken; ++j) {
      const int32_t id = rows.row_ids[t * kRowsPerToken + j];
      if (id < 0) continue;
      const float* r = table_.data() + int64_t{id} * model_dim_;
      for (int c = 0; c < model_dim_; ++c) x[c] += r[c];
    }
  }
  batch->labels = std::move(rows.labels);
  batch->targets.clear();
}

void SyntheticTask::FillRecall(Random& random, int32_t* rows, int32_t* labels) const {
  const int pairs = seqlen_ / 2;
  std::vector<int32_t> keys(task_.vocab_size);
  std::iota(keys.begin(), keys.end(), 0);
  for (int i = 0; i < pairs; ++i) {  // the first `pairs` of a partial Fisher-Yates shuffle
    std::swap(keys[i], keys[i + random.Below(task_.vocab_size - i)]);
  }
  std::vector<int32_t> values(pairs);
  for (int i = 0; i < pairs; ++i) {
    values[i] = static_cast<int32_t>(random.Below(task_.vocab_size));
    rows[i * kRowsPerToken] = keys_ + keys[i];
    rows[i * kRowsPerToken + 1] = values_ + values[i];
  }
  for (int t = pairs; t < seqlen_; ++t) {
    const int j = static_cast<int>(random.Below(pairs));
    rows[t * kRowsPerToken] = queries_ + keys[j];
    labels[t] = values[j];
  }
}

void SyntheticTask::FillCopy(Random& random, int32_t* rows, int32_t* labels) const {
  const int prompt = seqlen_ / 2;
  std::vector<int32_t> tokens(prompt);
  for (int t = 0; t < seqlen_; ++t) {
    rows[int64_t{t} * kRowsPerToken] = positions_ + t;
    if (t < prompt) {
      tokens[t] = static_cast<int32_t>(random.Below(task_.vocab_size));
      rows[int64_t{t} * kRowsPerToken + 1] = tokens_ + tokens[t];
    } else {
      rows[int64_t{t} * kRowsPerToken + 1] = marker_;
      labels[t] = t - prompt < prompt ? tokens[t - prompt] : -1;
    }
  }
}

UploadedDataset::UploadedDataset(const TrainingSpec& spec, std::vector<float> inputs,
                                 std::vector<float> targets)
    : batch_size_(spec.batch_size),
      sequence_values_(int64_t{spec.seqlen} * spec.layer.model_dim),
      num_sequences_(spec.upload.num_sequences),
      seed_(spec.seed),
      inputs_(std::move(inputs)),
      targets_(std::move(targets)) {}

const std::vector<int64_t>& UploadedDataset::Epoch(int64_t epoch) {
  if (epoch != epoch_) {
    order_.resize(num_sequences_);
    std::iota(order_.begin(), order_.end(), 0);
    Random random(seed_, kSteps + static_cast<uint64_t>(epoch));
    for (int64_t i = num_sequences_ - 1; i > 0; --i) {
      std::swap(order_[i], order_[random.Below(i + 1)]);
    }
    epoch_ = epoch;
  }
  return order_;
}

void UploadedDataset::Fill(int64_t step, HostBatch* batch) {
  batch->inputs.resize(batch_size_ * sequence_values_);
  batch->targets.resize(batch_size_ * sequence_values_);
  batch->labels.clear();
  for (int b = 0; b < batch_size_; ++b) {
    const int64_t index = (step - 1) * batch_size_ + b;
    const int64_t sequence = Epoch(index / num_sequences_)[index % num_sequences_];
    std::copy_n(inputs_.begin() + sequence * sequence_values_, sequence_values_,
                batch->inputs.begin() + b * sequence_values_);
    std::copy_n(targets_.begin() + sequence * sequence_values_, sequence_values_,
                batch->targets.begin() + b * sequence_values_);
  }
}

}  // namespace attnserve::training
