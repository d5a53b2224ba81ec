#!/usr/bin/env bash
# Installs, from Debian/Ubuntu packages, everything attnserve's build and tests need.
#
# Idempotent and quick when nothing is missing: it asks dpkg which packages are absent and only
# then runs apt-get update and apt-get install. Runs as root (CI, Dockerfiles) or through sudo.
# It never installs CUDA: the CUDA engines are optional and are built when nvcc is present
# (see docs/build.md).
#
# Usage: deploy/install-deps.sh [--print]   (--print lists the packages and exits)
set -euo pipefail

# Build tools and C++ libraries.
packages=(
  cmake ninja-build g++ pkg-config git
  libabsl-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev
  libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
)
# clang with its sanitizer/libFuzzer runtime (a Recommends of clang that --no-install-recommends
# would drop), and clang-format for the style check.
packages+=(clang clang-format)
# Debian's /usr/bin/python3 and the modules the integration tests use, and the real Prometheus
# server those tests scrape with.
packages+=(python3 python3-grpcio python3-protobuf python3-numpy python3-pytest prometheus)
packages+=(python3-yaml)  # tests/deploy: checks of deploy/'s compose, Prometheus, Grafana, k8s files
packages+=(nginx haproxy)  # tests/deploy: KV sessions through deploy/nginx and deploy/haproxy
# tests/server/buf_curl_test.py: openssl makes its certificate, npm installs buf curl. A Node.js
# that brought its own npm keeps it (Debian's npm package would conflict with that one).
packages+=(openssl)
command -v npm >/dev/null 2>&1 || packages+=(npm)
# The Python client's package (clients/python): pip installs it into a venv over the system's
# modules, setuptools and wheel build it (running protobuf-compiler's protoc), python3-build makes
# its wheel and sdist.
packages+=(python3-venv python3-pip python3-setuptools python3-wheel python3-build)
# PNG plots: bench/plot.py draws docs/images/ from docs/results/ (ctest docs_plots), and
# clients/python/examples/train_recall.py a training job's loss curve.
packages+=(python3-matplotlib)

# The clang runtime package carries clang's major version in its name (libclang-rt-14-dev on
# Debian 12); find it from the clang that is or will be installed.
clang_rt_package() {
  local major=""
  if command -v clang >/dev/null 2>&1; then
    major=$(clang -dumpversion 2>/dev/null | cut -d. -f1)
  fi
  if [[ -z "${major}" ]]; then
    # clang's dependency names the versioned compiler, e.g. "Depends: clang-14 (>= ...)".
    major=$(apt-cache depends clang 2>/dev/null | sed -n 's/.*Depends: clang-\([0-9][0-9]*\)$/\1/p' |
      head -n1)
  fi
  [[ -n "${major}" ]] && echo "libclang-rt-${major}-dev"
}

missing_packages() {
  local p status
  for p in "$@"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "${p}" 2>/dev/null || true)
    [[ "${status}" == "installed" ]] || echo "${p}"
  done
}

if [[ "${1:-}" == "--print" ]]; then
  printf '%s\n' "${packages[@]}" "$(clang_rt_package || echo 'libclang-rt-<clang major>-dev')"
  exit 0
fi

if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps: this script needs a Debian or Ubuntu system (apt-get, dpkg)" >&2
  exit 1
fi

rt=$(clang_rt_package || true)
[[ -n "${rt}" ]] && packages+=("${rt}")
mapfile -t missing < <(missing_packages "${packages[@]}")
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#packages[@]} packages are installed"
  exit 0
fi

SUDO=()
if [[ ${EUID} -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install-deps: not root and no sudo; install these packages: ${missing[*]}" >&2
    exit 1
  fi
  SUDO=(sudo)
fi

# Packages such as prometheus start a system service when installed. The tests start their own
# instances, so keep dpkg from starting any (this is what Docker's base images do). An existing
# policy is respected and left alone.
policy=/usr/sbin/policy-rc.d
if [[ ! -e "${policy}" ]]; then
  "${SUDO[@]}" sh -c "printf '#!/bin/sh\nexit 101\n' > ${policy} && chmod 755 ${policy}"
  trap '"${SUDO[@]}" rm -f "${policy}"' EXIT
fi

apt=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q -y -o DPkg::Lock::Timeout=600)
echo "install-deps: installing ${missing[*]}"
"${apt[@]}" update
"${apt[@]}" install --no-install-recommends "${missing[@]}"

# clang may only just have arrived: add its runtime if the first pass could not name it.
if [[ -z "${rt}" ]]; then
  rt=$(clang_rt_package || true)
  if [[ -n "${rt}" ]] && [[ -n "$(missing_packages "${rt}")" ]]; then
    "${apt[@]}" install --no-install-recommends "${rt}"
  fi
fi
echo "install-deps: done"
