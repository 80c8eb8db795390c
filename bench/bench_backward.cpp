// Backward pass time against the forward pass of the same shape, measured in the same run:
// "xForward" = backward time / forward time (FlashAttention-2's backward does 2.5x the forward's
// FLOPs: five products per tile instead of two). GFLOPS counts 10 n_q n_k d per backward.
//
//   cmake --preset bench && cmake --build --preset bench && build/bench/bench/bench_backward
#include <sdpa/sdpa.hpp>

#include "common.hpp"

namespace {

using sdpa_bench::Index;

/// args: n, d, threads
template <typename K>
void backward(benchmark::State& state, const K& kernel) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  std::srand(7);
  const Eigen::MatrixXf q = Eigen::MatrixXf::Random(n, d), k = Eigen::MatrixXf::Random(n, d),
                        v = Eigen::MatrixXf::Random(n, d), dO = Eigen::MatrixXf::Random(n, d);
  const auto fwd = sdpa::attentionForward(kernel, q, k, v);
  const double forwardSeconds = sdpa_bench::medianSeconds(
      [&] { benchmark::DoNotOptimize(sdpa::attentionForward(kernel, q, k, v).output.data()); }, 3);
  benchmark::DoNotOptimize(sdpa::attentionBackward(kernel, q, k, v, fwd, dO, sdpa::scale::InvSqrtDk{}).dq.data());
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    auto g = sdpa::attentionBackward(kernel, q, k, v, fwd, dO, sdpa::scale::InvSqrtDk{});
    benchmark::DoNotOptimize(g.dq.data());
  }
  const double seconds = timer.seconds();
  state.counters["GFLOPS"] = benchmark::Counter(10.0 * double(n) * double(n) * double(d) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
  if (state.iterations() > 0) state.counters["xForward"] = seconds / double(state.iterations()) / forwardSeconds;
}

template <typename K>
void BM_Backward(benchmark::State& state) {
  backward(state, K{});
}

/// The tiled backward with explicit block sizes. args: n, d, threads, blockQ, blockK
void BM_BackwardBlocks(benchmark::State& state) {
  backward(state, sdpa::kernel::Tiled{state.range(3), state.range(4)});
}

/// Storage order: q, k, v and dO column-major (0), row-major (1, numpy's and PyTorch's layout,
/// read in place) or a mix (2: q and v row-major, k and dO column-major, each read in place), into
/// preallocated gradients; "xColumnMajor" is the call's time over the column-major one's of the
/// same shape in the same run. Peak memory of either (one process
/// per filter): `/usr/bin/time -v build/bench/bench/bench_backward --benchmark_filter=...`.
/// args: n, d, threads, rowMajor
void BM_BackwardLayout(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::srand(7);
  const Eigen::MatrixXf qc = Eigen::MatrixXf::Random(n, d), kc = Eigen::MatrixXf::Random(n, d),
                        vc = Eigen::MatrixXf::Random(n, d), dOc = Eigen::MatrixXf::Random(n, d);
  const auto fwd = sdpa::attentionForward(qc, kc, vc);
  Eigen::MatrixXf dq(n, d), dk(n, d), dv(n, d);
  const auto run = [&](const auto& q, const auto& k, const auto& v, const auto& dO) {
    const auto call = [&] {
      sdpa::attentionBackwardInto(q, k, v, fwd.output, fwd.logSumExp, dO, dq, dk, dv, sdpa::scale::InvSqrtDk{});
    };
    call();
    const sdpa_bench::LoopTimer timer;
    for (auto _ : state) {
      call();
      benchmark::DoNotOptimize(dq.data());
    }
    return timer.seconds();
  };
  double seconds = 0;
  if (state.range(3) == 2) {  // a mix: q and v row by row, k and dO column by column
    const RowMajor q = qc, v = vc;
    seconds = run(q, kc, v, dOc);
  } else if (state.range(3)) {
    const RowMajor q = qc, k = kc, v = vc, dO = dOc;
    seconds = run(q, k, v, dO);
  } else {
    seconds = run(qc, kc, vc, dOc);
  }
  state.counters["GFLOPS"] = benchmark::Counter(10.0 * double(n) * double(n) * double(d) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
  sdpa_bench::reportLayoutRatio(state, seconds);
}

}  // namespace

BENCHMARK(BM_BackwardLayout)
    ->ArgNames({"n", "d", "threads", "rowMajor"})
    ->ArgsProduct({{1024, 4096}, {64, 128}, {1}, {0, 1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_BackwardBlocks)
    ->ArgNames({"n", "d", "threads", "bq", "bk"})
    ->ArgsProduct({{2048}, {16, 64, 128}, {1}, {32, 64, 128, 256}, {64, 128, 256}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Backward<sdpa::kernel::Tiled>)
    ->ArgNames({"n", "d", "threads"})
    ->ArgsProduct({{512, 2048, 4096}, {16, 32, 64, 128, 256}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Backward<sdpa::kernel::Tiled>)
    ->Name("BM_BackwardThreads<Tiled>")
    ->ArgNames({"n", "d", "threads"})
    ->ArgsProduct({{4096}, {64}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Backward<sdpa::kernel::Naive>)
    ->ArgNames({"n", "d", "threads"})
    ->ArgsProduct({{512, 2048}, {16, 64, 128}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
