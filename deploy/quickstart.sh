#!/usr/bin/env bash
# Sets everything up and runs attnserve's main job on this machine: installs the dependencies,
# builds in build/, and runs it.
#
# Today the main job is attn_local, which runs one attention problem through the tiled CPU
# engine in-process and checks it against the float64 reference; arguments are passed on to it
# (deploy/quickstart.sh --help lists them). Planned: start the gRPC server and send it a request
# instead; this script is the one place to change.
#
# Environment: ATTN_BUILD_DIR (default build), and those of deploy/common.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "${ATTN_ROOT}"

"${ATTN_ROOT}/deploy/install-deps.sh"
attn_find_cuda
dir=${ATTN_BUILD_DIR:-build}
attn_configure "${dir}" -DCMAKE_BUILD_TYPE=Release -DATTN_CUDA=AUTO
attn_compile "${dir}" attn_local

echo "==> ${dir}/clients/local/attn_local $*"
exec "${dir}/clients/local/attn_local" "$@"
