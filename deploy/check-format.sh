#!/usr/bin/env bash
# Checks that every tracked C++ and CUDA source is formatted by clang-format (.clang-format at
# the top). With --fix, formats them in place instead.
#
# Usage: deploy/check-format.sh [--fix]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "${ATTN_ROOT}"

patterns=('*.h' '*.hpp' '*.cc' '*.cpp' '*.cu' '*.cuh')
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Tracked files only: build folders and generated code never enter.
  mapfile -t files < <(git ls-files -- "${patterns[@]}")
else
  mapfile -t files < <(find . -path './build*' -prune -o -path './.git' -prune -o -type f \
    \( -name '*.h' -o -name '*.hpp' -o -name '*.cc' -o -name '*.cpp' -o -name '*.cu' \
    -o -name '*.cuh' \) -print | sed 's|^\./||' | sort)
fi
if [[ ${#files[@]} -eq 0 ]]; then
  echo "check-format: no sources"
  exit 0
fi

if [[ "${1:-}" == "--fix" ]]; then
  clang-format -i "${files[@]}"
  echo "check-format: formatted ${#files[@]} files"
  exit 0
fi

bad=()
for f in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "${f}" >/dev/null 2>&1; then
    bad+=("${f}")
  fi
done
if [[ ${#bad[@]} -gt 0 ]]; then
  echo "check-format: ${#bad[@]} of ${#files[@]} files are not clang-formatted:"
  printf '  %s\n' "${bad[@]}"
  echo "check-format: see the changes with 'clang-format --dry-run FILE'," \
    "apply them with deploy/check-format.sh --fix"
  exit 1
fi
echo "check-format: ${#files[@]} files OK ($(clang-format --version))"
