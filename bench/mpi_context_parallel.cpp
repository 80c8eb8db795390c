// Context parallelism (sdpa/distributed.hpp) under mpirun: is the ring's communication hidden
// behind its computation, and where does the performance model of docs/PERFORMANCE.md put the
// crossover? Run on 2 ranks (as root add --allow-run-as-root):
//
//   OMP_NUM_THREADS=1 mpirun -np 2 build/bench/bench/mpi_context_parallel --benchmark_repetitions=3
//
// Every rank runs every benchmark with a fixed iteration count (the ranks must make the same
// calls); each iteration is timed between barriers and the slowest rank's time counts (manual
// time). Only rank 0 reports. Not named bench_*: CI's smoke loop runs those without mpirun.
#include <mpi.h>

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <sdpa/distributed.hpp>
#include <sdpa/sdpa.hpp>
#include <vector>

namespace {

using sdpa::Index;
using Mat = Eigen::MatrixXf;
namespace dist = sdpa::distributed;

int rankOf() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int ranksOf() {
  int p = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

/// Seconds of f() on the slowest rank, the ranks started together.
template <typename F>
double timed(F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto t0 = std::chrono::steady_clock::now();
  f();
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

/// One layer's sequence of P n_r positions, H heads of d = 64, non-causal; this rank's rows and
/// every rank's K/V block (the no-communication baseline reads those).
struct Setup {
  static constexpr Index d = 64, H = 4;
  int rank, ranks;
  dist::Split split;
  Mat q, k, v, dO;
  std::vector<Mat> blocks;
  explicit Setup(Index rowsPerRank)
      : rank(rankOf()), ranks(ranksOf()), split(dist::Split::contiguous(rowsPerRank * ranksOf(), ranksOf())) {
    for (int b = 0; b < ranks; ++b) {
      std::srand(unsigned(100 + b));
      const Mat kb = Mat::Random(rowsPerRank, H * d), vb = Mat::Random(rowsPerRank, H * d);
      Mat packed(rowsPerRank, 2 * H * d);
      packed << kb, vb;
      blocks.push_back(packed);
      if (b == rank) {
        k = kb;
        v = vb;
      }
    }
    std::srand(unsigned(7 + rank));
    q = Mat::Random(rowsPerRank, H * d);
    dO = Mat::Random(rowsPerRank, H * d);
  }
  double forwardFlops() const { return 4.0 * double(q.rows()) * double(split.rows()) * double(H * d); }
};

const sdpa::scale::InvSqrtDk kTau;
const sdpa::mask::None kNone;

/// Ring forward against the same computation with every block already in hand: the ratio is
/// what the communication adds (1.0 = hidden).
void BM_RingForwardOverlap(benchmark::State& state) {
  Setup s(state.range(0));
  double ring = 0, compute = 0;
  for (auto _ : state) {
    const double c = timed([&] {
      benchmark::DoNotOptimize(dist::internal::ringForward(MPI_COMM_WORLD, s.q, s.k, s.v, sdpa::Heads{Setup::H},
                                                           s.split, s.split, kTau, kNone, &s.blocks));
    });
    const double r = timed([&] {
      benchmark::DoNotOptimize(
          dist::ringAttentionForward(MPI_COMM_WORLD, s.q, s.k, s.v, sdpa::Heads{Setup::H}, s.split, s.split));
    });
    compute += c;
    ring += r;
    state.SetIterationTime(r);
  }
  state.counters["ring/compute"] = ring / compute;
  state.counters["GFLOP/s"] = benchmark::Counter(s.forwardFlops(), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_RingBackwardOverlap(benchmark::State& state) {
  Setup s(state.range(0));
  double ring = 0, compute = 0;
  for (auto _ : state) {
    const double c = timed([&] {
      benchmark::DoNotOptimize(dist::internal::ringBackward(MPI_COMM_WORLD, s.q, s.k, s.v, s.dO, sdpa::Heads{Setup::H},
                                                            s.split, s.split, kTau, kNone, &s.blocks));
    });
    const double r = timed([&] {
      benchmark::DoNotOptimize(dist::ringAttentionBackward(MPI_COMM_WORLD, s.q, s.k, s.v, s.dO, sdpa::Heads{Setup::H},
                                                           s.split, s.split, kTau));
    });
    compute += c;
    ring += r;
    state.SetIterationTime(r);
  }
  state.counters["ring/compute"] = ring / compute;
}

/// Ulysses' forward (two all-to-alls around one ordinary call) against the ring's, same run.
void BM_UlyssesForward(benchmark::State& state) {
  Setup s(state.range(0));
  double ulysses = 0, ring = 0;
  for (auto _ : state) {
    const double u = timed([&] {
      benchmark::DoNotOptimize(
          dist::ulyssesAttentionForward(MPI_COMM_WORLD, s.q, s.k, s.v, sdpa::Heads{Setup::H}, s.split, s.split));
    });
    ring += timed([&] {
      benchmark::DoNotOptimize(
          dist::ringAttentionForward(MPI_COMM_WORLD, s.q, s.k, s.v, sdpa::Heads{Setup::H}, s.split, s.split));
    });
    ulysses += u;
    state.SetIterationTime(u);
  }
  state.counters["ulysses/ring"] = ulysses / ring;
  state.counters["GFLOP/s"] = benchmark::Counter(s.forwardFlops(), benchmark::Counter::kIsIterationInvariantRate);
}

/// The model's two rates. B: one-way bandwidth between ranks 0 and 1 for a message of one K/V
/// block (ping-pong, half the round trip). F: one block's forward on one rank (no MPI).
void BM_LinkBandwidth(benchmark::State& state) {
  const Index rows = state.range(0);
  std::vector<float> buf(size_t(rows * 2 * Setup::H * Setup::d));
  const int n = int(buf.size()), rank = rankOf();
  for (auto _ : state) {
    const double t = timed([&] {
      if (rank == 0) {
        MPI_Send(buf.data(), n, MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
        MPI_Recv(buf.data(), n, MPI_FLOAT, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      } else if (rank == 1) {
        MPI_Recv(buf.data(), n, MPI_FLOAT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Send(buf.data(), n, MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
      }
    });
    state.SetIterationTime(t / 2);
  }
  state.counters["GB/s"] =
      benchmark::Counter(double(buf.size() * sizeof(float)), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_BlockForward(benchmark::State& state) {
  Setup s(state.range(0));
  const Mat& blk = s.blocks[0];
  const Index c = Setup::H * Setup::d;
  for (auto _ : state) {
    const double t = timed([&] {
      benchmark::DoNotOptimize(
          sdpa::multiHeadAttentionForward(s.q, blk.leftCols(c), blk.rightCols(c), sdpa::Heads{Setup::H}));
    });
    state.SetIterationTime(t);
  }
  state.counters["GFLOP/s"] = benchmark::Counter(4.0 * double(s.q.rows()) * double(blk.rows()) * double(c),
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

// n_r (rows per rank) 64: the block's computation is short next to its transfer; 2048: long.
BENCHMARK(BM_RingForwardOverlap)
    ->ArgName("nr")
    ->Arg(64)
    ->Arg(2048)
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RingBackwardOverlap)
    ->ArgName("nr")
    ->Arg(64)
    ->Arg(2048)
    ->Iterations(10)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_UlyssesForward)
    ->ArgName("nr")
    ->Arg(64)
    ->Arg(2048)
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LinkBandwidth)
    ->ArgName("nr")
    ->Arg(64)
    ->Arg(2048)
    ->Iterations(50)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_BlockForward)
    ->ArgName("nr")
    ->Arg(64)
    ->Arg(2048)
    ->Iterations(20)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

/// The reporter of ranks other than 0: they run every benchmark (collectives) but print nothing.
class Silent : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  const int rank = rankOf();
  if (ranksOf() < 2) {
    if (rank == 0) std::fprintf(stderr, "mpi_context_parallel: run it on 2 or more ranks (mpirun -np 2 ...)\n");
    MPI_Finalize();
    return 1;
  }
  // Only rank 0 writes --benchmark_out: the others drop the flag.
  std::vector<char*> args(argv, argv + argc);
  if (rank != 0)
    args.erase(std::remove_if(args.begin() + 1, args.end(),
                              [](const char* a) { return std::strncmp(a, "--benchmark_out", 15) == 0; }),
               args.end());
  int n = int(args.size());
  benchmark::Initialize(&n, args.data());
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    Silent silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
