// Forward pass throughput, GFLOP/s counted as 4 n_q n_k d / time (QK^T and PV, 2 FLOPs per MAC),
// beside an SGEMM of the same FLOP count, the ceiling a forward pass can approach.
//
//   cmake --preset bench && cmake --build --preset bench && build/bench/bench/bench_forward
#include <benchmark/benchmark.h>

#include <sdpa/sdpa.hpp>

namespace {

void setFlops(benchmark::State& state, double flopsPerIteration) {
  state.counters["GFLOPS"] =
      benchmark::Counter(flopsPerIteration * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// args: n (= n_q = n_k), d (= d_k = d_v)
void BM_ForwardNaive(benchmark::State& state) {
  const Eigen::Index n = state.range(0), d = state.range(1);
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(n, d), k = Eigen::MatrixXf::Random(n, d),
                        v = Eigen::MatrixXf::Random(n, d);
  for (auto _ : state) {
    auto out = sdpa::attentionForward(q, k, v);
    benchmark::DoNotOptimize(out.output.data());
  }
  setFlops(state, 4.0 * double(n) * double(n) * double(d));
}

// The same forward pass with a DiagnosticsSink collecting per-row statistics (diagnostics.hpp).
void BM_ForwardNaiveWithDiagnostics(benchmark::State& state) {
  const Eigen::Index n = state.range(0), d = state.range(1);
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(n, d), k = Eigen::MatrixXf::Random(n, d),
                        v = Eigen::MatrixXf::Random(n, d);
  sdpa::DiagnosticsSink sink;
  for (auto _ : state) {
    auto out = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, sdpa::mask::None{}, {}, &sink);
    benchmark::DoNotOptimize(out.output.data());
  }
  setFlops(state, 4.0 * double(n) * double(n) * double(d));
}

// SGEMM of (n x 2d) * (2d x n): 2 * n * n * 2d = 4 n^2 d FLOPs, the same count as the forward.
void BM_SgemmSameFlops(benchmark::State& state) {
  const Eigen::Index n = state.range(0), d = state.range(1);
  const Eigen::MatrixXf a = Eigen::MatrixXf::Random(n, 2 * d), b = Eigen::MatrixXf::Random(2 * d, n);
  Eigen::MatrixXf c(n, n);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  setFlops(state, 4.0 * double(n) * double(n) * double(d));
}

}  // namespace

BENCHMARK(BM_ForwardNaive)
    ->ArgNames({"n", "d"})
    ->ArgsProduct({{128, 512, 2048}, {16, 64, 128}})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ForwardNaiveWithDiagnostics)
    ->ArgNames({"n", "d"})
    ->ArgsProduct({{512, 4096}, {64}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForwardNaive)->ArgNames({"n", "d"})->Args({4096, 64})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SgemmSameFlops)
    ->ArgNames({"n", "d"})
    ->ArgsProduct({{128, 512, 2048}, {16, 64, 128}})
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
