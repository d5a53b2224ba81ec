// attn_train_step_bench: where one training step's time goes on the GPU (docs/training.md), for
// the associative-recall job of bench/training/gpu_train_check.sh (large by default), without
// the server around it. Three parts, each after a warm-up:
//   phases   one step cut at stream synchronisations, each phase's median over --steps:
//            the host work of the batch as the trainer did it before (fill 4 * model_dim bytes
//            a token, upload them pageable, convert) and as it does now (fill row ids, upload
//            8 bytes a token, sum the rows on the device), the labels, the layer's forward, the
//            objective, the backward, the optimiser; and two GEMMs of the step alone
//   trainer  Trainer::Step back to back (the server's step without its scheduler): tokens/s
//   before   the same steps with the batch made and uploaded as before (dense): tokens/s
//
//   attn_train_step_bench [--path=fused|naive] [--steps=30] [--model_dim=1024] [--num_heads=16]
//       [--num_kv_heads=4] [--head_dim=64] [--seqlen=1024] [--batch=16] [--vocab=512]
// Prints one JSON line per part, then a table.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attn/engine.h"
#include "layers/attention_layer.h"
#include "layers/layer_ops.h"
#include "layers/objective.h"
#include "layers/optimizer.h"
#include "server/training/batch_source.h"
#include "server/training/trainer.h"

namespace {

using attnserve::training::HostBatch;
using attnserve::training::kRowsPerToken;
using attnserve::training::RowBatch;
using attnserve::training::SyntheticTask;
using attnserve::training::Trainer;
using attnserve::training::TrainingSpec;
namespace layers = attn::layers;

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}
template <typename T>
T Take(absl::StatusOr<T> v, const char* what) {
  Check(v.status(), what);
  return *std::move(v);
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::map<std::string, std::string> Flags(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    const char* eq = std::strchr(a, '=');
    if (std::strncmp(a, "--", 2) != 0 || eq == nullptr) {
      std::fprintf(stderr, "usage: attn_train_step_bench [--name=value ...] (got %s)\n", a);
      std::exit(2);
    }
    flags[std::string(a + 2, eq)] = eq + 1;
  }
  return flags;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags = Flags(argc, argv);
  const auto flag = [&](const char* name, int fallback) {
    auto it = flags.find(name);
    return it == flags.end() ? fallback : std::atoi(it->second.c_str());
  };
  const std::string path = flags.count("path") ? flags["path"] : "fused";
  const int steps = flag("steps", 30);

  TrainingSpec spec;
  spec.layer.model_dim = flag("model_dim", 1024);
  spec.layer.num_heads = flag("num_heads", 16);
  spec.layer.num_kv_heads = flag("num_kv_heads", 4);
  spec.layer.head_dim = flag("head_dim", 64);
  spec.layer.causal = true;
  spec.layer.residual = true;
  spec.layer.layer_norm = true;
  spec.layer.dtype = attn::DType::kBF16;
  spec.synthetic.vocab_size = flag("vocab", 512);
  spec.synthetic.seed = 1;
  spec.batch_size = flag("batch", 16);
  spec.seqlen = flag("seqlen", 1024);
  spec.steps = 1 << 20;
  spec.seed = 2;
  spec.path = path == "naive" ? attnserve::training::EnginePath::kNaive
                              : attnserve::training::EnginePath::kFused;
  spec.optimizer.learning_rate = 3e-3f;
  SyntheticTask task(spec);
  const int64_t tokens = int64_t{spec.batch_size} * spec.seqlen;
  const int64_t d = spec.layer.model_dim;

  // Phases, on the layer pieces the trainer uses.
  std::unique_ptr<layers::LayerOps> ops =
      Take(layers::CreateLayerOps(attn::MemorySpace::kDevice), "ops");
  std::unique_ptr<attn::Engine> engine =
      Take(attn::CreateEngine(path == "naive" ? attn::EngineKind::kCudaNaive
                                              : attn::EngineKind::kCudaFused),
           "engine");
  std::unique_ptr<layers::AttentionLayer> layer =
      Take(layers::AttentionLayer::Create(spec.layer, spec.batch_size, spec.seqlen, ops.get(),
                                          engine.get(), engine.get()),
           "layer");
  std::unique_ptr<layers::ClassificationObjective> objective =
      Take(layers::ClassificationObjective::Create(ops.get(), tokens, d, task.class_embeddings()),
           "objective");
  layers::OptimizerConfig oc = spec.optimizer;
  oc.total_steps = spec.steps;
  std::unique_ptr<layers::Optimizer> optimizer = Take(
      layers::Optimizer::Create(oc, ops.get(), layer->params(), layer->num_weights()), "optimizer");
  const std::vector<float> w0 = layers::InitialWeights(spec.layer, spec.seed);
  Check(ops->Upload(layer->weights(), w0.data(), w0.size() * 4), "weights");
  const std::vector<float>& table = *task.row_table();
  layers::Buffer table_dev = Take(ops->Allocate(table.size() * 4), "table");
  Check(ops->Upload(table_dev.data(), table.data(), table.size() * 4), "table upload");
  layers::Buffer ids_dev = Take(ops->Allocate(tokens * kRowsPerToken * 4), "ids");
  layers::Buffer x32 = Take(ops->Allocate(tokens * d * 4), "x32");
  layers::Buffer x = Take(ops->Allocate(tokens * d * 2), "x");
  HostBatch dense;
  RowBatch rows;
  // The batch path Step had before: the dense inputs uploaded as float32, converted on the device.
  const auto upload_dense = [&] {
    Check(ops->Upload(x32.data(), dense.inputs.data(), tokens * d * 4), "upload");
    Check(ops->Convert(x32.data(), attn::DType::kF32, x.data(), attn::DType::kBF16, tokens * d),
          "convert");
  };

  std::map<std::string, std::vector<double>> times;
  bool rows_match_dense = false;
  const auto timed = [&](const char* name, const std::function<void()>& f) {
    const double t0 = Now();
    f();
    Check(ops->Synchronize(), name);
    times[name].push_back(Now() - t0);
  };
  for (int i = 0; i < steps + 3; ++i) {
    const int64_t step = i + 1;
    timed("host_fill_dense", [&] { task.Fill(step, &dense); });
    timed("upload_dense", upload_dense);
    timed("host_fill_rows", [&] { task.FillRows(step, &rows); });
    timed("upload_rows", [&] {
      Check(ops->Upload(ids_dev.data(), rows.row_ids.data(), tokens * kRowsPerToken * 4), "ids");
      Check(
          ops->SumRows(table_dev.as<float>(), static_cast<int64_t>(table.size()) / d, d,
                       ids_dev.as<int32_t>(), kRowsPerToken, tokens, x.data(), attn::DType::kBF16),
          "sum rows");
    });
    if (i == 0) {
      // The device sums must be the dense batch bit for bit (SyntheticRows in trainer_test.cc
      // checks the same off the GPU): compare the two inputs of the first step.
      std::vector<uint16_t> from_rows(tokens * d), from_dense(tokens * d);
      Check(ops->Download(from_rows.data(), x.data(), tokens * d * 2), "download");
      upload_dense();
      Check(ops->Download(from_dense.data(), x.data(), tokens * d * 2), "download");
      rows_match_dense = from_rows == from_dense && rows.labels == dense.labels;
    }
    timed("labels", [&] { Check(objective->SetLabels(rows.labels.data()), "labels"); });
    timed("forward", [&] { Check(layer->Forward(x.data()), "forward"); });
    timed("objective", [&] { Check(objective->Evaluate(layer->output(), 1.f).status(), "loss"); });
    timed("backward", [&] { Check(layer->Backward(objective->d_out()), "backward"); });
    timed("optimizer", [&] {
      Check(optimizer->Apply(step, layer->weights(), layer->gradients()).status(), "apply");
    });
    // The step's largest bf16 GEMM (x w_q) and the objective's float32 logits GEMM, alone.
    timed("gemm_bf16_xwq", [&] {
      Check(ops->Gemm(false, false, 1.f, {x.data(), attn::DType::kBF16, tokens, d},
                      {x.data(), attn::DType::kBF16, d, d}, 0.f,
                      {x32.data(), attn::DType::kF32, tokens, d}),
            "gemm");
    });
    timed("gemm_f32_logits", [&] {
      Check(ops->Gemm(false, true, 1.f, {layer->output(), attn::DType::kF32, tokens, d},
                      {x32.data(), attn::DType::kF32, spec.synthetic.vocab_size, d}, 0.f,
                      {x32.as<float>() + int64_t{spec.synthetic.vocab_size} * d, attn::DType::kF32,
                       tokens, spec.synthetic.vocab_size}),
            "gemm");
    });
  }
  for (auto& [name, v] : times) v.erase(v.begin(), v.begin() + 3);  // the warm-up

  std::printf(
      "{\"part\": \"phases\", \"path\": \"%s\", \"tokens\": %lld, \"steps\": %d, "
      "\"rows_match_dense\": %s",
      path.c_str(), static_cast<long long>(tokens), steps, rows_match_dense ? "true" : "false");
  for (const auto& [name, v] : times)
    std::printf(", \"%s_ms\": %.4f", name.c_str(), 1e3 * Median(v));
  std::printf("}\n");
  const double gpu_step = Median(times["upload_rows"]) + Median(times["labels"]) +
                          Median(times["forward"]) + Median(times["objective"]) +
                          Median(times["backward"]) + Median(times["optimizer"]);
  layer.reset();
  objective.reset();
  optimizer.reset();

  // The trainer, as the server steps it, then the dense batch the way Step made it before.
  std::unique_ptr<Trainer> trainer;
  {
    attnserve::training::TrainerOptions options;
    options.space = attn::MemorySpace::kDevice;
    trainer = Take(Trainer::Create(spec, &task, options), "trainer");
  }
  for (int i = 0; i < 3; ++i) Take(trainer->Step(), "step");
  double t0 = Now();
  double loss = 0;
  for (int i = 0; i < steps; ++i) loss = Take(trainer->Step(), "step").loss;
  const double trainer_s = (Now() - t0) / steps;
  std::printf(
      "{\"part\": \"trainer\", \"path\": \"%s\", \"ms_per_step\": %.4f, "
      "\"tokens_per_second\": %.0f, \"loss\": %.4f}\n",
      path.c_str(), 1e3 * trainer_s, tokens / trainer_s, loss);
  trainer.reset();

  // Before: Step's old batch path (dense fill, 4 * model_dim bytes a token uploaded pageable,
  // converted) around the same layer step.
  layer = Take(layers::AttentionLayer::Create(spec.layer, spec.batch_size, spec.seqlen, ops.get(),
                                              engine.get(), engine.get()),
               "layer");
  objective =
      Take(layers::ClassificationObjective::Create(ops.get(), tokens, d, task.class_embeddings()),
           "objective");
  optimizer = Take(layers::Optimizer::Create(oc, ops.get(), layer->params(), layer->num_weights()),
                   "optimizer");
  Check(ops->Upload(layer->weights(), w0.data(), w0.size() * 4), "weights");
  const auto old_step = [&](int64_t step) {
    task.Fill(step, &dense);
    upload_dense();
    Check(objective->SetLabels(dense.labels.data()), "labels");
    Check(layer->Forward(x.data()), "forward");
    Check(objective->Evaluate(layer->output(), 1.f).status(), "loss");
    Check(layer->Backward(objective->d_out()), "backward");
    Check(optimizer->Apply(step, layer->weights(), layer->gradients()).status(), "apply");
  };
  for (int i = 0; i < 3; ++i) old_step(i + 1);
  Check(ops->Synchronize(), "sync");
  t0 = Now();
  for (int i = 0; i < steps; ++i) old_step(i + 4);
  Check(ops->Synchronize(), "sync");
  const double before_s = (Now() - t0) / steps;
  std::printf(
      "{\"part\": \"before\", \"path\": \"%s\", \"ms_per_step\": %.4f, "
      "\"tokens_per_second\": %.0f}\n",
      path.c_str(), 1e3 * before_s, tokens / before_s);

  std::printf("\n%-18s %10s   (%s, %lld tokens a step, medians of %d)\n", "phase", "ms",
              path.c_str(), static_cast<long long>(tokens), steps);
  for (const auto& [name, v] : times) std::printf("%-18s %10.3f\n", name.c_str(), 1e3 * Median(v));
  std::printf("%-18s %10.3f   (upload_rows .. optimizer)\n", "gpu step", 1e3 * gpu_step);
  std::printf("%-18s %10s   (device sums of the row ids against the dense batch, step 1)\n",
              "rows = dense", rows_match_dense ? "yes" : "NO");
  std::printf("%-18s %10.3f   %12.0f tokens/s\n", "trainer step", 1e3 * trainer_s,
              tokens / trainer_s);
  std::printf("%-18s %10.3f   %12.0f tokens/s\n", "before step", 1e3 * before_s, tokens / before_s);
  return 0;
}
