# Shared by deploy/quickstart.sh, deploy/test.sh and .ci/run (source it, do not run it):
# the repository root, the CUDA compiler, the build parallelism, and configure-and-build.
#
# Environment it reads:
#   ATTN_JOBS                parallel compile and test jobs (default: the number of cores)
#   ATTN_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES of CUDA builds (default: the project's
#                            "80;90a", see CMakeLists.txt)
#   CUDACXX                  the CUDA compiler; /usr/local/cuda/bin/nvcc when unset and no nvcc
#                            is on PATH

ATTN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ATTN_JOBS=${ATTN_JOBS:-$(nproc)}

# CMake looks for nvcc on PATH only, and the toolkit's default home /usr/local/cuda/bin is often
# not on PATH (CI, sudo, fresh shells): point CMake at it then.
attn_find_cuda() {
  if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1 &&
    [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
}

# attn_configure DIR [CMAKE_ARGS...]: configures the build folder DIR with Ninja.
attn_configure() {
  local dir=$1
  shift
  local args=(-S "${ATTN_ROOT}" -B "${dir}" -G Ninja "$@")
  if [[ -n "${ATTN_CUDA_ARCHITECTURES:-}" ]]; then
    args+=("-DCMAKE_CUDA_ARCHITECTURES=${ATTN_CUDA_ARCHITECTURES}")
  fi
  cmake "${args[@]}"
}

# attn_compile DIR [TARGET...]: builds the given targets of DIR, or all of them.
attn_compile() {
  local dir=$1
  shift
  local targets=()
  [[ $# -gt 0 ]] && targets=(--target "$@")
  cmake --build "${dir}" -j "${ATTN_JOBS}" "${targets[@]}"
}

# attn_now: seconds since the epoch, for step timings.
attn_now() { date +%s; }
