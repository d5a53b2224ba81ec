#!/usr/bin/env bash
# The CUDA compiler launcher of attn_cuda (kernels/cuda/CMakeLists.txt): runs the compile command
# it is given and keeps what ptxas said about each kernel (nvcc --resource-usage: registers,
# stack, spills, and its warnings, such as wgmma serialisation) in `<object>.resources`, which
# the kernel_resources test checks against tests/cuda/kernel_resources.txt. ptxas's info lines
# stay out of the build output; everything else the compiler prints passes through.
set -uo pipefail

object=""
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; ++i)); do
  if [[ ${args[i]} == -o ]]; then object=${args[i + 1]}; fi
done
if [[ -z $object ]]; then exec "$@"; fi

log="${object}.resources"
"$@" 2>"${log}.tmp"
rc=$?
# ptxas's info lines and the properties line under each (indented, "N bytes stack frame, ...").
grep -v -E '^ptxas info +:|^ +[0-9]+ bytes stack frame' "${log}.tmp" >&2
mv -f "${log}.tmp" "${log}"
exit "${rc}"
