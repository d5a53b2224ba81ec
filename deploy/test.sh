#!/usr/bin/env bash
# Sets up and runs every test: installs the dependencies, then builds three configurations and
# runs ctest in each.
#
#   build-test/      the main build: the CUDA engines are compiled when nvcc is found
#                    (ATTN_CUDA=AUTO), warnings are errors; CUDA tests skip themselves when no
#                    GPU is present
#   build-sanitize/  no CUDA, AddressSanitizer and UndefinedBehaviorSanitizer, RelWithDebInfo
#   build-fuzz/      clang: the libFuzzer target on the request decoder/validator, run for a
#                    bounded 20 s by its ctest (only that target is built)
#
# Every pass runs even when an earlier one fails. The exit status is non-zero when a build or a
# test failed. The last lines printed are ctest's own summary lines of each pass.
#
# Usage: deploy/test.sh [--no-install] [--no-sanitize] [--no-fuzz]
# Environment: ATTN_BUILD_DIR (default build-test; the sanitizer and fuzz passes use
# ATTN_BUILD_DIR with "-sanitize" or "-fuzz" in place of "-test", or appended), ATTN_WERROR (main
# pass, default ON), and those of deploy/common.sh (ATTN_JOBS, ATTN_CUDA_ARCHITECTURES, CUDACXX).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "${ATTN_ROOT}"

install=1
sanitize=1
fuzz=1
for arg in "$@"; do
  case "${arg}" in
    --no-install) install=0 ;;
    --no-sanitize) sanitize=0 ;;
    --no-fuzz) fuzz=0 ;;
    -h | --help)
      sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "test.sh: unknown argument ${arg}" >&2
      exit 2
      ;;
  esac
done

main_dir=${ATTN_BUILD_DIR:-build-test}
if [[ "${main_dir}" == *-test ]]; then
  sanitize_dir="${main_dir%-test}-sanitize"
else
  sanitize_dir="${main_dir}-sanitize"
fi

if [[ ${install} -eq 1 ]]; then
  "${ATTN_ROOT}/deploy/install-deps.sh"
fi
attn_find_cuda

# Sanitizer reports stop the test at the first error and say where it came from.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

timings=()
summaries=()
failed=()

# run_pass NAME DIR CMAKE_ARGS...: configure, build, ctest; records timings and the outcome.
run_pass() {
  local name=$1 dir=$2
  shift 2
  local t0 t1 t2
  t0=$(attn_now)
  rm -f "${dir}/ctest.log"  # a stale log must not pass for this run's
  echo "==> [${name}] configure and build in ${dir}"
  if ! { attn_configure "${dir}" "$@" && attn_compile "${dir}"; }; then
    t1=$(attn_now)
    timings+=("$(printf '%-18s %5ss  FAILED' "build ${name}" $((t1 - t0)))")
    summaries+=("[${name}] build failed: no tests ran")
    failed+=("build ${name}")
    return 0
  fi
  t1=$(attn_now)
  timings+=("$(printf '%-18s %5ss  ok' "build ${name}" $((t1 - t0)))")

  echo "==> [${name}] ctest in ${dir}"
  local outcome=ok
  if ! ctest --test-dir "${dir}" --output-on-failure --no-tests=error --timeout 600 \
    -j "${ATTN_JOBS}" 2>&1 | tee "${dir}/ctest.log"; then
    outcome=FAILED
    failed+=("ctest ${name}")
  fi
  t2=$(attn_now)
  timings+=("$(printf '%-18s %5ss  %s' "ctest ${name}" $((t2 - t1)) "${outcome}")")
  summaries+=("[${name}] ctest in ${dir}:")
  local line
  while IFS= read -r line; do
    summaries+=("${line}")
  done < <(grep -E '^[0-9]+% tests passed|^No tests were found|^Total Test time' \
    "${dir}/ctest.log" || echo "ctest printed no summary")
}

if [[ -n "${CUDACXX:-}" ]] || command -v nvcc >/dev/null 2>&1; then
  echo "test.sh: CUDA compiler: ${CUDACXX:-$(command -v nvcc)}"
else
  echo "test.sh: no CUDA compiler found; the main build has no CUDA engines"
fi
run_pass main "${main_dir}" -DCMAKE_BUILD_TYPE=Release -DATTN_CUDA=AUTO \
  "-DATTN_WERROR=${ATTN_WERROR:-ON}"
# Warnings are policed by the main pass: GCC's sanitizer instrumentation raises false
# positives of its own (-Wmaybe-uninitialized, -Wstringop-overflow), so they are not errors here.
# Benchmarks are programs, not tests: the sanitizer pass skips them.
if [[ ${sanitize} -eq 1 ]]; then
  run_pass sanitize "${sanitize_dir}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_CUDA=OFF \
    -DATTN_SANITIZE=ON -DATTN_BUILD_BENCH=OFF -DATTN_WERROR=OFF
fi

# The fuzzer needs clang's libFuzzer; CI's compiler is GCC, so it gets a clang build of its own.
if [[ ${fuzz} -eq 1 ]]; then
  fuzz_dir="${main_dir%-test}-fuzz"
  [[ "${fuzz_dir}" == "${main_dir}" ]] && fuzz_dir="${main_dir}-fuzz"
  t0=$(attn_now)
  echo "==> [fuzz] clang build of attn_request_decoder_fuzzer in ${fuzz_dir}"
  if attn_configure "${fuzz_dir}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_CUDA=OFF \
    -DATTN_BUILD_BENCH=OFF -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ &&
    attn_compile "${fuzz_dir}" attn_request_decoder_fuzzer; then
    t1=$(attn_now)
    timings+=("$(printf '%-18s %5ss  ok' "build fuzz" $((t1 - t0)))")
    outcome=ok
    if ! ctest --test-dir "${fuzz_dir}" -R '^server_request_decoder_fuzz$' --output-on-failure \
      --no-tests=error 2>&1 | tee "${fuzz_dir}/ctest.log"; then
      outcome=FAILED
      failed+=("fuzz")
    fi
    t2=$(attn_now)
    timings+=("$(printf '%-18s %5ss  %s' "fuzz (20 s run)" $((t2 - t1)) "${outcome}")")
    summaries+=("[fuzz] ctest in ${fuzz_dir}:")
    while IFS= read -r line; do
      summaries+=("${line}")
    done < <(grep -E '^[0-9]+% tests passed|^No tests were found|^Total Test time' \
      "${fuzz_dir}/ctest.log" || echo "ctest printed no summary")
  else
    t1=$(attn_now)
    timings+=("$(printf '%-18s %5ss  FAILED' "build fuzz" $((t1 - t0)))")
    summaries+=("[fuzz] build failed: the fuzzer did not run")
    failed+=("build fuzz")
  fi
fi

echo
echo "==== test.sh: step times ===="
printf '%s\n' "${timings[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "test.sh: FAILED: ${failed[*]}"
else
  echo "test.sh: all passes OK"
fi
echo "==== ctest summaries ===="
printf '%s\n' "${summaries[@]}"
[[ ${#failed[@]} -eq 0 ]]
