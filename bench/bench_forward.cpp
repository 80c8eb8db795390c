// Forward pass throughput, GFLOP/s counted as 4 n_q n_k d / time (QK^T and PV, 2 FLOPs per MAC),
// with the ratio to a one-thread SGEMM of the same FLOP count measured in the same run
// ("xSGEMM": Eigen's; "xSGEMM_openblas" when built with OpenBLAS). One head, n_q = n_k = n,
// d_k = d_v = d, float.
//
//   cmake --preset bench && cmake --build --preset bench
//   env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE build/bench/bench/bench_forward
//       --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
// With libopenblas-dev installed, bench_forward_blas is the same with EIGEN_USE_BLAS: the tiles'
// products run in OpenBLAS (its SGEMM is then also the "xSGEMM" ceiling).
#include <sdpa/sdpa.hpp>

#include "common.hpp"

namespace {

using sdpa_bench::Index;

Eigen::MatrixXf input(Index rows, Index cols, unsigned seed) {
  std::srand(seed);
  return Eigen::MatrixXf::Random(rows, cols);
}

/// The naive forward as most users write it, with its n x n buffers allocated once outside
/// the timing loop ("the same with preallocated buffers" of the baseline table).
struct PreallocatedNaive {
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> s;
  Eigen::MatrixXf out;
  void run(const Eigen::MatrixXf& q, const Eigen::MatrixXf& k, const Eigen::MatrixXf& v) {
    s.noalias() = q * k.transpose();
    s *= 1.0f / std::sqrt(float(q.cols()));
    for (Index i = 0; i < s.rows(); ++i) {
      auto row = s.row(i).array();
      row = (row - row.maxCoeff()).exp();
      row /= row.sum();
    }
    out.noalias() = s * v;
  }
};

// args: n, d, threads
void BM_ForwardPreallocatedNaive(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  const Eigen::MatrixXf q = input(n, d, 1), k = input(n, d, 2), v = input(n, d, 3);
  PreallocatedNaive naive;
  naive.run(q, k, v);
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    naive.run(q, k, v);
    benchmark::DoNotOptimize(naive.out.data());
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d), timer.seconds(), n, n, d);
}

/// sdpa's forward with kernel K and scale policy P. args: n, d, threads
template <typename K, typename P = sdpa::scale::InvSqrtDk>
void forward(benchmark::State& state, const K& kernel) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  const Eigen::MatrixXf q = input(n, d, 1), k = input(n, d, 2), v = input(n, d, 3);
  P scale{};
  benchmark::DoNotOptimize(sdpa::attentionForward(kernel, q, k, v, scale).output.data());  // warm scratch
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    auto out = sdpa::attentionForward(kernel, q, k, v, scale);
    benchmark::DoNotOptimize(out.output.data());
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d), timer.seconds(), n, n, d);
}

template <typename K, typename P = sdpa::scale::InvSqrtDk>
void BM_Forward(benchmark::State& state) {
  forward<K, P>(state, K{});
}

/// The softcap's cost: the tiled forward under Softcap{30} (its float tanh accurate to 1.4 ulp,
/// NUMERICS.md), beside BM_ForwardTargets<Tiled> of the same shape. args: n, d, threads
void BM_ForwardSoftcap(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  const Eigen::MatrixXf q = input(n, d, 1), k = input(n, d, 2), v = input(n, d, 3);
  const sdpa::mask::Softcap cap{30.0};
  benchmark::DoNotOptimize(sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, cap).output.data());
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    auto out = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, cap);
    benchmark::DoNotOptimize(out.output.data());
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d), timer.seconds(), n, n, d);
}

/// Causal prefill (LowerRight): hidden tiles skipped. FLOPs counted as for the full pass, so its
/// GFLOP/s over BM_ForwardTargets<Tiled>'s is the non-causal time over the causal. args: n, d, threads
void BM_ForwardCausal(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  const Eigen::MatrixXf q = input(n, d, 1), k = input(n, d, 2), v = input(n, d, 3);
  const sdpa::mask::Causal causal{sdpa::mask::Align::LowerRight};
  benchmark::DoNotOptimize(sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, causal).output.data());
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    auto out = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, causal);
    benchmark::DoNotOptimize(out.output.data());
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d), timer.seconds(), n, n, d);
}

/**
 * Half-precision inputs (H: Eigen::half or Eigen::bfloat16), output in H as PyTorch gives it,
 * with the tile products of kernel::Products(range(3)): 0 = Fp32 (k and v converted once per
 * call, the float kernel), 1 = Bf16 (bf16 dot products where the CPU has AVX512_BF16, else the
 * same as 0). Beside BM_ForwardTargets<Tiled> (float inputs) of the same shape.
 * args: n, d, threads, products
 */
template <typename H>
void BM_ForwardHalf(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  const sdpa::kernel::Tiled kernel{0, 0, state.range(3) ? sdpa::kernel::Products::Bf16 : sdpa::kernel::Products::Fp32};
  using M = Eigen::Matrix<H, Eigen::Dynamic, Eigen::Dynamic>;
  const M q = input(n, d, 1).cast<H>(), k = input(n, d, 2).cast<H>(), v = input(n, d, 3).cast<H>();
  benchmark::DoNotOptimize(sdpa::attentionForward(kernel, q, k, v, sdpa::scale::InvSqrtDk{}).output.data());
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    auto out = sdpa::attentionForward(kernel, q, k, v, sdpa::scale::InvSqrtDk{});
    benchmark::DoNotOptimize(out.output.data());
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d), timer.seconds(), n, n, d);
}

/// The tiled kernel with explicit block sizes. args: n, d, threads, blockQ, blockK
void BM_ForwardBlocks(benchmark::State& state) { forward(state, sdpa::kernel::Tiled{state.range(3), state.range(4)}); }

/// Multi-head: H heads of d = 64 (batch x heads >= 2 for the 2-thread target). args: n, H, threads
void BM_ForwardHeads(benchmark::State& state) {
  const Index n = state.range(0), H = state.range(1), d = 64;
  sdpa_bench::setThreads(int(state.range(2)));
  const Eigen::MatrixXf q = input(n, H * d, 1), k = input(n, H * d, 2), v = input(n, H * d, 3);
  benchmark::DoNotOptimize(sdpa::multiHeadAttention(q, k, v, sdpa::Heads{H}).data());
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    auto out = sdpa::multiHeadAttention(q, k, v, sdpa::Heads{H});
    benchmark::DoNotOptimize(out.data());
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d * H), timer.seconds(), n, n, d * H);
}

/// BM_ForwardHeads into preallocated outputs (multiHeadAttentionForwardInto): the difference is
/// the result's allocation, n x H d floats of fresh pages per call. args: n, H, threads
void BM_ForwardHeadsInto(benchmark::State& state) {
  const Index n = state.range(0), H = state.range(1), d = 64;
  sdpa_bench::setThreads(int(state.range(2)));
  const Eigen::MatrixXf q = input(n, H * d, 1), k = input(n, H * d, 2), v = input(n, H * d, 3);
  Eigen::MatrixXf out(n, H * d), lse(n, H);
  sdpa::multiHeadAttentionForwardInto(q, k, v, sdpa::Heads{H}, out, lse);
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    sdpa::multiHeadAttentionForwardInto(q, k, v, sdpa::Heads{H}, out, lse);
    benchmark::DoNotOptimize(out.data());
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d * H), timer.seconds(), n, n, d * H);
}

/// A DiagnosticsSink's cost on the tiled forward (the rows' figures streamed beside the online
/// softmax): sink 0 is the plain forward of the same shape, 1 the same call with a sink reused
/// from call to call. args: n, d, threads, sink
void BM_ForwardSink(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  const Eigen::MatrixXf q = input(n, d, 1), k = input(n, d, 2), v = input(n, d, 3);
  sdpa::DiagnosticsSink sink;
  sdpa::DiagnosticsSink* s = state.range(3) ? &sink : nullptr;
  const sdpa::mask::None none;
  benchmark::DoNotOptimize(sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, none, {}, s).output.data());
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    auto out = sdpa::attentionForward(q, k, v, sdpa::scale::InvSqrtDk{}, none, {}, s);
    benchmark::DoNotOptimize(out.output.data());
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d), timer.seconds(), n, n, d);
}

/// What a DiagnosticsSink adds besides the per-row figures: the per-head inputs of the
/// summaries (internal::moments of q and of k, and <Gq, Gk>_F). gram 0: from the rows' raw sums
/// (streamedInner, O(n d), a sink where every row sees every key); gram 1: from the centred
/// d x d Gram matrices (O(n d^2), a sink under a mask or over a batch). GFLOP/s counted as the
/// Gram matrices' lower halves, 2 n d^2 for the two, either way; "xForward": their time over one
/// forward of the same shape (no sink), timed beside them (median of 5).
/// args: n, d, gram
void BM_SinkMoments(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  const bool gram = state.range(2) != 0;
  sdpa_bench::setThreads(1);
  const Eigen::MatrixXf q = input(n, d, 1), k = input(n, d, 2), v = input(n, d, 3);
  const auto timeOf = [&](auto&& f) {
    f();
    return sdpa_bench::medianSeconds(f, 5);
  };
  const double forward = timeOf([&] { benchmark::DoNotOptimize(sdpa::attentionForward(q, k, v).output.data()); });
  const double sumR2 = (q * k.transpose()).squaredNorm();  // what the rows would give
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    const sdpa::internal::Moments mq = sdpa::internal::moments(q, gram), mk = sdpa::internal::moments(k, gram);
    benchmark::DoNotOptimize(gram ? sdpa::internal::gramInner(mq, mk)
                                  : sdpa::internal::streamedInner(sumR2, q, mq, k, mk));
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * double(n) * double(d) * double(d) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  if (state.iterations() > 0) state.counters["xForward"] = timer.seconds() / double(state.iterations()) / forward;
}

/// The online softmax's pass over one transposed logits tile (fast::softmaxTile: 256 keys x 32
/// lanes, base 2) alone, with a DiagnosticsSink's per-key figures or without: "nsPerKey" per key
/// and 16 (AVX2: 8) lanes. figures 0: none; 1: where some lane's maximum may be in the tile (the
/// first tiles of a row: the keys at the maximum tracked apart); 2: elsewhere. Each pass starts
/// from a copy of the tile (in the time, the same for all three).
/// args: figures
void BM_SoftmaxTile(benchmark::State& state) {
#if SDPA_HAS_ISA_DISPATCH
  namespace fast = sdpa::internal::fast;
  using sdpa::internal::Isa;
  const Isa isa = sdpa::internal::IsaChoice::current();
  if (isa < Isa::Avx2) {
    state.SkipWithError("needs AVX2 or AVX-512");
    return;
  }
  const int figures = int(state.range(0));
  const Index lanes = 32, keys = 256, dV = 64;
  const Eigen::MatrixXf logits = 2.0f * input(lanes, keys, 7);  // column j: key j of every lane
  Eigen::MatrixXf sT(lanes, keys), acc = Eigen::MatrixXf::Zero(dV, lanes), figs(fast::kTileFigures, lanes);
  const Eigen::VectorXf top = logits.rowwise().maxCoeff();
  Eigen::VectorXf m(lanes), l(lanes), bad = Eigen::VectorXf::Zero(lanes);
  const int stats = figures == 0 ? fast::kNoStats : fast::kStatsVisible;
  const sdpa_bench::LoopTimer timer;
  for (auto _ : state) {
    sT = logits;
    m.setConstant(figures == 2 ? 1e3f : -std::numeric_limits<float>::infinity());
    l.setZero();
    if (isa >= Isa::Avx512)
      fast::avx512::softmaxTileWith<true>(stats, sT.data(), lanes, {nullptr, nullptr, keys}, top.data(), false,
                                          m.data(), l.data(), acc.data(), dV, bad.data(), figs.data());
    else
      fast::avx2::softmaxTileWith<true>(stats, sT.data(), lanes, {nullptr, nullptr, keys}, top.data(), false, m.data(),
                                        l.data(), acc.data(), dV, bad.data(), figs.data());
    benchmark::DoNotOptimize(l.data());
  }
  const double groups = double(lanes) / (isa >= Isa::Avx512 ? 16.0 : 8.0);
  if (state.iterations() > 0)
    state.counters["nsPerKey"] = timer.seconds() / double(state.iterations()) / (double(keys) * groups) * 1e9;
#else
  state.SkipWithError("built without the fast kernels (SDPA_NO_ISA_DISPATCH)");
#endif
}

/// Storage order: q, k, v column-major (0), row-major (1, numpy's and PyTorch's layout, read in
/// place) or a mix (2: q and v row-major, k column-major, each read in place), into preallocated
/// outputs; "xColumnMajor" is the call's time over the column-major one's of the same shape in
/// the same run. Peak memory of either (one process per
/// filter): `/usr/bin/time -v build/bench/bench/bench_forward --benchmark_filter=...`.
/// args: n, d, threads, rowMajor
void BM_ForwardLayout(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1);
  sdpa_bench::setThreads(int(state.range(2)));
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::MatrixXf out(n, d);
  Eigen::VectorXf lse(n);
  const auto run = [&](const auto& q, const auto& k, const auto& v) {
    sdpa::attentionForwardInto(q, k, v, out, lse);
    const sdpa_bench::LoopTimer timer;
    for (auto _ : state) {
      sdpa::attentionForwardInto(q, k, v, out, lse);
      benchmark::DoNotOptimize(out.data());
    }
    return timer.seconds();
  };
  double seconds = 0;
  if (state.range(3) == 2) {  // a mix: q and v row by row, k column by column
    const RowMajor q = input(n, d, 1), v = input(n, d, 3);
    const Eigen::MatrixXf k = input(n, d, 2);
    seconds = run(q, k, v);
  } else if (state.range(3)) {
    const RowMajor q = input(n, d, 1), k = input(n, d, 2), v = input(n, d, 3);
    seconds = run(q, k, v);
  } else {
    const Eigen::MatrixXf q = input(n, d, 1), k = input(n, d, 2), v = input(n, d, 3);
    seconds = run(q, k, v);
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d), seconds, n, n, d);
  sdpa_bench::reportLayoutRatio(state, seconds);
}

/// BM_ForwardLayout over 8 heads side by side: q, k and v n x 8 d, column-major or row-major
/// (PyTorch's and ONNX Runtime's [n, heads x d]: a head a block of columns, its rows 8 d floats
/// apart), each read in place, into preallocated outputs; "xColumnMajor" as there.
/// args: n, d, threads, rowMajor
void BM_ForwardHeadsLayout(benchmark::State& state) {
  const Index n = state.range(0), d = state.range(1), H = 8;
  sdpa_bench::setThreads(int(state.range(2)));
  using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::MatrixXf out(n, H * d), lse(n, H);
  const auto run = [&](const auto& q, const auto& k, const auto& v) {
    sdpa::multiHeadAttentionForwardInto(q, k, v, sdpa::Heads{H}, out, lse);
    const sdpa_bench::LoopTimer timer;
    for (auto _ : state) {
      sdpa::multiHeadAttentionForwardInto(q, k, v, sdpa::Heads{H}, out, lse);
      benchmark::DoNotOptimize(out.data());
    }
    return timer.seconds();
  };
  double seconds = 0;
  if (state.range(3)) {
    const RowMajor q = input(n, H * d, 1), k = input(n, H * d, 2), v = input(n, H * d, 3);
    seconds = run(q, k, v);
  } else {
    const Eigen::MatrixXf q = input(n, H * d, 1), k = input(n, H * d, 2), v = input(n, H * d, 3);
    seconds = run(q, k, v);
  }
  sdpa_bench::reportFlops(state, 4.0 * double(n) * double(n) * double(d * H), seconds, n, n, d * H);
  sdpa_bench::reportLayoutRatio(state, seconds, H);
}

void sweep(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "d", "threads"});
  for (const Index n : {128, 512, 2048, 8192})
    for (const Index d : {16, 32, 64, 128, 256}) b->Args({n, d, 1});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}
void targets(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "d", "threads"});
  for (const Index n : {1024, 4096, 16384})
    for (const Index d : {16, 64, 128}) b->Args({n, d, 1});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_Forward<sdpa::kernel::Tiled>)->Apply(sweep);
BENCHMARK(BM_Forward<sdpa::kernel::Naive>)->Apply(sweep);
BENCHMARK(BM_Forward<sdpa::kernel::Tiled>)->Name("BM_ForwardTargets<Tiled>")->Apply(targets);
BENCHMARK(BM_ForwardPreallocatedNaive)
    ->ArgNames({"n", "d", "threads"})
    ->ArgsProduct({{1024, 4096}, {16, 64, 128}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// Policy cost: InvSqrtDk (above), None and Learnable fold into the same query-block multiply.
BENCHMARK(BM_Forward<sdpa::kernel::Tiled, sdpa::scale::None>)
    ->ArgNames({"n", "d", "threads"})
    ->Args({4096, 64, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Forward<sdpa::kernel::Tiled, sdpa::scale::Learnable<float>>)
    ->ArgNames({"n", "d", "threads"})
    ->Args({4096, 64, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForwardSoftcap)
    ->ArgNames({"n", "d", "threads"})
    ->ArgsProduct({{4096}, {16, 64, 128}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForwardCausal)
    ->ArgNames({"n", "d", "threads"})
    ->ArgsProduct({{4096}, {64, 128}, {1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForwardSink)
    ->ArgNames({"n", "d", "threads", "sink"})
    ->ArgsProduct({{1024, 4096, 16384}, {64, 128}, {1}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SinkMoments)
    ->ArgNames({"n", "d", "gram"})
    ->ArgsProduct({{1024, 4096}, {64, 128}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SoftmaxTile)->ArgNames({"figures"})->DenseRange(0, 2);
BENCHMARK(BM_ForwardLayout)
    ->ArgNames({"n", "d", "threads", "rowMajor"})
    ->ArgsProduct({{4096, 16384}, {64, 128}, {1}, {0, 1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForwardHeadsLayout)
    ->ArgNames({"n", "d", "threads", "rowMajor"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (const auto& [n, d] : {std::pair<Index, Index>{1024, 64}, {1024, 128}, {4096, 64}})
        for (const Index threads : {1, 2})
          for (const Index rowMajor : {0, 1}) b->Args({n, d, threads, rowMajor});
    })
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// Threads: one head with n_q >= 1024, and 8 heads.
BENCHMARK(BM_Forward<sdpa::kernel::Tiled>)
    ->Name("BM_ForwardThreads<Tiled>")
    ->ArgNames({"n", "d", "threads"})
    ->ArgsProduct({{4096}, {64}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// The shapes of bench/peers/peers.py, which times ONNX Runtime and PyTorch beside these.
BENCHMARK(BM_Forward<sdpa::kernel::Tiled>)
    ->Name("BM_ForwardPeers<Tiled>")
    ->ArgNames({"n", "d", "threads"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (const Index threads : {1, 2})
        for (const auto& [n, d] : {std::pair<Index, Index>{1024, 64}, {4096, 16}, {4096, 64}, {4096, 128}, {4096, 256}})
          b->Args({n, d, threads});
    })
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForwardHeads)
    ->ArgNames({"n", "H", "threads"})
    ->ArgsProduct({{256, 1024}, {8}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForwardHeadsInto)
    ->ArgNames({"n", "H", "threads"})
    ->ArgsProduct({{256, 1024}, {8}, {1, 2}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// Block sizes, for tuning: n = 4096.
BENCHMARK(BM_ForwardBlocks)
    ->ArgNames({"n", "d", "threads", "bq", "bk"})
    ->ArgsProduct({{4096}, {16, 64, 128, 256}, {1}, {32, 64, 128, 256}, {64, 128, 256, 512}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_ForwardHalf<Eigen::bfloat16>)
    ->ArgNames({"n", "d", "threads", "bf16dot"})
    ->ArgsProduct({{512, 1024, 4096}, {64, 128}, {1}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ForwardHalf<Eigen::half>)
    ->ArgNames({"n", "d", "threads", "bf16dot"})
    ->ArgsProduct({{512, 1024, 4096}, {64, 128}, {1}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
// bf16 inputs and output with bf16 products (vdpbf16ps or AMX tiles where the CPU has them), at
// the shapes of bench/peers/peers.py --dtype bf16 (PyTorch's bf16 SDPA beside these).
BENCHMARK(BM_ForwardHalf<Eigen::bfloat16>)
    ->Name("BM_ForwardPeersBf16")
    ->ArgNames({"n", "d", "threads", "bf16dot"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (const Index threads : {1, 2})
        for (const auto& [n, d] : {std::pair<Index, Index>{1024, 64}, {4096, 16}, {4096, 64}, {4096, 128}, {4096, 256}})
          b->Args({n, d, threads, 1});
    })
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
