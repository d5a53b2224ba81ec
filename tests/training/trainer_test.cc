// The training core without the server: the layer's gradients against float64 finite
// differences, a synthetic task learnt, a resumed run identical to an unbroken one, and a
// diverging run stopped. The server tests (training_server_test.cc) repeat the first three
// through the real binary.
#include "server/training/trainer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "layers/layer_ops.h"
#include "layers/random.h"
#include "tests/training/layer_reference.h"

namespace attnserve::training {
namespace {

TrainingSpec SmallSpec() {
  TrainingSpec spec;
  spec.layer.model_dim = 8;
  spec.layer.num_heads = 2;
  spec.layer.num_kv_heads = 1;
  spec.layer.head_dim = 4;
  spec.layer.causal = true;
  spec.synthetic.vocab_size = 4;
  spec.synthetic.seed = 11;
  spec.batch_size = 2;
  spec.seqlen = 7;
  spec.steps = 1;
  spec.seed = 5;
  spec.path = EnginePath::kCpu;
  spec.optimizer.kind = attn::layers::OptimizerKind::kSgd;
  spec.optimizer.learning_rate = 1.f;
  return spec;
}

std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// One SGD step of learning rate 1 from w0 leaves w0 - g: the gradient the trainer applied.
void ExpectGradientsMatch(const TrainingSpec& spec, BatchSource* data) {
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(spec, data, {});
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  absl::StatusOr<TrainerState> before = (*trainer)->Save();
  ASSERT_TRUE(before.ok()) << before.status();
  absl::StatusOr<StepStats> stats = (*trainer)->Step();
  ASSERT_TRUE(stats.ok()) << stats.status();
  absl::StatusOr<TrainerState> after = (*trainer)->Save();
  ASSERT_TRUE(after.ok()) << after.status();

  testing::ReferenceProblem problem;
  problem.layer = spec.layer;
  problem.batch = spec.batch_size;
  problem.seqlen = spec.seqlen;
  HostBatch batch;
  data->Fill(1, &batch);
  problem.inputs = ToDouble(batch.inputs);
  problem.labels = batch.labels;
  problem.class_embeddings = ToDouble(data->class_embeddings());
  problem.targets = ToDouble(batch.targets);
  const std::vector<double> w0 = ToDouble(before->weights);
  EXPECT_NEAR(stats->loss, testing::ReferenceLoss(problem, w0), 1e-5 * std::abs(stats->loss));

  const std::vector<int64_t> indices = testing::ParameterIndices(spec.layer);
  const std::vector<double> expected = testing::FiniteDifferences(problem, w0, indices);
  double scale = 0, worst = 0;
  for (double g : expected) scale = std::max(scale, std::abs(g));
  ASSERT_GT(scale, 1e-4);
  for (size_t i = 0; i < indices.size(); ++i) {
    const double got = before->weights[indices[i]] - after->weights[indices[i]];
    worst = std::max(worst, std::abs(got - expected[i]));
  }
  // float32 products of a few terms each: errors near 1e-6 of the largest slope.
  EXPECT_LT(worst, 1e-4 * scale) << "largest |dL/dw| " << scale;
}

TEST(TrainerGradients, CausalGqaClassification) {
  TrainingSpec spec = SmallSpec();
  SyntheticTask task(spec);
  ExpectGradientsMatch(spec, &task);
}

TEST(TrainerGradients, ResidualLayerNormCopyTask) {
  TrainingSpec spec = SmallSpec();
  spec.layer.residual = true;
  spec.layer.layer_norm = true;
  spec.synthetic.kind = TaskKind::kCopy;
  SyntheticTask task(spec);
  ExpectGradientsMatch(spec, &task);
}

TEST(TrainerGradients, WindowedRegression) {
  TrainingSpec spec = SmallSpec();
  spec.layer.causal = false;
  spec.layer.window_left = 2;
  spec.layer.window_right = 1;
  spec.layer.num_kv_heads = 2;
  spec.layer.layer_norm = true;
  spec.source = DataSource::kUploaded;
  spec.upload.num_sequences = 3;
  const int64_t values = spec.upload.num_sequences * spec.seqlen * spec.layer.model_dim;
  std::vector<float> inputs(values), targets(values);
  attn::layers::Random random(3);
  for (float& x : inputs) x = static_cast<float>(random.Normal());
  for (float& x : targets) x = static_cast<float>(random.Normal());
  UploadedDataset data(spec, inputs, targets);
  ExpectGradientsMatch(spec, &data);
}

// The trainer sends synthetic batches as row ids and sums them on the device (SumRows): the
// sums must be Fill's inputs bit for bit, in float32 and rounded to 16 bits, on every ops this
// build can run; ids outside the table add nothing.
TEST(SyntheticRows, SummedRowsAreTheDenseBatch) {
  std::vector<attn::MemorySpace> spaces{attn::MemorySpace::kHost};
  if (attn::layers::CreateLayerOps(attn::MemorySpace::kDevice).ok()) {
    spaces.push_back(attn::MemorySpace::kDevice);
  }
  for (const TaskKind kind : {TaskKind::kAssociativeRecall, TaskKind::kCopy}) {
    for (const attn::MemorySpace space : spaces) {
      for (const attn::DType dtype : {attn::DType::kF32, attn::DType::kBF16}) {
        SCOPED_TRACE(absl::StrCat(std::string(TaskName(kind)), " ",
                                  space == attn::MemorySpace::kHost ? "host" : "device", " ",
                                  std::string(attn::DTypeName(dtype))));
        TrainingSpec spec = SmallSpec();
        spec.synthetic.kind = kind;
        spec.synthetic.vocab_size = 5;
        spec.layer.model_dim = 37;  // no multiple of a vector width
        spec.batch_size = 3;
        spec.seqlen = 9;
        SyntheticTask task(spec);
        HostBatch dense;
        task.Fill(4, &dense);
        RowBatch rows;
        task.FillRows(4, &rows);
        ASSERT_EQ(rows.labels, dense.labels);
        const std::vector<float>& table = *task.row_table();
        const int64_t cols = spec.layer.model_dim;
        const int64_t table_rows = static_cast<int64_t>(table.size()) / cols;
        const int64_t tokens = int64_t{spec.batch_size} * spec.seqlen;
        ASSERT_EQ(static_cast<int64_t>(rows.row_ids.size()), tokens * kRowsPerToken);
        // Token 0's second row out of range both ways: token 0 then sums its first row alone.
        std::vector<int32_t> ids = rows.row_ids;
        ids[1] = static_cast<int32_t>(table_rows);
        std::vector<float> expected = dense.inputs;
        for (int64_t c = 0; c < cols; ++c) expected[c] = 0.f + table[ids[0] * cols + c];
        ids[kRowsPerToken + 1] = -7;
        for (int64_t c = 0; c < cols; ++c) {
          expected[cols + c] = 0.f + table[int64_t{ids[kRowsPerToken]} * cols + c];
        }

        auto ops = attn::layers::CreateLayerOps(space);
        ASSERT_TRUE(ops.ok()) << ops.status();
        const int64_t bytes = tokens * cols * attn::DTypeSize(dtype);
        auto table_buf = (*ops)->Allocate(static_cast<int64_t>(table.size()) * 4);
        auto ids_buf = (*ops)->Allocate(static_cast<int64_t>(ids.size()) * 4);
        auto out_buf = (*ops)->Allocate(bytes);
        auto want_f32 = (*ops)->Allocate(tokens * cols * 4);
        auto want_buf = (*ops)->Allocate(bytes);
        ASSERT_TRUE(table_buf.ok() && ids_buf.ok() && out_buf.ok() && want_f32.ok() &&
                    want_buf.ok());
        ASSERT_TRUE(
            (*ops)
                ->Upload(table_buf->data(), table.data(), static_cast<int64_t>(table.size()) * 4)
                .ok());
        ASSERT_TRUE(
            (*ops)->Upload(ids_buf->data(), ids.data(), static_cast<int64_t>(ids.size()) * 4).ok());
        ASSERT_TRUE((*ops)->Upload(want_f32->data(), expected.data(), tokens * cols * 4).ok());
        // Poisoned: every output byte must be written.
        const std::vector<unsigned char> poison(bytes, 0xff);
        ASSERT_TRUE((*ops)->Upload(out_buf->data(), poison.data(), bytes).ok());
        ASSERT_TRUE((*ops)
                        ->SumRows(table_buf->as<const float>(), table_rows, cols,
                                  ids_buf->as<const int32_t>(), kRowsPerToken, tokens,
                                  out_buf->data(), dtype)
                        .ok());
        ASSERT_TRUE((*ops)
                        ->Convert(want_f32->data(), attn::DType::kF32, want_buf->data(), dtype,
                                  tokens * cols)
                        .ok());
        std::vector<unsigned char> got(bytes), want(bytes);
        ASSERT_TRUE((*ops)->Download(got.data(), out_buf->data(), bytes).ok());
        ASSERT_TRUE((*ops)->Download(want.data(), want_buf->data(), bytes).ok());
        EXPECT_EQ(got, want);
      }
    }
  }
}

// The recall task of the server test, at the threshold it uses (docs/training.md).
TEST(TrainerLearns, AssociativeRecall) {
  TrainingSpec spec;
  spec.layer.model_dim = 64;
  spec.layer.num_heads = 4;
  spec.layer.num_kv_heads = 2;
  spec.layer.head_dim = 16;
  spec.layer.causal = true;
  spec.layer.residual = true;
  spec.layer.layer_norm = true;
  spec.synthetic.vocab_size = 16;
  spec.batch_size = 16;
  spec.seqlen = 32;
  spec.steps = 150;
  spec.optimizer.learning_rate = 1e-2f;
  SyntheticTask task(spec);
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(spec, &task, {});
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  std::vector<double> losses;
  for (int64_t i = 0; i < spec.steps; ++i) {
    absl::StatusOr<StepStats> stats = (*trainer)->Step();
    ASSERT_TRUE(stats.ok()) << stats.status();
    losses.push_back(stats->loss);
  }
  const double last10 = std::accumulate(losses.end() - 10, losses.end(), 0.0) / 10;
  EXPECT_GT(losses.front(), 2.0);  // chance is ln 16 = 2.77
  EXPECT_LT(last10, 0.1);
}

TEST(TrainerResume, RestoredRunMatchesUnbrokenRun) {
  TrainingSpec spec = SmallSpec();
  spec.optimizer.kind = attn::layers::OptimizerKind::kAdamW;
  spec.optimizer.learning_rate = 1e-2f;
  spec.optimizer.schedule = attn::layers::Schedule::kCosine;
  spec.optimizer.warmup_steps = 3;
  spec.optimizer.weight_decay = 0.1f;
  spec.optimizer.max_grad_norm = 0.5f;
  spec.layer.dtype = attn::DType::kF16;
  spec.steps = 20;
  SyntheticTask task(spec);
  absl::StatusOr<std::unique_ptr<Trainer>> straight = Trainer::Create(spec, &task, {});
  ASSERT_TRUE(straight.ok()) << straight.status();
  for (int i = 0; i < 20; ++i) ASSERT_TRUE((*straight)->Step().ok());

  absl::StatusOr<std::unique_ptr<Trainer>> first = Trainer::Create(spec, &task, {});
  ASSERT_TRUE(first.ok());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE((*first)->Step().ok());
  absl::StatusOr<TrainerState> checkpoint = (*first)->Save();
  ASSERT_TRUE(checkpoint.ok());
  absl::StatusOr<std::unique_ptr<Trainer>> resumed = Trainer::Create(spec, &task, {});
  ASSERT_TRUE(resumed.ok());
  ASSERT_TRUE((*resumed)->Restore(*checkpoint).ok());
  for (int i = 0; i < 12; ++i) ASSERT_TRUE((*resumed)->Step().ok());
  EXPECT_EQ((*resumed)->step(), 20);
  EXPECT_EQ((*resumed)->Save()->weights, (*straight)->Save()->weights);
}

// spec.deterministic reaches the attention backward: runs on four CPU threads, whose sequences
// span four key blocks (dQ sums that race otherwise), end with the same weights bit for bit;
// TrainerOptions::deterministic_backward (the server's flag) does the same for a spec that does
// not ask.
TEST(TrainerDeterministic, RunsOnSeveralThreadsEndWithTheSameWeights) {
  TrainingSpec spec = SmallSpec();
  spec.layer.model_dim = 64;
  spec.layer.num_heads = 4;
  spec.layer.head_dim = 32;
  spec.synthetic.kind = TaskKind::kCopy;
  spec.seqlen = 512;
  spec.steps = 2;
  spec.optimizer.learning_rate = 0.1f;
  TrainerOptions options;
  options.cpu_threads = 4;
  auto run = [](const TrainingSpec& s, const TrainerOptions& o) {
    SyntheticTask task(s);
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(s, &task, o);
    EXPECT_TRUE(trainer.ok()) << trainer.status();
    if (!trainer.ok()) return std::vector<float>();
    EXPECT_TRUE((*trainer)->deterministic());
    for (int64_t i = 0; i < s.steps; ++i) EXPECT_TRUE((*trainer)->Step().ok());
    return (*trainer)->Save()->weights;
  };
  spec.deterministic = true;
  const std::vector<float> first = run(spec, options);
  for (int i = 1; i < 4; ++i) EXPECT_EQ(run(spec, options), first) << "run " << i;
  spec.deterministic = false;
  TrainerOptions forced = options;
  forced.deterministic_backward = true;
  EXPECT_EQ(run(spec, forced), first);
}

TEST(TrainerDiverges, NanLossStopsTheRun) {
  TrainingSpec spec = SmallSpec();
  spec.optimizer.kind = attn::layers::OptimizerKind::kAdamW;
  spec.optimizer.learning_rate = 1e20f;
  spec.steps = 200;
  SyntheticTask task(spec);
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(spec, &task, {});
  ASSERT_TRUE(trainer.ok());
  absl::Status failure;
  for (int i = 0; i < 200 && failure.ok(); ++i) failure = (*trainer)->Step().status();
  EXPECT_EQ(failure.code(), absl::StatusCode::kInvalidArgument) << failure;
  EXPECT_NE(failure.message().find("the loss is NaN; training stopped"), std::string::npos)
      << failure;
}

}  // namespace
}  // namespace attnserve::training
