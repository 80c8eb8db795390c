// Context parallelism: one causal GQA layer's attention over a sequence split across the ranks
// of MPI_COMM_WORLD, by ring attention (zigzag split) and by Ulysses (contiguous split), forward
// and backward, each checked against one process computing the whole sequence.
//
//   mpirun -np 2 context_parallel [n] [d_k]      (as root: add --allow-run-as-root)
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sdpa/distributed.hpp>
#include <sdpa/sdpa.hpp>

namespace {

using sdpa::Index;
using Mat = Eigen::MatrixXf;

/// Rows of a whole-sequence matrix that `rank` holds under `split`, in its local order.
Mat rowsOf(const Mat& whole, const sdpa::distributed::Split& split, int rank) {
  Mat local(split.localRows(rank), whole.cols());
  for (const auto& s : split.segments(rank)) local.middleRows(s.local, s.rows) = whole.middleRows(s.global, s.rows);
  return local;
}

double seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int run(int argc, char** argv) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const Index n = argc > 1 ? std::atol(argv[1]) : 1024, dK = argc > 2 ? std::atol(argv[2]) : 64;
  const sdpa::Heads heads{4 * Index(ranks), 2 * Index(ranks)};  // GQA; Ulysses needs heads divisible by the ranks
  const Index H = heads.query, hKv = heads.keyValue;

  // The whole sequence, the same on every rank (a fixed seed), as a model's projections would give.
  std::srand(7);
  const Mat q = Mat::Random(n, H * dK), k = Mat::Random(n, hKv * dK), v = Mat::Random(n, hKv * dK),
            dO = Mat::Random(n, H * dK);
  const sdpa::mask::Causal causal{sdpa::mask::Align::UpperLeft};
  const sdpa::scale::InvSqrtDk tau;
  const auto whole = sdpa::multiHeadAttentionForward(q, k, v, heads, tau, causal);
  const auto wholeG = sdpa::multiHeadAttentionBackward(q, k, v, whole, dO, heads, tau, causal);

  int failed = 0;
  const auto report = [&](const char* route, const sdpa::distributed::Split& split, double time, const auto& f,
                          const auto& g) {
    double err[4] = {(f.output - rowsOf(whole.output, split, rank)).cwiseAbs().maxCoeff(),
                     (g.dq - rowsOf(wholeG.dq, split, rank)).cwiseAbs().maxCoeff(),
                     (g.dk - rowsOf(wholeG.dk, split, rank)).cwiseAbs().maxCoeff(),
                     (g.dv - rowsOf(wholeG.dv, split, rank)).cwiseAbs().maxCoeff()};
    MPI_Allreduce(MPI_IN_PLACE, err, 4, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &time, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0)
      std::printf(
          "%-8s %d ranks: forward + backward %7.1f ms; max |difference| from one process: out %.1e, "
          "dq %.1e, dk %.1e, dv %.1e\n",
          route, ranks, 1e3 * time, err[0], err[1], err[2], err[3]);
    for (double e : err) failed |= !(e < 1e-4);
  };

  {
    const auto split = sdpa::distributed::Split::zigzag(n, ranks);  // balances causal work
    const Mat ql = rowsOf(q, split, rank), kl = rowsOf(k, split, rank), vl = rowsOf(v, split, rank),
              dOl = rowsOf(dO, split, rank);
    const auto t0 = std::chrono::steady_clock::now();
    const auto f =
        sdpa::distributed::ringAttentionForward(MPI_COMM_WORLD, ql, kl, vl, heads, split, split, tau, causal);
    const auto g =
        sdpa::distributed::ringAttentionBackward(MPI_COMM_WORLD, ql, kl, vl, dOl, heads, split, split, tau, causal);
    report("ring", split, seconds(t0), f, g);
  }
  {
    const auto split = sdpa::distributed::Split::contiguous(n, ranks);
    const Mat ql = rowsOf(q, split, rank), kl = rowsOf(k, split, rank), vl = rowsOf(v, split, rank),
              dOl = rowsOf(dO, split, rank);
    const auto t0 = std::chrono::steady_clock::now();
    const auto f =
        sdpa::distributed::ulyssesAttentionForward(MPI_COMM_WORLD, ql, kl, vl, heads, split, split, tau, causal);
    const auto g =
        sdpa::distributed::ulyssesAttentionBackward(MPI_COMM_WORLD, ql, kl, vl, dOl, heads, split, split, tau, causal);
    report("Ulysses", split, seconds(t0), f, g);
  }
  return failed;
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // sdpa calls MPI from this thread only
  int status = 1;
  try {
    status = run(argc, argv);
  } catch (const std::exception& e) {  // the same error on every rank (the library checks collectively)
    std::fprintf(stderr, "context_parallel: %s\n", e.what());
  }
  MPI_Finalize();
  return status;
}
