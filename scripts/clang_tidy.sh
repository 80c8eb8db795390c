#!/usr/bin/env bash
# clang-tidy over sdpa's headers: runs the checks of .clang-tidy on translation units that
# instantiate the public API (below), reporting only findings in include/sdpa (HeaderFilterRegex) and
# failing on any (WarningsAsErrors). Needs a configured build directory with
# compile_commands.json (default: build/tidy, configured here).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/tidy}
# clang-tidy misreads `-mllvm -openmp-opt-disable` (a code-generation flag) and loses -std=.
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  -DSDPA_BUILD_BENCHMARKS=OFF -DSDPA_OPENMP=ON -DSDPA_CLANG_NO_OPENMP_OPT=OFF >/dev/null
# The translation units that instantiate the public API as a consumer does, chosen so that every
# part of the API is instantiated: multi_head.cpp (batched varlen GQA over every mask kind, the tiled
# kernel), learn_temperature.cpp (backward, learnable scales), decode_loop.cpp (the KV cache and
# its decoding, quantised K/V), tools/sdpa_check.cpp (diagnostics, npy) and, where CMake found MPI,
# context_parallel.cpp (distributed.hpp). Every test file: about 10 minutes; the other examples
# and test_threads.cpp repeat these headers' code for about 90 s more of CI (two cores).
files=(examples/decode_loop.cpp examples/multi_head.cpp examples/learn_temperature.cpp tools/sdpa_check.cpp)
# Context parallelism (sdpa/distributed.hpp), where CMake found MPI and so built its example;
# first, as it takes longest and xargs -P 2 starts in order.
if grep -q 'examples/context_parallel.cpp' "$build/compile_commands.json"; then
  files=(examples/context_parallel.cpp "${files[@]}")
fi
printf 'clang-tidy on %d files, headers of include/sdpa only\n' "${#files[@]}"
tidy=$(command -v clang-tidy || command -v clang-tidy-14)
log=$(mktemp)
status=0
printf '%s\n' "${files[@]}" | xargs -P 2 -n 1 "$tidy" -p "$build" --quiet >"$log" 2>&1 || status=$?
grep -v -E '^[0-9]+ warnings? generated\.$|^Suppressed [0-9]+ warnings|^Use -header-filter|^Use -system-headers' "$log" || true
rm -f "$log"
if [ "$status" -ne 0 ]; then
  echo "clang-tidy: findings above (exit $status)"
  exit 1
fi
echo "clang-tidy: no findings in include/sdpa"
