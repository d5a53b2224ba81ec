// `attnserve_client session ...` and `attnserve_client bench --sessions=N`: KV sessions from the
// command line.
//
//   session create --heads_kv=... [--kv_heads=8 --head_dim=128 --dtype=bf16] [--max_tokens=N]
//   session append --session_id=ID --tokens=N [--chunk_tokens=4096] [--seed=S]
//   session attend --session_id=ID [--tokens=1] [--append] [--causal] [--lse]
//   session get|delete --session_id=ID;  session list
//
// The session bench creates --sessions sessions, appends --context tokens to each (timing the
// ingest), then runs decode steps (one query token, its own K/V appended) from --concurrency
// clients for --duration, each client stepping its own sessions in turn; it prints steps/s,
// tokens/s, KV bytes read per second and p50/p90/p99 step latency. --stateless sends the same
// steps as plain Attend calls carrying the whole K/V history each time, for comparison. The
// first step of every session is checked against the float64 reference of the dense problem.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "clients/cli/channel_factory.h"

namespace attnserve::client {

// Flags are read in session_command.cc; `args` are the words after `session`.
int RunSessionCommand(const ChannelFactory& factory, const std::shared_ptr<grpc::Channel>& channel,
                      const std::vector<std::string>& args);

// `bench` with --sessions > 0.
int RunSessionBench(const ChannelFactory& factory,
                    const std::vector<std::shared_ptr<grpc::Channel>>& channels);

// Whether `bench` should run the session bench (--sessions > 0).
bool SessionBenchRequested();

}  // namespace attnserve::client
