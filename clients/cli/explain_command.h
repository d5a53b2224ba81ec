// `attnserve_client explain`: the online softmax of one query block, step by step, computed by
// the CPU tiled engine's own update (kernels/cpu/tile_trace.h observes it); no server involved.
//
//   explain [--q_block=4] [--kv_tile=16] [--seqlen=32] [--head_dim=64] [--causal] [--seed=1]
//           [--json]
//
// Fresh random Q, K, V (float32, one head, --seqlen queries and keys); the block is the last
// --q_block query rows, which see every key tile (under --causal the last tile is cut by the
// mask). Per K/V tile of --kv_tile keys it prints S (scaled, masked), rowmax(S), m, m_new,
// alpha, P, l and acc; then O = acc / l as the engine wrote it next to softmax(S) V computed the
// naive way in float64, and the largest difference. --json prints one object (Q, K, V included)
// for notebooks; `null` stands for -inf there (masked scores, m before the first tile).
// --seqlen is train submit's flag, --head_dim, --causal, --seed and --json attend's, with the
// same meaning. Exit status: 0 when O matches the reference (within 1e-4 x max(1, max |O|)),
// 1 when it does not, 2 on bad usage.
#pragma once

namespace attnserve::client {

int RunExplainCommand();

}  // namespace attnserve::client
