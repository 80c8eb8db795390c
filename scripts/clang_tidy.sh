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
# The examples and the tool use the public API as a consumer does (forward, multi-head, backward,
# learnable scales, diagnostics, the tiled and naive kernels, the KV cache); test_threads.cpp adds
# batched GQA, decoding and the multi-head backward. (Every test file: about 10 minutes; these: about 1.)
# test_threads.cpp first: it takes as long as three of the others, and xargs -P 2 starts in order.
files=(tests/test_threads.cpp examples/scaling_demo.cpp examples/multi_head.cpp examples/learn_temperature.cpp
       examples/long_sequence.cpp examples/decode_loop.cpp tools/sdpa_check.cpp)
# Context parallelism (sdpa/distributed.hpp), where CMake found MPI and so built its example.
if grep -q 'examples/context_parallel.cpp' "$build/compile_commands.json"; then
  files+=(examples/context_parallel.cpp)
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
