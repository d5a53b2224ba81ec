// `attnserve_client train ...`: training jobs from the command line (attnserve.v1.TrainingService).
//
//   train submit  [layer, data, optimiser flags] [--follow]   prints the job id
//   train watch   --job=ID     a progress line (step/total, loss, metric, tokens/s, ETA) that
//                              updates in place on a terminal, one line per event otherwise
//   train status  [--job=ID]   one job, or every job of the caller
//   train cancel  --job=ID
//   train result  --job=ID [--weights_dir=DIR] [--curve_csv=FILE]
//
// The layer's flags are named after the spec's fields (--model_dim, --num_heads, --num_kv_heads,
// --batch_size, --seqlen, --steps); --head_dim, --causal, --window_left, --window_right, --dtype,
// --path and --seed are attend's own flags, with the same meaning. The defaults, with
// --head_dim=16 --causal, are a small associative-recall job that learns in ~100 steps on a CPU.
// Exit status: 0 success (watch: the job SUCCEEDED), 1 an RPC failed or the job did not
// succeed, 2 bad usage.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "clients/cli/channel_factory.h"

namespace attnserve::client {

// `args` are the words after "train".
int RunTrainCommand(const std::vector<std::string>& args, const ChannelFactory& factory,
                    const std::shared_ptr<grpc::Channel>& channel);

}  // namespace attnserve::client
